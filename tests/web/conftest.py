"""A real daemon (uvicorn, listener, actors, maintenance) in-process on the test database, and a
client that talks to it over real HTTP."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import anyio
import asyncpg
import httpx
import msgspec
import pytest

from controlplane import app, settings
from controlplane.store import credentials


def test_settings(**overrides: Any) -> settings.Settings:
    base = settings.Settings()
    raw = msgspec.to_builtins(base)
    raw["server"]["port"] = 0
    raw["server"]["shutdown_grace_seconds"] = 1
    raw["runners"]["long_poll_max_seconds"] = 10
    raw["maintenance"]["dispatch_safety_tick_seconds"] = 0.5
    raw["maintenance"]["reaper_interval_seconds"] = 0.2
    raw["provisioners"]["session_seen_batch_seconds"] = 0.2  # a ping's stamp and fence check
    raw["database"]["pool_min_size"] = 1
    for dotted, value in overrides.items():
        section, knob = dotted.split("__")
        raw[section][knob] = value
    return msgspec.convert(raw, settings.Settings)


@dataclass
class Api:
    """A client of one daemon, with the credentials a test usually needs."""

    http: httpx.AsyncClient
    database_url: str
    daemon: app.Daemon
    workspace: UUID = field(default_factory=uuid.uuid4)
    orchestrator_key: str = ""
    admin_key: str = ""
    registration_token: str = ""

    def auth(self, token: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"}

    async def register(self, labels: list[str] | None = None, token: str | None = None) -> str:
        response = await self.http.post(
            "/v1/runners/register",
            json={"labels": labels or ["linux", "x64"]},
            headers=self.auth(token or self.registration_token),
        )
        assert response.status_code == 200, response.text
        session_token: str = response.json()["session_token"]
        return session_token

    def job(self, labels: list[str] | None = None, **extra: Any) -> dict[str, Any]:
        return {
            "job_execution_id": str(uuid.uuid4()),
            "job_id": str(uuid.uuid4()),
            "workflow_run_id": str(uuid.uuid4()),
            "workflow_run_attempt_id": str(uuid.uuid4()),
            "workspace_id": str(self.workspace),
            "project_id": str(uuid.uuid4()),
            "required_labels": labels or ["linux"],
            "queued_at": datetime.now(UTC).isoformat(),
            **extra,
        }

    async def enqueue(self, *jobs: dict[str, Any]) -> httpx.Response:
        return await self.http.post(
            "/v1/jobs", json={"jobs": list(jobs)}, headers=self.auth(self.orchestrator_key)
        )

    async def request_job(self, session_token: str, wait: float = 0) -> httpx.Response:
        return await self.http.post(
            f"/v1/runners/jobs/request?wait={wait}", headers=self.auth(session_token)
        )


async def run_daemon(database_url: str, config: settings.Settings) -> AsyncIterator[app.Daemon]:
    daemon = app.Daemon(config, database_url)
    ready = anyio.Event()
    async with anyio.create_task_group() as group:
        group.start_soon(lambda: daemon.run(on_ready=lambda _address: ready.set()))
        with anyio.fail_after(30):
            await ready.wait()
        yield daemon
        daemon.shutdown()


async def api_with(database_url: str, **overrides: Any) -> AsyncIterator[Api]:
    """A client (without credentials) of a daemon of its own, with settings `overrides`."""
    async for daemon in run_daemon(database_url, test_settings(**overrides)):
        async with httpx.AsyncClient(base_url=daemon.address, timeout=30) as http:
            yield Api(http=http, database_url=database_url, daemon=daemon)


@pytest.fixture
async def maintained(database_url: str) -> AsyncIterator[Api]:
    """A daemon whose provisioning maintenance runs every 0.2 s (only /metrics is called)."""
    async for api in api_with(database_url, maintenance__provisioning_interval_seconds=0.2):
        yield api


@pytest.fixture
async def daemon(database_url: str) -> AsyncIterator[app.Daemon]:
    async for running in run_daemon(database_url, test_settings()):
        yield running


@pytest.fixture
async def api(daemon: app.Daemon, database_url: str) -> AsyncIterator[Api]:
    async with open_api(daemon, database_url) as client:
        yield client


@asynccontextmanager
async def open_api(daemon: app.Daemon, database_url: str) -> AsyncIterator[Api]:
    """A client of `daemon` with an orchestrator key, an admin key and a registration token."""
    async with httpx.AsyncClient(base_url=daemon.address, timeout=30) as http:
        client = Api(http=http, database_url=database_url, daemon=daemon)
        conn = await asyncpg.connect(database_url)
        try:
            _, client.orchestrator_key = await credentials.create_api_key(
                conn, kind="orchestrator", name="test orchestrator"
            )
            _, client.admin_key = await credentials.create_api_key(conn, kind="admin", name="ops")
            _, client.registration_token = await credentials.create_manual_token(
                conn, workspace_id=client.workspace, name="runners"
            )
        finally:
            await conn.close()
        yield client


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(database_url)
    try:
        yield conn
    finally:
        await conn.close()
