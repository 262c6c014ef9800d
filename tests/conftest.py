"""Shared fixtures: one real PostgreSQL per test run, one migrated template, one database per test.

The server is the embedded one (started in a temporary folder for the run) unless
CONTROLPLANE_TEST_DATABASE_URL names a server to use instead; that URL must allow CREATE DATABASE.
The folder is on /dev/shm when the machine has one we can write: every test clones the template,
and on a virtual disk a clone took 70 to 300 ms against 12 ms in memory. The run's server is not
durable anyway (fsync off).
"""

from __future__ import annotations

import asyncio
import functools
import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import httpx
import pytest

from controlplane.store import migrations
from controlplane.store.embedded import EmbeddedPostgres

TEMPLATE = "cp_test_template"

# httpx builds a new SSL context for every client, parsing the CA bundle each time (about 60 ms a
# client here), though every test speaks plain HTTP to a local daemon: the run's clients share one.
_SHARED_SSL = httpx.create_ssl_context()
httpx.AsyncClient.__init__ = functools.partialmethod(  # type: ignore[method-assign,assignment]
    httpx.AsyncClient.__init__, verify=_SHARED_SSL
)


def _memory_folder() -> str | None:
    """The memory-backed folder when it is one we can write, else None (the system's default)."""
    # S108: only the parent of a mkdtemp folder (a fresh name, mode 0700), never a fixed path.
    shm = Path("/dev/shm")  # noqa: S108
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK) else None


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


def with_database(url: str, database: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{database}"))


@pytest.fixture(scope="session")
def _session_server() -> Iterator[EmbeddedPostgres | None]:
    """The embedded server of this run, or None when CONTROLPLANE_TEST_DATABASE_URL is set."""
    if os.environ.get("CONTROLPLANE_TEST_DATABASE_URL"):
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="cp-test-pg-", dir=_memory_folder()) as folder:
        server = EmbeddedPostgres(Path(folder) / "data", durable=False, max_connections=400)
        server.start()
        try:
            yield server
        finally:
            server.stop("immediate")


@pytest.fixture(scope="session")
def server_url(_session_server: EmbeddedPostgres | None) -> str:
    if _session_server is None:
        return os.environ["CONTROLPLANE_TEST_DATABASE_URL"]
    return _session_server.url


@pytest.fixture
def embedded_server(_session_server: EmbeddedPostgres | None) -> Iterator[EmbeddedPostgres]:
    """The session's embedded server, for tests that stop and restart PostgreSQL.

    Skipped against an external server. A test that stops it must start it again (`start()`
    reuses the port) before it ends: every later test shares it. As a safety net the fixture
    restarts a server left stopped.
    """
    if _session_server is None:
        pytest.skip("PostgreSQL restarts need the embedded server")
    try:
        yield _session_server
    finally:
        if not _session_server.running():
            _session_server.start()


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
