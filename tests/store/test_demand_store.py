"""Demand allocation against PostgreSQL: the rows a round writes, the stats and grants it returns,
the installation walk, terminate intents, and the lock interleavings of spec 3.4 and 3.8.

Scenario ids are those of spec section 8; the pure decisions have their own tests in
tests/domain/test_demand.py, these pin what the store reads and writes around them.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Collection
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

import anyio
import asyncpg
import pytest

from controlplane.actors.provisioning.rounds import RoundOutcome, installation_walk
from controlplane.domain import tokens
from controlplane.domain.binding import Scope
from controlplane.domain.demand import Template
from controlplane.domain.labels import LabelSet
from controlplane.domain.provisioners import Provisioner
from controlplane.domain.rounds import WalkEntry, WorkspaceRound
from controlplane.domain.terminate_intents import TerminateIntent, TerminateReason
from controlplane.store import demand, demand_inputs, demand_list, locks, provisioner_sessions
from controlplane.store.pool import Conn
from controlplane.store.provisioning import RoundTerms, SessionStore
from tests import provisioning as rows
from tests.factories import holding, holding_lock, wait_until_blocked

LINUX: LabelSet = ("linux",)
GPU: LabelSet = ("gpu", "linux")
X64: LabelSet = ("linux", "x64")
TTL = timedelta(seconds=60)
HOUR = timedelta(hours=1)
MINUTE = timedelta(minutes=1)


runner = rows.runner


def template(slots: int = 10, labels: LabelSet = LINUX, key: str = "small") -> Template:
    return Template(key=key, labels=labels, available_slots=slots)


async def poll(
    conn: Conn,
    provisioner: Provisioner,
    workspace_id: UUID,
    *,
    templates: tuple[Template, ...] | None = None,
    max_reservations: int = 100,
    launch_ttl: timedelta = TTL,
    grace: timedelta = TTL,
    scope: Scope | None = None,
    covering_window: timedelta | None = None,
    activation_timeout: timedelta | None = None,
    terminate_limit: int = 1000,
) -> WorkspaceRound:
    if scope is None:
        scope = Scope.INSTALLATION if provisioner.workspace_id is None else Scope.WORKSPACE
    result = await demand.allocate_workspace(
        conn,
        provisioner_id=provisioner.id,
        scope=scope,
        workspace_id=workspace_id,
        templates=templates if templates is not None else (template(),),
        max_reservations=max_reservations,
        launch_ttl=launch_ttl,
        activation_grace=grace,
        covering_window=covering_window,
        activation_timeout=activation_timeout,
        terminate_limit=terminate_limit,
    )
    assert result is not None
    return result


def launched(result: WorkspaceRound) -> list[tuple[LabelSet, int]]:
    return [(g.labels, g.count) for g in result.grants]


def stats(result: WorkspaceRound) -> list[tuple[LabelSet, int, int]]:
    return [(s.labels, s.queued, s.reserved) for s in result.allocation.stats]


async def stored(conn: Conn, workspace_id: UUID) -> list[tuple[str, LabelSet, int]]:
    """The workspace's reservation rows as (kind, labels, count), bound before launch."""
    found = await conn.fetch(
        "SELECT kind, required_labels, count FROM reservations WHERE workspace_id = $1"
        " ORDER BY kind, required_labels",
        workspace_id,
    )
    return [(r["kind"], tuple(r["required_labels"]), r["count"]) for r in found]


async def runner_row(conn: Conn, runner_id: UUID) -> asyncpg.Record:
    row = await conn.fetchrow("SELECT * FROM runner_instances WHERE id = $1", runner_id)
    assert row is not None
    return row


async def bound_to(conn: Conn, runner_id: UUID) -> str | None:
    """The kind of the live reservation the runner is assigned to, if any."""
    kind = await conn.fetchval(
        "SELECT r.kind FROM runner_instances ri JOIN reservations r ON r.id = ri.reservation_id"
        " WHERE ri.id = $1 AND r.expires_at > now()",
        runner_id,
    )
    assert kind is None or isinstance(kind, str)
    return kind


async def activation_token(conn: Conn, runner_id: UUID) -> UUID:
    token = tokens.new_opaque(tokens.Kind.ACTIVATION)
    value = await conn.fetchval(
        """
        INSERT INTO runner_activation_tokens
            (runner_instance_id, token_sha256, display_prefix, expires_at)
        VALUES ($1, $2, $3, now() + interval '10 minutes') RETURNING id
        """,
        runner_id,
        token.sha256,
        token.display_prefix,
    )
    assert isinstance(value, UUID)
    return value


async def token_revoked(conn: Conn, token_id: UUID) -> bool:
    return bool(
        await conn.fetchval(
            "SELECT revoked_at IS NOT NULL FROM runner_activation_tokens WHERE id = $1", token_id
        )
    )


@pytest.fixture
async def wsp(conn: Conn, workspace: UUID) -> Provisioner:
    """A workspace-scope provisioner of `workspace`."""
    return await rows.provisioner(conn, workspace)


@pytest.fixture
async def inst(conn: Conn) -> Provisioner:
    """An installation-scope provisioner."""
    return await rows.provisioner(conn)


# --- grants and stats ----------------------------------------------------------------------------


async def test_p01_grant_is_capped_by_unreserved_demand_slots_and_max(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    await rows.pending_jobs(conn, workspace, LINUX, 50)

    result = await poll(conn, wsp, workspace, templates=(template(20),), max_reservations=100)

    assert launched(result) == [(LINUX, 20)]
    assert stats(result) == [(LINUX, 50, 20)]
    assert await stored(conn, workspace) == [("launch", LINUX, 20)]
    capped = await poll(conn, wsp, workspace, templates=(template(100),), max_reservations=7)
    assert launched(capped) == [(LINUX, 7)]
    assert stats(capped) == [(LINUX, 50, 27)]


async def test_p02_without_idle_runners_exactly_one_launch_reservation(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    await rows.pending_jobs(conn, workspace, LINUX, 3)
    await runner(conn, wsp.id, control_session=None)  # not bindable

    result = await poll(conn, wsp, workspace)

    assert await stored(conn, workspace) == [("launch", LINUX, 3)]
    [grant] = result.grants
    assert (grant.workspace_id, grant.count, result.bound) == (workspace, 3, 0)
    assert await conn.fetchval("SELECT kind FROM reservations WHERE id = $1", grant.reservation_id)


async def test_p03_binds_the_oldest_matching_idle_runners_and_launches_the_rest(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    # Created youngest first, so the ids run opposite to the ages.
    young = await runner(conn, wsp.id, age=10 * MINUTE)
    middle = await runner(conn, wsp.id, age=20 * MINUTE)
    oldest = await runner(conn, wsp.id, age=30 * MINUTE)
    other = await runner(conn, wsp.id, labels=("windows",), age=HOUR)
    await rows.pending_jobs(conn, workspace, LINUX, 2)

    first = await poll(conn, wsp, workspace)

    assert (first.bound, first.grants) == (2, ())
    assert [await bound_to(conn, r) for r in (oldest, middle, young)] == ["bound", "bound", None]
    assert await stored(conn, workspace) == [("bound", LINUX, 2)]
    untouched = await runner_row(conn, other)
    assert (untouched["workspace_id"], untouched["reservation_id"]) == (None, None)

    await rows.pending_jobs(conn, workspace, LINUX, 2)
    second = await poll(conn, wsp, workspace)

    assert second.bound == 1 and await bound_to(conn, young) == "bound"
    assert launched(second) == [(LINUX, 1)]
    assert sorted(await stored(conn, workspace)) == [
        ("bound", LINUX, 1),
        ("bound", LINUX, 2),
        ("launch", LINUX, 1),
    ]


async def test_p04_bound_and_launch_reservations_have_their_own_lifetimes(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    await runner(conn, wsp.id)
    await rows.pending_jobs(conn, workspace, LINUX, 2)

    result = await poll(
        conn, wsp, workspace, launch_ttl=timedelta(seconds=120), grace=timedelta(seconds=30)
    )

    lifetimes = await conn.fetch(
        "SELECT kind, expires_at - created_at AS life FROM reservations WHERE workspace_id = $1"
        " ORDER BY kind",
        workspace,
    )
    assert [(r["kind"], r["life"]) for r in lifetimes] == [
        ("bound", timedelta(seconds=30)),
        ("launch", timedelta(seconds=120)),
    ]
    [grant] = result.grants
    assert grant.count == 1
    assert (
        await conn.fetchval("SELECT kind FROM reservations WHERE id = $1", grant.reservation_id)
        == "launch"
    )


async def test_p05_binding_a_demand_runner_counts_as_rebound(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    await runner(conn, wsp.id, launch_kind="demand", age=2 * MINUTE)
    await runner(conn, wsp.id, launch_kind="warm", age=MINUTE)
    await rows.pending_jobs(conn, workspace, LINUX, 2)

    result = await poll(conn, wsp, workspace)

    assert (result.bound, result.rebound) == (2, 1)


async def test_p06_an_adopted_runner_is_not_charged_against_other_demand(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    adopted_by = await rows.reservation(
        conn, workspace_id=workspace, provisioner_id=wsp.id, kind="bound", labels=LINUX
    )
    await runner(
        conn, wsp.id, labels=X64, workspace_id=workspace, reservation_id=adopted_by, assigned=True
    )
    await rows.pending_jobs(conn, workspace, LINUX, 1)
    await rows.pending_jobs(conn, workspace, X64, 2)

    result = await poll(conn, wsp, workspace, templates=(template(2, X64),))

    assert launched(result) == [(X64, 2)]
    assert stats(result) == [(X64, 2, 2), (LINUX, 1, 1)]


async def _capacity_after(
    conn: Conn, workspace: UUID, wsp: Provisioner, runners: list[dict[str, Any]]
) -> int:
    """Launch units granted for 10 queued jobs and 5 slots, with an own count-3 reservation
    and the given runners referencing it (`ref` is "assigned" or "intended")."""
    own = await rows.reservation(conn, workspace_id=workspace, provisioner_id=wsp.id, count=3)
    for spec in runners:
        ref = spec.pop("ref")
        link: dict[str, Any] = (
            {"reservation_id": own, "workspace_id": workspace, "assigned": True}
            if ref == "assigned"
            else {"intended_reservation_id": own}
        )
        await runner(conn, wsp.id, control_session=None, **(link | spec))
    await rows.pending_jobs(conn, workspace, LINUX, 10)
    result = await poll(conn, wsp, workspace, templates=(template(5),))
    assert stats(result) == [(LINUX, 10, 3 + sum(c for _, c in launched(result)))]
    return sum(c for _, c in launched(result))


async def test_p07_only_unadopted_units_of_a_reservation_are_deducted(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    assert await _capacity_after(conn, workspace, wsp, [{"ref": "assigned"}]) == 3


async def test_p08_a_reservation_without_adopted_units_is_deducted_in_full(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    assert await _capacity_after(conn, workspace, wsp, []) == 2


async def test_p09_a_runner_with_a_live_intended_reservation_uses_it(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    booting = {"ref": "intended", "state": "starting", "provider_runner_id": None}
    assert await _capacity_after(conn, workspace, wsp, [booting]) == 3


async def test_p10_a_released_runner_still_leaves_its_unit_pending(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    assert await _capacity_after(conn, workspace, wsp, [{"ref": "assigned", "released": True}]) == 2


async def test_p11_terminal_runners_do_not_use_their_reservation(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    finished = [{"ref": "assigned", "state": "terminated"}, {"ref": "intended", "state": "failed"}]
    assert await _capacity_after(conn, workspace, wsp, finished) == 2


async def test_p12_only_active_assigned_runners_reduce_pending(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    mixed = [
        {"ref": "assigned", "state": "running"},
        {"ref": "assigned", "state": "stopping"},
        {"ref": "assigned", "state": "stopped"},
    ]
    assert await _capacity_after(conn, workspace, wsp, mixed) == 4


# --- which idle runners are bound ----------------------------------------------------------------


async def _binds(conn: Conn, workspace: UUID, provisioner: Provisioner, runner_id: UUID) -> bool:
    """Poll one linux job; whether `runner_id` was bound (else the unit became a launch)."""
    await rows.pending_jobs(conn, workspace, LINUX, 1)
    result = await poll(conn, provisioner, workspace)
    assert result.bound + sum(g.count for g in result.grants) == 1
    return result.bound == 1 and await bound_to(conn, runner_id) == "bound"


async def test_p13_expired_intended_reservation_is_bindable_and_binding_clears_it(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    expired = await rows.reservation(
        conn, workspace_id=workspace, provisioner_id=wsp.id, ttl=-MINUTE
    )
    runner_id = await runner(conn, wsp.id, intended_reservation_id=expired)

    assert await _binds(conn, workspace, wsp, runner_id)

    row = await runner_row(conn, runner_id)
    assert row["intended_reservation_id"] is None
    assert row["workspace_id"] == workspace and row["assigned_at"] is not None


async def test_p14_deleted_intended_reservation_is_bindable(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    runner_id = await runner(conn, wsp.id, intended_reservation_id=uuid.uuid4())
    assert await _binds(conn, workspace, wsp, runner_id)


async def test_p15_runner_whose_reservation_expired_is_rebound_and_its_token_revoked(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    expired = await rows.reservation(
        conn, workspace_id=workspace, provisioner_id=wsp.id, ttl=-MINUTE
    )
    runner_id = await runner(
        conn, wsp.id, workspace_id=workspace, reservation_id=expired, assigned=True
    )
    token = await activation_token(conn, runner_id)

    assert await _binds(conn, workspace, wsp, runner_id)

    assert await token_revoked(conn, token)
    assert (await runner_row(conn, runner_id))["reservation_id"] != expired


async def test_p16_runner_whose_reservation_was_deleted_is_rebound(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    runner_id = await runner(
        conn, wsp.id, workspace_id=workspace, reservation_id=uuid.uuid4(), assigned=True
    )
    assert await _binds(conn, workspace, wsp, runner_id)


async def test_p17_runner_inside_its_live_reservation_is_not_bound(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    live = await rows.reservation(conn, workspace_id=workspace, provisioner_id=wsp.id, kind="bound")
    runner_id = await runner(
        conn, wsp.id, workspace_id=workspace, reservation_id=live, assigned=True
    )
    token = await activation_token(conn, runner_id)
    await rows.pending_jobs(conn, workspace, LINUX, 1)  # the live one reserves the first

    assert not await _binds(conn, workspace, wsp, runner_id)

    assert (await runner_row(conn, runner_id))["reservation_id"] == live
    assert not await token_revoked(conn, token)


async def test_p18_live_intended_reservation_of_another_workspace_protects_the_runner(
    conn: Conn, workspace: UUID, inst: Provisioner
) -> None:
    elsewhere = await rows.reservation(conn, workspace_id=uuid.uuid4(), provisioner_id=inst.id)
    runner_id = await runner(conn, inst.id, intended_reservation_id=elsewhere)
    assert not await _binds(conn, workspace, inst, runner_id)


async def test_p19_workspace_poll_does_not_rebind_a_stale_runner_of_another_workspace(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    other = uuid.uuid4()
    runner_id = await runner(
        conn, wsp.id, workspace_id=other, reservation_id=uuid.uuid4(), assigned=True
    )
    assert not await _binds(conn, workspace, wsp, runner_id)
    assert (await runner_row(conn, runner_id))["workspace_id"] == other


async def test_p20_workspace_neutral_runner_with_a_dangling_reservation_is_rebound(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    runner_id = await runner(conn, wsp.id, reservation_id=uuid.uuid4())
    assert await _binds(conn, workspace, wsp, runner_id)


async def test_p21_installation_poll_rebinds_a_stale_runner_across_workspaces(
    conn: Conn, workspace: UUID, inst: Provisioner
) -> None:
    runner_id = await runner(
        conn, inst.id, workspace_id=uuid.uuid4(), reservation_id=uuid.uuid4(), assigned=True
    )
    assert await _binds(conn, workspace, inst, runner_id)
    assert (await runner_row(conn, runner_id))["workspace_id"] == workspace


async def test_p22_released_runner_is_never_rebound(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    expired = await rows.reservation(
        conn, workspace_id=workspace, provisioner_id=wsp.id, ttl=-MINUTE
    )
    runner_id = await runner(
        conn, wsp.id, workspace_id=workspace, reservation_id=expired, assigned=True, released=True
    )
    assert not await _binds(conn, workspace, wsp, runner_id)


@pytest.mark.parametrize("session", [None, "closed"], ids=["no-session", "closed-session"])
async def test_p23_runner_without_a_control_session_is_not_bound(
    conn: Conn, workspace: UUID, wsp: Provisioner, session: str | None
) -> None:
    runner_id = await runner(conn, wsp.id, control_session=session)
    assert not await _binds(conn, workspace, wsp, runner_id)


async def test_p24_runner_with_an_expired_control_session_is_not_bound(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    runner_id = await runner(conn, wsp.id, control_session="expired")
    assert not await _binds(conn, workspace, wsp, runner_id)


async def test_p25_once_idle_runners_cover_demand_a_second_poll_grants_nothing(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    for _ in range(2):
        await runner(conn, wsp.id)
    await rows.pending_jobs(conn, workspace, LINUX, 2)

    first = await poll(conn, wsp, workspace)
    second = await poll(conn, wsp, workspace)

    assert (first.bound, first.grants) == (2, ())
    assert (second.bound, second.grants, second.allocation.newly_reserved) == (0, (), 0)
    assert stats(second) == [(LINUX, 2, 2)]
    assert await stored(conn, workspace) == [("bound", LINUX, 2)]


# --- grouping, budget and capacity ---------------------------------------------------------------


async def test_p26_overlapping_label_sets_are_allocated_most_specific_first(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    await rows.pending_jobs(conn, workspace, LINUX, 2)  # older
    await rows.pending_jobs(conn, workspace, GPU, 2)

    result = await poll(conn, wsp, workspace, templates=(template(3, GPU, "gpu"),))

    assert launched(result) == [(GPU, 2), (LINUX, 1)]
    assert await stored(conn, workspace) == [("launch", GPU, 2), ("launch", LINUX, 1)]


async def test_p27_two_provisioners_never_reserve_more_than_queued(
    conn: Conn, pool: asyncpg.Pool, database_url: str, observer: asyncpg.Connection, workspace: UUID
) -> None:
    first = await rows.provisioner(conn, workspace)
    second = await rows.provisioner(conn, workspace)
    await rows.pending_jobs(conn, workspace, LINUX, 5)
    results: list[WorkspaceRound] = []

    async def run(provisioner: Provisioner, connection: Conn) -> None:
        results.append(await poll(connection, provisioner, workspace))

    async with pool.acquire() as a, pool.acquire() as b:
        with anyio.fail_after(10):
            async with (
                anyio.create_task_group() as tg,
                holding_lock(database_url, locks.workspace(workspace)),
            ):
                # Both wait on the workspace lock: whichever goes second must see the first's rows.
                tg.start_soon(run, first, a)
                await wait_until_blocked(observer, a.get_server_pid())
                tg.start_soon(run, second, b)
                await wait_until_blocked(observer, b.get_server_pid())

    assert sorted(sum(g.count for g in r.grants) for r in results) == [0, 5]
    assert (
        await observer.fetchval(
            "SELECT sum(count) FROM reservations WHERE workspace_id = $1", workspace
        )
        == 5
    )


async def test_p28_the_budget_goes_to_the_most_specific_group_first(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    await rows.pending_jobs(conn, workspace, LINUX, 3)
    await rows.pending_jobs(conn, workspace, GPU, 3)

    result = await poll(conn, wsp, workspace, templates=(template(10, GPU),), max_reservations=4)

    assert launched(result) == [(GPU, 3), (LINUX, 1)]
    assert result.allocation.remaining_max == 0


async def test_p29_demand_no_template_satisfies_is_absent(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    await rows.pending_jobs(conn, workspace, ("windows",), 2)
    await rows.pending_jobs(conn, workspace, LINUX, 1)

    result = await poll(conn, wsp, workspace)

    assert stats(result) == [(LINUX, 1, 1)]
    assert await stored(conn, workspace) == [("launch", LINUX, 1)]


async def test_p30_zero_max_reservations_reports_stats_and_writes_nothing(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    idle = await runner(conn, wsp.id)
    await rows.pending_jobs(conn, workspace, LINUX, 3)

    result = await poll(conn, wsp, workspace, max_reservations=0)

    assert stats(result) == [(LINUX, 3, 0)]
    assert (result.grants, result.bound) == ((), 0)
    assert await stored(conn, workspace) == []
    assert (await runner_row(conn, idle))["workspace_id"] is None


async def test_p31_expiry_is_computed_from_database_time(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    await rows.pending_jobs(conn, workspace, LINUX, 1)
    before = await conn.fetchval("SELECT clock_timestamp()")

    [grant] = (await poll(conn, wsp, workspace)).grants

    after = await conn.fetchval("SELECT clock_timestamp()")
    assert before + TTL <= grant.expires_at <= after + TTL
    created = await conn.fetchval(
        "SELECT created_at FROM reservations WHERE id = $1", grant.reservation_id
    )
    assert grant.expires_at - created == TTL


async def test_p32_expired_reservations_do_not_count_as_reserved(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    other = await rows.provisioner(conn, workspace)
    await rows.reservation(
        conn, workspace_id=workspace, provisioner_id=other.id, count=5, ttl=-MINUTE
    )
    await rows.pending_jobs(conn, workspace, LINUX, 5)

    result = await poll(conn, wsp, workspace)

    assert launched(result) == [(LINUX, 5)]
    assert stats(result) == [(LINUX, 5, 5)]


async def test_p33_own_live_reservations_reduce_advertised_capacity(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    other = await rows.provisioner(conn, workspace)
    await rows.reservation(conn, workspace_id=workspace, provisioner_id=wsp.id, labels=X64, count=2)
    await rows.reservation(conn, workspace_id=workspace, provisioner_id=other.id, labels=X64)
    await rows.pending_jobs(conn, workspace, LINUX, 5)

    result = await poll(conn, wsp, workspace, templates=(template(3, X64),))

    assert launched(result) == [(LINUX, 1)]  # 3 slots, 2 spoken for by its own x64 units


async def test_p34_several_groups_are_granted_in_one_round(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    await rows.pending_jobs(conn, workspace, LINUX, 2)
    await rows.pending_jobs(conn, workspace, X64, 1)
    await rows.pending_jobs(conn, workspace, GPU, 1)

    result = await poll(
        conn, wsp, workspace, templates=(template(5, X64, "x64"), template(5, GPU, "gpu"))
    )

    assert sorted(launched(result)) == [(GPU, 1), (LINUX, 2), (X64, 1)]
    assert len({g.reservation_id for g in result.grants}) == 3
    assert len(await stored(conn, workspace)) == 3


# --- installation scope --------------------------------------------------------------------------


async def _older_demand(conn: Conn, labels: LabelSet, count: int) -> UUID:
    """A new workspace whose jobs are queued after every workspace created before it."""
    workspace_id = uuid.uuid4()
    await rows.pending_jobs(conn, workspace_id, labels, count)
    return workspace_id


class WalkStore(SessionStore):
    """The session's store, the walk limited to `eligible` workspaces (None: all) and stopped
    by `Aborted` when it asks for workspace number `abort_at` (the caller going away)."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        provisioner: Provisioner,
        generation: int,
        eligible: Collection[UUID] | None,
        abort_at: int | None,
    ) -> None:
        super().__init__(pool, provisioner, generation)
        self.eligible = eligible
        self.abort_at = abort_at
        self.asked = 0

    async def walk_workspaces(self, changed: Collection[UUID] = ()) -> list[WalkEntry]:
        async with self.pool.acquire() as conn:
            entries, _ = await demand_list.walk_list(conn, self.eligible, changed=changed)
            return entries

    async def allocate_in_walk(
        self, workspace_id: UUID, terms: RoundTerms
    ) -> WorkspaceRound | None:
        self.asked += 1
        if self.asked == self.abort_at:
            raise Aborted
        return await super().allocate_in_walk(workspace_id, terms)


class Aborted(Exception):
    """The caller going away (a closed socket) between two workspaces."""


async def install(
    pool: asyncpg.Pool,
    inst: Provisioner,
    *,
    slots: int,
    max_reservations: int = 100,
    launch_ttl: timedelta = TTL,
    covering_window: timedelta | None = HOUR,
    eligible: Collection[UUID] | None = None,
    abort_at: int | None = None,
    outcome: RoundOutcome | None = None,
    fair_share: bool = False,
) -> RoundOutcome:
    """The provisioner actor's installation walk, through its session's real store."""
    async with pool.acquire() as conn:
        generation = await provisioner_sessions.take_over(conn, inst.id, uuid.uuid4())
    assert generation is not None
    store = WalkStore(pool, inst, generation, eligible, abort_at)
    terms = RoundTerms(
        templates=(template(slots),),
        max_reservations=max_reservations,
        launch_ttl=launch_ttl,
        activation_grace=TTL,
        activation_timeout=None,
        covering_window=covering_window,
        fair_share=fair_share,
    )
    if outcome is None:
        outcome = RoundOutcome(remaining=terms.templates)
    await installation_walk(store, terms, outcome)
    return outcome


@pytest.mark.parametrize(("max_reservations", "slots", "launch"), [(5, 2, 2), (2, 5, 1)])
async def test_p35_bound_units_take_budget_but_no_template_slot(
    conn: Conn,
    pool: asyncpg.Pool,
    inst: Provisioner,
    max_reservations: int,
    slots: int,
    launch: int,
) -> None:
    first = await _older_demand(conn, LINUX, 1)
    second = await _older_demand(conn, LINUX, 9)
    await runner(conn, inst.id)

    result = await install(pool, inst, slots=slots, max_reservations=max_reservations)

    assert [(r.workspace_id, r.bound, launched(r)) for r in result.rounds] == [
        (first, 1, []),
        (second, 0, [(LINUX, launch)]),
    ]
    assert result.newly_reserved == 1 + launch


async def test_p36_workspaces_are_served_oldest_demand_first_without_overselling_slots(
    conn: Conn, pool: asyncpg.Pool, inst: Provisioner
) -> None:
    oldest = await _older_demand(conn, LINUX, 3)
    younger = await _older_demand(conn, LINUX, 3)
    youngest = await _older_demand(conn, LINUX, 3)

    result = await install(pool, inst, slots=4, eligible={younger, oldest})

    assert [(g.workspace_id, g.count) for g in result.grants] == [(oldest, 3), (younger, 1)]
    assert result.remaining[0].available_slots == 0
    assert await stored(conn, youngest) == []
    assert [s.labels for r in result.rounds for s in r.allocation.stats] == [LINUX, LINUX]


async def test_q38_a_fair_walk_gives_each_workspace_its_share_of_the_slots(
    conn: Conn, pool: asyncpg.Pool, inst: Provisioner
) -> None:
    busy = await _older_demand(conn, LINUX, 10)  # oldest demand, and the most of it
    small = await _older_demand(conn, LINUX, 1)
    other = await _older_demand(conn, LINUX, 3)

    result = await install(pool, inst, slots=6, eligible={busy, small, other}, fair_share=True)

    # Shares of 6 among 3: busy 2; small takes 1 of its 2, so other may take 3 of the 3 left.
    # Without fair share the busy workspace, oldest, would take all six (P-36).
    assert [(g.workspace_id, g.count) for g in result.grants] == [(busy, 2), (small, 1), (other, 3)]


async def test_p37_an_adopted_installation_runner_leaves_slots_for_the_next_workspace(
    conn: Conn, pool: asyncpg.Pool, inst: Provisioner
) -> None:
    first = await _older_demand(conn, LINUX, 1)
    second = await _older_demand(conn, LINUX, 5)
    stranded = await runner(
        conn, inst.id, workspace_id=second, reservation_id=uuid.uuid4(), assigned=True
    )

    result = await install(pool, inst, slots=2)

    assert (await runner_row(conn, stranded))["workspace_id"] == first
    assert [(g.workspace_id, g.count) for g in result.grants] == [(second, 2)]


async def test_p38_committed_rounds_are_recorded_before_an_abort_stops_the_walk(
    conn: Conn, pool: asyncpg.Pool, inst: Provisioner
) -> None:
    first = await _older_demand(conn, LINUX, 2)
    second = await _older_demand(conn, LINUX, 2)
    seen = RoundOutcome(remaining=())

    with pytest.raises(Aborted):
        await install(pool, inst, slots=10, abort_at=2, outcome=seen)

    assert [(g.workspace_id, g.count) for g in seen.grants] == [(first, 2)]
    assert await stored(conn, first) == [("launch", LINUX, 2)]
    assert await stored(conn, second) == []


async def test_p40_no_eligible_workspace_returns_nothing(
    conn: Conn, pool: asyncpg.Pool, inst: Provisioner
) -> None:
    await _older_demand(conn, LINUX, 2)

    result = await install(pool, inst, slots=10, eligible=set())

    assert (result.rounds, result.grants, result.skipped) == ([], [], [])
    assert await conn.fetchval("SELECT count(*) FROM reservations") == 0


async def test_p42_installation_grants_carry_the_lifetime_they_were_given(
    conn: Conn, pool: asyncpg.Pool, inst: Provisioner
) -> None:
    """The clamp itself (601 -> 600) is `domain.demand.reservation_ttl`; the store writes it."""
    await _older_demand(conn, LINUX, 1)
    result = await install(
        pool, inst, slots=10, launch_ttl=timedelta(seconds=600), covering_window=None
    )
    [grant] = result.grants
    created = await conn.fetchval(
        "SELECT created_at FROM reservations WHERE id = $1", grant.reservation_id
    )
    assert grant.expires_at - created == timedelta(seconds=600)


async def test_p43_demand_an_active_workspace_provisioner_advertises_is_skipped(
    conn: Conn, workspace: UUID, wsp: Provisioner, inst: Provisioner
) -> None:
    await rows.pending_jobs(conn, workspace, LINUX, 2)
    await rows.pending_jobs(conn, workspace, GPU, 1)
    await demand_inputs.replace_templates(conn, wsp.id, workspace, [template(0, X64)])  # zero slots
    gpu_only = (template(5, GPU),)

    covered = await poll(conn, inst, workspace, templates=gpu_only, covering_window=HOUR)

    assert launched(covered) == [(GPU, 1)]
    assert [s.labels for s in covered.allocation.stats] == [GPU]
    # Withdrawn, revoked or stale advertisements no longer cover anything.
    await demand_inputs.replace_templates(conn, wsp.id, workspace, [])
    uncovered = await poll(conn, inst, workspace, templates=gpu_only, covering_window=HOUR)
    assert launched(uncovered) == [(LINUX, 2)]


@pytest.mark.parametrize("how", ["revoked", "stale"])
async def test_p43_a_revoked_or_quiet_workspace_provisioner_covers_nothing(
    conn: Conn, workspace: UUID, wsp: Provisioner, inst: Provisioner, how: str
) -> None:
    await rows.pending_jobs(conn, workspace, LINUX, 2)
    await demand_inputs.replace_templates(conn, wsp.id, workspace, [template(3)])
    if how == "revoked":
        await conn.execute("UPDATE provisioner_tokens SET revoked_at = now() WHERE id = $1", wsp.id)
    else:
        await conn.execute(
            "UPDATE provisioner_templates SET advertised_at = now() - interval '2 hours'"
        )

    result = await poll(conn, inst, workspace, covering_window=HOUR)

    assert launched(result) == [(LINUX, 2)]


async def test_p44_a_busy_workspace_is_skipped_not_waited_on(
    conn: Conn, pool: asyncpg.Pool, database_url: str, inst: Provisioner
) -> None:
    busy = await _older_demand(conn, LINUX, 2)
    free = await _older_demand(conn, LINUX, 2)

    with anyio.fail_after(10):
        async with holding_lock(database_url, locks.workspace(busy)):
            single = await demand.allocate_workspace(
                conn,
                provisioner_id=inst.id,
                scope=Scope.INSTALLATION,
                workspace_id=busy,
                templates=(template(),),
                max_reservations=10,
                launch_ttl=TTL,
                activation_grace=TTL,
                try_lock=True,
            )
            walk = await install(pool, inst, slots=10)

    assert single is None
    assert walk.skipped == [busy]
    assert [(g.workspace_id, g.count) for g in walk.grants] == [(free, 2)]
    assert await stored(conn, busy) == []


async def test_templates_are_replaced_whole_and_an_empty_list_withdraws_them(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    await demand_inputs.replace_templates(
        conn, wsp.id, workspace, [template(1, ("Linux", "X64"), "a"), template(2, GPU, "b")]
    )
    await demand_inputs.replace_templates(conn, wsp.id, workspace, [template(4, X64, "c")])
    found = await conn.fetch(
        "SELECT template_key, labels, available_slots, workspace_id FROM provisioner_templates"
    )
    assert [tuple(r) for r in found] == [("c", list(X64), 4, workspace)]
    await demand_inputs.replace_templates(conn, wsp.id, workspace, [])
    assert await conn.fetchval("SELECT count(*) FROM provisioner_templates") == 0


async def test_a_round_locks_exactly_the_provisioners_live_reservations_in_the_workspace(
    conn: Conn, observer: asyncpg.Connection, workspace: UUID, wsp: Provisioner
) -> None:
    """Step 3 of the lock order: the rows of the provisioner's reservations in the workspace that
    are live at the round's time, and no other (the round finds them by id, then reads every
    reservation afresh once they are locked)."""
    other = await rows.provisioner(conn, workspace)
    live = await rows.reservation(conn, workspace_id=workspace, provisioner_id=wsp.id)
    expired = await rows.reservation(
        conn, workspace_id=workspace, provisioner_id=wsp.id, ttl=-MINUTE
    )
    others = await rows.reservation(conn, workspace_id=workspace, provisioner_id=other.id)
    elsewhere = await rows.reservation(conn, workspace_id=uuid.uuid4(), provisioner_id=wsp.id)
    ids = [live, expired, others, elsewhere]
    async with conn.transaction():  # the round's locks stay held until this commits
        await poll(conn, wsp, workspace)
        free = await observer.fetch(
            "SELECT id FROM reservations WHERE id = ANY($1::uuid[]) FOR UPDATE SKIP LOCKED", ids
        )
    assert {r["id"] for r in free} == {expired, others, elsewhere}


# --- binding races -------------------------------------------------------------------------------


async def _poll_while_row_held(
    conn: Conn,
    database_url: str,
    observer: asyncpg.Connection,
    held: UUID,
    change: str,
    poll_once: Callable[[], Awaitable[WorkspaceRound]],
) -> WorkspaceRound:
    """Hold runner `held` FOR UPDATE on a second connection, run `poll_once` until it waits for
    that row, then apply `change` (a statement on $1 = held) in the holder and commit."""
    results: list[WorkspaceRound] = []

    async def run() -> None:
        results.append(await poll_once())

    with anyio.fail_after(10):
        async with (
            anyio.create_task_group() as tg,
            holding(
                database_url, "SELECT 1 FROM runner_instances WHERE id = $1 FOR UPDATE", held
            ) as holder,
        ):
            tg.start_soon(run)
            await wait_until_blocked(observer, conn.get_server_pid())
            await holder.execute(change, held)
    [result] = results
    return result


async def test_p46_when_the_oldest_candidate_drops_out_the_poll_binds_the_next_one(
    conn: Conn, database_url: str, observer: asyncpg.Connection, workspace: UUID, wsp: Provisioner
) -> None:
    oldest = await runner(conn, wsp.id, age=2 * MINUTE)
    next_oldest = await runner(conn, wsp.id, age=MINUTE)
    await rows.pending_jobs(conn, workspace, LINUX, 1)

    result = await _poll_while_row_held(
        conn,
        database_url,
        observer,
        oldest,
        "UPDATE runner_instances SET runner_session_id = gen_random_uuid() WHERE id = $1",
        lambda: poll(conn, wsp, workspace),
    )

    assert (result.bound, result.grants) == (1, ())
    assert await bound_to(observer, next_oldest) == "bound"
    assert (await runner_row(observer, oldest))["reservation_id"] is None


async def test_p47_a_runner_re_reserved_while_the_poll_waited_is_not_rebound(
    conn: Conn, database_url: str, observer: asyncpg.Connection, workspace: UUID, wsp: Provisioner
) -> None:
    stale = await rows.reservation(conn, workspace_id=workspace, provisioner_id=wsp.id, ttl=-MINUTE)
    runner_id = await runner(
        conn, wsp.id, workspace_id=workspace, reservation_id=stale, assigned=True
    )
    fresh = await rows.reservation(
        conn, workspace_id=uuid.uuid4(), provisioner_id=wsp.id, kind="bound"
    )
    await rows.pending_jobs(conn, workspace, LINUX, 1)

    result = await _poll_while_row_held(
        conn,
        database_url,
        observer,
        runner_id,
        f"UPDATE runner_instances SET reservation_id = '{fresh}' WHERE id = $1",  # noqa: S608 -- a uuid the test made
        lambda: poll(conn, wsp, workspace),
    )

    assert result.bound == 0
    assert launched(result) == [(LINUX, 1)]
    assert (await runner_row(observer, runner_id))["reservation_id"] == fresh


# --- terminate intents ---------------------------------------------------------------------------


async def lease(
    conn: Conn,
    workspace_id: UUID,
    provisioner: Provisioner,
    provider_runner_id: str,
    *,
    started: timedelta | datetime,
    cancelled: bool,
    execution_id: UUID | None = None,
) -> UUID:
    """`started`: how long ago, or when."""
    # A running job of the provider runner, with the activation session that claimed it.
    session_id = await conn.fetchval(
        """
        INSERT INTO runner_sessions (workspace_id, registration_token_id, registration_token_kind,
            runner_instance_id, provisioner_id, provider_runner_id, labels, max_claims)
        VALUES ($1, gen_random_uuid(), 'activation', gen_random_uuid(), $2, $3, '{linux}', 1)
        RETURNING id
        """,
        workspace_id,
        provisioner.id,
        provider_runner_id,
    )
    execution_id = execution_id or uuid.uuid4()
    await conn.execute(
        """
        INSERT INTO running_jobs (pending_id, workspace_id, workflow_run_id,
            workflow_run_attempt_id, job_id, job_execution_id, project_id, runner_session_id,
            provisioner_id, provider_runner_id, required_labels, runner_labels, payload,
            queued_at, started_at, cancellation_requested_at)
        VALUES (gen_random_uuid(), $1, gen_random_uuid(), gen_random_uuid(), gen_random_uuid(),
                $2, gen_random_uuid(), $3, $4, $5, '{linux}', '{linux}', '{}', now(),
                coalesce($6::timestamptz, now() - $7::interval), CASE WHEN $8 THEN now() END)
        """,
        workspace_id,
        execution_id,
        session_id,
        provisioner.id,
        provider_runner_id,
        started if isinstance(started, datetime) else None,
        started if isinstance(started, timedelta) else None,
        cancelled,
    )
    return execution_id


async def busy_runner(
    conn: Conn, workspace_id: UUID, provisioner: Provisioner, name: str, **kw: Any
) -> UUID:
    """An activated runner of the workspace, as the provisioner knows it (`name`)."""
    return await runner(
        conn,
        provisioner.id,
        provider_runner_id=name,
        workspace_id=workspace_id,
        reservation_id=uuid.uuid4(),
        assigned=True,
        runner_session_id=uuid.uuid4(),
        control_session="closed",
        **kw,
    )


def cancelled(*names: str) -> tuple[TerminateIntent, ...]:
    return tuple(TerminateIntent(n, TerminateReason.JOB_CANCELLED, False) for n in names)


async def test_p67_the_poll_returns_runners_whose_latest_job_is_cancelled(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    await busy_runner(conn, workspace, wsp, "r-cancel")
    await busy_runner(conn, workspace, wsp, "r-busy")
    await lease(conn, workspace, wsp, "r-cancel", started=MINUTE, cancelled=True)
    await lease(conn, workspace, wsp, "r-busy", started=MINUTE, cancelled=False)

    result = await poll(conn, wsp, workspace)

    assert result.terminate_intents == cancelled("r-cancel")


async def test_p70_only_the_latest_jobs_cancellation_counts(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    await busy_runner(conn, workspace, wsp, "r-old-cancelled")
    await lease(conn, workspace, wsp, "r-old-cancelled", started=HOUR, cancelled=True)
    await lease(conn, workspace, wsp, "r-old-cancelled", started=MINUTE, cancelled=False)
    # The same start: the larger execution id is the latest.
    at = await conn.fetchval("SELECT now() - interval '1 minute'")
    for name, cancelled_one in (("r-tie-high", "high"), ("r-tie-low", "low")):
        await busy_runner(conn, workspace, wsp, name)
        for which, execution_id in zip(
            ("low", "high"), sorted([uuid.uuid4(), uuid.uuid4()]), strict=True
        ):
            await lease(
                conn,
                workspace,
                wsp,
                name,
                started=at,
                cancelled=which == cancelled_one,
                execution_id=execution_id,
            )

    result = await poll(conn, wsp, workspace)

    assert result.terminate_intents == cancelled("r-tie-high")


async def test_p71_terminal_runners_and_other_provisioners_runners_are_excluded(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    other = await rows.provisioner(conn, workspace)
    await busy_runner(conn, workspace, wsp, "r-stopped", state="stopped")
    await busy_runner(conn, workspace, other, "r-other")
    await busy_runner(conn, workspace, wsp, "r-mine")
    for provisioner, name in ((wsp, "r-stopped"), (other, "r-other"), (wsp, "r-mine")):
        await lease(conn, workspace, provisioner, name, started=MINUTE, cancelled=True)

    result = await poll(conn, wsp, workspace)

    assert result.terminate_intents == cancelled("r-mine")


async def test_p72_duplicates_collapse_and_truncation_keeps_a_sorted_prefix(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    for name in ("r-c", "r-a", "r-b"):
        await busy_runner(conn, workspace, wsp, name)
        await lease(conn, workspace, wsp, name, started=MINUTE, cancelled=True)
    await lease(conn, workspace, wsp, "r-a", started=MINUTE, cancelled=True)

    everything = await poll(conn, wsp, workspace)
    truncated = await poll(conn, wsp, workspace, terminate_limit=2)

    assert (everything.terminate_intents, everything.terminate_truncated) == (
        cancelled("r-a", "r-b", "r-c"),
        False,
    )
    assert (truncated.terminate_intents, truncated.terminate_truncated) == (
        cancelled("r-a", "r-b"),
        True,
    )


TIMEOUT = timedelta(minutes=5)


async def test_p73_p74_unactivated_demand_runners_time_out_once_then_as_retries(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    old = 10 * MINUTE
    live = await rows.reservation(conn, workspace_id=workspace, provisioner_id=wsp.id)
    common: dict[str, Any] = {
        "workspace_id": workspace,
        "reservation_id": uuid.uuid4(),
        "assigned": True,
        "age": old,
        "control_session": None,
    }
    timed_out = await runner(conn, wsp.id, provider_runner_id="r-timeout", **common)
    await runner(conn, wsp.id, provider_runner_id="r-warm", **(common | {"launch_kind": "warm"}))
    await runner(
        conn, wsp.id, provider_runner_id="r-manual", **(common | {"launch_kind": "manual"})
    )
    await runner(conn, wsp.id, provider_runner_id="r-young", **(common | {"age": MINUTE}))
    await runner(conn, wsp.id, provider_runner_id="r-live", **(common | {"reservation_id": live}))
    await runner(
        conn, wsp.id, provider_runner_id="r-intended", intended_reservation_id=live, **common
    )
    await runner(
        conn,
        wsp.id,
        provider_runner_id="r-activated",
        runner_session_id=uuid.uuid4(),
        **common,
    )

    first = await poll(conn, wsp, workspace, activation_timeout=TIMEOUT)

    assert first.terminate_intents == (
        TerminateIntent("r-timeout", TerminateReason.ACTIVATION_TIMEOUT, False),
    )
    released = await conn.fetch(
        "SELECT provider_runner_id FROM runner_instances WHERE reservation_released_at IS NOT NULL"
    )
    assert [r["provider_runner_id"] for r in released] == ["r-timeout"]
    released_at = (await runner_row(conn, timed_out))["reservation_released_at"]

    second = await poll(conn, wsp, workspace, activation_timeout=TIMEOUT)

    assert second.terminate_intents == (
        TerminateIntent("r-timeout", TerminateReason.ACTIVATION_TIMEOUT, True),
    )
    assert (await runner_row(conn, timed_out))["reservation_released_at"] == released_at


async def test_p73_activation_timeout_wins_over_a_cancelled_job_and_needs_the_setting(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    await runner(
        conn,
        wsp.id,
        provider_runner_id="r-both",
        workspace_id=workspace,
        reservation_id=uuid.uuid4(),
        assigned=True,
        age=HOUR,
    )
    await lease(conn, workspace, wsp, "r-both", started=MINUTE, cancelled=True)

    without = await poll(conn, wsp, workspace)
    with_timeout = await poll(conn, wsp, workspace, activation_timeout=TIMEOUT)

    assert without.terminate_intents == cancelled("r-both")
    assert with_timeout.terminate_intents == (
        TerminateIntent("r-both", TerminateReason.ACTIVATION_TIMEOUT, False),
    )


async def test_installation_rounds_compute_no_terminate_intents(
    conn: Conn, workspace: UUID, inst: Provisioner
) -> None:
    await busy_runner(conn, workspace, inst, "r-cancel")
    await lease(conn, workspace, inst, "r-cancel", started=MINUTE, cancelled=True)

    result = await poll(conn, inst, workspace, activation_timeout=TIMEOUT)

    assert result.terminate_intents == ()
