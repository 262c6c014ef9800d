"""SIGTERM on a real daemon process: parked long-polls are answered, nothing stays claimed."""

from __future__ import annotations

import signal
import uuid
from datetime import UTC, datetime

import anyio
import asyncpg
import httpx
import pytest

from controlplane.store import credentials
from tests.system.conftest import SpawnDaemon

pytestmark = pytest.mark.system


async def test_sigterm_answers_parked_runners_with_204_and_exits_cleanly(
    spawn_daemon: SpawnDaemon, database_url: str
) -> None:
    workspace = uuid.uuid4()
    conn = await asyncpg.connect(database_url)
    try:
        _, registration = await credentials.create_manual_token(
            conn, workspace_id=workspace, name="r"
        )
        _, orchestrator = await credentials.create_api_key(conn, kind="orchestrator", name="o")
    finally:
        await conn.close()
    answers: list[httpx.Response] = []
    async with (
        spawn_daemon() as replica,
        httpx.AsyncClient(base_url=replica.address, timeout=30) as client,
    ):
        sessions = []
        for _ in range(3):
            registered = await client.post(
                "/v1/runners/register",
                json={"labels": ["linux"]},
                headers={"Authorization": f"Bearer {registration}"},
            )
            sessions.append(registered.json()["session_token"])

        async def park(token: str) -> None:
            answers.append(
                await client.post(
                    "/v1/runners/jobs/request?wait=10",
                    headers={"Authorization": f"Bearer {token}"},
                )
            )

        with anyio.fail_after(20):
            async with anyio.create_task_group() as group:
                for token in sessions:
                    group.start_soon(park, token)
                while "controlplane_parked_runners 3.0" not in (await client.get("/metrics")).text:
                    await anyio.sleep(0.01)
                replica.signal(signal.SIGTERM)
            exit_code = await anyio.to_thread.run_sync(replica.process.wait)

    assert [answer.status_code for answer in answers] == [204, 204, 204]
    assert all(answer.headers["retry-after"] == "1" for answer in answers)
    assert exit_code == 0
    assert "shutdown.requested" in replica.log.read_text()
    # A job enqueued afterwards stays pending: nothing was claimed for the drained runners.
    job = {
        "job_execution_id": str(uuid.uuid4()),
        "job_id": str(uuid.uuid4()),
        "workflow_run_id": str(uuid.uuid4()),
        "workflow_run_attempt_id": str(uuid.uuid4()),
        "workspace_id": str(workspace),
        "project_id": str(uuid.uuid4()),
        "required_labels": ["linux"],
        "queued_at": datetime.now(UTC).isoformat(),
    }
    async with (
        spawn_daemon() as second,
        httpx.AsyncClient(base_url=second.address, timeout=30) as client,
    ):
        response = await client.post(
            "/v1/jobs", json={"jobs": [job]}, headers={"Authorization": f"Bearer {orchestrator}"}
        )
        assert response.json()["results"][0]["result"] == "enqueued"
    conn = await asyncpg.connect(database_url)
    try:
        assert await conn.fetchval("SELECT count(*) FROM running_jobs") == 0
        assert await conn.fetchval("SELECT count(*) FROM pending_jobs") == 1
    finally:
        await conn.close()
