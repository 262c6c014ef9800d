"""The asyncpg pool, with the settings every connection carries, and error translation.

Every connection gets a statement timeout (so a lock wait can never hang a request forever) and
an application name. Failing to connect becomes `Unavailable`; faults on a live connection
(lost connection, timeouts) reach the web layer, which answers them with 503 (web/errors.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from controlplane.errors import Unavailable

log = logging.getLogger("controlplane.pool")

Pool = asyncpg.Pool
# A store function runs on a dedicated connection or on one borrowed from the pool.
Conn = asyncpg.Connection | PoolConnectionProxy


@dataclass(frozen=True)
class PoolSettings:
    url: str
    min_size: int = 2
    max_size: int = 20
    statement_timeout_ms: int = 10_000
    lock_timeout_ms: int = 5_000
    application_name: str = "controlplane"


def server_settings(settings: PoolSettings) -> dict[str, str]:
    return {
        "statement_timeout": str(settings.statement_timeout_ms),
        "lock_timeout": str(settings.lock_timeout_ms),
        "application_name": settings.application_name,
        "timezone": "UTC",
    }


async def _no_session_state(_conn: asyncpg.Connection) -> None:
    """Release without asyncpg's reset round trip (unlock all, UNLISTEN, RESET ALL).

    asyncpg still rolls back an open transaction and drops listeners before calling this. The
    rest has nothing to undo: pooled connections never take session advisory locks (those live
    on dedicated connections, see locks.py), never LISTEN and never SET. Skipping it saves one
    round trip per borrowed connection, inside every dispatch.
    """


async def create_pool(settings: PoolSettings) -> Pool:
    try:
        pool = await asyncpg.create_pool(
            settings.url,
            min_size=settings.min_size,
            max_size=settings.max_size,
            server_settings=server_settings(settings),
            reset=_no_session_state,
        )
    except (OSError, asyncpg.PostgresConnectionError) as error:
        raise Unavailable(f"cannot connect to the database: {error}") from error
    assert pool is not None
    return pool


@contextlib.asynccontextmanager
async def borrow(pool: Pool) -> AsyncIterator[PoolConnectionProxy]:
    """A pooled connection whose release cannot fail the caller.

    asyncpg resets a connection on release and, when the reset fails (the server went away just
    after our statement committed), terminates it and re-raises. Work that committed must not be
    reported as failed, least of all a claim, which would then never reach its runner: the
    connection is already terminated, so we log and carry on.
    """
    conn = await pool.acquire()
    try:
        yield conn
    finally:
        try:
            await pool.release(conn)
        except Exception as error:
            log.warning("pool.release_failed", extra={"error": repr(error)})


async def connect(settings: PoolSettings) -> asyncpg.Connection:
    """A dedicated connection, outside the pool (session locks, LISTEN)."""
    try:
        return await asyncpg.connect(settings.url, server_settings=server_settings(settings))
    except (OSError, asyncpg.PostgresConnectionError) as error:
        raise Unavailable(f"cannot connect to the database: {error}") from error
