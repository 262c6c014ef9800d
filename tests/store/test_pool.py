"""The pool's acquire deadline: armed when an acquire has to wait, and only then."""

from __future__ import annotations

import anyio
import pytest

from controlplane.errors import DatabaseUnavailable
from controlplane.store.pool import PoolSettings, create_pool

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
