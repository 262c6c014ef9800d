"""Maintenance: the lease reaper, session garbage collection, retention and provisioning upkeep
(expired reservations, stale runner instances, spent runner credentials), led by one replica.

Every maintenance statement is safe when every replica runs it at once (the reaper try-locks each
execution, GC skips locked rows), so leadership only avoids waste. The leader holds a session
advisory lock (`locks.LEADER_KEY`) on a dedicated connection that never returns to a pool, because
asyncpg resets pooled connections with pg_advisory_unlock_all(). If that connection is lost, so is
the lock: we step down at once and try again on the next round.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta

import anyio
import asyncpg

from controlplane import metrics
from controlplane.domain.jobs import EndedLease, StaleRule
from controlplane.store import (
    ephemeral,
    fleet,
    leases,
    locks,
    reservation_cleanup,
    retention,
    runner_release,
    sessions,
)
from controlplane.store.pool import PoolSettings, connect

log = logging.getLogger("controlplane.maintenance")


class Leadership:
    """Holds, or keeps trying for, the leader lock on one dedicated connection."""

    def __init__(self, settings: PoolSettings) -> None:
        self._settings = settings
        self._conn: asyncpg.Connection | None = None
        self._leading = False
        self._guard = anyio.Lock()  # several maintenance loops ask at once

    @property
    def leading(self) -> bool:
        return self._leading and self._conn is not None and not self._conn.is_closed()

    async def try_lead(self) -> bool:
        """True while we hold the lock. Probes the connection; a lost one loses the lock."""
        async with self._guard:
            try:
                with anyio.fail_after(5):
                    if self._conn is None or self._conn.is_closed():
                        self._leading = False
                        self._conn = await connect(self._settings)
                    if self._leading:
                        await self._conn.execute("SELECT 1")
                    else:
                        self._leading = bool(
                            await self._conn.fetchval(
                                "SELECT pg_try_advisory_lock($1)", locks.LEADER_KEY
                            )
                        )
                        if self._leading:
                            log.info("maintenance.leading")
            except Exception as error:
                log.warning("maintenance.lead_failed", extra={"error": repr(error)})
                self.step_down()
            return self._leading

    def step_down(self) -> None:
        if self._conn is not None:
            self._conn.terminate()  # ends the session, which releases the lock
        self._conn = None
        self._leading = False


async def _every(seconds: float, leader: Leadership, work: Callable[[], Awaitable[None]]) -> None:
    while True:
        if await leader.try_lead():
            try:
                await work()
            except Exception as error:
                log.warning("maintenance.round_failed", extra={"error": repr(error)})
        await anyio.sleep(seconds)


@dataclass(frozen=True)
class Retention:
    events: timedelta
    tombstones: timedelta
    batch: int
    interval: float


@dataclass(frozen=True)
class Provisioning:
    """Expired reservations, stale runner instances, spent runner credentials."""

    interval: float
    stale_threshold: timedelta
    reaper_limit: int
    credential_retention: timedelta = timedelta(days=1)
    ephemeral_retention: timedelta = timedelta(days=7)
    batch: int = 1000


class Maintenance:
    def __init__(
        self,
        pool: asyncpg.Pool,
        leader: Leadership,
        *,
        rule: StaleRule,
        reaper_interval: float,
        reaper_limit: int,
        gc_interval: float,
        gc_limit: int,
        manual_retention: timedelta,
        capped_retention: timedelta,
        retention: Retention | None = None,
        provisioning: Provisioning | None = None,
        on_expired: Callable[[list[EndedLease]], None] = lambda _leases: None,
    ) -> None:
        self._pool = pool
        self._leader = leader
        self._rule = rule
        self._reaper_interval = reaper_interval
        self._reaper_limit = reaper_limit
        self._gc_interval = gc_interval
        self._gc_limit = gc_limit
        self._manual_retention = manual_retention
        self._capped_retention = capped_retention
        self._on_expired = on_expired
        self._retention = retention
        self._provisioning = provisioning
        self.expired_total = 0

    async def reap_once(self) -> int:
        """Expire stale leases until a round finds fewer than the limit; return how many."""
        total = 0
        while True:
            async with self._pool.acquire() as conn:
                expired = await leases.reap(conn, self._rule, limit=self._reaper_limit)
                # A provisioned runner whose lease expired may be gone: its unit, if it still
                # holds one, goes back once the runner is terminal (spec 4.14).
                released = await runner_release.release_after_leases(conn, expired)
            if released:
                metrics.units_released.labels("maintenance").inc(released)
            if expired:
                metrics.leases_expired.inc(len(expired))
                log.info("maintenance.leases_expired", extra={"count": len(expired)})
                self._on_expired(expired)
            total += len(expired)
            if len(expired) < self._reaper_limit:
                self.expired_total += total
                return total

    async def collect_sessions_once(self) -> int:
        async with self._pool.acquire() as conn:
            deleted = await sessions.collect_garbage(
                conn,
                manual_retention=self._manual_retention,
                capped_retention=self._capped_retention,
                limit=self._gc_limit,
            )
        if deleted:
            log.info("maintenance.sessions_deleted", extra={"count": deleted})
        return deleted

    async def prune_once(self) -> tuple[int, int]:
        """Delete events and tombstones past their retention; return how many of each."""
        plan = self._retention
        if plan is None:
            return (0, 0)
        events_deleted = tombstones_deleted = 0
        async with self._pool.acquire() as conn:
            while (n := await retention.prune_events(conn, plan.events, plan.batch)) > 0:
                events_deleted += n
                if n < plan.batch:
                    break
            while (n := await retention.prune_tombstones(conn, plan.tombstones, plan.batch)) > 0:
                tombstones_deleted += n
                if n < plan.batch:
                    break
        if events_deleted or tombstones_deleted:
            log.info(
                "maintenance.pruned",
                extra={"events": events_deleted, "tombstones": tombstones_deleted},
            )
        return (events_deleted, tombstones_deleted)

    async def provision_once(self) -> tuple[int, int, int]:
        """Delete expired reservations (unbinding unactivated runners), fail stale runner
        instances and release their units, prune spent runner credentials. Each step is its own
        transaction and safe on every replica at once. Returns (reservations, reaped, pruned)."""
        plan = self._provisioning
        if plan is None:
            return (0, 0, 0)
        expired = reaped = pruned = 0
        async with self._pool.acquire() as conn:
            while (
                n := await reservation_cleanup.delete_expired_reservations(conn, plan.batch)
            ) > 0:
                expired += n
                if n < plan.batch:
                    break
            reaped, released = await runner_release.reap_stale_runners(
                conn, threshold=plan.stale_threshold, limit=plan.reaper_limit
            )
            pruned = await retention.prune_runner_credentials(
                conn, plan.credential_retention, plan.batch
            )
            pruned += await ephemeral.prune_ephemeral_tokens(
                conn, plan.ephemeral_retention, plan.batch
            )
        metrics.runners_reaped.inc(reaped)
        metrics.units_released.labels("maintenance").inc(released)
        await self._count_phases(plan)
        if expired or reaped or pruned:
            log.info(
                "maintenance.provisioning",
                extra={
                    "reservations_expired": expired,
                    "runners_reaped": reaped,
                    "units_released": released,
                    "credentials_pruned": pruned,
                },
            )
        return (expired, reaped, pruned)

    async def _count_phases(self, plan: Provisioning) -> None:
        """Refresh the by-phase gauges; they stay exposed for three provisioning intervals."""
        try:
            async with self._pool.acquire() as conn:
                counts = await fleet.phase_counts(conn)
        except Exception as error:  # a metric must never fail the maintenance round
            log.warning("maintenance.phase_count_failed", extra={"error": repr(error)})
            return
        metrics.runner_phases.update(
            [
                (c.phase, metrics.provider_label(c.provider_kind), c.launch_kind, c.count,
                 c.oldest_age_seconds)
                for c in counts
            ],
            fresh_for=3 * plan.interval,
        )  # fmt: skip

    async def _provision(self) -> None:
        await self.provision_once()

    async def _prune(self) -> None:
        await self.prune_once()

    async def _reap(self) -> None:
        await self.reap_once()

    async def _collect(self) -> None:
        await self.collect_sessions_once()

    async def run(self) -> None:
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(_every, self._reaper_interval, self._leader, self._reap)
                group.start_soon(_every, self._gc_interval, self._leader, self._collect)
                if self._retention is not None:
                    group.start_soon(_every, self._retention.interval, self._leader, self._prune)
                if self._provisioning is not None:
                    interval = self._provisioning.interval
                    group.start_soon(_every, interval, self._leader, self._provision)
        finally:
            self._leader.step_down()
