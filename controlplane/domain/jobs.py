"""Job executions as the queue sees them: plain records, outcomes, and the lease staleness rule."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from controlplane.domain.labels import LabelSet


class Outcome(enum.StrEnum):
    """How an execution ended. A tombstone records exactly one of these."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"  # the lease's runner stopped heartbeating (and no retry was left)
    TIMED_OUT = "timed_out"  # the lease outlived its run timeout and the grace after it
    QUEUE_EXPIRED = "queue_expired"  # it waited in the queue past its queue timeout


class EnqueueResult(enum.StrEnum):
    ENQUEUED = "enqueued"  # a pending row was inserted
    DUPLICATE = "duplicate"  # already pending: the first write wins
    RUNNING = "running"  # already claimed: a replay never re-creates it
    ENDED = "ended"  # a tombstone exists: a replay never resurrects it


class EventType(enum.StrEnum):
    CLAIMED = "job.claimed"
    REQUEUED = "job.requeued"  # a claim whose response never reached the runner was put back
    CANCEL_REQUESTED = "job.cancel_requested"  # a running lease was asked to stop
    COMPLETED = "job.completed"  # terminal: the runner reported an outcome
    CANCELLED = "job.cancelled"  # terminal: the orchestrator ended it
    LEASE_EXPIRED = "job.lease_expired"  # terminal: the reaper took a dead lease
    TIMED_OUT = "job.timed_out"  # terminal: the lease outlived its run timeout and grace
    QUEUE_EXPIRED = "job.queue_expired"  # terminal: it waited past its queue timeout
    RETRIED = "job.retried"  # a lease lost with its runner went back to the queue


TERMINAL_EVENTS = frozenset(
    {
        EventType.COMPLETED,
        EventType.CANCELLED,
        EventType.LEASE_EXPIRED,
        EventType.TIMED_OUT,
        EventType.QUEUE_EXPIRED,
    }
)


@dataclass(frozen=True, slots=True)
class JobIdentity:
    workspace_id: UUID
    workflow_run_id: UUID
    workflow_run_attempt_id: UUID
    job_id: UUID
    job_execution_id: UUID
    project_id: UUID


@dataclass(frozen=True, slots=True)
class NewJob:
    """What the orchestrator enqueues. `required_labels` must already be canonical and non-empty."""

    identity: JobIdentity
    required_labels: LabelSet
    queued_at: datetime
    payload: dict[str, Any] = field(default_factory=dict)
    priority: int = 0  # higher first, FIFO within a priority (store/ordering.py)
    concurrency_key: str | None = None  # at most concurrency_limit of the key run at once
    concurrency_limit: int | None = None
    timeout_seconds: int | None = None  # the run timeout; None: none (docs/policies.md)
    queue_timeout_seconds: int | None = None  # how long it may wait pending; None: forever
    retries_on_lost: int = 0  # leases lost with their runner that go back to the queue


@dataclass(frozen=True, slots=True)
class ClaimedJob:
    identity: JobIdentity
    required_labels: LabelSet
    payload: dict[str, Any]
    queued_at: datetime
    started_at: datetime


@dataclass(frozen=True, slots=True)
class SessionClaims:
    """What a claim needs to know about the session; it comes from the verified session token."""

    runner_session_id: UUID
    workspace_id: UUID
    labels: LabelSet
    max_claims: int | None


@dataclass(frozen=True, slots=True)
class HeartbeatResult:
    identity: JobIdentity
    cancellation_requested: bool
    previous_capabilities: dict[str, Any] | None
    current_capabilities: dict[str, Any] | None
    # Seconds from the heartbeat to the lease's run deadline, by the database's clock (<= 0: it
    # has passed, so the runner must stop); None when the lease has no run timeout.
    timeout_in: float | None = None

    @property
    def must_stop(self) -> bool:
        """Cancelled, or past its run deadline: the heartbeat answers `cancel`."""
        return self.cancellation_requested or (self.timeout_in is not None and self.timeout_in <= 0)


@dataclass(frozen=True, slots=True)
class EndedLease:
    """A lease removed by complete or by the reaper."""

    identity: JobIdentity
    provisioner_id: UUID | None
    provider_runner_id: str | None
    cancellation_requested: bool
    newly_ended: bool  # False when the execution already had a tombstone (cancelled earlier)
    retried: bool = False  # the lease was lost and its execution went back to the queue


@dataclass(frozen=True, slots=True)
class ReconcileResult:
    was_pending: bool
    was_running: bool
    newly_ended: bool


@dataclass(frozen=True, slots=True)
class StaleRule:
    """A lease is stale when it never heartbeated within `grace`, or stopped for `threshold`."""

    threshold: timedelta = timedelta(seconds=180)
    grace: timedelta = timedelta(seconds=60)

    def __post_init__(self) -> None:
        if not timedelta(seconds=1) <= self.grace < self.threshold:
            raise ValueError(
                "the no-first-heartbeat grace must be at least 1 s and below the threshold"
            )

    def stale_since(
        self, started_at: datetime, first_heartbeat_at: datetime | None, last_heartbeat_at: datetime
    ) -> datetime:
        """The instant staleness is measured from (the reaper orders by it)."""
        if first_heartbeat_at is None and last_heartbeat_at <= started_at:
            return started_at
        return last_heartbeat_at

    def is_stale(
        self,
        now: datetime,
        started_at: datetime,
        first_heartbeat_at: datetime | None,
        last_heartbeat_at: datetime,
    ) -> bool:
        if first_heartbeat_at is None and last_heartbeat_at <= started_at:
            return started_at < now - self.grace
        return last_heartbeat_at < now - self.threshold
