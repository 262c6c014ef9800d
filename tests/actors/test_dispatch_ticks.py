"""The replica's dispatch safety tick (actors/ticks.py): one read for every parked actor, only
the actors with claimable work woken, each for the label sets that have it; a wake-up never
waits for the read; a failed read falls back to every actor claiming; one liveness stamp for the
whole replica. With the fake store of test_dispatch.py on trio's mock clock."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from uuid import UUID

import anyio

from controlplane.actors.dispatch import Dispatcher
from controlplane.actors.waiters import Waiter
from controlplane.domain.jobs import SessionClaims
from controlplane.errors import DatabaseUnavailable
from tests.actors.test_dispatch import FakeStore, anyio_backend

__all__ = ["anyio_backend"]  # the mock-clock backend fixture, used by every test here

TICK = 5.0
TOUCH = 10.0


def parked_in(workspace: UUID, *labels: str, capped: bool = False) -> Waiter:
    return Waiter(
        SessionClaims(uuid.uuid4(), workspace, tuple(sorted(labels)), 1 if capped else None)
    )


def claims_in(store: FakeStore) -> int:
    return len(store.claims)


async def _run(store: FakeStore, body: Callable[[Dispatcher], Awaitable[None]]) -> None:
    dispatcher = Dispatcher(store, tick_seconds=TICK, touch_seconds=TOUCH)
    async with anyio.create_task_group() as group:
        await group.start(dispatcher.run)
        await body(dispatcher)
        group.cancel_scope.cancel()


async def test_one_read_a_tick_and_only_an_actor_with_work_claims() -> None:
    """Three workspaces parked, nothing pending: each tick is one read naming every actor's
    label set and no claim at all. A job whose notification was lost in one of them: the next
    tick's read finds it and only that actor claims, and its runner gets the job."""
    store = FakeStore()
    a, b, c = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()

    async def body(dispatcher: Dispatcher) -> None:
        dispatcher.park(parked_in(a, "linux"))
        dispatcher.park(parked_in(b, "linux", "x64"))
        waiting = parked_in(c, "linux", capped=True)
        dispatcher.park(waiting)
        await anyio.sleep(1)  # each newcomer tried once, at once
        assert claims_in(store) == 3
        store.claims.clear()
        await anyio.sleep(TICK * 4)  # four ticks
        assert store.claims == []  # no actor claimed for nothing
        assert len(store.reads) == 4
        assert all(
            sorted(read) == sorted([(a, ("linux",)), (b, ("linux", "x64")), (c, ("linux",))])
            for read in store.reads
        )
        job = store.add(("linux",), workspace=c)  # committed; its NOTIFY is lost
        with anyio.fail_after(TICK):  # by the next tick
            await waiting.done.wait()
        assert waiting.job == job
        assert store.claims == [("linux",)]  # c's claim alone

    await _run(store, body)


async def test_the_tick_wakes_only_the_label_sets_with_work() -> None:
    """A job only the wider label set can take: the tick wakes that set, not the narrower one,
    which stays known to be empty and makes no claim."""
    store = FakeStore()
    workspace = uuid.uuid4()

    async def body(dispatcher: Dispatcher) -> None:
        narrow, wide = parked_in(workspace, "linux"), parked_in(workspace, "gpu", "linux")
        dispatcher.park(narrow)
        dispatcher.park(wide)
        await anyio.sleep(1)
        store.claims.clear()
        job = store.add(("gpu", "linux"), workspace=workspace)  # no wake-up
        with anyio.fail_after(TICK):
            await wide.done.wait()
        assert wide.job == job
        assert store.claims == [("gpu", "linux")]
        await anyio.sleep(TICK * 2)
        assert store.claims == [("gpu", "linux")]  # the narrow set is still known empty
        assert not narrow.done.is_set()

    await _run(store, body)


async def test_a_wake_up_does_not_wait_for_the_tick_read() -> None:
    """The tick's read takes 10 s (a slow database); a job notified meanwhile reaches its runner
    at once, not after the read."""
    store = FakeStore()
    a, b = uuid.uuid4(), uuid.uuid4()

    async def body(dispatcher: Dispatcher) -> None:
        dispatcher.park(parked_in(a, "linux"))
        waiting = parked_in(b, "linux")
        dispatcher.park(waiting)
        await anyio.sleep(1)
        store.read_delay = 10.0
        await anyio.sleep(TICK)  # 6: the read started at 5 and runs until 15
        assert len(store.reads) == 1
        job = store.add(("linux",), workspace=b)
        dispatcher.wake(b, ("linux",))
        with anyio.fail_after(0.5):
            await waiting.done.wait()
        assert waiting.job == job
        assert len(store.reads) == 1  # the read still running

    await _run(store, body)


async def test_a_failed_read_wakes_every_actor_to_claim_for_itself() -> None:
    """When the read fails, each actor claims as every tick did before it: a job whose
    notification was lost is still found, and while claims fail too the runners hear why."""
    store = FakeStore()
    a, b = uuid.uuid4(), uuid.uuid4()

    async def body(dispatcher: Dispatcher) -> None:
        idle, waiting = parked_in(a, "linux"), parked_in(b, "linux")
        dispatcher.park(idle)
        dispatcher.park(waiting)
        await anyio.sleep(1)
        store.claims.clear()
        store.read_failure = DatabaseUnavailable("the read timed out")
        job = store.add(("linux",), workspace=b)  # its NOTIFY is lost
        with anyio.fail_after(TICK):
            await waiting.done.wait()
        assert waiting.job == job
        assert len(store.claims) == 2  # both actors claimed, each for its own workspace
        store.failure = DatabaseUnavailable("the database is unreachable")
        with anyio.fail_after(TICK):
            await idle.done.wait()
        assert isinstance(idle.error, DatabaseUnavailable)

    await _run(store, body)


async def test_liveness_is_one_stamp_for_the_whole_replica_per_interval() -> None:
    store = FakeStore()
    workspaces = [uuid.uuid4() for _ in range(3)]
    parked = [parked_in(workspace, "linux") for workspace in workspaces for _ in range(2)]

    async def body(dispatcher: Dispatcher) -> None:
        for each in parked:
            dispatcher.park(each)
        await anyio.sleep(TOUCH * 3 + 1)
        assert len(store.touches) == 3  # one a replica and interval, not one a workspace
        ids = {each.session.runner_session_id for each in parked}
        assert all(set(batch) == ids for batch in store.touches)
        for each in parked:
            each.abandon()
        await anyio.sleep(TOUCH * 2)
        assert len(store.touches) == 3  # nobody parked: no stamp, and no read either
        reads = len(store.reads)
        await anyio.sleep(TICK * 2)
        assert len(store.reads) == reads

    await _run(store, body)
