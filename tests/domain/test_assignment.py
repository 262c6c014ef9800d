"""Batch acceptance and assignment checks (spec 2.7, 4.1, 4.6), without a database."""

from __future__ import annotations

from typing import Any
from uuid import UUID

import pytest

from controlplane.domain.assignment import (
    BatchEntry,
    accept_batch,
    check_assignment,
    committed_to,
)
from controlplane.domain.demand import ReservationKind
from controlplane.domain.runner_instances import ProvisionedRunner, RunnerState
from controlplane.errors import ReservationExpired, ReservationNotFound, RunnerNotAssignable
from tests.domain.provisioning_factories import GPU_LINUX, NOW, W, ago, reservation, runner, uid

R = uid(0x501)


def test_warm_entries_are_always_accepted_and_need_no_clock() -> None:
    kept, failures = accept_batch(
        [("small", None), ("big", None)], reservations={}, used={}, now=None
    )
    assert kept == [BatchEntry(0, "small", None), BatchEntry(1, "big", None)]
    assert failures == {}


def test_a_reservation_takes_entries_in_request_order_up_to_its_pending_units() -> None:
    launch = reservation(0x501, count=3)
    entries = [("a", R), (None, None), ("b", R), ("c", R)]
    kept, failures = accept_batch(entries, reservations={R: launch}, used={R: 1}, now=NOW)
    assert kept == [BatchEntry(0, "a", R), BatchEntry(1, None, None), BatchEntry(2, "b", R)]
    assert failures == {"capacity-exhausted": 1}


def test_used_beyond_the_count_leaves_no_room_rather_than_negative_room() -> None:
    kept, failures = accept_batch(
        [("a", R)], reservations={R: reservation(0x501, count=1)}, used={R: 5}, now=NOW
    )
    assert kept == []
    assert failures == {"capacity-exhausted": 1}


@pytest.mark.parametrize(
    ("found", "reason"),
    [
        ({}, "reservation-not-found"),
        ({R: reservation(0x501, kind=ReservationKind.BOUND)}, "reservation-kind-mismatch"),
        ({R: reservation(0x501, expires_in=-1)}, "reservation-expired"),
    ],
)
def test_an_unusable_reservation_refuses_every_entry_naming_it(
    found: dict[UUID, Any], reason: str
) -> None:
    kept, failures = accept_batch(
        [("a", R), ("b", R), ("w", None)], reservations=found, used={}, now=NOW
    )
    assert kept == [BatchEntry(2, "w", None)]
    assert failures == {reason: 2}


def _check(
    runners: list[ProvisionedRunner], *, requested: list[UUID] | None = None, **overrides: Any
) -> list[ProvisionedRunner]:
    by_id = {r.id: r for r in runners}
    arguments: dict[str, Any] = {
        "reservation_id": R,
        "reservation": reservation(0x501, count=2),
        "requested": sorted(requested if requested is not None else by_id),
        "runners": by_id,
        "committed": committed_to(R, by_id),
        "used_by_others": 0,
        "now": NOW,
    }
    arguments.update(overrides)
    return check_assignment(**arguments)


def _reason(runners: list[ProvisionedRunner], **overrides: Any) -> tuple[str, list[str]]:
    with pytest.raises(RunnerNotAssignable) as caught:
        _check(runners, **overrides)
    return caught.value.reason, caught.value.details["runner_instance_ids"]


def test_an_idle_running_matching_runner_is_assigned() -> None:
    idle = runner(1)
    assert _check([idle]) == [idle]


def test_committed_runners_are_a_replay_and_are_not_assigned_again() -> None:
    done = runner(1, reservation_id=R, workspace_id=W, assigned_at=ago(1))
    assert committed_to(R, {done.id: done}) == [done]
    fresh = runner(2)
    assert _check([done, fresh]) == [fresh]


def test_a_missing_bound_or_expired_reservation_is_refused_first() -> None:
    with pytest.raises(ReservationNotFound):
        _check([runner(1)], reservation=None)
    with pytest.raises(ReservationNotFound):
        _check([runner(1)], reservation=reservation(0x501, kind=ReservationKind.BOUND))
    with pytest.raises(ReservationExpired):
        _check([runner(1)], reservation=reservation(0x501, expires_in=-1))


def test_each_rejection_names_its_reason_and_only_the_runners_at_fault() -> None:
    other = uid(0x502)
    assert _reason([runner(1)], requested=[uid(1), uid(9)]) == ("runner-not-found", [str(uid(9))])
    assert _reason([runner(1), runner(2, reservation_id=other)]) == (
        "already-assigned",
        [str(uid(2))],
    )
    assert _reason([runner(1, reservation_released_at=ago(1))]) == (
        "already-released",
        [str(uid(1))],
    )
    assert _reason([runner(1, state=RunnerState.STARTING)]) == (
        "runner-not-running",
        [str(uid(1))],
    )
    assert _reason([runner(1, provider_runner_id=None)]) == (
        "provider-identity-missing",
        [str(uid(1))],
    )
    assert _reason([runner(1, control_session_expires_at=None)]) == (
        "control-session-not-active",
        [str(uid(1))],
    )
    assert _reason([runner(1)], reservation=reservation(0x501, GPU_LINUX)) == (
        "labels-mismatch",
        [str(uid(1))],
    )


def test_capacity_counts_other_holders_and_committed_runners_still_holding_a_unit() -> None:
    done = runner(1, reservation_id=R, workspace_id=W, assigned_at=ago(1))
    assert _check([done, runner(2)], used_by_others=0) == [runner(2)]
    assert _reason([done, runner(2)], used_by_others=1) == ("capacity-exhausted", [str(uid(2))])
    # A committed runner whose unit was released no longer counts against the reservation.
    gave_back = runner(1, reservation_id=R, workspace_id=W, assigned_at=ago(1),
                       reservation_released_at=ago(1))  # fmt: skip
    assert _check([gave_back, runner(2)], used_by_others=1) == [runner(2)]


def test_capacity_is_checked_before_the_runner_state_rules() -> None:
    reason, _ = _reason([runner(1, state=RunnerState.STARTING)], used_by_others=2)
    assert reason == "capacity-exhausted"
