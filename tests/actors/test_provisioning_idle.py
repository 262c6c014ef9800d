"""An idle provisioner actor costs the database nothing (issue 16): with no wake-up it sleeps
until a deadline it knows of (a reservation it made expiring, an instance it created timing out),
with no timer of its own for the safety net; the replica's demand sweep wakes only the actors
whose figures moved, and its slow full round, one statement for all the sessions per interval,
only those a round could find anything for. On trio's mock clock with the fake store of
test_provisioning.py."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import AsyncIterator, Collection, Sequence
from contextlib import asynccontextmanager
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
    """A sweep store whose figures the test sets (as one value each), and the sessions its
    full-round check finds something for (`due`); counts the statements of each."""

    def __init__(self) -> None:
        self.figures_of: dict[UUID, int] = {}
        self.statements = 0
        self.due: set[UUID] = set()
        self.full_statements = 0
        self.asked: list[set[UUID]] = []

    async def full_round_due(self, sessions: Sequence[SweptSession]) -> list[bool]:
        self.full_statements += 1
        self.asked.append({s.provisioner_id for s in sessions})
        return [s.provisioner_id in self.due for s in sessions]

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
    actor = ProvisionerActor(store, provisioner(workspace), LIMITS, send.send, lambda: NOW)
    if board is not None:
        board.add(actor)
    return actor, pushes, send


@pytest.mark.parametrize("scope", ["workspace", "installation"])
async def test_an_idle_actor_makes_no_store_call_of_its_own(scope: str) -> None:
    """No timer of its own either: the safety net is the replica's (the sweep's full round)."""
    workspace = uuid.uuid4()
    store = CountingStore(workspace)
    actor, pushes, _send = await _advertised(store, workspace if scope == "workspace" else None)
    async with anyio.create_task_group() as group:
        group.start_soon(actor.run)
        await actor.advertise([template()], 10, None)
        with anyio.fail_after(1):
            await pushes.receive()
        before = len(store.log)
        await anyio.sleep(10 * FULL)  # what was ten of its own full rounds
        assert store.log[before:] == []
        assert not actor.holds_work
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
    count: int,
    board: DemandBoard,
    group: anyio.abc.TaskGroup,
    workspaces: Sequence[UUID | None] = (),
) -> list[tuple[CountingStore, ProvisionerActor, Pushes]]:
    """`count` running workspace actors on `board` (or one for each of `workspaces`, None:
    installation scope), each past its advertisement's round."""
    fleet = []
    for workspace in workspaces or [uuid.uuid4() for _ in range(count)]:
        store = CountingStore(workspace)
        actor, pushes, _send = await _advertised(store, workspace, board)
        group.start_soon(actor.run)
        await actor.advertise([template()], 10, None)
        with anyio.fail_after(1):
            await pushes.receive()
        fleet.append((store, actor, pushes))
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
        for store, actor, _ in fleet:
            figures.figures_of[actor.provisioner.id] = 1  # e.g. a burst of claims elsewhere
            store.started.clear()
        read_at = anyio.current_time()
        found = await sweep.sweep()
        assert {a for a, _ in found} == {a for _, a, _ in fleet}
        assert await sweep.wake(found, over=SWEEP * SPREAD) == len(fleet)
        await anyio.sleep(1)
        starts = sorted(s for store, _, _ in fleet for s in store.started)
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
        [(first_store, first, _), (second_store, second, _)] = await _swept_fleet(2, board, group)
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


async def _full_round_fleet(
    group: anyio.abc.TaskGroup, workspaces: Sequence[UUID | None]
) -> tuple[DemandSweep, FixedFigures, list[tuple[CountingStore, ProvisionerActor, Pushes]]]:
    """Running actors past their advertisement's round, one per workspace (None: installation
    scope), and a running sweep with its full round every FULL, past its first sight of them."""
    board, figures = DemandBoard(), FixedFigures()
    sweep = DemandSweep(board, figures, tick_seconds=SWEEP, full_round_seconds=FULL)
    fleet = await _swept_fleet(0, board, group, workspaces)
    await group.start(sweep.run)
    await anyio.sleep(SWEEP + 1)  # first sight: each woken once
    return sweep, figures, fleet


async def test_the_full_round_is_one_statement_an_interval_and_wakes_no_idle_session() -> None:
    async with anyio.create_task_group() as group:
        workspaces = [uuid.uuid4() for _ in range(5)]
        _sweep, figures, fleet = await _full_round_fleet(group, [*workspaces, None])
        rounds = [store.rounds for store, _, _ in fleet]
        await anyio.sleep(3 * FULL)
        # A check every half interval: the first finds every session's round (first sight's)
        # too recent; the next five ask about all six sessions in one statement each. No round.
        assert figures.full_statements == 5
        assert figures.asked == [{actor.provisioner.id for _, actor, _ in fleet}] * 5
        assert [store.rounds for store, _, _ in fleet] == rounds
        assert all(pushes.statistics().current_buffer_used == 0 for _, _, pushes in fleet)
        group.cancel_scope.cancel()


async def test_the_full_round_finds_an_enqueue_whose_notification_was_lost() -> None:
    async with anyio.create_task_group() as group:
        workspace = uuid.uuid4()
        _sweep, figures, [(store, actor, pushes)] = await _full_round_fleet(group, [workspace])
        # A job whose NOTIFY was lost: the sweep's figures do not count a new pending job.
        store.queued[workspace] = 1
        figures.due.add(actor.provisioner.id)  # the statement sees it pending
        lost_at = anyio.current_time()
        with anyio.fail_after(FULL + SWEEP * (1 + SPREAD)):
            found = await pushes.receive()
        assert [g.count for g in found.grants] == [1]
        assert anyio.current_time() - lost_at >= FULL - 2 * SWEEP  # by the full round, no sooner
        group.cancel_scope.cancel()


async def test_the_full_round_wakes_an_actor_holding_work_without_asking_about_it() -> None:
    """An actor whose last push told of demand (or a warm pool, terminate intents) runs the
    full round's round on its own word; an unchanged round then pushes nothing."""
    async with anyio.create_task_group() as group:
        busy_ws, idle_ws = uuid.uuid4(), uuid.uuid4()
        board, figures = DemandBoard(), FixedFigures()
        busy_store = CountingStore(busy_ws)
        busy_store.queued[busy_ws] = 1
        busy, busy_pushes, _b = await _advertised(busy_store, busy_ws, board)
        idle_store = CountingStore(idle_ws)
        idle, idle_pushes, _i = await _advertised(idle_store, idle_ws, board)
        # No slot: demand it cannot serve, so no grant (whose expiry would be a deadline).
        for actor, pushes, slots in ((busy, busy_pushes, 0), (idle, idle_pushes, 10)):
            group.start_soon(actor.run)
            await actor.advertise([template(slots)], 10, None)
            with anyio.fail_after(1):
                await pushes.receive()
        assert (busy.holds_work, idle.holds_work) == (True, False)
        sweep = DemandSweep(board, figures, tick_seconds=SWEEP, full_round_seconds=FULL)
        await group.start(sweep.run)
        await anyio.sleep(SWEEP + 1)  # first sight
        rounds = (busy_store.rounds, idle_store.rounds)
        await anyio.sleep(FULL + SWEEP)
        assert figures.asked == [{idle.provisioner.id}]
        assert (busy_store.rounds, idle_store.rounds) == (rounds[0] + 1, rounds[1])
        assert busy_pushes.statistics().current_buffer_used == 0  # the same figures
        group.cancel_scope.cancel()


async def test_the_full_round_leaves_out_a_session_busy_with_rounds() -> None:
    """A session woken by its enqueues more often than every half interval is never woken for
    the safety net, nor asked about: its own rounds read everything that round would."""
    async with anyio.create_task_group() as group:
        workspaces = [uuid.uuid4(), uuid.uuid4()]
        _sweep, figures, fleet = await _full_round_fleet(group, workspaces)
        [(busy_store, busy, _), (_idle_store, idle, _)] = fleet
        figures.due = {busy.provisioner.id, idle.provisioner.id}
        for _ in range(int(3 * FULL / 100)):
            await anyio.sleep(100)
            busy.wake()  # an enqueue's notification, every 100 s
        await anyio.sleep(1)
        assert all(asked == {idle.provisioner.id} for asked in figures.asked)
        assert len(figures.asked) == 5  # as for any idle session: every half interval
        assert busy.rounds_begun == busy_store.rounds == 2 + int(3 * FULL / 100)
        group.cancel_scope.cancel()
