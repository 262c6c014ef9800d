"""The provisioner actor's logic with a fake `ProvisioningStore`, on trio with a mock clock:
rounds, the demand push and what it gives back, the installation walk, the fence, warm
launches. The store's own behaviour (locks, fencing rows) is tests/store/test_demand_store.py's;
the whole session over a real WebSocket is tests/web/test_control_session.py's."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Collection, Sequence
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any, cast
from uuid import UUID

import anyio
import pytest
import trio.testing
from anyio.streams.memory import MemoryObjectReceiveStream

from controlplane.actors.provisioning import DemandBoard, DemandPush, Limits, ProvisionerActor
from controlplane.domain.assignment import Batch, CreatedInstance
from controlplane.domain.binding import Scope
from controlplane.domain.demand import (
    Allocation,
    DemandStat,
    NewReservation,
    Reservation,
    ReservationKind,
    Template,
)
from controlplane.domain.labels import LabelSet
from controlplane.domain.provisioners import Provisioner
from controlplane.domain.reports import ReconcileOutcome, ReportOutcome, RunnerEvent
from controlplane.domain.rounds import Grant, WalkEntry, WorkspaceRound
from controlplane.domain.runner_instances import ProvisionedRunner
from controlplane.errors import Fenced, InvalidInput
from controlplane.store.ephemeral import MintedToken
from controlplane.store.lifecycle import Assigned
from controlplane.store.provisioning import RoundTerms

LINUX: LabelSet = ("linux",)
NOW = datetime(2026, 1, 1, tzinfo=UTC)
TICK = 30.0


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})


class FakeStore:
    """Queued jobs per workspace (insertion order is oldest demand first); each allocation
    grants min(unreserved jobs, template slots, budget) as one launch reservation. Records
    every call, and can hold a round open, report workspaces busy, or fence the session."""

    def __init__(self, workspace_id: UUID | None = None) -> None:
        self.queued: dict[UUID, int] = {}
        self.reserved: dict[UUID, int] = {}
        self.busy: set[UUID] = set()
        self.fenced: str | None = None
        self.hold: anyio.Event | None = None  # a round waits for it, when set
        self.rounds = 0  # allocation transactions that committed
        self.round_done = anyio.Event()
        self.open_now = 0
        self.most_open = 0
        self.budgets: list[tuple[UUID, int]] = []
        self.granted: list[UUID] = []
        self.deleted: list[UUID] = []
        self.created: list[tuple[str | None, UUID | None]] = []
        self.calls: list[str] = []
        if workspace_id is not None:
            self.queued[workspace_id] = 0

    def _check_fence(self) -> None:
        if self.fenced is not None:
            raise Fenced(self.fenced)

    async def _allocate(self, workspace_id: UUID, terms: RoundTerms) -> WorkspaceRound:
        self.open_now += 1
        self.most_open = max(self.most_open, self.open_now)
        try:
            if self.hold is not None:
                await self.hold.wait()
            await anyio.sleep(0.01)  # a transaction takes a round trip
            self._check_fence()
            return self._grant(workspace_id, terms)
        finally:
            self.open_now -= 1
            self.rounds += 1
            self.round_done.set()
            self.round_done = anyio.Event()

    def _grant(self, workspace_id: UUID, terms: RoundTerms) -> WorkspaceRound:
        self.budgets.append((workspace_id, terms.max_reservations))
        queued, reserved = self.queued.get(workspace_id, 0), self.reserved.get(workspace_id, 0)
        slots = sum(t.available_slots for t in terms.templates)
        count = max(0, min(queued - reserved, slots, terms.max_reservations))
        self.reserved[workspace_id] = reserved + count
        expires = NOW + terms.launch_ttl
        new = (NewReservation(ReservationKind.LAUNCH, LINUX, count, expires),) if count else ()
        stats = (DemandStat(LINUX, queued, reserved + count, NOW),) if queued else ()
        allocation = Allocation(stats, new, terms.templates, terms.max_reservations - count, 0)
        grants = tuple(Grant(uuid.uuid4(), workspace_id, LINUX, count, expires) for _ in new)
        self.granted.extend(g.reservation_id for g in grants)
        return WorkspaceRound(workspace_id, allocation, grants, bound=0, rebound=0)

    # --- ProvisioningStore ---------------------------------------------------------------------

    async def ping(self) -> None:
        self._check_fence()

    async def replace_templates(self, templates: Sequence[Template]) -> None:
        self._check_fence()
        self.calls.append("replace_templates")

    async def allocate_workspace(self, workspace_id: UUID, terms: RoundTerms) -> WorkspaceRound:
        return await self._allocate(workspace_id, terms)

    async def walk_workspaces(self, changed: Collection[UUID] = ()) -> list[WalkEntry]:
        return [WalkEntry(w, 0) for w, n in self.queued.items() if n]

    async def walk_figures(
        self, workspace_ids: Sequence[UUID], terms: RoundTerms
    ) -> list[WorkspaceRound]:
        figures = []
        for w in workspace_ids:
            queued, reserved = self.queued.get(w, 0), self.reserved.get(w, 0)
            stats = (DemandStat(LINUX, queued, reserved, NOW),) if queued else ()
            allocation = Allocation(stats, (), terms.templates, 0, 0)
            figures.append(WorkspaceRound(w, allocation, (), bound=0, rebound=0))
        return figures

    async def allocate_in_walk(
        self, workspace_id: UUID, terms: RoundTerms
    ) -> WorkspaceRound | None:
        if workspace_id in self.busy:
            self.budgets.append((workspace_id, terms.max_reservations))
            return None
        return await self._allocate(workspace_id, terms)

    async def outstanding_grants(self) -> list[tuple[Reservation, int]]:
        return []

    async def idle_candidates(
        self,
    ) -> tuple[list[ProvisionedRunner], frozenset[UUID], datetime]:
        return [], frozenset(), NOW

    async def delete_reservations(self, reservation_ids: Collection[UUID]) -> int:
        self.deleted.extend(reservation_ids)
        return len(reservation_ids)

    async def create_instances(
        self,
        provider_kind: str | None,
        entries: Sequence[tuple[str | None, UUID | None]],
        bootstrap_ttl: timedelta,
    ) -> Batch:
        self._check_fence()
        self.created.extend(entries)
        return Batch(
            tuple(CreatedInstance(uuid.uuid4(), "cp_bt_x", i) for i in range(len(entries))), {}
        )

    async def attach_provider(self, runner_instance_id: UUID, provider_runner_id: str) -> bool:
        raise AssertionError("not used")

    async def assign(self, reservation_id: UUID, runner_instance_ids: Sequence[UUID]) -> Assigned:
        self.calls.append("assign")
        return Assigned(list(runner_instance_ids), [])

    async def instance_counts(self) -> dict[tuple[str, str], int]:
        return {}  # a metric's read: not one of the calls the tests follow

    async def report(
        self,
        events: Sequence[RunnerEvent],
        *,
        received_at: datetime,
        reserved_labels: LabelSet,
        activation_timeout: timedelta,
    ) -> ReportOutcome:
        raise AssertionError("not used")

    async def reconcile(self, observed: Sequence[str], *, grace: timedelta) -> ReconcileOutcome:
        raise AssertionError("not used")

    async def mint(
        self, provider_runner_ids: Sequence[str], reservation_id: UUID | None, ttl: timedelta
    ) -> list[MintedToken]:
        raise AssertionError("not used")


def provisioner(workspace_id: UUID | None) -> Provisioner:
    scope = "installation" if workspace_id is None else "workspace"
    return Provisioner(
        uuid.uuid4(), scope, workspace_id, "p", "cp_pt_x", NOW, None, None, None, None
    )


LIMITS = Limits(
    activation_grace=timedelta(seconds=60),
    activation_timeout=timedelta(seconds=300),
    covering_window=timedelta(seconds=120),
    reservation_ttl_seconds=60,
    reservation_ttl_max_seconds=3600,
    bootstrap_ttl=timedelta(minutes=10),
    reconcile_grace=timedelta(minutes=5),
    ephemeral_ttl=timedelta(minutes=10),
    reserved_labels=(),
)


def template(slots: int = 10, idle_target: int = 0) -> Template:
    return Template("small", LINUX, slots, idle_target=idle_target)


Body = Callable[[ProvisionerActor, MemoryObjectReceiveStream[DemandPush]], Awaitable[None]]


async def _session(store: FakeStore, workspace_id: UUID | None, body: Body) -> None:
    """Run an actor over `store` while `body` drives it; pushes arrive on the stream."""
    send, received = anyio.create_memory_object_stream[DemandPush](100)
    actor = ProvisionerActor(store, provisioner(workspace_id), LIMITS, send.send, lambda: NOW)
    async with anyio.create_task_group() as group:
        group.start_soon(actor.run)
        await body(actor, received)
        group.cancel_scope.cancel()


async def _next(pushes: MemoryObjectReceiveStream[DemandPush], within: float = 5) -> DemandPush:
    with anyio.fail_after(within):
        return await pushes.receive()


async def test_an_advertisement_runs_a_round_and_pushes_demand_even_with_nothing_new() -> None:
    workspace = uuid.uuid4()
    store = FakeStore(workspace)
    store.queued[workspace] = 3

    async def body(actor: ProvisionerActor, pushes: MemoryObjectReceiveStream[DemandPush]) -> None:
        assert await actor.advertise([template(2)], 10, None) == 1
        first = await _next(pushes)
        assert (first.seq, first.newly_reserved) == (1, 2)
        assert [(g.workspace_id, g.count) for g in first.grants] == [(workspace, 2)]
        assert [(s.workspace_id, s.queued, s.reserved) for s in first.stats] == [(workspace, 3, 2)]
        # An advertisement always answers with a push, even when the round found nothing new.
        await actor.advertise([template(0)], 10, None)
        second = await _next(pushes)
        assert (second.seq, second.grants, second.newly_reserved) == (2, [], 0)
        assert store.calls == ["replace_templates", "replace_templates"]

    await _session(store, workspace, body)


class SlowCountStore(FakeStore):
    """Its divergence read (the last read of an advertisement) waits until `counted` is set."""

    def __init__(self, workspace_id: UUID | None) -> None:
        super().__init__(workspace_id)
        self.counted = anyio.Event()

    async def instance_counts(self) -> dict[tuple[str, str], int]:
        await self.counted.wait()
        return {}


async def test_an_advertisement_is_answered_before_its_round_pushes() -> None:
    """The protocol's order is `advertised`, then the round's `demand`: no round may start
    while the advertisement still waits on the store, or its push could overtake the answer
    (a client that takes that push for an earlier round's waits for ever: the likely cause of a
    1,000-session bench run that stopped)."""
    workspace = uuid.uuid4()
    store = SlowCountStore(workspace)
    store.queued[workspace] = 1

    async def body(actor: ProvisionerActor, pushes: MemoryObjectReceiveStream[DemandPush]) -> None:
        answered: list[int] = []

        async def advertise() -> None:
            answered.append(await actor.advertise([template(1)], 10, None))

        async with anyio.create_task_group() as group:
            group.start_soon(advertise)
            await anyio.sleep(1)  # mock time: a round (0.01 s a transaction) would be done
            assert answered == []  # still waiting on the store...
            assert pushes.statistics().current_buffer_used == 0  # ...and no round has pushed
            store.counted.set()
        assert answered == [1]
        push = await _next(pushes)
        assert push.newly_reserved == 1

    await _session(store, workspace, body)


async def test_a_wake_from_an_enqueue_reaches_the_actors_that_serve_the_workspace() -> None:
    workspace, other = uuid.uuid4(), uuid.uuid4()
    store = FakeStore(workspace)
    board = DemandBoard()

    async def body(actor: ProvisionerActor, pushes: MemoryObjectReceiveStream[DemandPush]) -> None:
        board.add(actor)
        await actor.advertise([template()], 10, None)
        await _next(pushes)
        rounds = store.rounds
        store.queued[workspace] = 1
        board.wake_workspace(other, LINUX)  # not ours: no round before the tick
        await anyio.sleep(TICK / 2)
        assert store.rounds == rounds
        board.wake_workspace(workspace, LINUX)
        with anyio.fail_after(1):  # well before the tick
            push = await pushes.receive()
        assert [(g.workspace_id, g.count) for g in push.grants] == [(workspace, 1)]
        board.remove(actor)
        assert len(board) == 0

    await _session(store, workspace, body)


async def test_rounds_never_interleave_and_wakes_during_one_coalesce_into_the_next() -> None:
    workspace = uuid.uuid4()
    store = FakeStore(workspace)
    store.hold = anyio.Event()
    board = DemandBoard()

    async def body(actor: ProvisionerActor, pushes: MemoryObjectReceiveStream[DemandPush]) -> None:
        board.add(actor)
        await actor.advertise([template()], 10, None)
        await anyio.sleep(1)  # the first round is open, waiting for `hold`
        assert store.open_now == 1
        for _ in range(5):
            board.wake_all()
            board.wake_workspace(workspace)
            await actor.advertise([template()], 10, None)
            await anyio.sleep(0.1)
        open_during_wakes = store.open_now
        assert store.hold is not None
        store.hold.set()
        await _next(pushes)
        await _next(pushes)  # the wakes during the first round: one more round, one push
        await anyio.sleep(TICK / 2)
        assert (open_during_wakes, store.most_open, store.rounds) == (1, 1, 2)

    await _session(store, workspace, body)


async def test_a_push_that_fails_gives_its_grants_back_and_ends_the_actor() -> None:
    workspace = uuid.uuid4()
    store = FakeStore(workspace)
    store.queued[workspace] = 2

    async def gone(_push: DemandPush) -> None:
        raise anyio.BrokenResourceError

    actor = ProvisionerActor(store, provisioner(workspace), LIMITS, gone, lambda: NOW)
    await actor.advertise([template()], 10, None)
    with anyio.fail_after(5), pytest.raises(anyio.BrokenResourceError):
        await actor.run()
    assert len(store.granted) == 1
    assert store.deleted == store.granted  # the launch reservation the push carried


async def test_an_installation_walk_skips_a_busy_workspace_and_carries_the_budget() -> None:
    oldest, busy, youngest, idle = (uuid.uuid4() for _ in range(4))
    store = FakeStore()
    store.queued.update({oldest: 2, busy: 4, youngest: 5, idle: 0})
    store.busy.add(busy)

    async def body(actor: ProvisionerActor, pushes: MemoryObjectReceiveStream[DemandPush]) -> None:
        await actor.advertise([template(10)], 3, None)
        push = await _next(pushes)
        assert [(g.workspace_id, g.count) for g in push.grants] == [(oldest, 2), (youngest, 1)]
        assert push.newly_reserved == 3
        # Each workspace is offered what the earlier ones left of the budget; the busy one is
        # skipped, not waited for, and the workspace without demand is never asked.
        assert store.budgets == [(oldest, 3), (busy, 1), (youngest, 1)]
        assert [s.workspace_id for s in push.stats] == [oldest, youngest]

    await _session(store, None, body)


async def test_a_walk_that_used_its_budget_asks_for_no_further_workspace() -> None:
    first, second = uuid.uuid4(), uuid.uuid4()
    store = FakeStore()
    store.queued.update({first: 5, second: 5})

    async def body(actor: ProvisionerActor, pushes: MemoryObjectReceiveStream[DemandPush]) -> None:
        await actor.advertise([template(10)], 4, None)
        push = await _next(pushes)
        assert [(g.workspace_id, g.count) for g in push.grants] == [(first, 4)]
        assert store.budgets == [(first, 4)]

    await _session(store, None, body)


@pytest.mark.parametrize("scope", ["workspace", "installation"])
async def test_a_fenced_session_stops_the_actor(scope: str) -> None:
    workspace = uuid.uuid4()
    store = FakeStore(workspace)
    store.queued[workspace] = 1
    pushes: list[DemandPush] = []

    async def send(push: DemandPush) -> None:
        pushes.append(push)

    owner = provisioner(workspace if scope == "workspace" else None)
    actor = ProvisionerActor(store, owner, LIMITS, send, lambda: NOW)
    await actor.advertise([template()], 10, None)
    store.fenced = "superseded"  # a takeover committed after the advertisement
    with anyio.fail_after(5), pytest.raises(Fenced) as raised:
        await actor.run()
    assert raised.value.verdict == "superseded"
    assert pushes == []  # nothing from a round that wrote nothing
    with pytest.raises(Fenced):
        await actor.advertise([template()], 10, None)  # requests are refused the same way


async def test_pushed_warm_launches_stop_counting_once_their_launch_ttl_passed() -> None:
    workspace = uuid.uuid4()
    store = FakeStore(workspace)
    ttl = 600

    async def body(actor: ProvisionerActor, pushes: MemoryObjectReceiveStream[DemandPush]) -> None:
        await actor.advertise([template(10, idle_target=2)], 10, ttl)
        first = await _next(pushes)
        pushed_at = anyio.current_time()
        assert [(w.template_key, w.count) for w in first.warm] == [("small", 2)]
        # Pushed and not created yet: the next rounds launch nothing more.
        actor.wake()
        await store.round_done.wait()
        await anyio.sleep(1)
        assert pushes.statistics().current_buffer_used == 0
        # The provisioner ignored them: once their launch TTL passed they stop counting, and
        # the first safety tick after that asks for them again.
        late = await _next(pushes, within=ttl + 2 * TICK)
        assert anyio.current_time() - pushed_at >= ttl
        assert [(w.template_key, w.count) for w in late.warm] == [("small", 2)]

    await _session(store, workspace, body)


async def test_a_created_warm_instance_takes_the_place_of_a_pushed_launch() -> None:
    workspace = uuid.uuid4()
    store = FakeStore(workspace)

    async def body(actor: ProvisionerActor, pushes: MemoryObjectReceiveStream[DemandPush]) -> None:
        await actor.advertise([template(10, idle_target=2)], 10, None)
        await _next(pushes)
        await actor.create_instances("local", [("small", None)])
        actor.wake()
        # The fake store never shows the new instance as idle, so the pool is one short again.
        again = await _next(pushes)
        assert [(w.template_key, w.count) for w in again.warm] == [("small", 1)]
        assert store.created == [("small", None)]

    await _session(store, workspace, body)


async def test_refused_requests_reach_no_store() -> None:
    workspace = uuid.uuid4()
    store = FakeStore(workspace)
    actor = ProvisionerActor(store, provisioner(workspace), LIMITS, _never, lambda: NOW)
    runner = uuid.uuid4()
    with pytest.raises(InvalidInput):
        await actor.assign(uuid.uuid4(), [runner, runner])
    with pytest.raises(InvalidInput):
        await actor.advertise([template(), template()], 10, None)  # one key twice
    with pytest.raises(InvalidInput):
        await actor.mint(["a", "a"], None)
    installation = ProvisionerActor(store, provisioner(None), LIMITS, _never, lambda: NOW)
    with pytest.raises(InvalidInput):
        await installation.mint(["a"], None)  # an installation provisioner must name one
    assert store.calls == []


async def _never(_push: DemandPush) -> None:
    raise AssertionError("no round ran")


def test_the_board_wakes_the_workspaces_actors_and_every_installation_actor_only() -> None:
    """The board keeps workspace actors by workspace: a wake reaches them and the installation
    actors, never another workspace's, and a removed actor is not woken."""
    first, second = uuid.uuid4(), uuid.uuid4()
    woken: list[str] = []

    class Probe:
        def __init__(self, name: str, workspace_id: uuid.UUID | None) -> None:
            self.name = name
            self.scope = Scope.WORKSPACE if workspace_id else Scope.INSTALLATION
            self.provisioner = SimpleNamespace(workspace_id=workspace_id)

        def wake(self) -> None:
            woken.append(self.name)

        def demand_changed(self, workspace_id: uuid.UUID) -> None:
            changed.append(workspace_id)
            self.wake()

        def resync(self) -> None:
            woken.append(f"{self.name}!")

    changed: list[uuid.UUID] = []
    board = DemandBoard()
    probes = [Probe("a", first), Probe("b", first), Probe("c", second), Probe("i", None)]
    for probe in probes:
        board.add(cast(ProvisionerActor, probe))
    board.wake_workspace(first)
    assert sorted(woken) == ["a", "b", "i"]
    assert changed == [first]  # the installation actor is told which workspace changed
    woken.clear()
    board.wake_workspace(uuid.uuid4())
    assert woken == ["i"]
    woken.clear()
    board.remove(cast(ProvisionerActor, probes[0]))
    board.remove(cast(ProvisionerActor, probes[3]))
    board.wake_workspace(first)
    assert woken == ["b"]
    woken.clear()
    board.wake_all()
    assert sorted(woken) == ["b", "c"]
    woken.clear()
    board.resync()
    assert sorted(woken) == ["b!", "c!"]
    assert len(board) == 2
