"""Retention: deletes events and tombstones past their retention, `batch` rows per statement, each
statement its own transaction (`store/retention.py`; no lock beyond the rows deleted)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

from controlplane.actors.maintenance.job import OnStore, drain
from controlplane.store import retention
from controlplane.store.pool import PoolAdapter

log = logging.getLogger("controlplane.maintenance")


class RetentionStore(Protocol):
    async def prune_events(self, older_than: timedelta, limit: int) -> int: ...

    async def prune_tombstones(self, older_than: timedelta, limit: int) -> int:
        """Only tombstones whose execution has no lease left."""
        ...


class PoolRetentionStore(PoolAdapter):
    async def prune_events(self, older_than: timedelta, limit: int) -> int:
        return await self._on_pool(retention.prune_events, older_than, limit)

    async def prune_tombstones(self, older_than: timedelta, limit: int) -> int:
        return await self._on_pool(retention.prune_tombstones, older_than, limit)


@dataclass(frozen=True, slots=True, kw_only=True)
class Retention(OnStore[RetentionStore]):
    name = "retention"

    events: timedelta
    tombstones: timedelta
    batch: int

    async def run_once(self) -> tuple[int, int]:
        """Delete events and tombstones past their retention; return how many of each."""
        events = await drain(lambda limit: self.store.prune_events(self.events, limit), self.batch)
        tombstones = await drain(
            lambda limit: self.store.prune_tombstones(self.tombstones, limit), self.batch
        )
        if events or tombstones:
            log.info("maintenance.pruned", extra={"events": events, "tombstones": tombstones})
        return (events, tombstones)
