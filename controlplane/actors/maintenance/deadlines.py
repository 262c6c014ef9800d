"""The execution deadlines (docs/policies.md, "The life of an execution"): leases past their run
timeout and its grace end as `timed_out`, pending executions past their queue timeout as
`queue_expired`, and the units of provisioned runners that ended with a timed-out lease are given
back (as the reaper does, spec 4.14).

Each batch is the store's (store/deadlines.py: try-locks and SKIP LOCKED only, so a late round
never holds up a claim or a completion); a round repeats batches of each until one comes back
short.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Protocol

import asyncpg

from controlplane import metrics
from controlplane.actors.maintenance.job import until_short
from controlplane.domain.jobs import EndedLease
from controlplane.store import deadlines, runner_release

log = logging.getLogger("controlplane.maintenance")


class DeadlineStore(Protocol):
    async def time_out(self, grace: timedelta, limit: int) -> tuple[list[EndedLease], int]:
        """End up to `limit` leases past their deadline and `grace`, then release the units
        their runners held if the runners are terminal; return the leases and the units."""
        ...

    async def expire_queued(self, limit: int) -> int:
        """Remove up to `limit` pending executions past their queue deadline; how many."""
        ...


class PoolDeadlineStore:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def time_out(self, grace: timedelta, limit: int) -> tuple[list[EndedLease], int]:
        async with self._pool.acquire() as conn:
            ended = await deadlines.time_out(conn, grace, limit=limit)
            released = await runner_release.release_after_leases(conn, ended)
        return ended, released

    async def expire_queued(self, limit: int) -> int:
        async with self._pool.acquire() as conn:
            return len(await deadlines.expire_queued(conn, limit=limit))


class Deadlines:
    name = "execution_deadlines"

    def __init__(
        self, store: DeadlineStore, *, grace: timedelta, interval: float, limit: int
    ) -> None:
        self._store = store
        self._grace = grace
        self.interval = interval
        self._limit = limit

    async def run_once(self) -> tuple[int, int]:
        """Time out leases, then expire queued executions, each until a batch is short; return
        how many of each."""
        timed_out = await until_short(self._time_out, self._limit)
        expired = await until_short(self._expire, self._limit)
        return timed_out, expired

    async def _time_out(self) -> tuple[int, int]:
        ended, released = await self._store.time_out(self._grace, self._limit)
        if released:
            metrics.units_released.labels("maintenance").inc(released)
        # A lease whose execution was cancelled while it drained ends as `cancelled`.
        newly = sum(1 for lease in ended if lease.newly_ended)
        if newly:
            metrics.jobs_timed_out.inc(newly)
            log.info("maintenance.leases_timed_out", extra={"count": newly})
        return len(ended), newly

    async def _expire(self) -> tuple[int, int]:
        count = await self._store.expire_queued(self._limit)
        if count:
            metrics.jobs_queue_expired.inc(count)
            log.info("maintenance.queue_expired", extra={"count": count})
        return count, count
