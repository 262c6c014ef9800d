"""Terminate intents (spec 3.6): which active runners a workspace provisioner is told to stop,
and why, and which `terminated` reports answer such an intent (spec 4.8 step 6).

Two reasons exist: the job the runner was running was cancelled, or a demand runner never
activated within the activation timeout and its reservations lapsed (`activation_timed_out`).
The store finds the candidates with the SQL function `cp_terminate_candidates` (sql/0011);
these functions classify them.
"""

from __future__ import annotations

import enum
from collections.abc import Set
from dataclasses import dataclass
from datetime import datetime, timedelta
from uuid import UUID

from controlplane.domain.runner_instances import (
    ProvisionedRunner,
    RunnerState,
    activation_timed_out,
)


class TerminateReason(enum.StrEnum):
    JOB_CANCELLED = "job-cancelled"
    ACTIVATION_TIMEOUT = "activation-timeout"


@dataclass(frozen=True, slots=True)
class TerminateIntent:
    provider_runner_id: str
    reason: TerminateReason
    retry: bool  # an activation timeout already delivered (its unit was released then)

    @property
    def releases_unit(self) -> bool:
        """The first delivery of an activation timeout marks the runner's unit released."""
        return self.reason is TerminateReason.ACTIVATION_TIMEOUT and not self.retry


def terminate_intent(
    runner: ProvisionedRunner,
    *,
    job_cancelled: bool,
    live_reservation_ids: Set[UUID],
    now: datetime,
    activation_timeout: timedelta | None,
) -> TerminateIntent | None:
    """The intent for one active runner with a provider identity, if any. An activation timeout
    wins over a cancelled job (the runner never ran it); `activation_timeout` None leaves
    timeouts out."""
    assert runner.provider_runner_id is not None
    if activation_timeout is not None and activation_timed_out(
        runner, live_reservation_ids=live_reservation_ids, now=now, timeout=activation_timeout
    ):
        return TerminateIntent(
            runner.provider_runner_id, TerminateReason.ACTIVATION_TIMEOUT, runner.released
        )
    if job_cancelled:
        return TerminateIntent(runner.provider_runner_id, TerminateReason.JOB_CANCELLED, False)
    return None


def honored_reason(*, timed_out: bool, cancelled: bool) -> TerminateReason | None:
    """Which intent a `terminated` report of a still-active runner answers, if any (the
    activation timeout first, as `terminate_intent` decides)."""
    if timed_out:
        return TerminateReason.ACTIVATION_TIMEOUT
    if cancelled:
        return TerminateReason.JOB_CANCELLED
    return None


def observed_intent(state: RunnerState, *, job_cancelled: bool) -> str | None:
    """Reconcile's desired intent for an observed runner of ours (spec 4.9 step 4): terminate a
    finished one (`terminal-state`) or one whose newest lease was cancelled (`job-cancelled`);
    None: keep it."""
    if state.is_terminal:
        return "terminal-state"
    if job_cancelled:
        return TerminateReason.JOB_CANCELLED.value
    return None
