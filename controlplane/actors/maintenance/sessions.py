"""Session cleanup: deletes manual and capped runner sessions past their retention that no lease
refers to (`sessions.collect_garbage`: session rows `FOR UPDATE SKIP LOCKED`, then delete)."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Protocol

import asyncpg

from controlplane.store import sessions

log = logging.getLogger("controlplane.maintenance")


class SessionStore(Protocol):
    async def collect_garbage(
        self, *, manual_retention: timedelta, capped_retention: timedelta, limit: int
    ) -> int:
        """Delete up to `limit` old sessions no lease refers to; return how many."""
        ...


class PoolSessionStore:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def collect_garbage(
        self, *, manual_retention: timedelta, capped_retention: timedelta, limit: int
    ) -> int:
        async with self._pool.acquire() as conn:
            return await sessions.collect_garbage(
                conn,
                manual_retention=manual_retention,
                capped_retention=capped_retention,
                limit=limit,
            )


class SessionCleanup:
    name = "session_gc"

    def __init__(
        self,
        store: SessionStore,
        *,
        interval: float,
        limit: int,
        manual_retention: timedelta,
        capped_retention: timedelta,
    ) -> None:
        self._store = store
        self.interval = interval
        self._limit = limit
        self._manual = manual_retention
        self._capped = capped_retention

    async def run_once(self) -> int:
        deleted = await self._store.collect_garbage(
            manual_retention=self._manual, capped_retention=self._capped, limit=self._limit
        )
        if deleted:
            log.info("maintenance.sessions_deleted", extra={"count": deleted})
        return deleted
