"""Workspace actors retire when nobody is parked with them, and come back on demand, losing no
wake-up (actors/dispatch.py, "Retirement"); with the fake store of test_dispatch.py on trio's
mock clock. The window between an actor's decision to retire and its removal is forced open
with the dispatcher's `on_retire` hook, which runs in that very step."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from uuid import UUID

import anyio
import pytest

from controlplane.actors.dispatch import Dispatcher
from controlplane.actors.waiters import WaiterState
from tests.actors.test_dispatch import WORKSPACE, FakeStore, anyio_backend, waiter

__all__ = ["anyio_backend"]  # the mock-clock backend fixture, used by every test here

IDLE = 2.0
TICK = 5.0


class Retirements:
    """What `on_retire` saw: the workspace, the mock time, and whatever the test does then."""

    def __init__(self) -> None:
        self.at: list[tuple[UUID, float]] = []
        self.retired = anyio.Event()
        self.then: Callable[[], None] | None = None

    def __call__(self, workspace_id: UUID) -> None:
        self.at.append((workspace_id, anyio.current_time()))
        self.retired.set()
        if self.then is not None:
            then, self.then = self.then, None
            then()


async def _run(
    store: FakeStore,
    body: Callable[[Dispatcher, Retirements], Awaitable[None]],
    idle: float = IDLE,
) -> None:
    retirements = Retirements()
    dispatcher = Dispatcher(store, tick_seconds=TICK, idle_seconds=idle, on_retire=retirements)
    async with anyio.create_task_group() as group:
        await group.start(dispatcher.run)
        await body(dispatcher, retirements)
        group.cancel_scope.cancel()


@pytest.mark.parametrize("idle", [0.0, IDLE])
async def test_an_actor_retires_its_idle_time_after_its_last_waiter_left_despite_wake_ups(
    idle: float,
) -> None:
    """Runners that went away mid long-poll leave at once (`parked` is exact), and wake-ups
    for the workspace (every replica hears every enqueue) neither run a claim with nobody to
    claim for nor put the retirement off."""
    store = FakeStore()

    async def body(dispatcher: Dispatcher, retirements: Retirements) -> None:
        parked = [waiter("linux") for _ in range(3)]
        for each in parked:
            dispatcher.park(each)
        await anyio.sleep(1)  # tried once, nothing queued: parked
        assert (dispatcher.actors, dispatcher.parked) == (1, 3)
        claims = len(store.claims)
        for each in parked:
            assert each.abandon()  # the runners disconnect
        left_at = anyio.current_time()
        assert dispatcher.parked == 0

        async def notifications() -> None:
            while True:
                dispatcher.wake(WORKSPACE, ("linux",))
                await anyio.sleep(idle / 4 or 0.001)

        async with anyio.create_task_group() as group:
            group.start_soon(notifications)
            with anyio.fail_after(TICK + 60):
                await retirements.retired.wait()
            group.cancel_scope.cancel()
        [(workspace, at)] = retirements.at
        assert workspace == WORKSPACE
        assert at - left_at == pytest.approx(idle, abs=0.01)
        assert dispatcher.actors == 0
        assert len(store.claims) == claims

    await _run(store, body, idle)


@pytest.mark.parametrize("waiter_arrives", ["in the retiring step", "later"])
async def test_a_job_announced_in_the_step_an_actor_retires_reaches_the_next_waiter(
    waiter_arrives: str,
) -> None:
    """The retiring actor had found `linux` empty. In the step it is forgotten, a `linux` job
    commits and its NOTIFY arrives (dropped: no actor), and a waiter parks then or later: a new
    actor starts, knows nothing empty, and its first claim finds the job."""
    store = FakeStore()

    async def body(dispatcher: Dispatcher, retirements: Retirements) -> None:
        first = waiter("linux")
        dispatcher.park(first)
        await anyio.sleep(1)
        assert store.claims == [("linux",)]  # found nothing: `linux` is cached empty
        first.abandon()
        late = waiter("linux")
        job = store.add(("linux",))
        store.jobs.clear()  # committed only in the retiring step, below

        def in_the_retiring_step() -> None:
            store.jobs.append((("linux",), job))
            dispatcher.wake(WORKSPACE, ("linux",))
            if waiter_arrives == "in the retiring step":
                dispatcher.park(late)

        retirements.then = in_the_retiring_step
        with anyio.fail_after(IDLE + 1):
            await retirements.retired.wait()
        if waiter_arrives == "later":
            assert dispatcher.actors == 0
            await anyio.sleep(30)  # well past the safety tick an actor would have had
            dispatcher.park(late)
        assert dispatcher.actors == 1
        with anyio.fail_after(1):  # within its first claim, not at a safety tick
            await late.done.wait()
        assert late.job is job
        assert store.claims == [("linux",), ("linux",)]

    await _run(store, body)


async def test_a_wake_while_nobody_is_parked_forgets_empty_labels_so_the_next_waiter_is_tried() -> (
    None
):
    """Between the last waiter leaving and the retirement, a wake-up runs no claim but still
    forgets the empty label sets it covers: a runner parking next is tried at once, not left
    to the safety tick as "known empty"."""
    store = FakeStore()

    async def body(dispatcher: Dispatcher, retirements: Retirements) -> None:
        first = waiter("linux", "x64")
        dispatcher.park(first)
        await anyio.sleep(0.5)
        first.abandon()
        job = store.add(("linux",))
        dispatcher.wake(WORKSPACE, ("linux",))
        await anyio.sleep(0.5)
        assert store.claims == [("linux", "x64")]  # nobody to claim for
        assert dispatcher.actors == 1 and not retirements.at  # still within its idle time
        second = waiter("linux", "x64")
        dispatcher.park(second)
        with anyio.fail_after(1):  # the safety tick is 5 s away
            await second.done.wait()
        assert second.job is job
        assert second.state is WaiterState.DELIVERED

    await _run(store, body)
