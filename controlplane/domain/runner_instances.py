"""Runner instances: the lifecycle state machine, report ordering, and the staleness rules.

A runner instance is one unit of provisioned compute owned by one provisioner. Its state only
moves forward: `starting`, `running`, `stopping` are active; `stopped`, `failed`, `terminated`
are terminal, and ranked in that order so a terminal state can still progress (stopped ->
failed -> terminated) but never come back. Who may move a row, and where to, is `transition`;
which of two provider reports describes the newer truth is `report_supersedes`.

The staleness rules decide which rows the maintenance actors may change: the stale runner
reaper (`StaleRunnerRule`), reconcile's absent-runner rule (`absent_and_stale`) and the
activation timeout of demand runners (`activation_timed_out`). Each takes `now` and its
threshold as parameters; the store runs the same predicate again inside the UPDATE that acts on
it, so a report committed meanwhile wins.
"""

from __future__ import annotations

import enum
from collections.abc import Set
from dataclasses import dataclass
from datetime import datetime, timedelta
from uuid import UUID

from controlplane.domain.labels import LabelSet

# Raised by `transition`; defined with every other error, importable from here as well.
from controlplane.errors import IllegalTransition as IllegalTransition


class RunnerState(enum.StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"
    TERMINATED = "terminated"

    @property
    def rank(self) -> int:
        return _RANK[self]

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATES


_RANK = {state: rank for rank, state in enumerate(RunnerState, start=1)}
ACTIVE_STATES = frozenset({RunnerState.STARTING, RunnerState.RUNNING, RunnerState.STOPPING})
TERMINAL_STATES = frozenset({RunnerState.STOPPED, RunnerState.FAILED, RunnerState.TERMINATED})


class LaunchKind(enum.StrEnum):
    DEMAND = "demand"  # created for a launch reservation
    WARM = "warm"  # created without one (warm pool)
    MANUAL = "manual"  # first seen in a provider report


class Cause(enum.StrEnum):
    """Who moves a runner instance, which decides the moves allowed."""

    CREATE = "create"  # batch creation by its provisioner: always `starting`
    FIRST_REPORT = "first-report"  # a report about an instance we have no row for
    REPORT = "report"  # a provider report that `report_supersedes` the stored one
    ENROLLMENT = "enrollment"  # the booted runner enrolled over its control session
    RECONCILE_ABSENT = "reconcile-absent"  # missing from the provisioner's observed set
    STALE_REAPER = "stale-reaper"  # neither the runner nor its provisioner was heard from
    REVOCATION = "revocation"  # its provisioner token was revoked


# The one target each non-report cause may move to, and the states it may move from.
_FIXED_MOVES: dict[Cause, tuple[RunnerState, frozenset[RunnerState]]] = {
    # A stopping instance is on its way out: letting enrollment revive it (as the reference
    # does) would make it bindable while its provisioner tears it down.
    Cause.ENROLLMENT: (RunnerState.RUNNING, frozenset({RunnerState.STARTING, RunnerState.RUNNING})),
    Cause.RECONCILE_ABSENT: (RunnerState.TERMINATED, ACTIVE_STATES),
    Cause.STALE_REAPER: (RunnerState.FAILED, ACTIVE_STATES),
    # Finished rows keep their own end state and time; only active ones are terminated.
    Cause.REVOCATION: (RunnerState.TERMINATED, ACTIVE_STATES),
}


def transition(current: RunnerState | None, target: RunnerState, cause: Cause) -> RunnerState:
    """The state after `cause` moves an instance from `current` (None: no row yet) to `target`.

    Raises IllegalTransition for any other move. Reports may stay at the same rank (a newer
    report of the same state) and may advance terminal states by rank, never go back.
    """
    allowed: bool
    if cause is Cause.CREATE:
        allowed = current is None and target is RunnerState.STARTING
    elif cause is Cause.FIRST_REPORT:
        allowed = current is None
    elif cause is Cause.REPORT:
        allowed = current is not None and target.rank >= current.rank
    else:
        fixed_target, sources = _FIXED_MOVES[cause]
        allowed = target is fixed_target and current in sources
    if not allowed:
        raise IllegalTransition(current, target, cause)
    return target


def clamp_reported_at(reported_at: datetime, received_at: datetime) -> datetime:
    """A provider's clock may run ahead: a report can never claim to be from the future."""
    return min(reported_at, received_at)


def report_supersedes(
    stored: RunnerState, stored_at: datetime, incoming: RunnerState, incoming_at: datetime
) -> bool:
    """Whether a (clamped) report replaces the stored projection: a higher rank always does, the
    same rank when it is not older. So a terminal state is never revived, and of two reports
    with one timestamp the higher rank wins whatever their arrival order."""
    if incoming.rank != stored.rank:
        return incoming.rank > stored.rank
    return incoming_at >= stored_at


@dataclass(frozen=True, slots=True)
class ProvisionedRunner:
    """One runner instance, with the facts binding and the maintenance rules read.

    `control_session_expires_at` is the expiry of its open (not closed) control session with
    its own provisioner, None when it has none. `reported_at` is when it was last heard from
    (report, enrollment or heartbeat); `updated_at` is the server's last write.
    """

    id: UUID
    provisioner_id: UUID
    created_at: datetime
    state: RunnerState
    labels: LabelSet
    reported_at: datetime
    updated_at: datetime
    launch_kind: LaunchKind = LaunchKind.MANUAL
    template_key: str | None = None
    provider_runner_id: str | None = None
    workspace_id: UUID | None = None
    reservation_id: UUID | None = None
    intended_reservation_id: UUID | None = None
    assigned_at: datetime | None = None
    runner_session_id: UUID | None = None
    reservation_released_at: datetime | None = None
    control_session_expires_at: datetime | None = None
    drained_at: datetime | None = None  # an operator drained it: never bound to new demand

    @property
    def released(self) -> bool:
        return self.reservation_released_at is not None

    def holds_unit_of(self, reservation_id: UUID) -> bool:
        """Whether this runner uses one unit of the reservation (spec 2.7): it is not finished,
        its unit was not released, and it is assigned to or was created for the reservation."""
        return (
            not self.state.is_terminal
            and not self.released
            and reservation_id in (self.reservation_id, self.intended_reservation_id)
        )


@dataclass(frozen=True, slots=True)
class StaleRunnerRule:
    """The stale runner reaper: an active runner nobody heard from within `threshold`, whose
    provisioner was not heard from either, is failed with reason `stale-provisioner`."""

    threshold: timedelta = timedelta(seconds=300)

    def __post_init__(self) -> None:
        if self.threshold < timedelta(seconds=1):
            raise ValueError("the stale runner threshold must be at least 1 s")

    def cutoff(self, now: datetime) -> datetime:
        return now - self.threshold

    def is_stale(
        self,
        runner: ProvisionedRunner,
        *,
        now: datetime,
        provisioner_last_seen_at: datetime | None,
        has_running_job: bool,
        runner_session_seen_at: datetime | None,
    ) -> bool:
        """`has_running_job`: a lease exists for the runner's provider identity.
        `runner_session_seen_at`: the last activity of a runner session for that identity."""
        cutoff = self.cutoff(now)
        return (
            not runner.state.is_terminal
            and runner.reported_at < cutoff
            and runner.updated_at < cutoff
            and (provisioner_last_seen_at is None or provisioner_last_seen_at < cutoff)
            and not has_running_job
            and (runner_session_seen_at is None or runner_session_seen_at < cutoff)
        )

    def is_drainable(self, runner: ProvisionedRunner, *, now: datetime) -> bool:
        """A finished, activated runner still holding its unit: the reaper releases it when it
        finds no stale active runner (the release its terminal report could not make)."""
        return (
            runner.state.is_terminal
            and runner.runner_session_id is not None
            and runner.updated_at < self.cutoff(now)
            and not runner.released
            and (runner.reservation_id is not None or runner.intended_reservation_id is not None)
        )


def absent_and_stale(
    runner: ProvisionedRunner, observed: Set[str], *, now: datetime, grace: timedelta
) -> bool:
    """Reconcile terminates an active runner its provisioner no longer observes, once it has not
    been heard from for `grace`. An empty observed set changes nothing: it is more likely a
    failed listing than a provider with no compute left."""
    return (
        bool(observed)
        and not runner.state.is_terminal
        and runner.provider_runner_id is not None
        and runner.provider_runner_id not in observed
        and runner.reported_at < now - grace
    )


def activation_timed_out(
    runner: ProvisionedRunner, *, live_reservation_ids: Set[UUID], now: datetime, timeout: timedelta
) -> bool:
    """A demand runner that never activated within `timeout` and whose reservations have lapsed
    is told to terminate. Warm and manual runners wait for demand instead; a live reservation
    (assigned or intended) still protects a slow boot."""
    return (
        runner.launch_kind is LaunchKind.DEMAND
        and not runner.state.is_terminal
        and runner.provider_runner_id is not None
        and runner.runner_session_id is None
        and runner.created_at < now - timeout
        and runner.reservation_id not in live_reservation_ids
        and runner.intended_reservation_id not in live_reservation_ids
    )
