from __future__ import annotations

import anyio
import asyncpg

from tests.web.conftest import Api


async def test_long_poll_gets_job_enqueued_later_then_heartbeat_and_complete(
    api: Api, db: asyncpg.Connection
) -> None:
    session = await api.register()
    job = api.job(payload={"script": "echo hi"})
    got: dict[str, object] = {}

    async def runner() -> None:
        response = await api.request_job(session, wait=10)
        got["status"] = response.status_code
        got["body"] = response.json()

    async with anyio.create_task_group() as group:
        group.start_soon(runner)
        # Enqueue only once the runner is parked with the workspace actor.
        with anyio.fail_after(10):
            while api.daemon.replica is None or api.daemon.replica.dispatcher.parked == 0:
                await anyio.sleep(0.01)
        response = await api.enqueue(job)
        assert response.json()["results"][0]["result"] == "enqueued"
    assert got["status"] == 200
    body = got["body"]
    assert isinstance(body, dict)
    assert body["job_execution_id"] == job["job_execution_id"]
    assert body["payload"] == {"script": "echo hi"}
    lease = body["lease_token"]
    execution = job["job_execution_id"]
    beat = await api.http.post(f"/v1/runners/jobs/{execution}/heartbeat", headers=api.auth(lease))
    assert beat.status_code == 200 and beat.json()["cancel"] is False
    done = await api.http.post(
        f"/v1/runners/jobs/{execution}/complete",
        json={"outcome": "succeeded", "exit_code": 0},
        headers=api.auth(beat.json()["lease_token"]),
    )
    assert done.status_code == 200 and done.json() == {"recorded": True}
    assert await db.fetchval("SELECT count(*) FROM running_jobs") == 0
    assert await db.fetchval("SELECT outcome FROM ended_executions") == "succeeded"
