"""Properties of `allocate` and `warm_pool_launches` over random rows (hypothesis)."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from datetime import timedelta
from typing import TypeVar

from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.domain.binding import BindTarget, Scope, is_bindable
from controlplane.domain.demand import (
    Allocation,
    AllocationInputs,
    DemandGroup,
    ReservationKind,
    Template,
    WarmLaunch,
    allocate,
    live_reservation_ids,
    warm_pool_launches,
)
from controlplane.domain.labels import LabelSet, matches
from controlplane.domain.runner_instances import LaunchKind, RunnerState
from tests.domain.provisioning_factories import (
    NOW,
    P2,
    W2,
    P,
    W,
    ago,
    later,
    reservation,
    runner,
    uid,
)

label_sets = st.sets(st.sampled_from(["arm", "gpu", "linux", "x64"]), min_size=1).map(
    lambda labels: tuple(sorted(labels))
)
moments = st.integers(-120, 120).map(later)
Row = TypeVar("Row")
maybe_reservation = st.one_of(st.none(), st.integers(1, 12).map(uid))
wide_label_sets = st.sets(st.sampled_from(["arm", "gpu", "linux", "x64"]), min_size=2).map(
    lambda labels: tuple(sorted(labels))
)


@st.composite
def odd_runner_fields(draw: st.DrawFn, n: int) -> dict[str, object]:
    """Anything but a plainly idle runner of P (the factory's default)."""
    return {
        "provisioner_id": draw(st.sampled_from([P, P, P2])),
        "state": draw(st.sampled_from(RunnerState)),
        "provider_runner_id": draw(st.sampled_from([None, f"provider-{n}"])),
        "workspace_id": draw(st.sampled_from([None, W, W2])),
        "reservation_id": draw(maybe_reservation),
        "intended_reservation_id": draw(maybe_reservation),
        "runner_session_id": draw(st.sampled_from([None, uid(99)])),
        "reservation_released_at": draw(st.sampled_from([None, ago(1)])),
        "control_session_expires_at": draw(st.one_of(st.none(), moments)),
    }


@st.composite
def allocation_inputs(draw: st.DrawFn) -> AllocationInputs:
    demand = [
        DemandGroup(labels, draw(st.integers(1, 30)), ago(draw(st.integers(0, 5))))
        for labels in draw(st.lists(label_sets, max_size=5, unique=True))
    ]
    templates = [
        Template(f"t{index}", labels, draw(st.integers(0, 12)), idle_target=draw(st.integers(0, 4)))
        for index, labels in enumerate(draw(st.lists(label_sets, max_size=4)))
    ]
    reservations = [
        reservation(
            n,
            draw(label_sets),
            draw(st.integers(1, 6)),
            kind=draw(st.sampled_from(ReservationKind)),
            expires_in=draw(st.integers(-60, 120)),
            workspace_id=draw(st.sampled_from([W, W, W2])),
            provisioner_id=draw(st.sampled_from([P, P, P2])),
        )
        for n in draw(st.sets(st.integers(1, 10), max_size=6))
    ]
    runners = [
        runner(
            n,
            created_at=ago(draw(st.integers(0, 50))),
            labels=draw(wide_label_sets),
            launch_kind=draw(st.sampled_from(LaunchKind)),
            template_key=draw(st.sampled_from([None, "t0", "t1", "t2"])),
            **(draw(st.just({}) | odd_runner_fields(n))),
        )
        for n in draw(st.sets(st.integers(100, 140), max_size=8))
    ]
    return AllocationInputs(
        workspace_id=W,
        provisioner_id=P,
        scope=draw(st.sampled_from(Scope)),
        demand=demand,
        templates=templates,
        reservations=reservations,
        runners=runners,
        max_reservations=draw(st.integers(0, 40)),
        launch_ttl=timedelta(seconds=120),
        activation_grace=timedelta(seconds=60),
        covering_labels=draw(st.lists(label_sets, max_size=1)),
    )


def run(inputs: AllocationInputs) -> tuple[Allocation, tuple[WarmLaunch, ...]]:
    allocation = allocate(inputs, now=NOW)
    warm = warm_pool_launches(
        allocation.remaining_templates,
        inputs.runners,
        live=live_reservation_ids(inputs.reservations, NOW),
        now=NOW,
        just_bound=allocation.bound_runner_ids,
    )
    return allocation, warm


@given(allocation_inputs())
@settings(max_examples=300)
def test_launches_never_exceed_the_advertised_slots(inputs: AllocationInputs) -> None:
    allocation, warm = run(inputs)
    advertised = sum(t.available_slots for t in inputs.templates)
    launched = sum(r.count for r in allocation.grants) + sum(w.count for w in warm)
    assert launched <= advertised
    for before, after in zip(inputs.templates, allocation.remaining_templates, strict=True):
        assert 0 <= after.available_slots <= before.available_slots
    for grant in allocation.grants:
        assert sum(d.count for d in grant.draws) == grant.count
    left = {t.key: t.available_slots for t in allocation.remaining_templates}
    assert all(w.count <= left[w.template_key] for w in warm)


@given(allocation_inputs())
@settings(max_examples=300)
def test_reserved_units_never_exceed_max_reservations(inputs: AllocationInputs) -> None:
    allocation, _ = run(inputs)
    assert allocation.newly_reserved <= inputs.max_reservations
    assert allocation.remaining_max == inputs.max_reservations - allocation.newly_reserved
    assert all(r.count > 0 for r in allocation.reservations)


@given(allocation_inputs())
@settings(max_examples=300)
def test_nothing_is_granted_to_a_template_or_runner_lacking_a_required_label(
    inputs: AllocationInputs,
) -> None:
    allocation, warm = run(inputs)
    templates = {t.key: t for t in inputs.templates}
    runners = {r.id: r for r in inputs.runners}
    live = live_reservation_ids(inputs.reservations, NOW)
    for new in allocation.reservations:
        assert any(matches(new.labels, t.labels) for t in inputs.templates)
        for draw in new.draws:
            assert matches(new.labels, templates[draw.template_key].labels)
        target = BindTarget(P, W, inputs.scope, new.labels)
        assert all(is_bindable(runners[i], target, live=live, now=NOW) for i in new.runner_ids)
        assert list(new.runner_ids) == sorted(new.runner_ids)
    bound = [i for r in allocation.reservations for i in r.runner_ids]
    assert len(bound) == len(set(bound))
    assert all(templates[w.template_key].labels == w.labels for w in warm)


@given(allocation_inputs())
@settings(max_examples=300)
def test_total_granted_never_exceeds_demand_plus_idle_targets(inputs: AllocationInputs) -> None:
    allocation, warm = run(inputs)
    demand = sum(g.queued for g in inputs.demand)
    targets = sum(t.idle_target for t in inputs.templates)
    assert allocation.newly_reserved + sum(w.count for w in warm) <= demand + targets
    live_before = Counter[LabelSet]()
    for r in inputs.reservations:
        if r.workspace_id == W and r.is_live(NOW):
            live_before[r.labels] += r.count
    for stat in allocation.stats:
        granted = stat.reserved - live_before[stat.labels]
        assert granted >= 0
        assert granted == 0 or stat.reserved <= stat.queued  # never oversold by this round


def canonical(result: tuple[Allocation, tuple[WarmLaunch, ...]]) -> tuple[object, ...]:
    allocation, warm = result
    remaining = sorted((t.key, t.available_slots) for t in allocation.remaining_templates)
    return (allocation.stats, allocation.reservations, remaining, allocation.rebound, set(warm))


def shuffled(rows: Sequence[Row], shuffler: random.Random) -> list[Row]:
    copy = list(rows)
    shuffler.shuffle(copy)
    return copy


@given(allocation_inputs(), st.randoms(use_true_random=False))
@settings(max_examples=300)
def test_allocation_is_deterministic_and_ignores_row_order(
    inputs: AllocationInputs, shuffler: random.Random
) -> None:
    first = run(inputs)
    assert run(inputs) == first
    reordered = replace(
        inputs,
        demand=shuffled(inputs.demand, shuffler),
        templates=shuffled(inputs.templates, shuffler),
        reservations=shuffled(inputs.reservations, shuffler),
        runners=shuffled(inputs.runners, shuffler),
    )
    assert canonical(run(reordered)) == canonical(first)
