"""store/pool.py: the database faults leave the store as DatabaseUnavailable, whichever way the
connection was had and whichever statement failed; store code inside a borrow still sees
asyncpg's own error, and errors that are not faults pass through untouched."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import asyncpg
import pytest

from controlplane.errors import DatabaseUnavailable
from controlplane.store.pool import (
    Pool,
    PoolSettings,
    borrow,
    connect,
    create_pool,
    unavailable,
)

# Server-side timeouts short enough that the statements below end by them, not by finishing.
_QUICK = "SELECT set_config('statement_timeout', '50ms', true)"
_LOCK_QUICK = "SELECT set_config('lock_timeout', '50ms', true)"
_FOREVER = "SELECT pg_sleep(30)"


@pytest.fixture
async def small_pool(database_url: str) -> AsyncIterator[Pool]:
    created = await create_pool(
        PoolSettings(
            url=database_url,
            min_size=1,
            max_size=1,
            statement_timeout_ms=100,
            lock_timeout_ms=100,
            acquire_timeout_seconds=0.2,
        )
    )
    try:
        yield created
    finally:
        await created.close()


async def test_a_statement_timeout_in_any_statement_is_database_unavailable(pool: Pool) -> None:
    with anyio.fail_after(10), pytest.raises(DatabaseUnavailable) as raised:  # noqa: PT012
        async with pool.acquire() as conn, conn.transaction():
            await conn.execute(_QUICK)
            await conn.fetchval(_FOREVER)
    assert isinstance(raised.value.__cause__, asyncpg.QueryCanceledError)
    assert raised.value.code == "database-unavailable"
    # The connection was not broken by it: the pool hands it out again and it answers.
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT 1") == 1


async def test_a_lock_timeout_is_seen_raw_inside_the_borrow_and_translated_outside(
    pool: Pool, observer: asyncpg.Connection
) -> None:
    seen_inside: list[type[BaseException]] = []
    async with observer.transaction():
        await observer.execute("SELECT pg_advisory_xact_lock(424242)")
        with anyio.fail_after(10), pytest.raises(DatabaseUnavailable) as raised:  # noqa: PT012
            async with pool.acquire() as conn, conn.transaction():
                await conn.execute(_LOCK_QUICK)
                try:
                    await conn.execute("SELECT pg_advisory_xact_lock(424242)")
                except asyncpg.LockNotAvailableError as error:
                    seen_inside.append(type(error))
                    raise
    assert seen_inside == [asyncpg.LockNotAvailableError]
    assert isinstance(raised.value.__cause__, asyncpg.LockNotAvailableError)


async def test_the_pools_own_queries_are_covered(small_pool: Pool) -> None:
    with anyio.fail_after(10), pytest.raises(DatabaseUnavailable) as raised:
        await small_pool.fetchval(_FOREVER)  # ended by the pool's 100 ms statement timeout
    assert isinstance(raised.value.__cause__, asyncpg.QueryCanceledError)


async def test_no_connection_within_the_acquire_deadline_is_database_unavailable(
    small_pool: Pool,
) -> None:
    async with small_pool.acquire():
        with anyio.fail_after(10):
            with pytest.raises(DatabaseUnavailable) as raised:
                async with small_pool.acquire():
                    pass
            assert isinstance(raised.value.__cause__, TimeoutError)
            with pytest.raises(DatabaseUnavailable) as raised:
                async with borrow(small_pool):
                    pass
            assert isinstance(raised.value.__cause__, TimeoutError)


async def test_a_connection_lost_under_its_user_is_dropped_and_database_unavailable(
    small_pool: Pool, observer: asyncpg.Connection
) -> None:
    with anyio.fail_after(10):
        with pytest.raises(DatabaseUnavailable) as raised:  # noqa: PT012
            async with borrow(small_pool) as conn:
                pid = conn.get_server_pid()
                await observer.execute("SELECT pg_terminate_backend($1)", pid)
                while await observer.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid
                ):
                    await anyio.sleep(0.01)
                await conn.fetchval("SELECT 1")
        assert isinstance(raised.value.__cause__, asyncpg.InterfaceError | OSError), repr(
            raised.value.__cause__
        )
        # The pool recovers by itself with a fresh connection.
        async with small_pool.acquire() as conn:
            assert await conn.fetchval("SELECT 1") == 1
            assert conn.get_server_pid() != pid


async def test_errors_that_are_not_faults_pass_through(pool: Pool) -> None:
    with pytest.raises(asyncpg.DivisionByZeroError):
        async with pool.acquire() as conn:
            await conn.fetchval("SELECT 1 / 0")
    with pytest.raises(asyncpg.DivisionByZeroError):
        async with borrow(pool) as conn:
            await conn.fetchval("SELECT 1 / 0")
    with pytest.raises(KeyError):
        async with pool.acquire():
            raise KeyError("mine")


def test_the_translation_keeps_the_cause_and_says_retry() -> None:
    error = unavailable(TimeoutError())
    assert isinstance(error, DatabaseUnavailable)
    assert error.message == "database unavailable; retry"
    assert error.details == {}


@pytest.fixture
async def watched_pool(database_url: str) -> AsyncIterator[Pool]:
    """A pool whose command deadline (0.5 s) is shorter than the statement timeouts below, so
    the client-side deadline, not the server, ends a statement that runs too long."""
    created = await create_pool(
        PoolSettings(url=database_url, min_size=1, max_size=2, command_timeout_seconds=0.5)
    )
    try:
        yield created
    finally:
        await created.close()


# The server would end this statement after 5 s (so the backend does not outlive the test).
_HUNG = "SELECT set_config('statement_timeout', '5s', true)"


async def test_a_statement_past_the_command_deadline_is_cut_and_its_connection_dropped(
    watched_pool: Pool,
) -> None:
    pids: set[int] = set()
    for how in ("acquire", "borrow", "pool"):
        with anyio.fail_after(4), pytest.raises(DatabaseUnavailable) as raised:  # noqa: PT012
            if how == "pool":
                await watched_pool.fetchval("SELECT pg_sleep(30)")
            else:
                borrowed = watched_pool.acquire() if how == "acquire" else borrow(watched_pool)
                async with borrowed as conn, conn.transaction():
                    pids.add(conn.get_server_pid())
                    await conn.execute(_HUNG)
                    await conn.fetchval(_FOREVER)
        # Cut by the client (the watchdog terminated the connection; a transaction's exit then
        # finds it closed), not cancelled by the server.
        lost = asyncpg.ConnectionDoesNotExistError | asyncpg.InterfaceError
        assert isinstance(raised.value.__cause__, lost), (
            how,
            repr(raised.value.__cause__),
        )
    # The pool serves again, from a fresh connection.
    with anyio.fail_after(10):
        async with watched_pool.acquire() as conn:
            assert await conn.fetchval("SELECT 1") == 1
            assert conn.get_server_pid() not in pids


async def test_a_borrow_that_keeps_sending_statements_outlives_the_command_deadline(
    watched_pool: Pool,
) -> None:
    """The deadline is per statement: six statements of 0.2 s each (1.2 s in all) in one
    borrow with a 0.5 s deadline all answer."""
    with anyio.fail_after(20):
        async with watched_pool.acquire() as conn, conn.transaction():
            for _ in range(6):
                await conn.execute("SELECT pg_sleep(0.2)")
            assert await conn.fetchval("SELECT 1") == 1


async def test_dedicated_connections_keep_the_per_statement_timer(database_url: str) -> None:
    conn = await connect(PoolSettings(url=database_url, command_timeout_seconds=0.5))
    try:
        with anyio.fail_after(4), pytest.raises(TimeoutError):  # noqa: PT012
            async with conn.transaction():
                await conn.execute(_HUNG)
                await conn.fetchval(_FOREVER)
    finally:
        conn.terminate()
