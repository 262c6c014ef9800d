"""Provider reports and reconcile, as decisions over plain data (spec 4.8, 4.9).

A report batch is settled in steps: one winning event per provider id (`aggregate`); the session
a workspace provisioner's runner is credited with (`with_sessions`); which reported reservation
id each winner may carry (`reservation_verdicts`, then `adopt_pending` for the ids no stored row
decides); and which terminal winners are fresh enough to release their unit (`fresh_terminal`).
The store locks, reads the inputs and writes what these return.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from uuid import UUID

from controlplane.domain.labels import LabelSet, canonicalise, strip_reserved
from controlplane.domain.runner_instances import (
    ProvisionedRunner,
    RunnerState,
    clamp_reported_at,
    report_supersedes,
)

# The milestone column each reported state stamps (its earliest reported time wins).
MILESTONE_OF = {
    RunnerState.RUNNING: "started_at",
    RunnerState.STOPPING: "stopping_at",
    RunnerState.STOPPED: "stopped_at",
    RunnerState.FAILED: "failed_at",
    RunnerState.TERMINATED: "terminated_at",
}
MILESTONES = tuple(MILESTONE_OF.values())


@dataclass(frozen=True, slots=True)
class RunnerEvent:
    """One provider report about one runner, as the provisioner sent it (times unclamped)."""

    provider_runner_id: str
    state: RunnerState
    reported_at: datetime
    reservation_id: UUID | None = None
    template_key: str | None = None
    labels: LabelSet = ()
    reason: str | None = None
    runner_session_id: UUID | None = None
    provider_kind: str | None = None


@dataclass(frozen=True, slots=True)
class ReportWinner:
    """The event a batch settles on for one provider id, with every milestone it saw."""

    event: RunnerEvent
    milestones: dict[str, datetime] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class HonoredIntent:
    provider_runner_id: str
    reason: str  # 'job-cancelled' or 'activation-timeout'


@dataclass(frozen=True, slots=True)
class ReportOutcome:
    accepted: int  # distinct provider runner ids
    reservations_released: int
    terminate_intents_honored: tuple[HonoredIntent, ...] = ()


def aggregate(
    events: Iterable[RunnerEvent], *, received_at: datetime, strip: LabelSet
) -> dict[str, ReportWinner]:
    """Step 1 of 4.8: one winner per provider id (highest rank, then latest clamped time), in
    first-seen order. Times are clamped to `received_at`, labels canonical without `strip`. The
    winner keeps the reservation, template, session and provider kind of a losing event when it
    has none of its own (P-96), in whichever order the two arrived; each state's milestone keeps
    its earliest time."""
    winners: dict[str, ReportWinner] = {}
    for raw in events:
        event = replace(
            raw,
            reported_at=clamp_reported_at(raw.reported_at, received_at),
            labels=strip_reserved(canonicalise(raw.labels), strip),
        )
        milestone = MILESTONE_OF.get(event.state)
        found = winners.get(event.provider_runner_id)
        if found is None:
            winners[event.provider_runner_id] = ReportWinner(
                event, {milestone: event.reported_at} if milestone else {}
            )
            continue
        milestones = dict(found.milestones)
        if milestone and (milestone not in milestones or event.reported_at < milestones[milestone]):
            milestones[milestone] = event.reported_at
        current = found.event
        winner, loser = (
            (event, current)
            if report_supersedes(current.state, current.reported_at, event.state, event.reported_at)
            else (current, event)
        )
        merged = replace(
            winner,
            reservation_id=winner.reservation_id or loser.reservation_id,
            template_key=winner.template_key or loser.template_key,
            runner_session_id=winner.runner_session_id or loser.runner_session_id,
            provider_kind=winner.provider_kind or loser.provider_kind,
        )
        winners[event.provider_runner_id] = ReportWinner(merged, milestones)
    return winners


def with_sessions(
    winners: Mapping[str, ReportWinner], credited: Mapping[str, UUID]
) -> dict[str, ReportWinner]:
    """Step 3 of 4.8: each credited winner carries the session of its runner's latest consumed
    ephemeral token, whatever it reported."""
    return {
        pid: ReportWinner(replace(w.event, runner_session_id=credited[pid]), w.milestones)
        if pid in credited
        else w
        for pid, w in winners.items()
    }


class Verdict(enum.Enum):
    KEEP = "keep"
    DROP = "drop"
    ADOPT_IF_PENDING = "adopt-if-pending"  # no stored row decides: a pending unit must


def reservation_verdict(event: RunnerEvent, row: ProvisionedRunner | None) -> Verdict:
    """Whether a winner may carry its reported reservation id (step 4 of 4.8), given the
    runner's stored row. A terminal report keeps it only when the row already links to it; a
    report that will not be projected, or about a released runner, drops it; a row created
    for (intended) or assigned to a reservation keeps only that one; otherwise the id is
    adopted only if the reservation has a pending unit."""
    wanted = event.reservation_id
    if event.state.is_terminal:
        ok = row is not None and wanted in (row.reservation_id, row.intended_reservation_id)
        return Verdict.KEEP if ok else Verdict.DROP
    if row is None:
        return Verdict.ADOPT_IF_PENDING
    if row.released or not report_supersedes(
        row.state, row.reported_at, event.state, event.reported_at
    ):
        return Verdict.DROP
    if row.intended_reservation_id is not None:
        return Verdict.KEEP if row.intended_reservation_id == wanted else Verdict.DROP
    if row.reservation_id is not None:
        return Verdict.KEEP if row.reservation_id == wanted else Verdict.DROP
    return Verdict.ADOPT_IF_PENDING


def reservation_verdicts(
    winners: Mapping[str, ReportWinner], stored: Mapping[str, ProvisionedRunner]
) -> tuple[set[str], list[tuple[str, UUID]]]:
    """For the winners that report a reservation id: the provider ids that must drop it, and
    the (provider id, reservation) candidates left to `adopt_pending`, in batch order."""
    dropped: set[str] = set()
    candidates: list[tuple[str, UUID]] = []
    for pid, winner in winners.items():
        wanted = winner.event.reservation_id
        if wanted is None:
            continue
        verdict = reservation_verdict(winner.event, stored.get(pid))
        if verdict is Verdict.DROP:
            dropped.add(pid)
        elif verdict is Verdict.ADOPT_IF_PENDING:
            candidates.append((pid, wanted))
    return dropped, candidates


def adopt_pending(candidates: Iterable[tuple[str, UUID]], pending: Mapping[UUID, int]) -> set[str]:
    """The candidates that must drop their reservation id: first in batch order takes a pending
    unit; a reservation with none left (or not adoptable: absent from `pending`) refuses."""
    left = dict(pending)
    refused: set[str] = set()
    for pid, wanted in candidates:
        if left.get(wanted, 0) > 0:
            left[wanted] -= 1
        else:
            refused.add(pid)
    return refused


def without_reservation(
    winners: Mapping[str, ReportWinner], pids: Iterable[str]
) -> dict[str, ReportWinner]:
    drop = set(pids)
    return {
        pid: ReportWinner(replace(w.event, reservation_id=None), w.milestones) if pid in drop else w
        for pid, w in winners.items()
    }


def fresh_terminal(
    winners: Mapping[str, ReportWinner], stored: Mapping[str, ProvisionedRunner]
) -> dict[str, datetime]:
    """The terminal winners whose runner may give its unit back, with their report time: no
    stored row (yet), or a report not older than the stored one."""
    return {
        pid: w.event.reported_at
        for pid, w in winners.items()
        if w.event.state.is_terminal
        and (pid not in stored or w.event.reported_at >= stored[pid].reported_at)
    }


# -------------------------------------------------------------------------- reconcile (4.9)


@dataclass(frozen=True, slots=True)
class BoundJob:
    job_id: UUID
    job_execution_id: UUID
    workflow_run_attempt_id: UUID
    last_heartbeat_at: datetime
    cancellation_requested_at: datetime | None


@dataclass(frozen=True, slots=True)
class ObservedRunner:
    """Reconcile's answer for one observed id; `state` None: no row of ours in scope."""

    provider_runner_id: str
    state: RunnerState | None = None
    reservation_id: UUID | None = None
    intended_reservation_id: UUID | None = None  # only filled when asked for
    runner_session_id: UUID | None = None
    bound_job: BoundJob | None = None
    desired_intent: str = "keep"  # or 'terminate'
    intent_reason: str | None = None  # 'terminal-state' or 'job-cancelled'


@dataclass(frozen=True, slots=True)
class ReconcileOutcome:
    runners: tuple[ObservedRunner, ...]
    terminated_absent_provider_runner_ids: tuple[str, ...]
    reservations_released: int
