"""Retention: deletes events and tombstones past their retention, `batch` rows per statement, each
statement its own transaction (`store/retention.py`; no lock beyond the rows deleted)."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Protocol

import asyncpg

from controlplane.actors.maintenance.job import drain
from controlplane.store import retention

log = logging.getLogger("controlplane.maintenance")


class RetentionStore(Protocol):
    async def prune_events(self, older_than: timedelta, limit: int) -> int: ...

    async def prune_tombstones(self, older_than: timedelta, limit: int) -> int:
        """Only tombstones whose execution has no lease left."""
        ...


class PoolRetentionStore:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def prune_events(self, older_than: timedelta, limit: int) -> int:
        async with self._pool.acquire() as conn:
            return await retention.prune_events(conn, older_than, limit)

    async def prune_tombstones(self, older_than: timedelta, limit: int) -> int:
        async with self._pool.acquire() as conn:
            return await retention.prune_tombstones(conn, older_than, limit)


class Retention:
    name = "retention"

    def __init__(
        self,
        store: RetentionStore,
        *,
        interval: float,
        events: timedelta,
        tombstones: timedelta,
        batch: int,
    ) -> None:
        self._store = store
        self.interval = interval
        self._events = events
        self._tombstones = tombstones
        self._batch = batch

    async def run_once(self) -> tuple[int, int]:
        """Delete events and tombstones past their retention; return how many of each."""
        events = await drain(
            lambda limit: self._store.prune_events(self._events, limit), self._batch
        )
        tombstones = await drain(
            lambda limit: self._store.prune_tombstones(self._tombstones, limit), self._batch
        )
        if events or tombstones:
            log.info("maintenance.pruned", extra={"events": events, "tombstones": tombstones})
        return (events, tombstones)
