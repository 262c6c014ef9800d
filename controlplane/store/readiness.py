"""What /readyz and /metrics report about the database, read in one bounded go.

Takes no lock: it reads the migrations table and counts the queue.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import anyio
import asyncpg

from controlplane.store import migrations, queries

log = logging.getLogger("controlplane.health")


@dataclass(frozen=True, slots=True)
class DatabaseFacts:
    database: str  # "ok", or why not
    migrations: str  # "ok", "<n> pending" or "unknown"
    depth: queries.QueueDepth | None


async def read_facts(pool: asyncpg.Pool, *, deadline_seconds: float) -> DatabaseFacts:
    """The facts within `deadline_seconds`; a failure is a fact too (logged, never raised)."""
    try:
        with anyio.fail_after(deadline_seconds):
            async with pool.acquire() as conn:
                todo = await migrations.pending(conn)
                depth = await queries.depth(conn)
    except Exception as error:
        log.warning("health.database_unreachable", extra={"error": repr(error)})
        return DatabaseFacts(f"unreachable: {type(error).__name__}", "unknown", None)
    return DatabaseFacts("ok", "ok" if not todo else f"{len(todo)} pending", depth)
