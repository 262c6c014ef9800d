"""The orchestrator routes over real HTTP: enqueue, outcome, execution state, the event feed."""

from __future__ import annotations

import json
import uuid
from datetime import datetime
from typing import Any
from uuid import UUID

import anyio
import asyncpg
import httpx
import pytest

from controlplane.store import credentials
from tests.web import conftest
from tests.web.conftest import Api


def error_code(response: httpx.Response) -> str:
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"code", "message", "details"}, body
    return str(body["error"]["code"])


async def pending_count(db: asyncpg.Connection) -> int:
    count: int = await db.fetchval("SELECT count(*) FROM pending_jobs")
    return count


def results(response: httpx.Response) -> list[str]:
    assert response.status_code == 200, response.text
    return [item["result"] for item in response.json()["results"]]


async def enqueue_raw(api: Api, body: Any, key: str | None = None) -> httpx.Response:
    return await api.http.post("/v1/jobs", json=body, headers=api.auth(key or api.orchestrator_key))


async def outcome(
    api: Api, execution: str, body: dict[str, Any], key: str | None = None
) -> httpx.Response:
    return await api.http.post(
        f"/v1/jobs/{execution}/outcome", json=body, headers=api.auth(key or api.orchestrator_key)
    )


async def state(api: Api, execution: str, key: str | None = None) -> httpx.Response:
    return await api.http.get(
        f"/v1/jobs/{execution}", headers=api.auth(key or api.orchestrator_key)
    )


async def events(api: Api, query: str = "", key: str | None = None) -> httpx.Response:
    return await api.http.get(f"/v1/events{query}", headers=api.auth(key or api.orchestrator_key))


async def claim(api: Api, job: dict[str, Any]) -> str:
    """Enqueue `job`, claim it with a fresh runner of exactly its labels; return the lease."""
    assert results(await api.enqueue(job)) == ["enqueued"]
    response = await api.request_job(await api.register(job["required_labels"]))
    assert response.status_code == 200, response.text
    assert response.json()["job_execution_id"] == job["job_execution_id"]
    lease: str = response.json()["lease_token"]
    return lease


async def scoped_key(api: Api, workspace: UUID) -> str:
    conn = await asyncpg.connect(api.database_url)
    try:
        _, raw = await credentials.create_api_key(
            conn, kind="orchestrator", name="one workspace", workspace_id=workspace
        )
    finally:
        await conn.close()
    return raw


# Enqueue --------------------------------------------------------------------------------------


async def test_enqueue_reports_enqueued_duplicate_running_and_ended(
    api: Api, db: asyncpg.Connection
) -> None:
    first, second = api.job(), api.job()
    assert results(await api.enqueue(first, second, first)) == ["enqueued", "enqueued", "duplicate"]
    assert await pending_count(db) == 2
    assert results(await api.enqueue(first)) == ["duplicate"]
    lease = await claim(api, third := api.job(["gpu"]))
    assert results(await api.enqueue(third)) == ["running"]
    done = await api.http.post(
        f"/v1/runners/jobs/{third['job_execution_id']}/complete",
        json={"outcome": "succeeded"},
        headers=api.auth(lease),
    )
    assert done.status_code == 200
    assert results(await api.enqueue(third)) == ["ended"]
    assert await db.fetchval("SELECT count(*) FROM running_jobs") == 0
    assert await pending_count(db) == 2


async def test_enqueue_stores_canonical_labels_and_the_payload(
    api: Api, db: asyncpg.Connection
) -> None:
    job = api.job(["X64", "linux", "Linux"], payload={"steps": [1, 2], "env": {"A": "b"}})
    assert results(await api.enqueue(job)) == ["enqueued"]
    row = await db.fetchrow("SELECT required_labels, payload::text AS payload FROM pending_jobs")
    assert row is not None
    assert row["required_labels"] == ["linux", "x64"]
    session = await api.register(["linux", "x64"])
    claimed = await api.request_job(session)
    assert claimed.json()["payload"] == {"steps": [1, 2], "env": {"A": "b"}}


async def test_enqueue_payload_over_the_limit_is_413_and_enqueues_nothing(
    api: Api, db: asyncpg.Connection
) -> None:
    limit = api.daemon.settings.queue.max_payload_bytes
    wrapper = len(json.dumps({"blob": ""}, separators=(",", ":")))

    async def send(*jobs: dict[str, Any]) -> httpx.Response:
        body = json.dumps({"jobs": list(jobs)}, separators=(",", ":"))
        return await api.http.post(
            "/v1/jobs",
            content=body.encode(),
            headers={**api.auth(api.orchestrator_key), "content-type": "application/json"},
        )

    fits = api.job(payload={"blob": "a" * (limit - wrapper)})  # exactly `limit` bytes
    too_big = api.job(payload={"blob": "a" * (limit - wrapper + 1)})
    response = await send(api.job(), too_big)
    assert response.status_code == 413, response.text
    assert error_code(response) == "payload-too-large"
    assert response.json()["error"]["details"]["index"] == 1
    assert await pending_count(db) == 0
    assert results(await send(fits)) == ["enqueued"]


async def test_enqueue_body_over_the_server_limit_is_413_and_enqueues_nothing(
    api: Api, db: asyncpg.Connection
) -> None:
    limit = api.daemon.settings.server.max_body_bytes
    jobs = [api.job(payload={"blob": "a" * 60_000}) for _ in range(limit // 60_000 + 1)]
    response = await api.enqueue(*jobs)
    assert response.status_code == 413
    assert error_code(response) == "payload-too-large"
    assert await pending_count(db) == 0


def _bad_jobs(api: Api) -> dict[str, dict[str, Any]]:
    naive = datetime.now().replace(tzinfo=None).isoformat()
    return {
        "bad-execution-id": api.job(job_execution_id="not-a-uuid"),
        "bad-workspace-id": api.job(workspace_id="123"),
        "naive-queued-at": api.job(queued_at=naive),
        "queued-at-not-a-time": api.job(queued_at="yesterday"),
        "slash-label": api.job(["linux/amd64"]),
        "no-labels": {**api.job(), "required_labels": []},
        "21-labels": api.job([f"l{i}" for i in range(21)]),
        "unknown-job-field": api.job(urgency=5),
        "payload-not-an-object": api.job(payload=[1, 2]),
        "missing-project": {k: v for k, v in api.job().items() if k != "project_id"},
    }


@pytest.mark.parametrize(
    "case",
    [
        "bad-execution-id",
        "bad-workspace-id",
        "naive-queued-at",
        "queued-at-not-a-time",
        "slash-label",
        "no-labels",
        "21-labels",
        "unknown-job-field",
        "payload-not-an-object",
        "missing-project",
    ],
)
async def test_enqueue_with_an_invalid_job_is_400_and_enqueues_nothing(
    api: Api, db: asyncpg.Connection, case: str
) -> None:
    response = await api.enqueue(api.job(), _bad_jobs(api)[case])
    assert response.status_code == 400, response.text
    assert error_code(response) == "validation-error"
    assert await pending_count(db) == 0


@pytest.mark.parametrize(
    "body",
    [{"jobs": []}, {}, {"jobs": [], "dry_run": True}, [], "jobs"],
    ids=["no-jobs", "no-field", "unknown-field", "array", "string"],
)
async def test_enqueue_with_an_invalid_body_is_400(api: Api, body: Any) -> None:
    response = await enqueue_raw(api, body)
    assert response.status_code == 400, response.text
    assert error_code(response) == "validation-error"


async def test_enqueue_with_malformed_json_is_400(api: Api, db: asyncpg.Connection) -> None:
    response = await api.http.post(
        "/v1/jobs",
        content=b'{"jobs": [',
        headers={**api.auth(api.orchestrator_key), "content-type": "application/json"},
    )
    assert response.status_code == 400
    assert error_code(response) == "validation-error"
    assert await pending_count(db) == 0


async def test_enqueue_of_more_than_the_batch_limit_is_400_and_enqueues_nothing(
    api: Api, db: asyncpg.Connection
) -> None:
    limit = api.daemon.settings.queue.max_batch_size
    response = await api.enqueue(*[api.job() for _ in range(limit + 1)])
    assert response.status_code == 400, response.text
    assert error_code(response) == "validation-error"
    assert response.json()["error"]["details"] == {"count": limit + 1}
    assert await pending_count(db) == 0
    assert results(await api.enqueue(*[api.job() for _ in range(limit)])) == ["enqueued"] * limit


async def test_a_workspace_key_cannot_enqueue_for_another_workspace(
    api: Api, db: asyncpg.Connection
) -> None:
    key = await scoped_key(api, api.workspace)
    own = api.job()
    foreign = api.job(workspace_id=str(uuid.uuid4()))
    response = await enqueue_raw(api, {"jobs": [own, foreign]}, key)
    assert response.status_code == 403
    assert error_code(response) == "forbidden"
    assert await pending_count(db) == 0
    assert results(await enqueue_raw(api, {"jobs": [own]}, key)) == ["enqueued"]


@pytest.mark.parametrize("token_kind", ["none", "admin", "manual", "unknown"])
async def test_enqueue_without_an_orchestrator_key_is_401(
    api: Api, db: asyncpg.Connection, token_kind: str
) -> None:
    headers = {
        "none": {},
        "admin": api.auth(api.admin_key),
        "manual": api.auth(api.registration_token),
        "unknown": api.auth("cp_oak_" + "A" * 43),
    }[token_kind]
    response = await api.http.post("/v1/jobs", json={"jobs": [api.job()]}, headers=headers)
    assert response.status_code == 401
    assert error_code(response) == "unauthorized"
    assert await pending_count(db) == 0


async def test_a_revoked_or_expired_orchestrator_key_is_401_with_its_reason(
    api: Api, db: asyncpg.Connection
) -> None:
    await db.execute(
        "UPDATE api_keys SET expires_at = now() - interval '1 second' WHERE kind = 'orchestrator'"
    )
    response = await api.enqueue(api.job())
    assert response.status_code == 401
    assert error_code(response) == "api-key-expired"
    await db.execute("UPDATE api_keys SET expires_at = NULL, revoked_at = now()")
    response = await api.enqueue(api.job())
    assert response.status_code == 401
    assert error_code(response) == "api-key-revoked"
    assert await pending_count(db) == 0


# Outcome --------------------------------------------------------------------------------------


async def test_cancelling_a_pending_execution_removes_it_and_tombstones_it(
    api: Api, db: asyncpg.Connection
) -> None:
    job = api.job()
    await api.enqueue(job)
    response = await outcome(
        api, job["job_execution_id"], {"status": "cancelled", "reason": "stop"}
    )
    assert response.status_code == 200, response.text
    assert response.json() == {"was_pending": True, "was_running": False, "newly_ended": True}
    assert await pending_count(db) == 0
    found = await state(api, job["job_execution_id"])
    assert found.status_code == 200
    assert found.json()["state"] == "ended"
    assert found.json()["outcome"] == "cancelled"
    assert found.json()["ended_by"] == "orchestrator"
    assert results(await api.enqueue(job)) == ["ended"]
    payload = await db.fetchval(
        "SELECT payload::text FROM events WHERE event_type = 'job.cancelled'"
    )
    assert '"reason": "stop"' in payload
    again = await outcome(api, job["job_execution_id"], {"status": "cancelled"})
    assert again.json() == {"was_pending": False, "was_running": False, "newly_ended": False}


async def test_cancelling_a_running_execution_asks_its_runner_to_stop(
    api: Api, db: asyncpg.Connection
) -> None:
    job = api.job()
    lease = await claim(api, job)
    response = await outcome(api, job["job_execution_id"], {"status": "cancelled"})
    assert response.json() == {"was_pending": False, "was_running": True, "newly_ended": True}
    assert await db.fetchval("SELECT cancellation_requested_at IS NOT NULL FROM running_jobs")
    found = (await state(api, job["job_execution_id"])).json()
    assert found["cancel_requested"] is True
    assert found["runner_session_id"] is not None
    beat = await api.http.post(
        f"/v1/runners/jobs/{job['job_execution_id']}/heartbeat", headers=api.auth(lease)
    )
    assert beat.json()["cancel"] is True


async def test_an_installation_key_can_end_an_unknown_execution_before_its_enqueue(
    api: Api, db: asyncpg.Connection
) -> None:
    job = api.job()
    response = await outcome(api, job["job_execution_id"], {"status": "succeeded"})
    assert response.status_code == 200
    assert response.json() == {"was_pending": False, "was_running": False, "newly_ended": True}
    assert results(await api.enqueue(job)) == ["ended"]
    assert await pending_count(db) == 0


@pytest.mark.parametrize(
    "body",
    [
        {"status": "expired"},
        {"status": "done"},
        {},
        {"status": "cancelled", "reason": ""},
        {"status": "cancelled", "reason": "a" * 513},
        {"status": "cancelled", "reason": "bad\nline"},
        {"status": "cancelled", "by": "me"},
    ],
    ids=["expired", "unknown", "missing", "empty-reason", "long-reason", "control-char", "extra"],
)
async def test_outcome_with_a_bad_body_is_400_and_changes_nothing(
    api: Api, db: asyncpg.Connection, body: dict[str, Any]
) -> None:
    job = api.job()
    await api.enqueue(job)
    response = await outcome(api, job["job_execution_id"], body)
    assert response.status_code == 400, response.text
    assert error_code(response) == "validation-error"
    assert await pending_count(db) == 1
    assert await db.fetchval("SELECT count(*) FROM ended_executions") == 0


async def test_outcome_and_state_with_a_non_uuid_path_are_400(api: Api) -> None:
    response = await outcome(api, "nope", {"status": "cancelled"})
    assert response.status_code == 400
    assert error_code(response) == "validation-error"
    response = await state(api, "nope")
    assert response.status_code == 400
    assert error_code(response) == "validation-error"


# Execution state ------------------------------------------------------------------------------


async def test_execution_state_follows_the_execution_from_pending_to_ended(api: Api) -> None:
    job = api.job()
    execution = job["job_execution_id"]
    unknown = await state(api, execution)
    assert unknown.status_code == 404
    assert error_code(unknown) == "not-found"
    await api.enqueue(job)
    assert (await state(api, execution)).json() == {
        "job_execution_id": execution,
        "state": "pending",
        "workspace_id": str(api.workspace),
        "outcome": None,
        "ended_by": None,
        "runner_session_id": None,
        "cancel_requested": False,
        "exit_code": None,
        "output_tail": None,
        "waiting": {
            "stuck": True,
            "missing_labels": ["linux"],
            "reason": "no live runner or connected provisioner offers linux",
            "live_runners": 0,
            "busy_runners": 0,
            "templates": 0,
            "paused_runners": 0,
            "position": 1,
            "reasons": [
                {
                    "code": "no-taker",
                    "message": "no live runner or connected provisioner offers linux",
                }
            ],
        },
        "attempt": 1,
        "lost_attempts": [],
    }
    claimed = await api.request_job(await api.register())
    assert claimed.status_code == 200
    running = (await state(api, execution)).json()
    assert running["state"] == "running"
    assert running["runner_session_id"] is not None
    assert running["cancel_requested"] is False
    await api.http.post(
        f"/v1/runners/jobs/{execution}/complete",
        json={"outcome": "succeeded", "exit_code": 0, "output_tail": "ok\n"},
        headers=api.auth(claimed.json()["lease_token"]),
    )
    ended = (await state(api, execution)).json()
    assert (ended["state"], ended["outcome"], ended["ended_by"]) == ("ended", "succeeded", "runner")
    assert (ended["exit_code"], ended["output_tail"]) == (0, "ok\n")


async def test_the_server_keeps_the_last_output_tail_bytes_of_a_reported_tail(
    database_url: str,
) -> None:
    """A runner may send more than the server keeps; the server keeps the end, whole characters
    only (the ellipsis is three bytes), and tells runners how much it keeps with each job."""
    config = conftest.test_settings(runners__output_tail_bytes=8)
    async for daemon in conftest.run_daemon(database_url, config):
        async with conftest.open_api(daemon, database_url) as api:
            job = api.job()
            await api.enqueue(job)
            claimed = await api.request_job(await api.register())
            assert claimed.json()["output_tail_bytes"] == 8
            execution = job["job_execution_id"]
            done = await api.http.post(
                f"/v1/runners/jobs/{execution}/complete",
                json={"outcome": "failed", "exit_code": 1, "output_tail": "start…middle…end\n"},
                headers=api.auth(claimed.json()["lease_token"]),
            )
            assert done.status_code == 200, done.text
            ended = (await state(api, execution)).json()
            assert ended["output_tail"] == "e…end\n"  # 8 bytes: 1 + 3 + 4


# Workspace scope ------------------------------------------------------------------------------


async def test_a_workspace_key_never_sees_or_ends_another_workspaces_execution(
    api: Api, db: asyncpg.Connection
) -> None:
    other = uuid.uuid4()
    key = await scoped_key(api, other)
    job = api.job()
    await api.enqueue(job)
    execution = job["job_execution_id"]
    found = await state(api, execution, key)
    assert found.status_code == 404
    assert error_code(found) == "not-found"
    ended = await outcome(api, execution, {"status": "cancelled"}, key)
    assert ended.status_code == 404
    assert error_code(ended) == "not-found"
    # An execution nobody knows is not found either: a scoped key writes no tombstones.
    unknown = await outcome(api, str(uuid.uuid4()), {"status": "cancelled"}, key)
    assert unknown.status_code == 404
    assert await pending_count(db) == 1
    assert await db.fetchval("SELECT count(*) FROM ended_executions") == 0
    assert (await state(api, execution)).json()["state"] == "pending"
    own = api.job(workspace_id=str(other))
    assert results(await enqueue_raw(api, {"jobs": [own]}, key)) == ["enqueued"]
    assert (await state(api, own["job_execution_id"], key)).json()["state"] == "pending"
    mine = await outcome(api, own["job_execution_id"], {"status": "cancelled"}, key)
    assert mine.json()["was_pending"] is True


async def test_a_workspace_key_reads_only_its_workspaces_events(api: Api) -> None:
    other = uuid.uuid4()
    key = await scoped_key(api, other)
    await claim(api, api.job())
    everything = (await events(api)).json()["events"]
    assert [event["type"] for event in everything] == ["job.claimed"]
    assert (await events(api, key=key)).json()["events"] == []
    forbidden = await events(api, f"?workspace_id={api.workspace}", key)
    assert forbidden.status_code == 403
    assert error_code(forbidden) == "forbidden"
    allowed = await events(api, f"?workspace_id={other}", key)
    assert allowed.status_code == 200
    assert allowed.json()["events"] == []


# Events ---------------------------------------------------------------------------------------


async def test_events_page_through_the_feed_with_the_cursor(api: Api) -> None:
    job = api.job()
    lease = await claim(api, job)
    await api.http.post(
        f"/v1/runners/jobs/{job['job_execution_id']}/complete",
        json={"outcome": "succeeded"},
        headers=api.auth(lease),
    )
    whole = (await events(api)).json()
    assert [event["type"] for event in whole["events"]] == ["job.claimed", "job.completed"]
    assert all(event["job_execution_id"] == job["job_execution_id"] for event in whole["events"])
    assert whole["events"][1]["payload"]["outcome"] == "succeeded"
    first = (await events(api, "?limit=1")).json()
    assert [event["type"] for event in first["events"]] == ["job.claimed"]
    second = (await events(api, f"?limit=1&after={first['next_cursor']}")).json()
    assert [event["type"] for event in second["events"]] == ["job.completed"]
    assert second["next_cursor"] == whole["next_cursor"]
    last = (await events(api, f"?after={second['next_cursor']}")).json()
    assert last == {"events": [], "next_cursor": second["next_cursor"]}
    other = (await events(api, f"?workspace_id={uuid.uuid4()}")).json()
    assert other["events"] == []


@pytest.mark.parametrize(
    ("query", "code"),
    [
        ("?after=not-a-cursor", "invalid-cursor"),
        ("?after=1.x", "invalid-cursor"),
        ("?after=.5", "invalid-cursor"),
        ("?limit=0", "validation-error"),
        ("?limit=1001", "validation-error"),
        ("?limit=1.5", "validation-error"),
        ("?wait=11", "validation-error"),
        ("?wait=-1", "validation-error"),
        ("?workspace_id=abc", "validation-error"),
    ],
)
async def test_events_with_bad_query_parameters_are_400(api: Api, query: str, code: str) -> None:
    response = await events(api, query)
    assert response.status_code == 400
    assert error_code(response) == code


async def test_an_event_long_poll_answers_when_an_event_arrives(api: Api) -> None:
    cursor = (await events(api)).json()["next_cursor"]
    job = api.job()
    await api.enqueue(job)
    got: list[httpx.Response] = []

    async def reader() -> None:
        got.append(await events(api, f"?after={cursor}&wait=10"))

    with anyio.fail_after(5):  # well inside the 10 s wait: woken by the claim, not the deadline
        async with anyio.create_task_group() as group:
            group.start_soon(reader)
            assert (await api.request_job(await api.register())).status_code == 200
    assert [event["type"] for event in got[0].json()["events"]] == ["job.claimed"]


async def test_an_event_long_poll_with_nothing_new_answers_empty_at_its_deadline(
    api: Api,
) -> None:
    with anyio.fail_after(5):
        response = await events(api, "?after=0.0&wait=0.3")
    assert response.json() == {"events": [], "next_cursor": "0.0"}
