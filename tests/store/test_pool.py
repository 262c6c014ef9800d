"""The pool's acquire deadline: armed when an acquire has to wait, and only then; and the release
of a connection whose transaction a cancel left open."""

from __future__ import annotations

import asyncio
import uuid

import anyio
import pytest

from controlplane.errors import DatabaseUnavailable
from controlplane.store.pool import PoolSettings, borrow, create_pool

DEADLINE = 0.5


async def test_an_acquire_that_has_to_wait_gives_up_at_the_deadline(database_url: str) -> None:
    pool = await create_pool(
        PoolSettings(url=database_url, min_size=1, max_size=1, acquire_timeout_seconds=DEADLINE)
    )
    try:
        async with pool.acquire():
            assert pool.get_idle_size() == 0
            started = anyio.current_time()
            with anyio.fail_after(30), pytest.raises(DatabaseUnavailable):
                async with pool.acquire():
                    pass
            assert anyio.current_time() - started >= 0.9 * DEADLINE
        # Released: the next acquire finds it idle and gets it.
        async with pool.acquire() as conn:
            assert await conn.fetchval("SELECT 1") == 1
    finally:
        await pool.close()


async def test_an_acquire_that_finds_an_idle_connection_is_not_bounded_on_release(
    database_url: str,
) -> None:
    """With a connection idle, no deadline is armed (it would cost a timer per request); the
    connection goes back to the pool as usual and serves the next acquire."""
    pool = await create_pool(
        PoolSettings(url=database_url, min_size=1, max_size=1, acquire_timeout_seconds=DEADLINE)
    )
    try:
        for _ in range(3):
            assert pool.get_idle_size() == 1
            borrowed = pool.acquire()
            assert borrowed.timeout is None
            async with borrowed as conn:
                assert await conn.fetchval("SELECT 1") == 1
        waiting = pool.acquire()
        async with pool.acquire():
            assert pool.acquire().timeout == DEADLINE
        assert waiting.timeout is None  # decided when asked, while one was idle
    finally:
        await pool.close()


async def test_a_transaction_left_open_is_rolled_back_on_release_without_an_error(
    database_url: str,
) -> None:
    """A connection released inside a transaction: what a stop leaves when its cancellation cuts
    short the ROLLBACK of `async with conn.transaction()` (asyncpg then no longer knows of the
    transaction, as with a BEGIN of our own, which stands in for it here). The release rolls the
    connection back before anyone else gets it, and says so in our log: not through the event
    loop's exception handler, whose default prints asyncpg's "Resetting connection with an
    active transaction" as an error."""
    loop = asyncio.get_running_loop()
    reported: list[dict[str, object]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    pool = await create_pool(PoolSettings(url=database_url, min_size=1, max_size=1))
    workspace = uuid.uuid4()
    found = "SELECT count(*) FROM workspace_settings WHERE workspace_id = $1"
    try:
        async with borrow(pool) as conn:
            await conn.execute("BEGIN")
            await conn.execute(
                "INSERT INTO workspace_settings (workspace_id) VALUES ($1)", workspace
            )
            assert conn.is_in_transaction()
        async with borrow(pool) as conn:  # the same connection: the pool has one
            assert not conn.is_in_transaction()
            assert await conn.fetchval(found, workspace) == 0
            await conn.execute(
                "INSERT INTO workspace_settings (workspace_id) VALUES ($1)", workspace
            )
        async with borrow(pool) as conn:  # and it still commits what runs outside a transaction
            assert await conn.fetchval(found, workspace) == 1
    finally:
        await pool.close()
        loop.set_exception_handler(previous)
    assert reported == []
