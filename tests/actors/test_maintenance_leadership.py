"""The maintenance leader with a fake lock, on trio with a mock clock: jobs run only while the lock
is held, stop the moment it is lost, and one job's failures never stop another."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import anyio
import pytest
import trio.testing

from controlplane.actors.maintenance.leadership import Leadership
from controlplane.actors.maintenance.reaper import LeaseReaper
from controlplane.actors.maintenance.sessions import SessionCleanup
from controlplane.domain.jobs import EndedLease, StaleRule


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})


class FakeLock:
    """The leader lock of one replica; `rival` says whether another replica holds it."""

    def __init__(self) -> None:
        self.rival = False
        self.held = False
        self.tries: list[float] = []
        self.releases = 0
        self.acquire_errors = 0  # the next tries fail: the database is unreachable
        self.probe_error: Exception | None = None  # the next probe raises this
        self.probe_hangs = False  # the next probe never answers
        self._lost = anyio.Event()

    async def acquire(self) -> bool:
        self.tries.append(anyio.current_time())
        if self.acquire_errors:
            self.acquire_errors -= 1
            raise ConnectionRefusedError("no database")
        if not self.held and not self.rival:
            self.held = True
            self._lost = anyio.Event()
        return self.held

    async def probe(self) -> None:
        if self.probe_hangs:
            self.probe_hangs = False
            await anyio.sleep_forever()
        if self.probe_error is not None:
            error, self.probe_error = self.probe_error, None
            raise error

    async def wait_lost(self) -> None:
        await self._lost.wait()

    def release(self) -> None:
        self.releases += 1
        self.held = False

    def lose(self) -> None:
        """The lock's connection ends (a server restart): the lock goes with it."""
        self.held = False
        self._lost.set()


class FakeReaperStore:
    def __init__(self) -> None:
        self.reaps: list[float] = []

    async def reap(self, rule: StaleRule, limit: int) -> tuple[list[EndedLease], int]:
        self.reaps.append(anyio.current_time())
        return [], 0


class Rounds:
    """A job recording when its rounds start and end; each takes `takes` seconds."""

    def __init__(self, name: str, interval: float, *, takes: float = 0) -> None:
        self.name = name
        self.interval = interval
        self.takes = takes
        self.rounds: list[float] = []
        self.ends: list[float] = []

    async def run_once(self) -> None:
        self.rounds.append(anyio.current_time())
        await anyio.sleep(self.takes)
        self.ends.append(anyio.current_time())


def _since(start: float, times: list[float]) -> list[float]:
    return [round(t - start, 6) for t in times]


async def _leading(leadership: Leadership, body: Callable[[float], Awaitable[None]]) -> None:
    async with anyio.create_task_group() as group:
        start = anyio.current_time()
        group.start_soon(leadership.run)
        await body(start)
        group.cancel_scope.cancel()


async def test_the_reaper_runs_every_interval_while_leading_and_stops_when_the_lock_is_lost() -> (
    None
):
    lock, store = FakeLock(), FakeReaperStore()
    reaper = LeaseReaper(store, rule=StaleRule(), interval=5, limit=100)
    leadership = Leadership(lock, [reaper])

    async def body(start: float) -> None:
        await anyio.sleep(12)
        assert _since(start, store.reaps) == [0, 5, 10]
        assert leadership.leading
        lock.rival = True  # another replica wins the lock while ours is gone
        lock.lose()
        await anyio.sleep(12)  # t=24: tries at 17 and 22 lost to the rival
        assert _since(start, store.reaps) == [0, 5, 10]
        assert not leadership.leading
        assert _since(start, lock.tries) == [0, 17, 22]
        lock.rival = False
        await anyio.sleep(6)  # t=30
        assert _since(start, store.reaps) == [0, 5, 10, 27]
        assert leadership.terms == 2

    await _leading(leadership, body)
    assert lock.releases >= 2  # on the loss, and on the way out
    assert not lock.held


async def test_nothing_runs_while_another_replica_leads() -> None:
    lock, job = FakeLock(), Rounds("job", 5)
    lock.rival = True
    leadership = Leadership(lock, [job], interval=3)

    async def body(start: float) -> None:
        await anyio.sleep(10)
        assert job.rounds == [] and not leadership.leading
        assert _since(start, lock.tries) == [0, 3, 6, 9]
        lock.rival = False
        await anyio.sleep(3)  # t=13
        assert _since(start, job.rounds) == [12]

    await _leading(leadership, body)


@pytest.mark.parametrize(
    ("probe", "next_term"),
    [("fails", 16), ("hangs", 18)],
    ids=["a-failed-probe", "a-probe-past-its-deadline"],
)
async def test_a_probe_that_fails_or_hangs_ends_the_term_and_stops_the_jobs(
    probe: str, next_term: float, caplog: pytest.LogCaptureFixture
) -> None:
    """Probes every 4 s (t=4, 8, 12) with a 2 s deadline; the one at t=12 fails at once or at
    t=14. The jobs stop at once, and the leader tries again an interval later."""
    lock, job = FakeLock(), Rounds("job", 5)
    leadership = Leadership(lock, [job], interval=4, deadline=2)

    async def body(start: float) -> None:
        await anyio.sleep(11)
        if probe == "fails":
            lock.probe_error = ConnectionResetError("gone")
        else:
            lock.probe_hangs = True
        await anyio.sleep(next_term - 11 - 1)  # one second before the next term
        assert _since(start, job.rounds) == [0, 5, 10]
        assert not leadership.leading and lock.releases == 1
        await anyio.sleep(2)
        assert _since(start, job.rounds) == [0, 5, 10, next_term]

    with caplog.at_level(logging.WARNING, logger="controlplane.maintenance"):
        await _leading(leadership, body)
    failed = [r for r in caplog.records if r.getMessage() == "maintenance.lead_failed"]
    assert len(failed) == 1
    assert ("gone" if probe == "fails" else "TimeoutError") in failed[0].__dict__["error"]


async def test_a_round_in_flight_when_the_lock_is_lost_ends_by_itself_and_none_follows() -> None:
    """Rounds take 3 s, every 5 s after the last ended: t=0-3, 8-11. The lock is lost at t=9:
    the round in flight finishes at t=11, no round starts after it, and only then does the
    leader wait its interval (4 s) and try again (t=15)."""
    lock, job = FakeLock(), Rounds("job", 5, takes=3)
    leadership = Leadership(lock, [job], interval=4)

    async def body(start: float) -> None:
        await anyio.sleep(9)
        lock.rival = True
        lock.lose()
        await anyio.sleep(9)  # t=18, between the tries at 15 and 19
        assert _since(start, job.rounds) == [0, 8]
        assert _since(start, job.ends) == [3, 11]
        assert _since(start, lock.tries) == [0, 15]
        assert not leadership.leading

    await _leading(leadership, body)


async def test_a_database_that_refuses_connections_is_tried_again_every_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lock, job = FakeLock(), Rounds("job", 5)
    lock.acquire_errors = 2
    leadership = Leadership(lock, [job])

    async def body(start: float) -> None:
        await anyio.sleep(12)
        assert _since(start, lock.tries) == [0, 5, 10]
        assert _since(start, job.rounds) == [10]

    with caplog.at_level(logging.WARNING, logger="controlplane.maintenance"):
        await _leading(leadership, body)
    assert [r.getMessage() for r in caplog.records].count("maintenance.lead_failed") == 2


class BrokenSessions:
    async def collect_garbage(
        self, *, manual_retention: timedelta, capped_retention: timedelta, limit: int
    ) -> int:
        raise ConnectionResetError("session GC lost its connection")


async def test_j132_a_failing_session_gc_is_logged_and_the_reaper_still_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each job keeps its own loop: session GC failing every round (logged each time) neither
    stops the reaper nor changes either one's pace."""
    lock, reaps = FakeLock(), FakeReaperStore()
    reaper = LeaseReaper(reaps, rule=StaleRule(), interval=3, limit=100)
    gc = SessionCleanup(
        BrokenSessions(),
        interval=5,
        limit=1000,
        manual_retention=timedelta(days=1),
        capped_retention=timedelta(days=7),
    )
    leadership = Leadership(lock, [gc, reaper])

    async def body(start: float) -> None:
        await anyio.sleep(11)
        assert _since(start, reaps.reaps) == [0, 3, 6, 9]
        assert leadership.leading and leadership.terms == 1

    with caplog.at_level(logging.WARNING, logger="controlplane.maintenance"):
        await _leading(leadership, body)
    failures = [r for r in caplog.records if r.getMessage() == "maintenance.round_failed"]
    assert [r.__dict__["job"] for r in failures] == ["session_gc"] * 3  # t=0, 5, 10


async def test_leaving_releases_the_lock() -> None:
    lock, job = FakeLock(), Rounds("job", 5)
    leadership = Leadership(lock, [job])

    async def body(_start: float) -> None:
        await anyio.sleep(1)
        assert lock.held

    await _leading(leadership, body)
    assert not lock.held and not leadership.leading
