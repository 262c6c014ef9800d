"""The maintenance leader: win the leader lock, run the jobs while holding it, stop them the moment
it is lost, and keep trying.

The lock is a session advisory lock on a dedicated connection (`store.locks.LeaderLock`), so
holding it means holding that connection. It is lost when the connection ends (noticed at once)
or when a probe, every `interval`, fails or outlives its deadline (a server that stopped
answering). Either way we end our session, so the server releases the lock for another replica,
and stop every job: none starts another round, and a round in flight is left to end by itself,
within the pool's deadlines, rather than cancelled. Finishing it is safe, since every
maintenance statement is its own transaction and safe on every replica at once; cancelling it
gains nothing and can interrupt asyncpg while it opens a pooled connection, which leaves a
future's exception unretrieved (a logged error in the daemon, a failure in a test).
Shutdown still cancels everything, rounds included.

Between tries, and after a loss, the leader waits `interval` (by default the shortest of the
jobs', the reaper's), so a replica takes over within about one interval of the leader's end.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import anyio

from controlplane.actors.maintenance.job import Job, every
from controlplane.retry import Backoff

log = logging.getLogger("controlplane.maintenance")


class LeaderLock(Protocol):
    async def acquire(self) -> bool:
        """Try the lock (never wait for it); True while we hold it."""
        ...

    async def probe(self) -> None:
        """A round trip on the lock's session; raises if it is gone."""
        ...

    async def wait_lost(self) -> None:
        """Return once the lock's session has ended."""
        ...

    def release(self) -> None:
        """End the session, and with it the lock."""
        ...


class Leadership:
    def __init__(
        self,
        lock: LeaderLock,
        jobs: Sequence[Job],
        *,
        interval: float | None = None,
        deadline: float = 5.0,
    ) -> None:
        """`interval` paces the tries and the probes: by default the shortest of the jobs', the
        pace at which, before this class, every job's round tried or probed the lock."""
        self._lock = lock
        self._jobs = list(jobs)
        self._interval = interval if interval is not None else min(j.interval for j in jobs)
        self._deadline = deadline  # for each try and each probe
        self.leading = False
        self.terms = 0  # how many times this replica won the lock

    async def run(self) -> None:
        retry = Backoff.constant(self._interval)
        try:
            while True:
                if await self._elect():
                    await self._lead()
                await anyio.sleep(retry.next())
        finally:
            self._step_down()

    async def _elect(self) -> bool:
        try:
            with anyio.fail_after(self._deadline):
                won = await self._lock.acquire()
        except Exception as error:
            self._failed(error)
            return False
        if won:
            self.leading = True
            self.terms += 1
            log.info("maintenance.leading")
        return won

    async def _lead(self) -> None:
        """Run every job until the lock is lost; return once each has stopped."""
        stop = anyio.Event()
        async with anyio.create_task_group() as jobs:
            for job in self._jobs:
                jobs.start_soon(every, job, stop, name=f"maintenance.{job.name}")
            await self._hold()
            stop.set()

    async def _hold(self) -> None:
        """Return once the lock is lost: its session ended, or a probe failed or hung."""
        while True:
            with anyio.move_on_after(self._interval):
                await self._lock.wait_lost()
                self._failed(ConnectionError("the leader lock's connection was lost"))
                return
            try:
                with anyio.fail_after(self._deadline):
                    await self._lock.probe()
            except Exception as error:
                self._failed(error)
                return

    def _failed(self, error: Exception) -> None:
        log.warning("maintenance.lead_failed", extra={"error": repr(error)})
        self._step_down()

    def _step_down(self) -> None:
        self._lock.release()
        self.leading = False
