"""Session cleanup: deletes manual and capped runner sessions past their retention that no lease
refers to (`sessions.collect_garbage`: session rows `FOR UPDATE SKIP LOCKED`, then delete)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

from controlplane.actors.maintenance.job import OnStore
from controlplane.store import sessions
from controlplane.store.pool import PoolAdapter

log = logging.getLogger("controlplane.maintenance")


class SessionStore(Protocol):
    async def collect_garbage(
        self, *, manual_retention: timedelta, capped_retention: timedelta, limit: int
    ) -> int:
        """Delete up to `limit` old sessions no lease refers to; return how many."""
        ...


class PoolSessionStore(PoolAdapter):
    async def collect_garbage(
        self, *, manual_retention: timedelta, capped_retention: timedelta, limit: int
    ) -> int:
        return await self._on_pool(
            sessions.collect_garbage,
            manual_retention=manual_retention,
            capped_retention=capped_retention,
            limit=limit,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionCleanup(OnStore[SessionStore]):
    name = "session_gc"

    limit: int
    manual_retention: timedelta
    capped_retention: timedelta

    async def run_once(self) -> int:
        deleted = await self.store.collect_garbage(
            manual_retention=self.manual_retention,
            capped_retention=self.capped_retention,
            limit=self.limit,
        )
        if deleted:
            log.info("maintenance.sessions_deleted", extra={"count": deleted})
        return deleted
