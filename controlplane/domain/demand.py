"""Demand allocation: which pending work a provisioner gets, as bound idle runners or launches.

Pending jobs of one workspace are aggregated into demand groups (one per exact label set). A
provisioner advertises templates (labels and free slots). `allocate` decides, for one workspace
and one provisioner, how many units of each group that provisioner reserves: first by binding
its idle enrolled runners (a `bound` reservation with a short activation grace, never returned
to the provisioner, consuming no slot), then by asking it to launch compute (a `launch`
reservation returned as a grant, drawing slots from the tightest satisfying templates). The
per-template `idle_target` (our addition) then asks for warm-pool launches, see
`warm_pool_launches`.

Everything here is pure: the inputs are the rows the store read, `now` is the transaction's
database clock (reservation expiry is always judged by the database's clock), and the output is
the rows the store must write.

How the store and the actors use it
-----------------------------------
The provisioner actor (one per connected provisioner, on the replica holding its WebSocket)
runs an allocation when the provisioner advertises templates and when its workspace's demand
changes. For an installation provisioner it walks the eligible workspaces in oldest-demand
order, each in its own transaction, feeding `Allocation.remaining_templates` and
`remaining_max` of one workspace into the next; it computes `warm_pool_launches` once, after the
last workspace. Within a replica the allocation for a workspace goes through that workspace's
actor, so it never interleaves with that workspace's claims, expiry and binding.

One allocation transaction takes its locks in the global order (spec 3.8), which is what makes
it deadlock-free against assignment, batch creation, reports, releases and reservation cleanup:

1. `SELECT now()`: the `now` passed here.
2. The workspace advisory lock (`locks.workspace(W)`): blocking for a workspace provisioner,
   try-lock for an installation one (a busy workspace is skipped this round). It serialises all
   allocation for W across replicas, so the reservations read in 4 are all there are and the
   live units of a label set never exceed its queued count at allocation time.
3. Demand groups of W (`GROUP BY required_labels`, count, oldest `created_at`).
4. Every reservation of W; for this provisioner's live ones, the assignment advisory locks
   `locks.assignment(P, R)` in one statement sorted by key, then the rows `FOR UPDATE` in id
   order. Counting units under those locks means an in-flight assignment, batch creation,
   report adoption or release cannot expose the same unit twice.
5. The provisioner's runners that matter (`AllocationInputs.runners`), with the expiry of
   every reservation they reference, in any workspace (added to `reservations`).
6. `allocate`.
7. Binding, in a savepoint: lock every runner of `Allocation.bound_runner_ids` individually
   `FOR UPDATE` in ascending id (the order reservation cleanup locks runner rows in), then
   re-read them and the reservations they reference in a new statement and apply
   `binding.is_bindable` (a row lock that waited re-evaluates the row, not the reservation
   sub-queries). If any runner fails, roll back to the savepoint (dropping the partial locks),
   reload step 5 and allocate again: the next-oldest idle runner refills the unit, or it
   becomes a launch unit.
8. Insert the bound reservations, revoke the bound runners' unconsumed activation tokens, write
   `binding.bind_runner`'s fields with the predicate repeated in the UPDATE (a row count that
   differs from the locked set aborts the transaction), insert the launch reservations.

After commit the actor pushes the launch grants and warm launches. Grants the provisioner never
received (its socket closed first) are deleted again, as the reference does on a disconnect.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from uuid import UUID

from controlplane.domain.binding import BindTarget, Scope, is_idle, select_idle_runners
from controlplane.domain.labels import LabelSet, canonicalise, matches, strip_reserved
from controlplane.domain.runner_instances import LaunchKind, ProvisionedRunner, RunnerState
from controlplane.errors import InvalidInput


class ReservationKind(enum.StrEnum):
    BOUND = "bound"  # satisfied by idle runners the server bound; never returned
    LAUNCH = "launch"  # returned to the provisioner, which must start compute


@dataclass(frozen=True, slots=True)
class DemandGroup:
    """All pending jobs of one workspace requiring exactly `labels`."""

    labels: LabelSet
    queued: int
    oldest_queued_at: datetime


@dataclass(frozen=True, slots=True)
class Template:
    """What a provisioner can launch. `idle_target` asks to keep that many idle runners of this
    template around (a warm pool); 0 means launch only for demand."""

    key: str
    labels: LabelSet
    available_slots: int
    starting: int = 0
    running: int = 0
    idle_target: int = 0


@dataclass(frozen=True, slots=True)
class Reservation:
    id: UUID
    workspace_id: UUID
    provisioner_id: UUID
    labels: LabelSet
    count: int
    kind: ReservationKind
    expires_at: datetime

    def is_live(self, now: datetime) -> bool:
        return self.expires_at > now


@dataclass(frozen=True, slots=True)
class AllocationInputs:
    """One allocation round for one workspace and one provisioner.

    `reservations`: every reservation row of the workspace (any provisioner, any kind, live or
    not) plus every reservation, of any workspace, that one of `runners` references.
    `runners`: the provisioner's active, unreleased runners that either reference one of its
    live reservations in the workspace or may be idle (no runner session).
    `covering_labels` (installation scope): the label sets of the workspace's own active
    provisioners; demand they can serve, even with no free slot, is left to them.
    """

    workspace_id: UUID
    provisioner_id: UUID
    scope: Scope
    demand: Sequence[DemandGroup]
    templates: Sequence[Template]
    reservations: Sequence[Reservation]
    runners: Sequence[ProvisionedRunner]
    max_reservations: int
    launch_ttl: timedelta
    activation_grace: timedelta
    covering_labels: Sequence[LabelSet] = ()

    def __post_init__(self) -> None:
        if self.max_reservations < 0:
            raise ValueError("max_reservations cannot be negative")
        if self.launch_ttl <= timedelta(0) or self.activation_grace <= timedelta(0):
            raise ValueError("reservation lifetimes must be positive")


@dataclass(frozen=True, slots=True)
class SlotDraw:
    template_key: str
    count: int


@dataclass(frozen=True, slots=True)
class NewReservation:
    """A reservation row to insert. `runner_ids` (bound) are the runners to bind, in ascending
    id, the order to lock them in. `draws` (launch) are the template slots it was charged to."""

    kind: ReservationKind
    labels: LabelSet
    count: int
    expires_at: datetime
    runner_ids: tuple[UUID, ...] = ()
    draws: tuple[SlotDraw, ...] = ()


@dataclass(frozen=True, slots=True)
class DemandStat:
    labels: LabelSet
    queued: int
    reserved: int  # live units after this round; advisory, may exceed queued later
    oldest_queued_at: datetime


@dataclass(frozen=True, slots=True)
class Allocation:
    stats: tuple[DemandStat, ...]
    reservations: tuple[NewReservation, ...]
    remaining_templates: tuple[Template, ...]  # input order, `available_slots` = what is left
    remaining_max: int
    rebound: int  # bound runners that were launched for demand (activation outcome metric)

    @property
    def grants(self) -> tuple[NewReservation, ...]:
        """What the provisioner is told: launch reservations only."""
        return tuple(r for r in self.reservations if r.kind is ReservationKind.LAUNCH)

    @property
    def newly_reserved(self) -> int:
        return sum(r.count for r in self.reservations)

    @property
    def bound_runner_ids(self) -> frozenset[UUID]:
        return frozenset(i for r in self.reservations for i in r.runner_ids)


@dataclass(frozen=True, slots=True)
class WarmLaunch:
    """Launch `count` runners of a template without a reservation, to refill its warm pool."""

    template_key: str
    labels: LabelSet
    count: int


def reservation_ttl(
    requested_seconds: int | None, *, default_seconds: int, ceiling_seconds: int
) -> timedelta:
    """A launch reservation's lifetime: what the provisioner asked for, capped by the ceiling."""
    return timedelta(seconds=min(requested_seconds or default_seconds, ceiling_seconds))


def live_reservation_ids(reservations: Iterable[Reservation], now: datetime) -> frozenset[UUID]:
    return frozenset(r.id for r in reservations if r.is_live(now))


def used_units(reservation: Reservation, runners: Iterable[ProvisionedRunner]) -> int:
    """How many of its provisioner's runners hold a unit of the reservation (spec 2.7). A
    finished or released runner holds none, so its unit stays pending until the row changes."""
    return sum(
        1
        for runner in runners
        if runner.provisioner_id == reservation.provisioner_id
        and runner.holds_unit_of(reservation.id)
    )


class _Slots:
    """Remaining template slots, drawn from the tightest satisfying template first."""

    def __init__(self, templates: Sequence[Template]) -> None:
        self.templates = templates
        self.left = [max(0, t.available_slots) for t in templates]
        self.order = sorted(
            range(len(templates)), key=lambda i: (len(templates[i].labels), templates[i].key, i)
        )

    def satisfying(self, labels: LabelSet) -> list[int]:
        return [i for i in self.order if matches(labels, self.templates[i].labels)]

    def capacity(self, indexes: Iterable[int]) -> int:
        return sum(self.left[i] for i in indexes)

    def draw(self, indexes: Iterable[int], units: int) -> tuple[SlotDraw, ...]:
        draws: dict[str, int] = {}
        for i in indexes:
            if units <= 0:
                break
            taken = min(units, self.left[i])
            if taken:
                self.left[i] -= taken
                units -= taken
                key = self.templates[i].key
                draws[key] = draws.get(key, 0) + taken
        return tuple(SlotDraw(key, n) for key, n in draws.items())

    def remaining(self) -> tuple[Template, ...]:
        return tuple(
            replace(t, available_slots=left)
            for t, left in zip(self.templates, self.left, strict=True)
        )


def _specific_first(labels: LabelSet) -> tuple[int, LabelSet]:
    return (-len(labels), labels)


def allocate(inputs: AllocationInputs, *, now: datetime) -> Allocation:
    """Reserve demand of one workspace for one provisioner (spec 3.3, bound vs launch)."""
    workspace_rows = [r for r in inputs.reservations if r.workspace_id == inputs.workspace_id]
    live = live_reservation_ids(inputs.reservations, now)
    reserved: dict[LabelSet, int] = defaultdict(int)
    for reservation in workspace_rows:
        if reservation.is_live(now):
            reserved[reservation.labels] += reservation.count

    # This provisioner's units still to be launched or adopted already spoke for some slots.
    slots = _Slots(inputs.templates)
    own = [
        r for r in workspace_rows if r.provisioner_id == inputs.provisioner_id and r.is_live(now)
    ]
    for reservation in sorted(own, key=lambda r: (*_specific_first(r.labels), r.id)):
        pending = max(0, reservation.count - used_units(reservation, inputs.runners))
        slots.draw(slots.satisfying(reservation.labels), pending)

    groups = [
        g
        for g in inputs.demand
        if not any(set(g.labels) <= set(covering) for covering in inputs.covering_labels)
    ]
    # More labels first (the tighter demand has fewer places to go), then the longest waiting.
    groups.sort(key=lambda g: (-len(g.labels), g.oldest_queued_at, g.labels))

    stats: list[DemandStat] = []
    new: list[NewReservation] = []
    remaining_max = inputs.max_reservations
    bound: set[UUID] = set()
    rebound = 0
    for group in groups:
        satisfying = slots.satisfying(group.labels)
        if not satisfying:
            continue  # nothing this provisioner runs could take it: not its demand
        already = reserved[group.labels]
        grant = min(max(0, group.queued - already), slots.capacity(satisfying), remaining_max)
        if grant > 0:
            remaining_max -= grant
            target = BindTarget(
                inputs.provisioner_id, inputs.workspace_id, inputs.scope, group.labels
            )
            idle = select_idle_runners(
                inputs.runners, target, count=grant, live=live, now=now, exclude=bound
            )
            if idle:
                bound.update(r.id for r in idle)
                rebound += sum(1 for r in idle if r.launch_kind is LaunchKind.DEMAND)
                new.append(
                    NewReservation(
                        ReservationKind.BOUND,
                        group.labels,
                        len(idle),
                        now + inputs.activation_grace,
                        runner_ids=tuple(r.id for r in idle),
                    )
                )
            launch = grant - len(idle)
            if launch > 0:
                new.append(
                    NewReservation(
                        ReservationKind.LAUNCH,
                        group.labels,
                        launch,
                        now + inputs.launch_ttl,
                        draws=slots.draw(satisfying, launch),
                    )
                )
        stats.append(
            DemandStat(group.labels, group.queued, already + grant, group.oldest_queued_at)
        )

    return Allocation(tuple(stats), tuple(new), slots.remaining(), remaining_max, rebound)


def covers(inputs: AllocationInputs, allocation: Allocation) -> bool:
    """Whether the round left nothing for this provisioner in the workspace: every demand
    group is either reserved in full after it (live units, any provisioner's, at least the
    queued count) or matches none of the provisioner's templates. A group left to the
    workspace's own provisioners (`covering_labels`) is not covered: that ends with time alone.
    Only a new pending job, a change of the workspace's live reservations or of the templates
    can make a covered workspace's next round grant or bind anything (`allocate` gives nothing
    to a group whose units are all reserved)."""
    reserved = {s.labels: s.reserved for s in allocation.stats}
    for group in inputs.demand:
        if group.labels in reserved:
            if reserved[group.labels] < group.queued:
                return False
        elif any(matches(group.labels, t.labels) for t in inputs.templates):
            return False  # left to the covering provisioners
    return True


def without_pending(
    templates: Sequence[Template], pending: Iterable[tuple[Reservation, int]]
) -> tuple[Template, ...]:
    """The templates left once the provisioner's launch units still to be launched are charged
    to them, most specific reservation first, each to its tightest satisfying templates: the
    same charging `allocate` applies to the reservations of the workspace it serves. An
    installation provisioner's round charges its units in every other workspace this way, so a
    workspace skipped this round (busy) or without demand still holds its slots."""
    slots = _Slots(templates)
    for reservation, units in sorted(
        pending, key=lambda item: (*_specific_first(item[0].labels), item[0].id)
    ):
        slots.draw(slots.satisfying(reservation.labels), units)
    return slots.remaining()


def _is_booting(runner: ProvisionedRunner, *, live: Set[UUID]) -> bool:
    """Compute not enrolled yet (starting, or running by its provider's report but without a
    control session) that no live reservation is waiting for: it will come up idle."""
    return (
        (runner.state is RunnerState.STARTING or runner.control_session_expires_at is None)
        and not runner.state.is_terminal
        and runner.runner_session_id is None
        and not runner.released
        and runner.reservation_id not in live
        and runner.intended_reservation_id not in live
    )


def warm_pool_launches(
    templates: Sequence[Template],
    runners: Iterable[ProvisionedRunner],
    *,
    live: Set[UUID],
    now: datetime,
    just_bound: Set[UUID] = frozenset(),
    unacknowledged: Mapping[str, int] | None = None,
) -> tuple[WarmLaunch, ...]:
    """Launches that bring each template's idle runners up to its `idle_target`.

    `templates` are what allocation left (`Allocation.remaining_templates`), so demand is served
    first and a warm launch never takes a slot the provisioner did not advertise. Idle runners
    and boots no reservation waits for count toward the target, minus `just_bound` (bound by
    this round, not yet written); `unacknowledged` counts warm launches already pushed whose
    instances the provisioner has not created yet. Warm launches are not reservations, so
    `max_reservations` does not cap them.
    """
    supply: dict[str, int] = defaultdict(int)
    for runner in runners:
        if runner.template_key is None or runner.id in just_bound:
            continue
        if is_idle(runner, live=live, now=now) or _is_booting(runner, live=live):
            supply[runner.template_key] += 1
    pushed = unacknowledged or {}
    launches = []
    for template in templates:
        missing = template.idle_target - supply[template.key] - pushed.get(template.key, 0)
        count = min(missing, max(0, template.available_slots))
        if count > 0:
            launches.append(WarmLaunch(template.key, template.labels, count))
    return tuple(launches)


def walk_capacity(templates: Sequence[Template], budget: int) -> int:
    """What an installation provisioner's walk can hand out this round: its budget, and no more
    than the slots it advertised when it advertised any (binding idle runners takes no slot, so
    a provisioner with no free slot still has its budget to bind with)."""
    slots = sum(t.available_slots for t in templates)
    return min(budget, slots) if slots > 0 else budget


def walk_share(capacity: int, workspaces_left: int) -> int:
    """The most the next workspace of a walk may take: an even share, rounded up, of what the
    walk has left among the workspaces still to visit (fair share across workspaces: the
    oldest-demand workspace goes first, but cannot take what the others' shares hold)."""
    if workspaces_left <= 0 or capacity <= 0:
        return 0
    return -(-capacity // workspaces_left)


def advertised_templates(
    scope: str, ads: Sequence[Template], reserved_labels: LabelSet
) -> tuple[Template, ...]:
    """Canonical templates of an advertisement; `scope` is the provisioner's (`workspace` or
    `installation`). A workspace provisioner's reserved labels are stripped (spec 3.1);
    a template left with no label is dropped. Template keys must be unique."""
    keys = [ad.key for ad in ads]
    if len(set(keys)) != len(keys):
        raise InvalidInput("template_key must be unique within an advertisement")
    templates = []
    for ad in ads:
        labels = canonicalise(ad.labels)
        if scope == "workspace":
            labels = strip_reserved(labels, reserved_labels)
        if labels:
            templates.append(replace(ad, labels=labels))
    return tuple(templates)
