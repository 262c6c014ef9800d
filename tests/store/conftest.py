from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from uuid import UUID

import asyncpg
import pytest

from controlplane.store.pool import Conn, PoolSettings, create_pool


@pytest.fixture
async def pool(database_url: str) -> AsyncIterator[asyncpg.Pool]:
    created = await create_pool(PoolSettings(url=database_url, min_size=1, max_size=10))
    try:
        yield created
    finally:
        await created.close()


@pytest.fixture
async def conn(pool: asyncpg.Pool) -> AsyncIterator[Conn]:
    async with pool.acquire() as connection:
        yield connection


@pytest.fixture
async def observer(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    """A separate connection for watching pg_stat_activity and for raw assertions."""
    connection = await asyncpg.connect(database_url)
    try:
        yield connection
    finally:
        await connection.close()


@pytest.fixture
def workspace() -> UUID:
    return uuid.uuid4()
