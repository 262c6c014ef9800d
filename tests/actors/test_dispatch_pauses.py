"""The dispatcher's side of a runner pause (actors/dispatch.py), with the fake store of
test_dispatch.py on trio's mock clock: the database refuses paused sessions itself (tested in
tests/store/test_pauses.py); here, who is answered "paused" and when."""

from __future__ import annotations

import anyio

from controlplane.actors.dispatch import Dispatcher
from controlplane.actors.waiters import WaiterState
from controlplane.errors import RunnerPaused
from tests.actors.test_dispatch import WORKSPACE, FakeStore, _run, anyio_backend, waiter

__all__ = ["anyio_backend"]  # the mock-clock backend fixture, used by every test here


async def test_a_pause_answers_the_sessions_parked_waiters_and_its_later_requests_at_once() -> None:
    store = FakeStore()

    async def body(dispatcher: Dispatcher) -> None:
        paused, other = waiter("linux"), waiter("linux")
        dispatcher.park(paused)
        dispatcher.park(other)
        await anyio.sleep(1)  # both tried, nothing queued: parked
        session = paused.session.runner_session_id
        dispatcher.runner_paused(WORKSPACE, session, True)
        assert paused.state is WaiterState.FAILED and isinstance(paused.error, RunnerPaused)
        assert other.state is WaiterState.WAITING

        again = waiter("linux")
        again.session = paused.session
        claims = len(store.claims)
        dispatcher.park(again)  # answered without parking, without a claim
        assert isinstance(again.error, RunnerPaused)
        assert len(store.claims) == claims

        job = store.add(("linux",))
        dispatcher.wake(WORKSPACE, ("linux",))
        with anyio.fail_after(3):
            await other.done.wait()
        assert other.job is job

        dispatcher.runner_paused(WORKSPACE, session, False)
        resumed = waiter("linux")
        resumed.session = paused.session
        dispatcher.park(resumed)
        second = store.add(("linux",))
        dispatcher.wake(WORKSPACE, ("linux",))
        with anyio.fail_after(3):
            await resumed.done.wait()
        assert resumed.job is second

    await _run(store, body)


async def test_a_listener_reconnect_forgets_pauses_so_no_runner_is_held_paused_wrongly() -> None:
    store = FakeStore()

    async def body(dispatcher: Dispatcher) -> None:
        first = waiter("linux")
        dispatcher.runner_paused(WORKSPACE, first.session.runner_session_id, True)
        assert dispatcher.paused.holds(first.session.runner_session_id)
        dispatcher.paused.forget()
        assert not dispatcher.paused.holds(first.session.runner_session_id)
        dispatcher.park(first)  # parks: the claim path alone now keeps it from a job
        await anyio.sleep(1)
        assert first.state is WaiterState.WAITING

    await _run(store, body)
