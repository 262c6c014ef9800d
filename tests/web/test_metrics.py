from __future__ import annotations

from datetime import UTC, datetime
from uuid import UUID

import anyio
import asyncpg
from prometheus_client.parser import text_string_to_metric_families

from controlplane import metrics
from controlplane.domain.jobs import ClaimedJob, JobIdentity
from tests.web.conftest import Api


def _declared() -> set[str]:
    return {family.name for family in metrics.REGISTRY.collect()}


async def _scrape(api: Api) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = await api.http.get("/metrics")
    assert response.status_code == 200
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


async def test_every_declared_metric_is_exposed_and_parses(api: Api) -> None:
    response = await api.http.get("/metrics")
    exposed = {family.name for family in text_string_to_metric_families(response.text)}
    assert _declared() <= exposed
    assert all(name.startswith("controlplane_") for name in _declared())


async def test_s101_counters_move_with_their_events(api: Api) -> None:
    before = await _scrape(api)
    session = await api.register()
    job = api.job()
    assert (await api.enqueue(job)).status_code == 200
    assert (await api.enqueue(job)).status_code == 200  # a duplicate
    taken = await api.request_job(session)
    assert taken.status_code == 200
    assert (await api.request_job(session)).status_code == 204
    done = await api.http.post(
        f"/v1/runners/jobs/{job['job_execution_id']}/complete",
        json={"outcome": "failed"},
        headers=api.auth(taken.json()["lease_token"]),
    )
    assert done.status_code == 200
    after = await _scrape(api)

    def moved(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert moved("controlplane_jobs_enqueued_total", result="enqueued") == 1
    assert moved("controlplane_jobs_enqueued_total", result="duplicate") == 1
    assert moved("controlplane_job_claims_total", outcome="claimed") == 1
    assert moved("controlplane_job_claims_total", outcome="empty") == 1
    assert moved("controlplane_jobs_completed_total", outcome="failed") == 1
    assert moved("controlplane_dispatch_seconds_count", outcome="claimed") == 1
    assert after[("controlplane_listener_connected", ())] == 1


def _identity(job: dict[str, str]) -> JobIdentity:
    return JobIdentity(
        workspace_id=UUID(job["workspace_id"]),
        workflow_run_id=UUID(job["workflow_run_id"]),
        workflow_run_attempt_id=UUID(job["workflow_run_attempt_id"]),
        job_id=UUID(job["job_id"]),
        job_execution_id=UUID(job["job_execution_id"]),
        project_id=UUID(job["project_id"]),
    )


async def test_gauges_and_the_put_back_and_expiry_counters_move(api: Api) -> None:
    replica = api.daemon.replica
    assert replica is not None
    before = await _scrape(api)
    registered = await api.http.post(
        "/v1/runners/register",
        json={"labels": ["linux"]},
        headers=api.auth(api.registration_token),
    )
    session, session_id = registered.json()["session_token"], UUID(registered.json()["session_id"])
    job = api.job()
    await api.enqueue(job)

    parked = await api.register(["gpu"])  # waits: nothing needs a gpu
    async with anyio.create_task_group() as group:
        group.start_soon(api.request_job, parked, 5)
        with anyio.fail_after(10):
            while replica.dispatcher.parked == 0:
                await anyio.sleep(0.01)
        # The cluster gauges are read from the database at most once per
        # health.refresh_seconds, so they may trail the enqueue by that much.
        pending = ("controlplane_pending_job_executions", ())
        with anyio.fail_after(10):
            while (during := await _scrape(api)).get(pending, 0) < 1:
                await anyio.sleep(0.05)
        group.cancel_scope.cancel()
    assert during[("controlplane_parked_runners", ())] >= 1
    assert during[("controlplane_workspace_actors", ())] >= 1

    assert (await api.request_job(session)).status_code == 200
    running = ("controlplane_running_job_executions", ())
    with anyio.fail_after(10):
        while (await _scrape(api)).get(running, 0) < 1:
            await anyio.sleep(0.05)
    now = datetime.now(UTC)
    undelivered = ClaimedJob(_identity(job), ("linux",), {}, now, now)
    await replica.dispatcher.put_back(undelivered, session_id)  # as if the runner had gone
    assert (await api.request_job(session)).status_code == 200
    conn = await asyncpg.connect(api.database_url)
    try:
        await conn.execute(
            "UPDATE running_jobs SET started_at = now() - interval '1 hour',"
            " last_heartbeat_at = now() - interval '1 hour'"
        )
    finally:
        await conn.close()
    expired = ("controlplane_leases_expired_total", ())
    with anyio.fail_after(10):  # the daemon's reaper runs every 0.2 s in tests
        while (after := await _scrape(api)).get(expired, 0) - before.get(expired, 0) < 1:
            await anyio.sleep(0.05)
    put_backs = ("controlplane_put_backs_total", ())
    assert after[put_backs] - before.get(put_backs, 0) == 1
