"""A parked job request (`Waiter`) and the hand-over of a claim made for it.

A waiter leaves WAITING once, for one of three ends: a job delivered, a failure, or abandoned by
its request handler (deadline passed or client gone). Whoever holds it on the replica's side (its
workspace actor, actors/dispatch.py) is told in the same step through `on_leave`, so the actor's
set of waiters holds exactly those still waiting and can retire as soon as it is empty.

Delivery and put-back. A claim is handed to its waiter only if the waiter is still waiting; the
request handler marks a waiter abandoned in the same event-loop step as it stops waiting, so
exactly one side owns the job: a claim made for an abandoned waiter is put back at its original
queue position at once, never left to expire.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol
from uuid import UUID

import anyio

from controlplane import metrics
from controlplane.domain.jobs import ClaimedJob, SessionClaims
from controlplane.errors import ControlPlaneError
from controlplane.retry import Backoff
from controlplane.store.claiming import ProvisionedClaim

log = logging.getLogger("controlplane.dispatch")

_PUT_BACK_ATTEMPTS = 3


class PutBackStore(Protocol):
    async def put_back(self, job_execution_id: UUID, runner_session_id: UUID) -> bool: ...


class WaiterState(enum.Enum):
    WAITING = "waiting"
    DELIVERED = "delivered"
    FAILED = "failed"
    ABANDONED = "abandoned"


@dataclass(eq=False, slots=True)
class Waiter:
    """A parked job request. `done` is set when it is answered; `on_answer`, when the request
    handler set one, is called too (the handler cancels its wait with it, so a parked request
    needs no second task to watch for its answer). `on_leave`, set by the actor holding it, is
    called with the waiter whenever it stops waiting, for whichever reason."""

    session: SessionClaims
    state: WaiterState = WaiterState.WAITING
    job: ClaimedJob | None = None
    error: ControlPlaneError | None = None
    done: anyio.Event = field(default_factory=anyio.Event)
    on_answer: Callable[[], object] | None = None
    on_leave: Callable[[Waiter], None] | None = None

    def deliver(self, job: ClaimedJob) -> bool:
        if self.state is not WaiterState.WAITING:
            return False
        self.state, self.job = WaiterState.DELIVERED, job
        self._answered()
        return True

    def fail(self, error: ControlPlaneError) -> None:
        if self.state is WaiterState.WAITING:
            self.state, self.error = WaiterState.FAILED, error
            self._answered()

    def _answered(self) -> None:
        self.done.set()
        if self.on_answer is not None:
            self.on_answer()
        self._left()

    def abandon(self) -> bool:
        """Stop waiting. False when a job was delivered first (the caller then owns it)."""
        if self.state is WaiterState.WAITING:
            self.state = WaiterState.ABANDONED
            self.done.set()
            self._left()
        return self.state is not WaiterState.DELIVERED

    def _left(self) -> None:
        if self.on_leave is not None:
            self.on_leave(self)


def observe_claim(job: ClaimedJob) -> None:
    """Queue time (spec J-31/J-32) and, on a provisioned runner's first claim, the time since
    its activation. A claim without a provisioner link is a manual runner's."""
    provider, launch_kind = "unknown", "manual"
    if isinstance(job, ProvisionedClaim):
        provider = metrics.provider_label(job.provider_kind)
        launch_kind = job.launch_kind or "unknown"
        if job.activated_at is not None:
            since = (job.started_at - job.activated_at).total_seconds()
            metrics.observe_seconds(metrics.activation_to_first_claim, since, provider, launch_kind)
    queued = (job.started_at - job.queued_at).total_seconds()
    metrics.observe_seconds(metrics.queue_time, queued, provider, launch_kind)


async def put_back(store: PutBackStore, job: ClaimedJob, runner_session_id: UUID) -> None:
    """Return an undelivered claim to the queue, retrying briefly if the database blips.

    Shielded, so a shutdown cannot interrupt it. If every attempt fails, the lease (never
    heartbeated) is expired by the reaper after the no-first-heartbeat grace: the job then ends
    `expired`, and the orchestrator decides whether to run it again. The retries bound that loss
    to outages over about a second.
    """
    execution = job.identity.job_execution_id
    retry = Backoff(0.25, 0.25 * _PUT_BACK_ATTEMPTS, linear=True)  # 0.25 s, then 0.5 s
    with anyio.CancelScope(shield=True):
        for attempt in range(1, _PUT_BACK_ATTEMPTS + 1):
            try:
                await store.put_back(execution, runner_session_id)
                return
            except Exception as error:
                log.warning(
                    "dispatch.put_back_failed",
                    extra={
                        "job_execution_id": str(execution),
                        "attempt": attempt,
                        "error": repr(error),
                    },
                )
            if attempt < _PUT_BACK_ATTEMPTS:  # after the last, the reaper's grace takes over
                await anyio.sleep(retry.next())
