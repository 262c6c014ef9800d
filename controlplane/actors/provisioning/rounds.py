"""Allocation rounds of one provisioner, through its session's `ProvisioningStore`.

A workspace provisioner's round is one transaction for its workspace. An installation
provisioner's round is a walk: the workspaces with demand, oldest first, one transaction each
(`ProvisioningStore.allocate_in_walk`, a try-lock: a busy workspace waits for the next round),
carrying its budget from one workspace to the next; its slots for each workspace are the
advertised ones minus its launch units still pending in every other workspace, read fresh in
that workspace's transaction (so a busy, skipped workspace still holds what it was granted).
Each committed workspace is recorded in the `RoundOutcome` before the next one starts, so a walk
stopped half-way (a fenced session, a database fault) has recorded every grant it made.

A walk runs a workspace's transaction only while it could give it something (issue 16; the
walk at 10,000 workspaces ran 1,000 transactions a round with no slot free). It carries the
slots it has left, as spec 3.5 step 4 does: before the first workspace, the advertised ones
less the provisioner's pending launch units (one read); after each committed round, what that
round left. Once no template has a slot left, or the fair share leaves a workspace nothing, or
a template has none left and a round of this walk gave nothing (before that the slots may all
go to the first workspace, and a read would be wasted), one statement reads the demand figures
of every workspace still to visit and of those that gave nothing (`walk_figures`,
store/walk_figures.py: `allocate` with no budget over each one's inputs), and from there a
workspace runs its transaction only when `could_give`: a demand group with units no live
reservation holds that a template with a slot left satisfies. Figures the memory still holds
are used so before any read. The others report those figures
(`RoundOutcome.figured`), which is all their rounds would have done: an installation round
computes no terminate intents and no activation timeouts (workspace scope only), cleans up no
reservation (maintenance does), and binds idle runners only within the grant its slots allow
(spec 3.3 step 7: with no slot left it binds none, whatever idle runners the provisioner has,
so no idle-runner read is needed). A figured workspace is not remembered as covered, and stays
listed whatever its age (changes.py), so it is walked once it can be given something. The
figures are read at most once a round, in one statement (a GROUP BY over those workspaces'
pending rows) instead of a transaction each, and only for workspaces the memory has no figures
of: figures read in an earlier round are carried while no notice came for the workspace and
the fingerprint of its live reservations is the one the read saw (no new job, the same
reservations: its unreserved units can only have fallen since, by claims or deadlines, so it
still could give nothing; its queued count is reported as read, as a covered workspace's is).
Their snapshot is a little later than the list's; a change after it is notified (a new job), is
a reservation expiry the actor has a deadline for, or waits for the next round, as a change
during a full walk would.

Every transaction the store runs for the session takes the session's fencing row first (its
implementation, store/provisioning.py, says how); nothing here checks the fence.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Protocol
from uuid import UUID

from controlplane import metrics
from controlplane.actors.provisioning.changes import WalkMemory
from controlplane.domain.assignment import Batch
from controlplane.domain.demand import (
    Reservation,
    Template,
    walk_capacity,
    walk_share,
    without_pending,
)
from controlplane.domain.labels import LabelSet, matches
from controlplane.domain.reports import ReconcileOutcome, ReportOutcome, RunnerEvent
from controlplane.domain.rounds import Grant, WalkEntry, WorkspaceRound
from controlplane.domain.runner_instances import ProvisionedRunner
from controlplane.domain.terminate_intents import TerminateReason
from controlplane.store.ephemeral import MintedToken
from controlplane.store.lifecycle import Assigned
from controlplane.store.provisioning import RoundTerms


class ProvisioningStore(Protocol):
    """What a provisioner actor asks the database, for its one control session. Every write
    holds the session's fencing row first and raises `errors.Fenced` when the session lost its
    generation (nothing was written then)."""

    async def ping(self) -> None: ...

    async def replace_templates(self, templates: Sequence[Template]) -> None: ...

    async def allocate_workspace(self, workspace_id: UUID, terms: RoundTerms) -> WorkspaceRound: ...

    async def walk_workspaces(self, changed: Collection[UUID] = ()) -> list[WalkEntry]: ...

    async def walk_figures(
        self, workspace_ids: Sequence[UUID], terms: RoundTerms
    ) -> list[WorkspaceRound]: ...

    async def allocate_in_walk(
        self, workspace_id: UUID, terms: RoundTerms
    ) -> WorkspaceRound | None: ...

    async def outstanding_grants(self) -> list[tuple[Reservation, int]]: ...

    async def idle_candidates(
        self,
    ) -> tuple[list[ProvisionedRunner], frozenset[UUID], datetime]: ...

    async def delete_reservations(self, reservation_ids: Collection[UUID]) -> int: ...

    async def create_instances(
        self,
        provider_kind: str | None,
        entries: Sequence[tuple[str | None, UUID | None]],
        bootstrap_ttl: timedelta,
    ) -> Batch: ...

    async def attach_provider(self, runner_instance_id: UUID, provider_runner_id: str) -> bool: ...

    async def assign(
        self, reservation_id: UUID, runner_instance_ids: Sequence[UUID]
    ) -> Assigned: ...

    async def instance_counts(self) -> dict[tuple[str, str], int]:
        """The provisioner's starting and running instances by (template key, state)."""
        ...

    async def report(
        self,
        events: Sequence[RunnerEvent],
        *,
        received_at: datetime,
        reserved_labels: LabelSet,
        activation_timeout: timedelta,
    ) -> ReportOutcome: ...

    async def reconcile(self, observed: Sequence[str], *, grace: timedelta) -> ReconcileOutcome: ...

    async def mint(
        self, provider_runner_ids: Sequence[str], reservation_id: UUID | None, ttl: timedelta
    ) -> list[MintedToken]: ...


@dataclass(frozen=True, slots=True)
class WorkspaceDemand:
    """One demand figure of one workspace, as the provisioner is told of it."""

    workspace_id: UUID
    labels: LabelSet
    queued: int
    reserved: int
    oldest_queued_at: datetime


@dataclass
class RoundOutcome:
    """What one round committed, workspace by workspace, and the templates' slots left."""

    remaining: tuple[Template, ...]
    rounds: list[WorkspaceRound] = field(default_factory=list)
    skipped: list[UUID] = field(default_factory=list)  # busy workspaces of a walk
    unchanged: list[UUID] = field(default_factory=list)  # covered and unchanged: not walked
    figured: list[UUID] = field(default_factory=list)  # nothing to give them: figures only

    def record(self, result: WorkspaceRound) -> None:
        """Add one committed workspace transaction (or one's figures). A count of 0 is not
        added: a walk records each of up to 1,000 listed workspaces every round."""
        self.rounds.append(result)
        if result.rebound:
            metrics.activation_outcomes.labels("rebound").inc(result.rebound)
        reaped = sum(
            1
            for intent in result.terminate_intents
            if intent.reason is TerminateReason.ACTIVATION_TIMEOUT and not intent.retry
        )
        if reaped:
            metrics.activation_outcomes.labels("reaped").inc(reaped)

    @property
    def stats(self) -> list[WorkspaceDemand]:
        return [
            WorkspaceDemand(r.workspace_id, s.labels, s.queued, s.reserved, s.oldest_queued_at)
            for r in self.rounds
            for s in r.allocation.stats
        ]

    @property
    def grants(self) -> list[Grant]:
        return [g for r in self.rounds for g in r.grants]

    @property
    def newly_reserved(self) -> int:
        return sum(r.allocation.newly_reserved for r in self.rounds)

    @property
    def bound_ids(self) -> frozenset[UUID]:
        return frozenset(i for r in self.rounds for i in r.allocation.bound_runner_ids)

    @property
    def terminate(self) -> list[str]:
        return [i.provider_runner_id for r in self.rounds for i in r.terminate_intents]

    @property
    def intent_reasons(self) -> dict[str, str]:
        """Provider runner id -> why it is to be terminated."""
        return {
            i.provider_runner_id: i.reason.value for r in self.rounds for i in r.terminate_intents
        }


async def workspace_round(
    store: ProvisioningStore, workspace_id: UUID, terms: RoundTerms
) -> RoundOutcome:
    """A workspace provisioner's round: one fenced allocation transaction."""
    result = await store.allocate_workspace(workspace_id, terms)
    outcome = RoundOutcome(remaining=result.allocation.remaining_templates)
    outcome.record(result)
    return outcome


async def installation_walk(
    store: ProvisioningStore,
    terms: RoundTerms,
    outcome: RoundOutcome,
    memory: WalkMemory | None = None,
    now: float = 0.0,
) -> None:
    """Spec 3.5: each workspace with pending jobs, oldest demand first, in its own fenced
    transaction, carrying the budget to the next; `outcome` records each as it commits.
    `outcome.remaining` ends as the advertised templates less every launch unit still pending.

    With `terms.fair_share` (`provisioners.installation_fair_share`, issue 14) a workspace may
    take at most its even share of what is left (`walk_share`), so one busy workspace cannot
    take every slot while others wait; what a workspace leaves unused passes to the ones after
    it in this walk. Without it the oldest demand may take all (spec 3.5).

    With `memory` (issue 16, changes.py; `now` its monotonic clock) a listed workspace that was
    covered when last walked and has not changed since keeps its place in the order and in the
    fair share but runs no transaction: it would have granted and bound nothing and used none
    of the budget, so every other workspace's round is what the full walk gives it. Its demand
    figures are those of its last walk (`WalkMemory.carried`). The workspaces notified since
    their last walk join the list whatever their age (`WalkMemory.marked`).

    The slots the walk has left are carried from one workspace to the next (spec 3.5 step 4):
    the advertised ones less the provisioner's pending launch units, read once before the first
    workspace, then what each committed round left. Once no template has a slot left, or the
    fair share leaves a workspace nothing, or a template has none and a round gave nothing, one
    statement reads the figures of every workspace still to visit (`walk_figures`; the memory's,
    `WalkMemory.figures`, are used without a read), and a workspace runs its transaction only if
    they show a demand group with unreserved units that a template with a slot left could take
    (`could_give`); the others report those figures. A round grants at most a group's unreserved
    units, capped by the slots of its satisfying templates and the budget, and binds only within
    that grant (spec 3.3 step 7), so a workspace left out this way would have granted and bound
    nothing, whatever idle runners the provisioner has: with no slot left at all, the walk runs
    no further transaction, and its terminate intents (workspace scope only) and reservations
    are untouched. A workspace missing from the figures (none read yet, or a store that reads
    none) is walked."""
    budget = terms.max_reservations
    capacity = walk_capacity(terms.templates, budget)
    changed = memory.marked() if memory is not None else frozenset()
    entries = await store.walk_workspaces(changed)
    unchanged = memory.plan(entries, now) if memory is not None else frozenset()
    slots = without_pending(terms.templates, await store.outstanding_grants())
    committed = False
    figures: dict[UUID, WorkspaceRound] | None = None
    gave_nothing: list[WalkEntry] = []  # walked before the figures were read, in vain
    for index, entry in enumerate(entries):
        if budget <= 0:
            break
        workspace_id = entry.workspace_id
        if workspace_id in unchanged:
            assert memory is not None
            outcome.record(memory.carried(workspace_id))
            outcome.unchanged.append(workspace_id)
            continue
        cap = budget
        if terms.fair_share:
            cap = min(budget, walk_share(capacity, len(entries) - index))
        if figures is None and (
            cap <= 0
            or not any(t.available_slots > 0 for t in slots)
            or (gave_nothing and any(t.available_slots <= 0 for t in slots))
        ):
            rest = [*gave_nothing, *entries[index:]]
            figures = await _figures(store, terms, rest, unchanged, memory)
        if figures is not None:
            known = figures.get(workspace_id)
        else:
            known = memory.figures(workspace_id) if memory is not None else None
        if known is not None and not could_give(known, slots, cap):
            outcome.record(known)
            outcome.figured.append(workspace_id)
            continue
        result = await store.allocate_in_walk(workspace_id, replace(terms, max_reservations=cap))
        if memory is not None:
            memory.walked(entry, result)
        if result is None:
            outcome.skipped.append(workspace_id)
            continue
        outcome.record(result)
        committed = True
        if figures is None and not result.allocation.newly_reserved:
            gave_nothing.append(entry)
        slots = result.allocation.remaining_templates
        used = cap - result.allocation.remaining_max
        budget -= used
        capacity -= used
    if committed:
        slots = without_pending(terms.templates, await store.outstanding_grants())
    outcome.remaining = slots


async def _figures(
    store: ProvisioningStore,
    terms: RoundTerms,
    rest: Sequence[WalkEntry],
    unchanged: Collection[UUID],
    memory: WalkMemory | None,
) -> dict[UUID, WorkspaceRound]:
    """The figures of the workspaces still to visit: those the memory still holds, and one
    statement for the others."""
    figures: dict[UUID, WorkspaceRound] = {}
    unread = []
    for entry in rest:
        if entry.workspace_id in unchanged:
            continue
        kept = memory.figures(entry.workspace_id) if memory is not None else None
        if kept is None:
            unread.append(entry.workspace_id)
        else:
            figures[entry.workspace_id] = kept
    read = await store.walk_figures(unread, terms) if unread else []
    if memory is not None:
        memory.read(read)
    figures.update((r.workspace_id, r) for r in read)
    return figures


def could_give(figures: WorkspaceRound, slots: Sequence[Template], cap: int) -> bool:
    """Whether a workspace's round could grant or bind anything, by its figures (a round with
    no budget), with `slots` left and at most `cap` units: a demand group with units no live
    reservation holds, which a template with a slot left satisfies."""
    return cap > 0 and any(
        stat.queued > stat.reserved
        and any(t.available_slots > 0 and matches(stat.labels, t.labels) for t in slots)
        for stat in figures.allocation.stats
    )


def grant_of(reservation: Reservation, pending: int) -> Grant:
    """An outstanding launch reservation as a grant of its units still to be launched."""
    return Grant(
        reservation_id=reservation.id,
        workspace_id=reservation.workspace_id,
        labels=reservation.labels,
        count=pending,
        expires_at=reservation.expires_at,
    )
