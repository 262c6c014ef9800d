"""The lease reaper: expires leases whose runner stopped heartbeating (or puts them back in the
queue as their next attempt, when their job asked for retries and has some left: store/retries.py),
and gives back the unit of a provisioned runner that ended with its lease (spec 4.14).

Each batch is the store's: `leases.reap` (execution try-locks, then rows: see its docstring and
docs/concurrency.md), then `runner_release.release_after_leases`, one transaction per lease after
the reap committed. A round repeats batches until one comes back short.
"""

from __future__ import annotations

import logging
from typing import Protocol

import asyncpg

from controlplane import metrics
from controlplane.actors.maintenance.job import until_short
from controlplane.domain.jobs import EndedLease, StaleRule
from controlplane.store import leases, runner_release

log = logging.getLogger("controlplane.maintenance")


class ReaperStore(Protocol):
    async def reap(self, rule: StaleRule, limit: int) -> tuple[list[EndedLease], int]:
        """Expire up to `limit` stale leases, then release the units their runners held if the
        runners are terminal; return the expired leases and the units released."""
        ...


class PoolReaperStore:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def reap(self, rule: StaleRule, limit: int) -> tuple[list[EndedLease], int]:
        async with self._pool.acquire() as conn:
            expired = await leases.reap(conn, rule, limit=limit)
            released = await runner_release.release_after_leases(conn, expired)
        return expired, released


class LeaseReaper:
    name = "lease_reaper"

    def __init__(self, store: ReaperStore, *, rule: StaleRule, interval: float, limit: int) -> None:
        self._store = store
        self._rule = rule
        self.interval = interval
        self._limit = limit

    async def run_once(self) -> int:
        """Expire stale leases until a batch finds fewer than the limit; return how many."""
        return await until_short(self._batch, self._limit)

    async def _batch(self) -> tuple[int, int]:
        expired, released = await self._store.reap(self._rule, self._limit)
        if released:
            metrics.units_released.labels("maintenance").inc(released)
        retried = sum(1 for lease in expired if lease.retried)
        if retried:
            metrics.jobs_retried.inc(retried)
            log.info("maintenance.leases_retried", extra={"count": retried})
        if len(expired) > retried:
            metrics.leases_expired.inc(len(expired) - retried)
            log.info("maintenance.leases_expired", extra={"count": len(expired) - retried})
        return len(expired), len(expired)
