"""The safety tick's pacing (actors/ticks.py): at most `tick_passes` tick passes at once on a
replica, a real wake-up never waits for a turn, and ticks are spread within the tick; with the
fake store of test_dispatch.py on trio's mock clock."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from uuid import UUID

import anyio
import pytest

from controlplane.actors import dispatch
from controlplane.actors.dispatch import Dispatcher
from controlplane.actors.ticks import SPREAD, TickTurns, next_tick
from controlplane.actors.waiters import Waiter
from controlplane.domain.jobs import ClaimedJob, SessionClaims
from tests.actors.test_dispatch import FakeStore, anyio_backend

__all__ = ["anyio_backend"]  # the mock-clock backend fixture, used by every test here

TICK = 5.0


class SlowStore(FakeStore):
    """Claims of any workspace (one waiter each: `claim`), each taking `delay[workspace]`
    seconds, and failing then for a workspace in `failing`; records the claims in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.delay: dict[UUID, float] = {}
        self.in_flight: set[UUID] = set()
        self.most_in_flight = 0
        self.claimed_in: list[UUID] = []
        self.failing: set[UUID] = set()

    async def claim(self, session: SessionClaims) -> ClaimedJob | None:
        self.in_flight.add(session.workspace_id)
        self.most_in_flight = max(self.most_in_flight, len(self.in_flight))
        self.claimed_in.append(session.workspace_id)
        try:
            await anyio.sleep(self.delay.get(session.workspace_id, 0.0))
            if session.workspace_id in self.failing:
                raise RuntimeError("the database went away mid claim")
            return await super().claim(session)
        finally:
            self.in_flight.discard(session.workspace_id)

    async def touch(self, workspace_id: UUID, runner_session_ids: list[UUID]) -> None:
        self.touches.append(list(runner_session_ids))


def parked_in(workspace: UUID) -> Waiter:
    return Waiter(SessionClaims(uuid.uuid4(), workspace, ("linux",), 1))  # capped: `claim`


async def _run(
    store: SlowStore, passes: int, body: Callable[[Dispatcher], Awaitable[None]]
) -> None:
    dispatcher = Dispatcher(store, tick_seconds=TICK, tick_passes=passes)
    async with anyio.create_task_group() as group:
        await group.start(dispatcher.run)
        await body(dispatcher)
        group.cancel_scope.cancel()


async def test_tick_passes_take_turns() -> None:
    """Three actors tick within one second of each other with 3 s claims: with one turn their
    tick claims run one after another, and each still runs."""
    store = SlowStore()
    workspaces = [uuid.uuid4() for _ in range(3)]

    async def body(dispatcher: Dispatcher) -> None:
        for workspace in workspaces:
            dispatcher.park(parked_in(workspace))
        await anyio.sleep(0.5)  # each newcomer tried at once, in parallel: no turn needed
        assert store.most_in_flight == 3
        store.most_in_flight = 0
        store.claimed_in.clear()
        store.delay = dict.fromkeys(workspaces, 3.0)
        await anyio.sleep(13)  # ticks at 4 to 5 s, then 3 s each in turn
        assert store.most_in_flight == 1
        assert set(store.claimed_in) == set(workspaces)

    await _run(store, 1, body)


async def test_a_wake_up_does_not_wait_for_a_tick_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """A holds the only turn in a 10 s claim; B's tick queues behind it. A job for B and its
    notification reach B's waiter at once, not after A's claim."""
    monkeypatch.setattr(dispatch, "next_tick", lambda tick: tick)  # ticks at known times
    store = SlowStore()
    a, b = uuid.uuid4(), uuid.uuid4()

    async def body(dispatcher: Dispatcher) -> None:
        dispatcher.park(parked_in(a))
        await anyio.sleep(0.5)
        waiting = Waiter(SessionClaims(uuid.uuid4(), b, ("linux",), 1))
        dispatcher.park(waiting)
        await anyio.sleep(0.5)
        store.delay[a] = 10.0
        await anyio.sleep(5)  # A ticked at 5.0 and holds the turn; B ticked at 5.5: queued
        assert store.in_flight == {a}
        assert b not in store.claimed_in[2:]
        job = store.add(("linux",))
        dispatcher.wake(b, ("linux",))
        with anyio.fail_after(0.5):
            await waiting.done.wait()
        assert waiting.job == job
        assert store.in_flight == {a}  # A's tick claim is still running
        # B left the queue: when A's turn ends, the turn is free again, and B's next tick runs.
        store.delay[a] = 0.0
        claims = len(store.claimed_in)
        await anyio.sleep(15)
        assert store.claimed_in[claims:].count(a) >= 1

    await _run(store, 1, body)


def test_turns_are_handed_over_in_order_and_a_leaver_gets_none() -> None:
    granted: list[str] = []

    class Taker:
        def __init__(self, name: str) -> None:
            self.name = name

        def granted(self) -> None:
            granted.append(self.name)

    turns = TickTurns(1)
    first, second, third = Taker("first"), Taker("second"), Taker("third")
    assert turns.take(first)
    assert not turns.take(second)
    assert not turns.take(third)
    assert turns.queued == 2
    turns.leave(second)
    turns.release()  # first's turn goes to third
    assert granted == ["third"]
    turns.release()  # third's is free again
    assert turns.take(Taker("fourth"))
    with pytest.raises(ValueError, match="at least one"):
        TickTurns(0)


def test_a_tick_is_never_longer_than_the_tick() -> None:
    waits = [next_tick(TICK) for _ in range(1000)]
    assert all(SPREAD * TICK <= wait <= TICK for wait in waits)
    assert max(waits) - min(waits) > 0.5  # spread, not one value


async def test_no_turn_is_lost_to_a_runner_leaving_or_a_failing_claim(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """B queues for the only turn and its runner goes away: B leaves the queue. A's tick claim
    fails: its turn is returned all the same. Then C's tick runs in its turn, at once."""
    monkeypatch.setattr(dispatch, "next_tick", lambda tick: tick)
    store = SlowStore()
    a, b, c = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()

    async def body(dispatcher: Dispatcher) -> None:
        dispatcher.park(parked_in(a))
        await anyio.sleep(0.5)
        leaving = parked_in(b)
        dispatcher.park(leaving)
        await anyio.sleep(0.5)
        store.delay[a] = 3.0
        store.failing.add(a)
        await anyio.sleep(4.7)  # 5.7: A ticked at 5.0 (a 3 s claim); B's tick at 5.5 queued
        assert store.in_flight == {a}
        assert leaving.abandon()  # B's runner disconnects while B waits for a turn
        await anyio.sleep(2.5)  # 8.2: A's claim failed at 8.0, its waiter answered "unavailable"
        assert store.in_flight == set()
        assert dispatcher.parked == 0
        staying = parked_in(c)
        dispatcher.park(staying)
        await anyio.sleep(0.5)
        store.claimed_in.clear()
        await anyio.sleep(5)  # C's tick at 13.7: its turn is free, so it claims at once
        assert store.claimed_in == [c]

    await _run(store, 1, body)
