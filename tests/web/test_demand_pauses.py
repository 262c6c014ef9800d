"""A workspace pause and resume reach its provisioners at once (docs/policies.md Q-90): a real
daemon whose provisioner actors run a round only when woken, a real WebSocket session."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import asyncpg
import pytest

from controlplane import app, metrics
from tests.web import conftest
from tests.web.conftest import run_daemon
from tests.web.control_client import hello, open_session
from tests.web.provisioning_client import advertise, next_grant, until, workspace_provisioner

pytestmark = pytest.mark.anyio


@pytest.fixture
async def slow_ticks(database_url: str) -> AsyncIterator[app.Daemon]:
    """Provisioner rounds only when woken (the safety tick is ten minutes away)."""
    config = conftest.test_settings(provisioners__demand_safety_tick_seconds=600)
    async for running in run_daemon(database_url, config):
        yield running


def rounds() -> float:
    return (
        metrics.REGISTRY.get_sample_value("controlplane_allocation_rounds_total", {"outcome": "ok"})
        or 0.0
    )


async def test_q90_a_resume_wakes_the_workspaces_provisioner_which_grants_at_once(
    slow_ticks: app.Daemon, database_url: str, db: asyncpg.Connection
) -> None:
    async with conftest.open_api(slow_ticks, database_url) as api:
        _, token = await workspace_provisioner(api, db)
        paused = await api.http.post(
            f"/v1/admin/workspaces/{api.workspace}/pause", headers=api.auth(api.admin_key)
        )
        assert paused.status_code == 200, paused.text
        ws = await open_session(api.daemon, token)
        await hello(ws)
        await advertise(ws)
        await until(ws, "demand")
        before = rounds()
        assert (await api.enqueue(api.job(["linux"]))).status_code == 200
        # The enqueue's wake runs a round, which grants nothing: the workspace is paused.
        with anyio.fail_after(10):
            while rounds() == before:
                await anyio.sleep(0.01)
        assert await db.fetchval("SELECT count(*) FROM reservations") == 0
        resumed = await api.http.post(
            f"/v1/admin/workspaces/{api.workspace}/resume", headers=api.auth(api.admin_key)
        )
        assert resumed.status_code == 200, resumed.text
        grant = await next_grant(ws)  # within 10 s; no tick would come in time
        assert (grant["labels"], grant["count"]) == (["linux"], 1)
        await ws.close()
