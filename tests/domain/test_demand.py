from __future__ import annotations

from datetime import timedelta

import pytest

from controlplane.domain.binding import Scope, bind_runner
from controlplane.domain.demand import (
    Allocation,
    AllocationInputs,
    DemandStat,
    NewReservation,
    ReservationKind,
    SlotDraw,
    WarmLaunch,
    allocate,
    live_reservation_ids,
    reservation_ttl,
    used_units,
    warm_pool_launches,
)
from controlplane.domain.runner_instances import LaunchKind, ProvisionedRunner, RunnerState
from tests.domain.provisioning_factories import (
    GPU_LINUX,
    LINUX,
    NOW,
    P2,
    W2,
    W,
    ago,
    group,
    inputs,
    later,
    reservation,
    runner,
    template,
    uid,
)

X64: tuple[str, ...] = ("linux", "x64")


def launches(allocation: Allocation) -> list[tuple[tuple[str, ...], int]]:
    return [(r.labels, r.count) for r in allocation.grants]


def bound(allocation: Allocation) -> list[NewReservation]:
    return [r for r in allocation.reservations if r.kind is ReservationKind.BOUND]


def test_p01_grant_is_capped_by_unreserved_demand_slots_and_max() -> None:
    result = allocate(inputs(demand=(group(queued=50),), templates=(template(slots=20),)), now=NOW)
    assert launches(result) == [(LINUX, 20)]
    assert result.stats == (DemandStat(LINUX, 50, 20, ago(60)),)

    capped_by_max = allocate(inputs(demand=(group(queued=50),), max_reservations=7), now=NOW)
    assert launches(capped_by_max) == [(LINUX, 7)]
    assert capped_by_max.remaining_max == 0

    others = (reservation(1, count=45, provisioner_id=P2),)
    capped_by_demand = allocate(inputs(demand=(group(queued=50),), reservations=others), now=NOW)
    assert launches(capped_by_demand) == [(LINUX, 5)]
    assert capped_by_demand.stats[0].reserved == 50


def test_p02_without_idle_runners_one_launch_reservation() -> None:
    result = allocate(inputs(demand=(group(queued=3),)), now=NOW)
    assert result.reservations == (
        NewReservation(ReservationKind.LAUNCH, LINUX, 3, later(120), draws=(SlotDraw("small", 3),)),
    )


def test_p03_binds_the_oldest_matching_idle_runners_and_launches_the_rest() -> None:
    runners = (
        runner(3, created_at=ago(10)),
        runner(5, created_at=ago(30)),
        runner(1, created_at=ago(20)),
        runner(2, created_at=ago(99), labels=("macos",)),
    )
    covered = allocate(inputs(demand=(group(queued=2),), runners=runners), now=NOW)
    assert [r.runner_ids for r in bound(covered)] == [(uid(1), uid(5))]  # oldest two, id order
    assert covered.grants == ()

    remainder = allocate(inputs(demand=(group(queued=5),), runners=runners), now=NOW)
    assert [r.count for r in bound(remainder)] == [3]
    assert launches(remainder) == [(LINUX, 2)]
    assert uid(2) not in remainder.bound_runner_ids
    assert remainder.newly_reserved == 5


def test_p04_bound_and_launch_reservations_have_their_own_lifetimes() -> None:
    result = allocate(inputs(demand=(group(queued=2),), runners=(runner(1),)), now=NOW)
    kinds = {r.kind: r.expires_at for r in result.reservations}
    assert kinds == {ReservationKind.BOUND: later(60), ReservationKind.LAUNCH: later(120)}
    assert [r.kind for r in result.grants] == [ReservationKind.LAUNCH]


def test_p05_binding_a_demand_runner_counts_as_rebound() -> None:
    runners = (runner(1, launch_kind=LaunchKind.DEMAND), runner(2, launch_kind=LaunchKind.WARM))
    assert allocate(inputs(demand=(group(queued=2),), runners=runners), now=NOW).rebound == 1


def test_p06_an_adopted_unit_is_not_charged_against_other_demand() -> None:
    adopted = reservation(1, GPU_LINUX, kind=ReservationKind.BOUND)
    holder = runner(
        1, labels=GPU_LINUX, workspace_id=adopted.workspace_id, reservation_id=adopted.id
    )
    result = allocate(
        inputs(
            demand=(group(GPU_LINUX, queued=1), group(LINUX, queued=1)),
            templates=(template("gpu", GPU_LINUX, slots=1),),
            reservations=(adopted,),
            runners=(holder,),
        ),
        now=NOW,
    )
    assert launches(result) == [(LINUX, 1)]
    assert [s.reserved for s in result.stats] == [1, 1]


def capacity_left_for_linux(*runners_of_p: ProvisionedRunner, count: int = 3) -> int:
    """Launch units `linux` demand gets from a 5-slot linux+x64 template while a linux+x64
    reservation of `count` units is held by `runners_of_p`."""
    held = reservation(7, X64, count)
    result = allocate(
        inputs(
            demand=(group(LINUX, queued=10),),
            templates=(template("x64", X64, slots=5),),
            reservations=(held,),
            runners=runners_of_p,
        ),
        now=NOW,
    )
    return sum(count for _, count in launches(result))


def test_p07_only_unadopted_units_of_a_reservation_are_deducted() -> None:
    assigned = runner(1, labels=X64, workspace_id=W, reservation_id=uid(7))
    assert capacity_left_for_linux(assigned) == 3


def test_p08_a_reservation_without_adopted_units_is_deducted_in_full() -> None:
    assert capacity_left_for_linux() == 2


def test_p09_a_live_intended_reservation_counts_as_used() -> None:
    booting = runner(1, state=RunnerState.STARTING, intended_reservation_id=uid(7))
    assert capacity_left_for_linux(booting) == 3


def test_p10_a_released_runner_still_leaves_its_unit_pending() -> None:
    released = runner(1, reservation_id=uid(7), workspace_id=W, reservation_released_at=ago(1))
    assert capacity_left_for_linux(released) == 2


def test_p11_a_terminal_runner_does_not_use_its_reservation() -> None:
    for link in ({"reservation_id": uid(7)}, {"intended_reservation_id": uid(7)}):
        dead = runner(1, state=RunnerState.FAILED, **link)
        assert capacity_left_for_linux(dead) == 2


def test_p12_only_active_unreleased_runners_of_the_owner_count_as_used() -> None:
    held = reservation(7, X64, 4)
    runners = [
        runner(1, reservation_id=held.id),
        runner(2, state=RunnerState.STOPPING, intended_reservation_id=held.id),
        runner(3, state=RunnerState.STOPPED, reservation_id=held.id),
        runner(4, reservation_id=held.id, provisioner_id=P2),
        runner(5, reservation_id=uid(8), runner_session_id=uid(60)),
    ]
    assert used_units(held, runners) == 2
    assert capacity_left_for_linux(*runners, count=4) == 3


def test_p17_a_runner_inside_its_activation_grace_is_not_bound() -> None:
    grace = reservation(7, kind=ReservationKind.BOUND, expires_in=30)
    activating = runner(1, workspace_id=grace.workspace_id, reservation_id=grace.id)
    result = allocate(
        inputs(demand=(group(queued=2),), reservations=(grace,), runners=(activating,)),
        now=NOW,
    )
    assert bound(result) == []
    assert launches(result) == [(LINUX, 1)]


def test_p25_once_idle_runners_cover_demand_a_second_round_grants_nothing() -> None:
    runners = (runner(1), runner(2))
    first = allocate(inputs(demand=(group(queued=2),), runners=runners), now=NOW)
    [made] = first.reservations
    written = reservation(9, count=made.count, kind=made.kind, expires_in=60)
    rebound = tuple(
        bind_runner(r, reservation_id=written.id, workspace_id=W, now=NOW) for r in runners
    )
    second = allocate(
        inputs(demand=(group(queued=2),), reservations=(written,), runners=rebound),
        now=NOW,
    )
    assert second.reservations == ()
    assert second.stats == (DemandStat(LINUX, 2, 2, ago(60)),)


def test_p26_overlapping_label_sets_are_served_most_specific_first() -> None:
    result = allocate(
        inputs(
            demand=(group(LINUX, queued=1, oldest=600), group(GPU_LINUX, queued=1, oldest=5)),
            templates=(template("gpu", GPU_LINUX, slots=1),),
        ),
        now=NOW,
    )
    assert launches(result) == [(GPU_LINUX, 1)]
    assert [(s.labels, s.reserved) for s in result.stats] == [(GPU_LINUX, 1), (LINUX, 0)]


def test_p26_equally_specific_groups_are_served_oldest_first() -> None:
    result = allocate(
        inputs(
            demand=(group(("arm",), queued=2, oldest=5), group(("x64",), queued=2, oldest=50)),
            templates=(template("any", ("arm", "x64"), slots=3),),
        ),
        now=NOW,
    )
    assert launches(result) == [(("x64",), 2), (("arm",), 1)]


def test_p26_a_group_is_drawn_from_the_tightest_satisfying_template() -> None:
    result = allocate(
        inputs(
            demand=(group(LINUX, queued=3),),
            templates=(template("big", GPU_LINUX, slots=5), template("small", LINUX, slots=2)),
        ),
        now=NOW,
    )
    assert result.grants[0].draws == (SlotDraw("small", 2), SlotDraw("big", 1))


def test_p27_a_second_provisioner_never_reserves_more_than_queued() -> None:
    first = allocate(inputs(demand=(group(queued=5),), templates=(template(slots=3),)), now=NOW)
    [grant] = first.grants
    written = reservation(1, count=grant.count)
    second = allocate(
        inputs(provisioner_id=P2, demand=(group(queued=5),), reservations=(written,)), now=NOW
    )
    assert launches(second) == [(LINUX, 2)]
    assert second.stats[0].reserved == 5


def test_p28_the_budget_goes_to_the_most_specific_group_first() -> None:
    result = allocate(
        inputs(
            demand=(group(LINUX, queued=3), group(GPU_LINUX, queued=3)),
            templates=(template("gpu", GPU_LINUX, slots=10),),
            max_reservations=4,
        ),
        now=NOW,
    )
    assert launches(result) == [(GPU_LINUX, 3), (LINUX, 1)]


def test_p29_demand_no_template_satisfies_is_absent() -> None:
    result = allocate(inputs(demand=(group(("macos",), queued=4), group(queued=1))), now=NOW)
    assert [s.labels for s in result.stats] == [LINUX]
    assert launches(result) == [(LINUX, 1)]


def test_p30_zero_max_reservations_reports_stats_and_writes_nothing() -> None:
    result = allocate(
        inputs(demand=(group(queued=4),), runners=(runner(1),), max_reservations=0), now=NOW
    )
    assert result.reservations == ()
    assert result.stats == (DemandStat(LINUX, 4, 0, ago(60)),)


def test_p31_expiry_is_the_given_database_clock_plus_the_lifetime() -> None:
    db_now = NOW + timedelta(seconds=13)
    result = allocate(inputs(demand=(group(),), launch_ttl=timedelta(seconds=60)), now=db_now)
    assert result.grants[0].expires_at == db_now + timedelta(seconds=60)


def test_p32_expired_reservations_do_not_count_as_reserved() -> None:
    expired = reservation(1, count=3, expires_in=0, provisioner_id=P2)
    result = allocate(inputs(demand=(group(queued=3),), reservations=(expired,)), now=NOW)
    assert launches(result) == [(LINUX, 3)]
    assert live_reservation_ids([expired], NOW) == frozenset()


def test_p33_own_live_reservations_reduce_advertised_capacity() -> None:
    own = reservation(1, X64, count=4)
    foreign = reservation(2, X64, count=4, provisioner_id=P2)
    for held, expected in ((own, 1), (foreign, 5)):
        result = allocate(
            inputs(
                demand=(group(LINUX, queued=9),),
                templates=(template("x64", X64, slots=5),),
                reservations=(held,),
            ),
            now=NOW,
        )
        assert launches(result) == [(LINUX, expected)]


def test_p34_several_groups_are_granted_in_one_round() -> None:
    result = allocate(
        inputs(
            demand=(group(LINUX, queued=2), group(X64, queued=1), group(("macos",), queued=1)),
            templates=(template("x64", X64), template("mac", ("macos",))),
        ),
        now=NOW,
    )
    assert sorted(launches(result)) == [(LINUX, 2), (("linux", "x64"), 1), (("macos",), 1)]


def installation_round(previous: Allocation | None, **overrides: object) -> Allocation:
    """One workspace of an installation round, carrying over what the previous one left."""
    carried: dict[str, object] = {"scope": Scope.INSTALLATION}
    if previous is not None:
        carried |= {
            "templates": previous.remaining_templates,
            "max_reservations": previous.remaining_max,
        }
    return allocate(inputs(**(carried | overrides)), now=NOW)


def test_p35_bound_units_take_budget_but_no_template_slot() -> None:
    for max_reservations, slots, expected_launch in ((5, 2, 2), (2, 5, 1)):
        first = installation_round(
            None,
            demand=(group(queued=1),),
            runners=(runner(1),),
            templates=(template(slots=slots),),
            max_reservations=max_reservations,
        )
        assert [r.count for r in bound(first)] == [1]
        second = installation_round(first, workspace_id=W2, demand=(group(queued=9),))
        assert launches(second) == [(LINUX, expected_launch)]


def test_p36_template_slots_are_not_oversold_across_workspaces() -> None:
    first = installation_round(None, demand=(group(queued=3),), templates=(template(slots=4),))
    second = installation_round(first, workspace_id=W2, demand=(group(queued=3),))
    assert launches(first) == [(LINUX, 3)]
    assert launches(second) == [(LINUX, 1)]
    assert second.remaining_templates[0].available_slots == 0


def test_p37_an_adopted_installation_runner_leaves_slots_for_the_next_workspace() -> None:
    stranded = runner(1, workspace_id=W2, reservation_id=uid(99))
    first = installation_round(
        None, demand=(group(queued=1),), runners=(stranded,), templates=(template(slots=2),)
    )
    assert first.bound_runner_ids == {stranded.id}
    assert first.remaining_templates[0].available_slots == 2
    second = installation_round(first, workspace_id=W2, demand=(group(queued=5),))
    assert launches(second) == [(LINUX, 2)]


def test_p43_demand_a_workspace_provisioner_can_serve_is_left_to_it() -> None:
    result = installation_round(
        None,
        demand=(group(LINUX, queued=2), group(GPU_LINUX, queued=1)),
        templates=(template("gpu", GPU_LINUX),),
        covering_labels=(X64,),
    )
    assert [s.labels for s in result.stats] == [GPU_LINUX]
    assert launches(result) == [(GPU_LINUX, 1)]


def test_p42_p64_requested_lifetimes_are_clamped_to_the_ceiling() -> None:
    def ttl(requested: int | None) -> timedelta:
        return reservation_ttl(requested, default_seconds=60, ceiling_seconds=600)

    assert ttl(601) == timedelta(seconds=600)
    assert ttl(540) == timedelta(seconds=540)
    assert ttl(120) == timedelta(seconds=120)
    assert ttl(None) == timedelta(seconds=60)


def test_p46_when_the_oldest_candidate_drops_out_the_next_one_is_bound() -> None:
    """The store's savepoint retry: the re-read runner fails the re-check, allocation runs again
    on the fresh rows and the next-oldest eligible runner refills the unit."""
    oldest, next_oldest = runner(2, created_at=ago(90)), runner(1, created_at=ago(80))
    before = allocate(inputs(demand=(group(),), runners=(oldest, next_oldest)), now=NOW)
    assert before.bound_runner_ids == {oldest.id}
    activated = runner(2, created_at=ago(90), runner_session_id=uid(50))
    after = allocate(inputs(demand=(group(),), runners=(activated, next_oldest)), now=NOW)
    assert after.bound_runner_ids == {next_oldest.id}


def test_p47_a_runner_re_reserved_meanwhile_turns_the_unit_into_a_launch() -> None:
    elsewhere = reservation(5, kind=ReservationKind.BOUND, workspace_id=W2)
    rebound = runner(1, workspace_id=W2, reservation_id=elsewhere.id)
    result = allocate(
        inputs(demand=(group(),), runners=(rebound,), reservations=(elsewhere,)), now=NOW
    )
    assert bound(result) == []
    assert launches(result) == [(LINUX, 1)]


@pytest.mark.parametrize(
    "bad",
    [{"max_reservations": -1}, {"launch_ttl": timedelta(0)}, {"activation_grace": timedelta(0)}],
)
def test_allocation_inputs_refuse_negative_budget_and_lifetimes(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=r"cannot be negative|must be positive"):
        inputs(**bad)


# Warm pool (our addition): keep `idle_target` idle runners per template.


def warm(allocation_inputs: AllocationInputs, **kwargs: object) -> tuple[WarmLaunch, ...]:
    allocation = allocate(allocation_inputs, now=NOW)
    live = live_reservation_ids(allocation_inputs.reservations, NOW)
    return warm_pool_launches(
        allocation.remaining_templates,
        allocation_inputs.runners,
        live=live,
        now=NOW,
        just_bound=allocation.bound_runner_ids,
        **kwargs,  # type: ignore[arg-type]
    )


def test_warm_pool_refills_to_the_idle_target_counting_idle_and_booting_runners() -> None:
    booting = runner(2, state=RunnerState.STARTING, provider_runner_id=None)
    other_template = runner(3, template_key="large")
    assert warm(
        inputs(
            templates=(template(idle_target=4),),
            runners=(runner(1), booting, other_template),
        )
    ) == (WarmLaunch("small", LINUX, 2),)


def test_warm_pool_serves_demand_first_and_never_exceeds_free_slots() -> None:
    assert warm(
        inputs(demand=(group(queued=3),), templates=(template(slots=5, idle_target=9),))
    ) == (WarmLaunch("small", LINUX, 2),)
    assert (
        warm(inputs(demand=(group(queued=5),), templates=(template(slots=5, idle_target=9),))) == ()
    )


def test_warm_pool_does_not_count_runners_bound_this_round_or_headed_for_demand() -> None:
    demand_boot = runner(2, state=RunnerState.STARTING, intended_reservation_id=uid(7))
    result = warm(
        inputs(
            demand=(group(queued=1),),
            templates=(template(idle_target=1),),
            reservations=(reservation(7, X64),),
            runners=(runner(1), demand_boot),
        )
    )
    assert result == (WarmLaunch("small", LINUX, 1),)


def test_warm_pool_subtracts_launches_pushed_but_not_yet_created() -> None:
    target = inputs(templates=(template(idle_target=3),), runners=(runner(1),))
    assert warm(target, unacknowledged={"small": 1}) == (WarmLaunch("small", LINUX, 1),)
    assert warm(target, unacknowledged={"small": 5}) == ()


def test_warm_pool_ignores_the_reservation_budget() -> None:
    assert warm(inputs(templates=(template(idle_target=2),), max_reservations=0)) == (
        WarmLaunch("small", LINUX, 2),
    )
