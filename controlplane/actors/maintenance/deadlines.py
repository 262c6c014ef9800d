"""The execution deadlines (docs/policies.md, "The life of an execution"): leases past their run
timeout and its grace end as `timed_out`, pending executions past their queue timeout as
`queue_expired`, and the units of provisioned runners that ended with a timed-out lease are given
back (as the reaper does, spec 4.14).

Each batch is the store's (store/deadlines.py: try-locks and SKIP LOCKED only, so a late round
never holds up a claim or a completion); a round repeats batches of each until one comes back
short.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

from controlplane import metrics
from controlplane.actors.maintenance.job import OnStore, tally, units_released, until_short
from controlplane.domain.jobs import EndedLease
from controlplane.store import deadlines, runner_release
from controlplane.store.pool import PoolAdapter


class DeadlineStore(Protocol):
    async def time_out(self, grace: timedelta, limit: int) -> tuple[list[EndedLease], int]:
        """End up to `limit` leases past their deadline and `grace`, then release the units
        their runners held if the runners are terminal; return the leases and the units."""
        ...

    async def expire_queued(self, limit: int) -> int:
        """Remove up to `limit` pending executions past their queue deadline; how many."""
        ...


class PoolDeadlineStore(PoolAdapter):
    async def time_out(self, grace: timedelta, limit: int) -> tuple[list[EndedLease], int]:
        async with self._pool.acquire() as conn:
            ended = await deadlines.time_out(conn, grace, limit=limit)
            return await runner_release.with_units_released(conn, ended)

    async def expire_queued(self, limit: int) -> int:
        return len(await self._on_pool(deadlines.expire_queued, limit=limit))


@dataclass(frozen=True, slots=True, kw_only=True)
class Deadlines(OnStore[DeadlineStore]):
    name = "execution_deadlines"

    grace: timedelta
    limit: int

    async def run_once(self) -> tuple[int, int]:
        """Time out leases, then expire queued executions, each until a batch is short; return
        how many of each."""
        timed_out = await until_short(self._time_out, self.limit)
        expired = await until_short(self._expire, self.limit)
        return timed_out, expired

    async def _time_out(self) -> tuple[int, int]:
        ended, released = await self.store.time_out(self.grace, self.limit)
        units_released(released)
        # A lease whose execution was cancelled while it drained ends as `cancelled`.
        newly = sum(1 for lease in ended if lease.newly_ended)
        tally(newly, metrics.jobs_timed_out, "maintenance.leases_timed_out")
        return len(ended), newly

    async def _expire(self) -> tuple[int, int]:
        count = await self.store.expire_queued(self.limit)
        tally(count, metrics.jobs_queue_expired, "maintenance.queue_expired")
        return count, count
