"""Provisioning upkeep, every `maintenance.provisioning_interval_seconds`.

A round has three parts, each with its own error handling, so a failure in one skips only that
part:

1. upkeep: delete expired reservations (unbinding runners that never activated;
   `reservation_cleanup.delete_expired_reservations`), fail stale runner instances and release
   their units (`runner_release.reap_stale_runners`), prune spent bootstrap tokens, control
   sessions and activation tokens (`retention.prune_runner_credentials`), in that order;
2. ephemeral-token GC (`ephemeral.prune_ephemeral_tokens`), which also prunes the rate-limiter
   rows that go with the tokens (a failure counts `controlplane_rate_limit_prune_failures_total`);
3. the runner-phase gauges (`fleet.phase_counts`) and, apart from them, the gauge of enrolled
   runners without a recent report (`lifecycle.enrolled_without_recent_report`), each exposed for
   three intervals; either count failing leaves the other.

Each statement is its own transaction, with the locks its store docstring names, and safe on
every replica at once.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol, TypeVar

from controlplane import metrics
from controlplane.actors.maintenance.job import OnStore, drain
from controlplane.store import (
    ephemeral,
    fleet,
    lifecycle,
    reservation_cleanup,
    retention,
    runner_release,
)
from controlplane.store.fleet import PhaseCount
from controlplane.store.pool import PoolAdapter

log = logging.getLogger("controlplane.maintenance")

T = TypeVar("T")


class UpkeepStore(Protocol):
    async def delete_expired_reservations(self, limit: int) -> int: ...

    async def reap_stale_runners(self, threshold: timedelta, limit: int) -> tuple[int, int]:
        """Fail up to `limit` stale runners and release their units: (reaped, released)."""
        ...

    async def prune_runner_credentials(self, older_than: timedelta, limit: int) -> int: ...

    async def prune_ephemeral_tokens(self, older_than: timedelta, limit: int) -> int: ...

    async def phase_counts(self) -> list[PhaseCount]: ...

    async def enrolled_without_recent_report(self, stale_after: timedelta) -> int: ...


class PoolUpkeepStore(PoolAdapter):
    async def delete_expired_reservations(self, limit: int) -> int:
        return await self._on_pool(reservation_cleanup.delete_expired_reservations, limit)

    async def reap_stale_runners(self, threshold: timedelta, limit: int) -> tuple[int, int]:
        return await self._on_pool(
            runner_release.reap_stale_runners, threshold=threshold, limit=limit
        )

    async def prune_runner_credentials(self, older_than: timedelta, limit: int) -> int:
        return await self._on_pool(retention.prune_runner_credentials, older_than, limit)

    async def prune_ephemeral_tokens(self, older_than: timedelta, limit: int) -> int:
        return await self._on_pool(ephemeral.prune_ephemeral_tokens, older_than, limit)

    async def phase_counts(self) -> list[PhaseCount]:
        return await self._on_pool(fleet.phase_counts)

    async def enrolled_without_recent_report(self, stale_after: timedelta) -> int:
        return await self._on_pool(lifecycle.enrolled_without_recent_report, stale_after)


@dataclass(frozen=True, slots=True, kw_only=True)
class ProvisioningUpkeep(OnStore[UpkeepStore]):
    name = "provisioning"

    stale_threshold: timedelta
    reaper_limit: int
    credential_retention: timedelta = timedelta(days=1)
    ephemeral_retention: timedelta = timedelta(days=7)
    batch: int = 1000

    async def run_once(self) -> tuple[int, int, int]:
        """One round; returns (reservations expired, runners reaped, credentials pruned), where
        a part that failed counts nothing."""
        upkeep = await _guarded("provisioning", self._upkeep)
        tokens = await _guarded("ephemeral_gc", self._prune_ephemeral)
        if tokens is None:
            metrics.rate_limit_prune_failures.inc()
        await self._count_phases()
        await self._count_enrolled_without_report()
        expired, reaped, released, pruned = upkeep or (0, 0, 0, 0)
        pruned += tokens or 0
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

    async def _upkeep(self) -> tuple[int, int, int, int]:
        store = self.store
        expired = await drain(store.delete_expired_reservations, self.batch)
        reaped, released = await store.reap_stale_runners(self.stale_threshold, self.reaper_limit)
        metrics.runners_reaped.inc(reaped)
        metrics.units_released.labels("maintenance").inc(released)
        pruned = await store.prune_runner_credentials(self.credential_retention, self.batch)
        return (expired, reaped, released, pruned)

    async def _prune_ephemeral(self) -> int:
        return await self.store.prune_ephemeral_tokens(self.ephemeral_retention, self.batch)

    async def _count_phases(self) -> None:
        """Refresh the by-phase gauges; they stay exposed for three provisioning intervals."""
        try:
            counts = await self.store.phase_counts()
        except Exception as error:  # a metric must never fail the maintenance round
            log.warning("maintenance.phase_count_failed", extra={"error": repr(error)})
            return
        metrics.runner_phases.update(
            [
                (c.phase, metrics.provider_label(c.provider_kind), c.launch_kind, c.count,
                 c.oldest_age_seconds)
                for c in counts
            ],
            fresh_for=3 * self.interval,
        )  # fmt: skip

    async def _count_enrolled_without_report(self) -> None:
        """Refresh the enrolled-without-recent-report gauge, apart from the phase gauges."""
        try:
            quiet = await self.store.enrolled_without_recent_report(self.stale_threshold)
        except Exception as error:  # a metric must never fail the maintenance round
            log.warning("maintenance.enrolled_count_failed", extra={"error": repr(error)})
            return
        metrics.enrolled_without_recent_report.update(quiet, fresh_for=3 * self.interval)


async def _guarded(part: str, work: Callable[[], Awaitable[T]]) -> T | None:
    """`work()`, or None when it failed (logged as the round of `part` failing)."""
    try:
        return await work()
    except Exception as error:
        log.warning("maintenance.round_failed", extra={"job": part, "error": repr(error)})
        return None
