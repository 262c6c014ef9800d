from __future__ import annotations

from datetime import UTC, datetime

from controlplane.domain import tokens
from tests.web.conftest import Api


async def test_j44_claim_mints_a_lease_token_carrying_the_job_identity(api: Api) -> None:
    session = await api.register()
    job = api.job()
    await api.enqueue(job)
    response = await api.request_job(session)
    assert response.status_code == 200
    body = response.json()
    assert "steps" not in body
    replica = api.daemon.replica
    assert replica is not None
    claims = tokens.verify(
        body["lease_token"],
        tokens.Kind.JOB_LEASE,
        await replica.keys.keys_for(body["lease_token"]),
        datetime.now(UTC),
    )
    assert claims["ex"] == job["job_execution_id"]
    assert claims["job"] == job["job_id"]
    assert claims["run"] == job["workflow_run_id"]
    assert claims["att"] == job["workflow_run_attempt_id"]
    assert claims["prj"] == job["project_id"]
    assert claims["ws"] == job["workspace_id"]


async def test_j45_empty_queue_answers_204_without_a_token(api: Api) -> None:
    session = await api.register()
    response = await api.request_job(session)
    assert response.status_code == 204
    assert response.content == b""
