"""Shared fixtures: one real PostgreSQL per test run, one migrated template, one database per test.

The server is the embedded one (started in a temporary folder for the run) unless
CONTROLPLANE_TEST_DATABASE_URL names a server to use instead; that URL must allow CREATE DATABASE.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from controlplane.store import migrations
from controlplane.store.embedded import EmbeddedPostgres

TEMPLATE = "cp_test_template"


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


def with_database(url: str, database: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{database}"))


@pytest.fixture(scope="session")
def server_url() -> Iterator[str]:
    configured = os.environ.get("CONTROLPLANE_TEST_DATABASE_URL")
    if configured:
        yield configured
        return
    with tempfile.TemporaryDirectory(prefix="cp-test-pg-") as folder:
        server = EmbeddedPostgres(Path(folder) / "data", durable=False, max_connections=400)
        url = server.start()
        try:
            yield url
        finally:
            server.stop("immediate")


async def _build_template(server_url: str) -> None:
    admin = await asyncpg.connect(server_url)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{TEMPLATE}" WITH (FORCE)')
        await admin.execute(f'CREATE DATABASE "{TEMPLATE}"')
    finally:
        await admin.close()
    conn = await asyncpg.connect(with_database(server_url, TEMPLATE))
    try:
        await migrations.migrate(conn)
    finally:
        await conn.close()


@pytest.fixture(scope="session")
def template(server_url: str) -> str:
    asyncio.run(_build_template(server_url))
    return TEMPLATE


@pytest.fixture
async def database_url(server_url: str, template: str) -> AsyncIterator[str]:
    """A fresh database cloned from the migrated template, dropped afterwards."""
    name = f"cp_test_{uuid.uuid4().hex[:16]}"
    admin = await asyncpg.connect(server_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}" STRATEGY FILE_COPY')
    finally:
        await admin.close()
    yield with_database(server_url, name)
    admin = await asyncpg.connect(server_url)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


@pytest.fixture
async def empty_database_url(server_url: str) -> AsyncIterator[str]:
    """A fresh database with no migrations applied."""
    name = f"cp_test_{uuid.uuid4().hex[:16]}"
    admin = await asyncpg.connect(server_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    yield with_database(server_url, name)
    admin = await asyncpg.connect(server_url)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()
