from __future__ import annotations

from typing import Any

from controlplane.domain.binding import (
    BindTarget,
    Scope,
    bind_runner,
    is_bindable,
    select_idle_runners,
)
from controlplane.domain.demand import live_reservation_ids
from controlplane.domain.runner_instances import ProvisionedRunner, RunnerState
from tests.domain.provisioning_factories import (
    LINUX,
    NOW,
    W2,
    P,
    W,
    ago,
    reservation,
    runner,
    uid,
)

LIVE = reservation(10, expires_in=30)
LIVE_ELSEWHERE = reservation(11, expires_in=30, workspace_id=W2)
EXPIRED = reservation(12, expires_in=-1)
DELETED = uid(13)  # no row at all
LIVE_IDS = live_reservation_ids([LIVE, LIVE_ELSEWHERE, EXPIRED], NOW)
FOR_W = BindTarget(P, W, Scope.WORKSPACE, LINUX)


def bindable(target: BindTarget = FOR_W, **overrides: Any) -> bool:
    return is_bindable(runner(1, **overrides), target, live=LIVE_IDS, now=NOW)


def test_an_enrolled_workspace_neutral_runner_is_bindable() -> None:
    assert bindable()
    assert not bindable(labels=("macos",))
    assert not bindable(provisioner_id=uid(0xB2))
    assert not bindable(provider_runner_id=None)
    assert not bindable(state=RunnerState.STARTING)


def test_p13_expired_intended_reservation_is_bindable_and_binding_clears_it() -> None:
    assert bindable(intended_reservation_id=EXPIRED.id)
    stranded = runner(1, intended_reservation_id=EXPIRED.id)
    bound = bind_runner(stranded, reservation_id=uid(20), workspace_id=W, now=NOW)
    assert (bound.intended_reservation_id, bound.reservation_id) == (None, uid(20))
    assert (bound.workspace_id, bound.assigned_at) == (W, NOW)


def test_p14_deleted_intended_reservation_is_bindable() -> None:
    assert bindable(intended_reservation_id=DELETED)


def test_p15_assigned_runner_whose_reservation_expired_is_rebindable() -> None:
    assert bindable(workspace_id=W, reservation_id=EXPIRED.id, assigned_at=ago(90))


def test_p16_assigned_runner_whose_reservation_was_deleted_is_rebindable() -> None:
    assert bindable(workspace_id=W, reservation_id=DELETED, assigned_at=ago(90))


def test_p17_runner_inside_its_live_reservation_is_not_bindable() -> None:
    assert not bindable(workspace_id=W, reservation_id=LIVE.id, assigned_at=ago(5))


def test_p18_live_intended_reservation_protects_even_from_another_workspace() -> None:
    assert not bindable(intended_reservation_id=LIVE.id)
    assert not bindable(intended_reservation_id=LIVE_ELSEWHERE.id)


def test_p19_workspace_poll_does_not_take_a_stale_runner_of_another_workspace() -> None:
    assert not bindable(workspace_id=W2, reservation_id=EXPIRED.id)


def test_p20_workspace_neutral_runner_with_dangling_reservation_is_rebound() -> None:
    assert bindable(workspace_id=None, reservation_id=DELETED)


def test_p21_installation_poll_rebinds_across_workspaces() -> None:
    installation = BindTarget(P, W, Scope.INSTALLATION, LINUX)
    assert bindable(installation, workspace_id=W2, reservation_id=EXPIRED.id)
    assert not bindable(installation, workspace_id=W2, reservation_id=LIVE_ELSEWHERE.id)


def test_p22_released_runner_is_never_rebound() -> None:
    assert not bindable(reservation_id=EXPIRED.id, reservation_released_at=ago(30))


def test_p23_runner_without_control_session_is_not_bound() -> None:
    assert not bindable(control_session_expires_at=None)


def test_p24_runner_with_expired_control_session_is_not_bound() -> None:
    assert not bindable(control_session_expires_at=NOW)


def test_activated_runner_and_workspace_without_reservation_are_never_bound() -> None:
    assert not bindable(runner_session_id=uid(40))
    assert not bindable(workspace_id=W, reservation_id=None)


def test_selection_is_oldest_first_returned_in_lock_order() -> None:
    runners = [
        runner(4, created_at=ago(10)),
        runner(9, created_at=ago(40)),
        runner(2, created_at=ago(30)),
        runner(7, created_at=ago(30)),
        runner(1, created_at=ago(50), runner_session_id=uid(40)),
    ]

    def pick(count: int, exclude: frozenset[Any] = frozenset()) -> list[int]:
        chosen: tuple[ProvisionedRunner, ...] = select_idle_runners(
            runners, FOR_W, count=count, live=LIVE_IDS, now=NOW, exclude=exclude
        )
        return [r.id.int for r in chosen]

    assert pick(3) == [2, 7, 9]  # created 40, 30, 30 (tie by id) seconds ago
    assert pick(2, exclude=frozenset({uid(9)})) == [2, 7]
    assert pick(0) == []
    assert pick(10) == [2, 4, 7, 9]
