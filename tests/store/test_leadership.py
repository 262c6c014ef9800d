"""The leader lock on real PostgreSQL, and the leader running its jobs while it holds it."""

from __future__ import annotations

import anyio
import asyncpg

from controlplane.actors.maintenance.leadership import Leadership
from controlplane.store.locks import LeaderLock
from controlplane.store.pool import PoolSettings


async def test_one_leader_at_a_time_and_the_lock_passes_on_when_it_steps_down(
    database_url: str,
) -> None:
    first = LeaderLock(PoolSettings(url=database_url))
    second = LeaderLock(PoolSettings(url=database_url))
    try:
        assert await first.acquire()
        assert not await second.acquire()
        assert await first.acquire()  # still leading: asking again only probes
        await first.probe()
        assert not await second.acquire()  # retried on its kept connection
        first.release()  # its session ends, which releases the lock
        with anyio.fail_after(10):  # the server ends that session asynchronously
            while not await second.acquire():
                await anyio.sleep(0.01)
        assert not await first.acquire()
    finally:
        first.release()
        second.release()


class Rounds:
    """A job that counts its rounds and says when one starts."""

    name = "rounds"
    interval = 0.01

    def __init__(self) -> None:
        self.count = 0
        self.started = anyio.Event()

    async def run_once(self) -> None:
        self.count += 1
        self.started.set()


async def _backend_pid(database_url: str) -> int:
    """The backend that holds the leader lock (there is one leader: ours)."""
    conn = await asyncpg.connect(database_url)
    try:
        pid: int = await conn.fetchval(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
        return pid
    finally:
        await conn.close()


async def test_the_leader_stops_its_jobs_when_its_session_is_killed_and_leads_again(
    database_url: str,
) -> None:
    """pg_terminate_backend ends the lock's session, as a server restart would: the leader
    notices the lost connection, cancels its jobs, and wins the lock again on a new session."""
    lock = LeaderLock(PoolSettings(url=database_url))
    job = Rounds()
    leadership = Leadership(lock, [job], interval=0.05)
    async with anyio.create_task_group() as group:
        group.start_soon(leadership.run)
        with anyio.fail_after(10):
            await job.started.wait()
        assert leadership.terms == 1
        pid = await _backend_pid(database_url)
        killer = await asyncpg.connect(database_url)
        try:
            assert await killer.fetchval("SELECT pg_terminate_backend($1)", pid)
        finally:
            await killer.close()
        with anyio.fail_after(10):
            while leadership.terms < 2:
                await anyio.sleep(0.01)
        assert await _backend_pid(database_url) != pid
        job.started = anyio.Event()
        with anyio.fail_after(10):
            await job.started.wait()  # the jobs run again under the new term
        group.cancel_scope.cancel()
    assert not leadership.leading
