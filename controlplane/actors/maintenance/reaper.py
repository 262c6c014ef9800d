"""The lease reaper: expires leases whose runner stopped heartbeating (or puts them back in the
queue as their next attempt, when their job asked for retries and has some left: store/retries.py),
and gives back the unit of a provisioned runner that ended with its lease (spec 4.14).

Each batch is the store's: `leases.reap` (execution try-locks, then rows: see its docstring and
docs/concurrency.md), then `runner_release.release_after_leases`, one transaction per lease after
the reap committed. A round repeats batches until one comes back short.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from controlplane import metrics
from controlplane.actors.maintenance.job import OnStore, tally, units_released, until_short
from controlplane.domain.jobs import EndedLease, StaleRule
from controlplane.store import leases, runner_release
from controlplane.store.pool import PoolAdapter


class ReaperStore(Protocol):
    async def reap(self, rule: StaleRule, limit: int) -> tuple[list[EndedLease], int]:
        """Expire up to `limit` stale leases, then release the units their runners held if the
        runners are terminal; return the expired leases and the units released."""
        ...


class PoolReaperStore(PoolAdapter):
    async def reap(self, rule: StaleRule, limit: int) -> tuple[list[EndedLease], int]:
        async with self._pool.acquire() as conn:
            expired = await leases.reap(conn, rule, limit=limit)
            return await runner_release.with_units_released(conn, expired)


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseReaper(OnStore[ReaperStore]):
    name = "lease_reaper"

    rule: StaleRule
    limit: int

    async def run_once(self) -> int:
        """Expire stale leases until a batch finds fewer than the limit; return how many."""
        return await until_short(self._batch, self.limit)

    async def _batch(self) -> tuple[int, int]:
        expired, released = await self.store.reap(self.rule, self.limit)
        units_released(released)
        retried = sum(1 for lease in expired if lease.retried)
        tally(retried, metrics.jobs_retried, "maintenance.leases_retried")
        tally(len(expired) - retried, metrics.leases_expired, "maintenance.leases_expired")
        return len(expired), len(expired)
