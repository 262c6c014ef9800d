"""An idle provisioner actor costs the database nothing (issue 16): with no wake-up it sleeps
until a deadline it knows of (a reservation it made expiring, an instance it created timing out)
or its slow full round; the replica's demand sweep wakes only the actors whose figures moved.
On trio's mock clock with the fake store of test_provisioning.py."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import AsyncIterator, Collection, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from datetime import datetime
from typing import Any
from uuid import UUID

import anyio
import anyio.abc
import pytest
import trio.testing
from anyio.streams.memory import MemoryObjectReceiveStream

from controlplane.actors.provisioning import DemandBoard, DemandPush, DemandSweep, ProvisionerActor
from controlplane.actors.provisioning.sweep import SPREAD
from controlplane.domain.demand import Reservation
from controlplane.domain.rounds import WalkEntry, WorkspaceRound
from controlplane.store.demand_sweep import Figures, Read, SweptSession
from controlplane.store.provisioning import RoundTerms
from tests.actors.test_provisioning import LIMITS, NOW, FakeStore, provisioner, template

FULL = 600.0  # the slow full round, far from every deadline below
LIMITS_IDLE = replace(LIMITS, full_round_seconds=FULL)
TTL = LIMITS.reservation_ttl_seconds  # an advertisement naming no lifetime gets this one
SWEEP = 2.0
Pushes = MemoryObjectReceiveStream[DemandPush]


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})


class CountingStore(FakeStore):
    """The fake store, recording when every read or transaction of a round starts."""

    def __init__(self, workspace_id: UUID | None = None) -> None:
        super().__init__(workspace_id)
        self.started: list[float] = []  # allocation transactions
        self.log: list[tuple[str, float]] = []  # every round's store call

    def _called(self, name: str) -> None:
        self.log.append((name, anyio.current_time()))

    async def allocate_workspace(self, workspace_id: UUID, terms: RoundTerms) -> WorkspaceRound:
        self.started.append(anyio.current_time())
        self._called("allocate_workspace")
        return await super().allocate_workspace(workspace_id, terms)

    async def walk_workspaces(self, changed: Collection[UUID] = ()) -> list[WalkEntry]:
        self._called("walk_workspaces")
        return await super().walk_workspaces(changed)

    async def outstanding_grants(self) -> list[tuple[Reservation, int]]:
        self._called("outstanding_grants")
        return await super().outstanding_grants()


class FixedFigures:
    """A sweep store whose figures the test sets (as one value each); counts its statements."""

    def __init__(self) -> None:
        self.figures_of: dict[UUID, int] = {}
        self.statements = 0

    async def figures(self, sessions: Sequence[SweptSession], since: datetime | None) -> Read:
        self.statements += 1
        return Read(
            NOW,
            [Figures((self.figures_of.get(s.provisioner_id, 0),), (), (), 0) for s in sessions],
        )


async def _advertised(
    store: CountingStore, workspace: UUID | None, board: DemandBoard | None = None
) -> tuple[ProvisionerActor, MemoryObjectReceiveStream[DemandPush], Any]:
    send, pushes = anyio.create_memory_object_stream[DemandPush](100)
    actor = ProvisionerActor(store, provisioner(workspace), LIMITS_IDLE, send.send, lambda: NOW)
    if board is not None:
        board.add(actor)
    return actor, pushes, send


@pytest.mark.parametrize("scope", ["workspace", "installation"])
async def test_an_idle_actor_makes_no_store_call_until_its_full_round(scope: str) -> None:
    workspace = uuid.uuid4()
    store = CountingStore(workspace)
    actor, pushes, _send = await _advertised(store, workspace if scope == "workspace" else None)
    async with anyio.create_task_group() as group:
        group.start_soon(actor.run)
        await actor.advertise([template()], 10, None)
        with anyio.fail_after(1):
            await pushes.receive()
        began, before = anyio.current_time(), len(store.log)
        await anyio.sleep(FULL - 1)  # 300 of the old 2 s safety ticks
        assert store.log[before:] == []
        await anyio.sleep(2)  # the slow safety net still runs, once
        assert store.log[before:]
        assert all(began + FULL - 0.01 <= at <= began + FULL + 0.1 for _, at in store.log[before:])
        group.cancel_scope.cancel()


@asynccontextmanager
async def _granted() -> AsyncIterator[tuple[CountingStore, ProvisionerActor, Pushes, DemandPush]]:
    """A running workspace actor whose advertisement granted one unit for one queued job."""
    workspace = uuid.uuid4()
    store = CountingStore(workspace)
    store.queued[workspace] = 1
    actor, pushes, _send = await _advertised(store, workspace)
    async with anyio.create_task_group() as group:
        group.start_soon(actor.run)
        await actor.advertise([template()], 10, None)
        with anyio.fail_after(1):
            first = await pushes.receive()
        assert [g.count for g in first.grants] == [1]
        yield store, actor, pushes, first
        group.cancel_scope.cancel()


async def test_a_grant_expiry_wakes_the_actor_at_the_deadline() -> None:
    async with _granted() as (store, actor, pushes, _first):
        granted_at = anyio.current_time()  # just after the round that wrote the grant
        assert actor.provisioner.workspace_id is not None
        store.reserved[actor.provisioner.workspace_id] = 0  # expired unused: demand again
        with anyio.fail_after(TTL + 1):
            again = await pushes.receive()
        assert [g.count for g in again.grants] == [1]
        # At the deadline, not a safety tick later (and not before it).
        assert store.started[-1] >= granted_at + TTL - 0.02
        assert store.started[-1] <= granted_at + TTL + 0.02
        assert len(store.started) == 2  # nothing in between


async def test_an_instance_created_for_a_grant_wakes_the_actor_at_its_activation_timeout() -> None:
    async with _granted() as (store, actor, _pushes, first):
        await actor.create_instances("docker", [("small", first.grants[0].reservation_id)])
        created_at = anyio.current_time()
        timeout = LIMITS.activation_timeout.total_seconds()
        await anyio.sleep(timeout + 1)
        # One round when the grant's lifetime ended, one at the activation timeout; none else.
        assert len(store.started) == 3
        assert abs(store.started[1] - (created_at + TTL)) < 0.05
        assert abs(store.started[2] - (created_at + timeout)) < 0.05


async def test_a_deadline_set_while_the_actor_sleeps_cuts_the_sleep_short() -> None:
    workspace = uuid.uuid4()
    store = CountingStore(workspace)
    actor, pushes, _send = await _advertised(store, workspace)
    async with anyio.create_task_group() as group:
        group.start_soon(actor.run)
        await actor.advertise([template()], 10, None)
        with anyio.fail_after(1):
            await pushes.receive()
        await anyio.sleep(1)  # asleep until its full round, FULL away
        # An instance for a grant of an earlier session: its activation timeout is sooner.
        await actor.create_instances("docker", [("small", uuid.uuid4())])
        created_at = anyio.current_time()
        timeout = LIMITS.activation_timeout.total_seconds()
        await anyio.sleep(timeout + 1)
        assert len(store.started) == 2
        assert abs(store.started[1] - (created_at + timeout)) < 0.05
        group.cancel_scope.cancel()


async def test_the_sweep_wakes_only_actors_whose_figures_moved() -> None:
    board = DemandBoard()
    figures = FixedFigures()
    sweep = DemandSweep(board, figures, tick_seconds=SWEEP)
    quiet_ws, busy_ws = uuid.uuid4(), uuid.uuid4()
    quiet_store, busy_store = CountingStore(quiet_ws), CountingStore(busy_ws)
    quiet, quiet_pushes, _a = await _advertised(quiet_store, quiet_ws, board)
    busy, busy_pushes, _b = await _advertised(busy_store, busy_ws, board)
    async with anyio.create_task_group() as group:
        group.start_soon(quiet.run)
        group.start_soon(busy.run)
        for actor, pushes in ((quiet, quiet_pushes), (busy, busy_pushes)):
            await actor.advertise([template()], 10, None)
            with anyio.fail_after(1):
                await pushes.receive()
        await group.start(sweep.run)
        await anyio.sleep(SWEEP + 1)  # first sight: each woken once
        assert (quiet_store.rounds, busy_store.rounds) == (2, 2)
        await anyio.sleep(50 * SWEEP)  # nothing moved: fifty statements, no round
        assert figures.statements == 51
        assert (quiet_store.rounds, busy_store.rounds) == (2, 2)
        # A job claimed on another replica: its workspace's figures move, no notification.
        busy_store.queued[busy_ws] = 1
        figures.figures_of[busy.provisioner.id] = 1
        with anyio.fail_after(SWEEP + 1):
            push = await busy_pushes.receive()
        assert [g.count for g in push.grants] == [1]
        await anyio.sleep(5 * SWEEP)
        assert (quiet_store.rounds, busy_store.rounds) == (2, 3)
        group.cancel_scope.cancel()


async def test_a_sweep_with_no_session_reads_nothing() -> None:
    figures = FixedFigures()
    sweep = DemandSweep(DemandBoard(), figures, tick_seconds=SWEEP)
    async with anyio.create_task_group() as group:
        await group.start(sweep.run)
        await anyio.sleep(10 * SWEEP)
        group.cancel_scope.cancel()
    assert figures.statements == 0


async def _swept_fleet(
    count: int, board: DemandBoard, group: anyio.abc.TaskGroup
) -> list[tuple[CountingStore, ProvisionerActor]]:
    """`count` running workspace actors on `board`, each past its advertisement's round."""
    fleet = []
    for _ in range(count):
        workspace = uuid.uuid4()
        store = CountingStore(workspace)
        actor, pushes, _send = await _advertised(store, workspace, board)
        group.start_soon(actor.run)
        await actor.advertise([template()], 10, None)
        with anyio.fail_after(1):
            await pushes.receive()
        fleet.append((store, actor))
    return fleet


async def test_the_sweep_spreads_the_rounds_it_wakes_over_half_a_tick() -> None:
    """When many actors' figures moved in one tick, their rounds must not all start at once
    (they queued for the pool and the database ahead of an enqueue's round)."""
    board, figures = DemandBoard(), FixedFigures()
    sweep = DemandSweep(board, figures, tick_seconds=SWEEP)
    async with anyio.create_task_group() as group:
        fleet = await _swept_fleet(8, board, group)
        await sweep.wake(await sweep.sweep(), over=SWEEP * SPREAD)  # first sight: settle
        await anyio.sleep(1)
        for store, actor in fleet:
            figures.figures_of[actor.provisioner.id] = 1  # e.g. a burst of claims elsewhere
            store.started.clear()
        read_at = anyio.current_time()
        found = await sweep.sweep()
        assert {a for a, _ in found} == {a for _, a in fleet}
        assert await sweep.wake(found, over=SWEEP * SPREAD) == len(fleet)
        await anyio.sleep(1)
        starts = sorted(s for store, _ in fleet for s in store.started)
        assert len(starts) == len(fleet)  # one round each
        gap = SWEEP * SPREAD / len(fleet)
        assert all(b - a >= gap - 1e-6 for a, b in itertools.pairwise(starts))
        assert starts[0] - read_at < 0.01  # the first at once
        assert starts[-1] - read_at < SWEEP * SPREAD  # the last within half a tick
        group.cancel_scope.cancel()


async def test_the_sweep_does_not_wake_an_actor_that_began_a_round_since_its_read() -> None:
    board, figures = DemandBoard(), FixedFigures()
    sweep = DemandSweep(board, figures, tick_seconds=SWEEP)
    async with anyio.create_task_group() as group:
        (first_store, first), (second_store, second) = await _swept_fleet(2, board, group)
        await sweep.wake(await sweep.sweep(), over=0)
        await anyio.sleep(1)
        for store, actor in ((first_store, first), (second_store, second)):
            figures.figures_of[actor.provisioner.id] = 1
            store.started.clear()
        found = await sweep.sweep()
        assert [a for a, _ in found] == board.actors()
        # An enqueue's notification reaches the later one before the sweep would wake it: that
        # round reads what the sweep read, so the sweep's wake would be a second, idle round.
        later = found[-1][0]
        assert later.provisioner.workspace_id is not None
        board.wake_workspace(later.provisioner.workspace_id)
        assert await sweep.wake(found, over=SWEEP * SPREAD) == 1
        await anyio.sleep(SWEEP)
        assert sorted(len(s.started) for s in (first_store, second_store)) == [1, 1]
        group.cancel_scope.cancel()
