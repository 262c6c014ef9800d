"""How many launch units a batch may take, and which runners an assignment may take (spec 2.7,
4.1, 4.6).

Both decisions read what the store loaded under its locks: the reservation rows, the runner
rows and `used(R)`, the units other live runners already hold. They raise or return; the store
writes what they decided.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

from controlplane.domain.demand import Reservation, ReservationKind
from controlplane.domain.labels import matches
from controlplane.domain.runner_instances import ProvisionedRunner, RunnerState
from controlplane.errors import ReservationExpired, ReservationNotFound, RunnerNotAssignable

# ------------------------------------------------------------------------------- batch (4.1)


@dataclass(frozen=True, slots=True)
class CreatedInstance:
    runner_instance_id: UUID
    bootstrap_token: str  # raw, returned once; only its SHA-256 is stored
    request_index: int


@dataclass(frozen=True, slots=True)
class Batch:
    instances: tuple[CreatedInstance, ...]
    # reason (reservation-not-found, reservation-kind-mismatch, reservation-expired,
    # capacity-exhausted) -> units refused for it
    capacity_failures: dict[str, int]

    @property
    def reservation_unavailable(self) -> bool:
        return bool(self.capacity_failures)


@dataclass(frozen=True, slots=True)
class BatchEntry:
    """One accepted entry of a batch: its index in the request, template and reservation."""

    request_index: int
    template_key: str | None
    reservation_id: UUID | None


def accept_batch(
    entries: Sequence[tuple[str | None, UUID | None]],
    *,
    reservations: Mapping[UUID, Reservation],
    used: Mapping[UUID, int],
    now: datetime | None,
) -> tuple[list[BatchEntry], dict[str, int]]:
    """The entries of a batch that get an instance, in request order, and the units refused by
    reason. An entry without a reservation is warm and always accepted; entries of reservation
    R are accepted in request order up to pending(R) = count(R) - used(R), and only when R is
    one of `reservations` (the provisioner's own), a launch reservation and live at `now` (the
    database clock, read only when some entry names a reservation)."""
    wanted = Counter(r for _, r in entries if r is not None)
    failures: Counter[str] = Counter()
    room: dict[UUID, int] = {}
    for reservation_id, requested in wanted.items():
        reservation = reservations.get(reservation_id)
        if reservation is None:
            failures["reservation-not-found"] += requested
        elif reservation.kind is not ReservationKind.LAUNCH:
            failures["reservation-kind-mismatch"] += requested
        elif now is None or not reservation.is_live(now):
            failures["reservation-expired"] += requested
        else:
            pending = max(0, reservation.count - used.get(reservation_id, 0))
            room[reservation_id] = min(requested, pending)
            if requested > pending:
                failures["capacity-exhausted"] += requested - pending
    kept: list[BatchEntry] = []
    for index, (template_key, entry_reservation) in enumerate(entries):
        if entry_reservation is not None:
            if room.get(entry_reservation, 0) <= 0:
                continue
            room[entry_reservation] -= 1
        kept.append(BatchEntry(index, template_key, entry_reservation))
    return kept, dict(failures)


# -------------------------------------------------------------------------- assignment (4.6)


def committed_to(
    reservation_id: UUID, runners: Mapping[UUID, ProvisionedRunner]
) -> list[ProvisionedRunner]:
    """The runners whose assignment to the reservation is already committed (in `runners`'
    order). When they are every requested runner, the assignment is a replay: it succeeds
    without looking at the reservation (deleted, or bound, by now)."""
    return [
        r
        for r in runners.values()
        if r.reservation_id == reservation_id and r.assigned_at and r.workspace_id
    ]


def check_assignment(
    *,
    reservation_id: UUID,
    reservation: Reservation | None,
    requested: Sequence[UUID],
    runners: Mapping[UUID, ProvisionedRunner],
    committed: Sequence[ProvisionedRunner],
    used_by_others: int,
    now: datetime,
) -> list[ProvisionedRunner]:
    """The runners an assignment must newly assign, in `requested` order (sorted ids), or the
    first rule it breaks: `ReservationNotFound`, `ReservationExpired`, else
    `RunnerNotAssignable` with the reason and the runners at fault, checked in this order:
    runner-not-found, already-assigned, already-released, capacity-exhausted,
    runner-not-running, provider-identity-missing, control-session-not-active,
    labels-mismatch.

    `runners` are the provisioner's own requested rows; `committed` those already assigned to
    the reservation (`committed_to`); `used_by_others` the units of the reservation held by
    runners outside the request."""
    if reservation is None or reservation.kind is not ReservationKind.LAUNCH:
        raise ReservationNotFound("no such launch reservation", reservation_id=str(reservation_id))
    if not reservation.is_live(now):
        raise ReservationExpired("the reservation expired", reservation_id=str(reservation_id))
    if missing := [i for i in requested if i not in runners]:
        raise RunnerNotAssignable("runner-not-found", missing)
    if taken := [i for i in requested if runners[i].reservation_id not in (None, reservation_id)]:
        raise RunnerNotAssignable("already-assigned", taken)
    committed_ids = {r.id for r in committed}
    new = [runners[i] for i in requested if i not in committed_ids]
    if released := [r.id for r in new if r.released]:
        raise RunnerNotAssignable("already-released", released)
    charged = len(new) + sum(1 for r in committed if r.holds_unit_of(reservation_id))
    if used_by_others + charged > reservation.count:
        raise RunnerNotAssignable("capacity-exhausted", [r.id for r in new])
    for reason, failing in (
        ("runner-not-running", [r.id for r in new if r.state is not RunnerState.RUNNING]),
        ("provider-identity-missing", [r.id for r in new if r.provider_runner_id is None]),
        (
            "control-session-not-active",
            [r.id for r in new if r.control_session_expires_at is None],
        ),
        ("labels-mismatch", [r.id for r in new if not matches(reservation.labels, r.labels)]),
    ):
        if failing:
            raise RunnerNotAssignable(reason, failing)
    return new
