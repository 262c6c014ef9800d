"""Reading back work in flight over real HTTP: a lease's state with its runner session's
effective tool capabilities, workspaces' job counts, and the capabilities in the admin runner
view (spec jobs 3.9, 3.10, 5.6)."""

from __future__ import annotations

import uuid
from typing import Any
from uuid import UUID

import asyncpg
import httpx
import pytest

from controlplane.store import credentials
from tests.web.conftest import Api

pytestmark = pytest.mark.anyio

CAPABILITIES = {"harnesses": {"claude": {"tools": ["bash", "edit"]}}}
NONE: dict[str, Any] = {"harnesses": {}}


async def _runner(api: Api, capabilities: dict[str, Any] | None = None) -> tuple[str, str]:
    """A registered runner: (session token, session id)."""
    body: dict[str, Any] = {"labels": ["linux"]}
    if capabilities is not None:
        body["capabilities"] = capabilities
    response = await api.http.post(
        "/v1/runners/register", json=body, headers=api.auth(api.registration_token)
    )
    assert response.status_code == 200, response.text
    return response.json()["session_token"], response.json()["session_id"]


async def _leased(api: Api, capabilities: dict[str, Any] | None) -> tuple[dict[str, Any], str]:
    """A job claimed by a new runner: (the job, its runner session id)."""
    token, session_id = await _runner(api, capabilities)
    job = api.job(["linux"])
    assert (await api.enqueue(job)).status_code == 200
    claimed = await api.request_job(token)
    assert claimed.status_code == 200, claimed.text
    return job, session_id


async def _lease(api: Api, execution: str, key: str | None = None, **query: str) -> httpx.Response:
    return await api.http.get(
        f"/v1/jobs/{execution}/lease", params=query, headers=api.auth(key or api.orchestrator_key)
    )


async def _scoped_key(db: asyncpg.Connection, workspace: UUID) -> str:
    _, raw = await credentials.create_api_key(
        db, kind="orchestrator", name="scoped", workspace_id=workspace
    )
    return raw


async def test_a_lease_is_active_for_its_session_and_job_with_fresh_capabilities(
    api: Api, db: asyncpg.Connection
) -> None:
    job, session_id = await _leased(api, CAPABILITIES)
    execution = job["job_execution_id"]
    found = await _lease(api, execution, runner_session_id=session_id, job_id=job["job_id"])
    assert found.status_code == 200, found.text
    body = found.json()
    assert body["active"] is True
    assert body["capabilities"]["capabilities"] == CAPABILITIES
    assert body["capabilities"]["report_fresh"] is True
    assert body["capabilities"]["reported_at"] is not None

    other_session = str(uuid.uuid4())
    for query in (
        {"runner_session_id": other_session},
        {"runner_session_id": session_id, "job_id": str(uuid.uuid4())},
    ):
        answer = await _lease(api, execution, **query)
        assert answer.json() == {"active": False, "capabilities": None}
    unknown = await _lease(api, str(uuid.uuid4()), runner_session_id=session_id)
    assert unknown.json() == {"active": False, "capabilities": None}


async def test_a_cancel_requested_lease_is_still_active(api: Api, db: asyncpg.Connection) -> None:
    job, session_id = await _leased(api, None)
    cancelled = await api.http.post(
        f"/v1/jobs/{job['job_execution_id']}/outcome",
        json={"status": "cancelled"},
        headers=api.auth(api.orchestrator_key),
    )
    assert cancelled.json()["was_running"] is True
    found = await _lease(api, job["job_execution_id"], runner_session_id=session_id)
    assert found.json()["active"] is True
    assert found.json()["capabilities"] == {
        "capabilities": NONE, "report_fresh": False, "reported_at": None
    }  # fmt: skip


async def test_a_report_past_the_window_counts_as_none(api: Api, db: asyncpg.Connection) -> None:
    job, session_id = await _leased(api, CAPABILITIES)
    await db.execute(
        "UPDATE runner_sessions SET tool_capabilities_reported_at = now() - interval '61 seconds'"
    )  # the default window is 60 s
    found = await _lease(api, job["job_execution_id"], runner_session_id=session_id)
    effective = found.json()["capabilities"]
    assert effective["capabilities"] == NONE
    assert effective["report_fresh"] is False
    assert effective["reported_at"] is not None  # when the stale report was sent


async def test_a_scoped_key_sees_only_its_workspaces_leases(
    api: Api, db: asyncpg.Connection
) -> None:
    job, session_id = await _leased(api, CAPABILITIES)
    own = await _scoped_key(db, api.workspace)
    other = await _scoped_key(db, uuid.uuid4())
    seen = await _lease(api, job["job_execution_id"], own, runner_session_id=session_id)
    hidden = await _lease(api, job["job_execution_id"], other, runner_session_id=session_id)
    assert seen.json()["active"] is True
    assert hidden.json() == {"active": False, "capabilities": None}


@pytest.mark.parametrize(
    "query",
    [{}, {"runner_session_id": "x"}, {"runner_session_id": str(uuid.uuid4()), "extra": "1"}],
    ids=["missing", "not-a-uuid", "unknown-parameter"],
)
async def test_a_malformed_lease_query_is_400(api: Api, query: dict[str, str]) -> None:
    answer = await _lease(api, str(uuid.uuid4()), **query)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == "validation-error"


async def test_lease_state_needs_an_orchestrator_key(api: Api) -> None:
    query = {"runner_session_id": str(uuid.uuid4())}
    assert (await _lease(api, str(uuid.uuid4()), api.admin_key, **query)).status_code == 401


async def _counts(api: Api, body: Any, key: str | None = None) -> httpx.Response:
    return await api.http.post(
        "/v1/job-counts", json=body, headers=api.auth(key or api.orchestrator_key)
    )


async def test_j86_job_counts_in_input_order_with_zeros_and_cancelled_leases_running(
    api: Api, db: asyncpg.Connection
) -> None:
    job, _ = await _leased(api, None)
    await api.http.post(
        f"/v1/jobs/{job['job_execution_id']}/outcome",
        json={"status": "cancelled"},
        headers=api.auth(api.orchestrator_key),
    )  # requested, not yet reaped: still running
    await api.enqueue(api.job(["linux"]), api.job(["linux"]), api.job(["linux", "gpu"]))
    empty = [str(uuid.uuid4()), str(uuid.uuid4())]
    answer = await _counts(api, {"workspace_ids": [empty[0], str(api.workspace), empty[1]]})
    assert answer.status_code == 200, answer.text
    counts = answer.json()["counts"]
    assert [(c["workspace_id"], c["queued"], c["running"]) for c in counts] == [
        (empty[0], 0, 0), (str(api.workspace), 3, 1), (empty[1], 0, 0)
    ]  # fmt: skip
    by_labels = [(g["labels"], g["queued"], g["running"]) for g in counts[1]["labels"]]
    assert by_labels == [(["linux"], 2, 1), (["gpu", "linux"], 1, 0)]
    assert counts[0]["labels"] == []


@pytest.mark.parametrize(
    "body",
    [
        {"workspace_ids": []},
        {"workspace_ids": [str(uuid.uuid4()) for _ in range(101)]},
        {"workspace_ids": ["00000000-0000-4000-8000-000000000001"] * 2},
        {"workspace_ids": ["not-a-uuid"]},
        {"workspace_ids": [str(uuid.uuid4())], "extra": 1},
    ],
    ids=["none", "101", "duplicate", "not-a-uuid", "unknown-field"],
)
async def test_malformed_job_count_requests_are_400(api: Api, body: dict[str, Any]) -> None:
    answer = await _counts(api, body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == "validation-error"


async def test_a_scoped_key_counts_only_its_own_workspace(api: Api, db: asyncpg.Connection) -> None:
    key = await _scoped_key(db, api.workspace)
    assert (await _counts(api, {"workspace_ids": [str(api.workspace)]}, key)).status_code == 200
    refused = await _counts(api, {"workspace_ids": [str(api.workspace), str(uuid.uuid4())]}, key)
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "forbidden"


async def test_the_admin_runner_view_shows_effective_capabilities(
    api: Api, db: asyncpg.Connection
) -> None:
    token, reporting = await _runner(api, CAPABILITIES)
    _, silent = await _runner(api)
    assert (await api.request_job(token)).status_code == 204

    async def view() -> dict[str, Any]:
        listed = await api.http.get("/v1/admin/runners", headers=api.auth(api.admin_key))
        assert listed.status_code == 200, listed.text
        return {item["runner_session_id"]: item["capabilities"] for item in listed.json()["items"]}

    shown = await view()
    assert shown[reporting]["capabilities"] == CAPABILITIES
    assert shown[reporting]["report_fresh"] is True
    assert shown[silent] == {"capabilities": NONE, "report_fresh": False, "reported_at": None}
    await db.execute(
        "UPDATE runner_sessions SET tool_capabilities_reported_at = now() - interval '1 hour'"
        " WHERE tool_capabilities IS NOT NULL"
    )
    stale = (await view())[reporting]
    assert (stale["capabilities"], stale["report_fresh"]) == (NONE, False)
