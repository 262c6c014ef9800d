"""Two daemon processes on one PostgreSQL: cross-replica wake-up, and no job lost or doubled."""

from __future__ import annotations

import uuid
from collections import Counter
from typing import Any

import anyio
import asyncpg
import httpx
import pytest

from tests.system.conftest import SpawnDaemon
from tests.system.wire import job_body, orchestrator_and_registration

pytestmark = pytest.mark.system


async def _register(client: httpx.AsyncClient, token: str, labels: list[str]) -> str:
    response = await client.post(
        "/v1/runners/register",
        json={"labels": labels},
        headers={"Authorization": f"Bearer {token}"},
    )
    assert response.status_code == 200, response.text
    session: str = response.json()["session_token"]
    return session


async def test_runner_parked_on_a_gets_job_enqueued_through_b(
    spawn_daemon: SpawnDaemon, database_url: str
) -> None:
    workspace = uuid.uuid4()
    orchestrator, registration = await orchestrator_and_registration(database_url, workspace)
    async with (
        spawn_daemon() as replica_a,
        spawn_daemon() as replica_b,
        httpx.AsyncClient(base_url=replica_a.address, timeout=30) as a,
        httpx.AsyncClient(base_url=replica_b.address, timeout=30) as b,
    ):
        session = await _register(a, registration, ["linux"])
        job = job_body(workspace, ["linux"])
        received: dict[str, Any] = {}

        async def park() -> None:
            response = await a.post(
                "/v1/runners/jobs/request?wait=10",
                headers={"Authorization": f"Bearer {session}"},
            )
            received["status"] = response.status_code
            received["body"] = response.json() if response.status_code == 200 else None

        async with anyio.create_task_group() as group:
            group.start_soon(park)
            # Wait until replica A reports the runner parked, then enqueue through B.
            with anyio.fail_after(10):
                while "controlplane_parked_runners 1.0" not in (await a.get("/metrics")).text:
                    await anyio.sleep(0.01)
            enqueued = await b.post(
                "/v1/jobs",
                json={"jobs": [job]},
                headers={"Authorization": f"Bearer {orchestrator}"},
            )
            assert enqueued.json()["results"][0]["result"] == "enqueued"
        assert received["status"] == 200
        assert received["body"]["job_execution_id"] == job["job_execution_id"]


async def test_thousand_jobs_fifty_runners_two_replicas_none_lost_none_twice(
    spawn_daemon: SpawnDaemon, database_url: str
) -> None:
    workspace = uuid.uuid4()
    orchestrator, registration = await orchestrator_and_registration(database_url, workspace)
    total, runners = 1000, 50
    label_sets = [["linux"], ["linux", "x64"], ["gpu", "linux"]]
    jobs = [job_body(workspace, label_sets[i % 3]) for i in range(total)]
    delivered: Counter[str] = Counter()
    completed_count = 0
    done = anyio.Event()
    async with (
        spawn_daemon() as replica_a,
        spawn_daemon() as replica_b,
        httpx.AsyncClient(base_url=replica_a.address, timeout=30) as a,
        httpx.AsyncClient(base_url=replica_b.address, timeout=30) as b,
    ):

        async def runner(client: httpx.AsyncClient, labels: list[str]) -> None:
            nonlocal completed_count
            session = await _register(client, registration, labels)
            auth = {"Authorization": f"Bearer {session}"}
            while not done.is_set():
                response = await client.post("/v1/runners/jobs/request?wait=2", headers=auth)
                if response.status_code == 204:
                    continue
                assert response.status_code == 200, response.text
                body = response.json()
                execution = body["job_execution_id"]
                delivered[execution] += 1
                completed = await client.post(
                    f"/v1/runners/jobs/{execution}/complete",
                    json={"outcome": "succeeded"},
                    headers={"Authorization": f"Bearer {body['lease_token']}"},
                )
                assert completed.status_code == 200, completed.text
                completed_count += 1
                if completed_count >= total:
                    done.set()

        with anyio.fail_after(240):
            async with anyio.create_task_group() as group:
                for index in range(runners):
                    client = a if index % 2 == 0 else b
                    # Every job's labels are covered by some runner: gpu runners take everything.
                    labels = ["gpu", "linux", "x64"] if index % 5 == 0 else ["linux", "x64"]
                    group.start_soon(runner, client, labels)
                for start in range(0, total, 50):
                    client = b if (start // 50) % 2 == 0 else a
                    response = await client.post(
                        "/v1/jobs",
                        json={"jobs": jobs[start : start + 50]},
                        headers={"Authorization": f"Bearer {orchestrator}"},
                    )
                    assert response.status_code == 200, response.text
                await done.wait()
                group.cancel_scope.cancel()

    assert len(delivered) == total
    assert set(delivered) == {job["job_execution_id"] for job in jobs}
    assert max(delivered.values()) == 1
    conn = await asyncpg.connect(database_url)
    try:
        assert await conn.fetchval("SELECT count(*) FROM pending_jobs") == 0
        assert await conn.fetchval("SELECT count(*) FROM running_jobs") == 0
        assert await conn.fetchval("SELECT count(*) FROM ended_executions") == total
        claimed = await conn.fetchval(
            "SELECT count(*) FROM events WHERE event_type = 'job.claimed'"
        )
        completed = await conn.fetchval(
            "SELECT count(*) FROM events WHERE event_type = 'job.completed'"
        )
        assert (claimed, completed) == (total, total)
    finally:
        await conn.close()
