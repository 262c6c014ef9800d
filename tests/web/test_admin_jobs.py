"""Operators' job routes: the list, one execution with why it waits, cancel, pending groups."""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg
import httpx

from tests.web.conftest import Api


async def _get(api: Api, path: str, **params: str) -> httpx.Response:
    return await api.http.get(path, params=params, headers=api.auth(api.admin_key))


async def _three_jobs(api: Api) -> dict[str, dict[str, Any]]:
    """Changed in this order: `running` started, `ended` ended (with an output tail), `pending`
    was enqueued."""
    jobs = {name: api.job(["linux"]) for name in ("ended", "running", "pending")}
    session = await api.register(["linux", "x64"])
    for name in ("ended", "running"):
        await api.enqueue(jobs[name])
        claimed = await api.request_job(session)
        assert claimed.json()["job_execution_id"] == jobs[name]["job_execution_id"]
        jobs[name]["lease"] = claimed.json()["lease_token"]
    done = await api.http.post(
        f"/v1/runners/jobs/{jobs['ended']['job_execution_id']}/complete",
        json={"outcome": "failed", "exit_code": 2, "output_tail": "boom\n"},
        headers=api.auth(jobs["ended"]["lease"]),
    )
    assert done.status_code == 200
    await api.enqueue(jobs["pending"])
    return jobs


async def test_jobs_are_listed_newest_change_first_and_filtered(api: Api) -> None:
    jobs = await _three_jobs(api)
    listed = await _get(api, "/v1/admin/jobs", workspace_id=str(api.workspace))
    assert listed.status_code == 200, listed.text
    items = listed.json()["items"]
    assert [item["status"] for item in items] == ["pending", "ended", "running"]
    assert [item["job_execution_id"] for item in items] == [
        jobs[name]["job_execution_id"] for name in ("pending", "ended", "running")
    ]
    ended = items[1]
    assert (ended["outcome"], ended["exit_code"], ended["required_labels"]) == ("failed", 2, None)
    assert items[2]["runner_session_id"] is not None
    running = await _get(api, "/v1/admin/jobs", status="running")
    assert [item["status"] for item in running.json()["items"]] == ["running"]
    by_labels = await _get(api, "/v1/admin/jobs", labels="linux")
    assert {item["status"] for item in by_labels.json()["items"]} == {"pending", "running"}
    assert (await _get(api, "/v1/admin/jobs", labels="gpu")).json()["items"] == []
    other = await _get(api, "/v1/admin/jobs", workspace_id=str(uuid.uuid4()))
    assert other.json()["items"] == []
    first = await _get(api, "/v1/admin/jobs", limit="2")
    assert len(first.json()["items"]) == 2 and first.json()["next_cursor"]
    rest = await _get(api, "/v1/admin/jobs", limit="2", cursor=first.json()["next_cursor"])
    assert [item["status"] for item in rest.json()["items"]] == ["running"]
    assert rest.json()["next_cursor"] is None


async def test_bad_list_queries_are_refused(api: Api) -> None:
    for params in ({"status": "done"}, {"labels": ""}, {"labels": "Bad Label"}, {"x": "1"}):
        refused = await _get(api, "/v1/admin/jobs", **params)
        assert refused.status_code == 400, (params, refused.text)
    assert (await api.http.get("/v1/admin/jobs")).status_code == 401
    orchestrator = await api.http.get("/v1/admin/jobs", headers=api.auth(api.orchestrator_key))
    assert orchestrator.status_code in (401, 403)


async def test_show_gives_the_output_tail_of_an_ended_job(api: Api) -> None:
    jobs = await _three_jobs(api)
    shown = await _get(api, f"/v1/admin/jobs/{jobs['ended']['job_execution_id']}")
    assert shown.status_code == 200
    body = shown.json()
    assert (body["job"]["status"], body["output_tail"], body["waiting"]) == (
        "ended",
        "boom\n",
        None,
    )
    missing = await _get(api, f"/v1/admin/jobs/{uuid.uuid4()}")
    assert missing.status_code == 404


async def test_a_pending_job_says_why_it_waits(api: Api) -> None:
    stuck = api.job(["gpu", "linux"])
    await api.enqueue(stuck)
    await api.register(["linux", "x64"])  # live, idle, but without gpu
    shown = (await _get(api, f"/v1/admin/jobs/{stuck['job_execution_id']}")).json()
    assert shown["waiting"] == {
        "stuck": True,
        "missing_labels": ["gpu"],
        "reason": "no live runner or connected provisioner offers gpu",
        "live_runners": 0,
        "busy_runners": 0,
        "templates": 0,
        "paused_runners": 0,
        "position": 1,
        "reasons": [
            {"code": "no-taker", "message": "no live runner or connected provisioner offers gpu"}
        ],
    }
    groups = (await _get(api, "/v1/admin/queue/pending")).json()["items"]
    assert [(g["labels"], g["pending"], g["waiting"]["stuck"]) for g in groups] == [
        (["gpu", "linux"], 1, True)
    ]
    await api.register(["gpu", "linux"])  # now someone can take it
    shown = (await _get(api, f"/v1/admin/jobs/{stuck['job_execution_id']}")).json()
    assert shown["waiting"]["stuck"] is False
    assert shown["waiting"]["live_runners"] == 1


async def test_an_operator_cancels_a_pending_job(api: Api, db: asyncpg.Connection) -> None:
    job = api.job()
    await api.enqueue(job)
    execution = job["job_execution_id"]
    path = f"/v1/admin/jobs/{execution}/cancel"
    cancelled = await api.http.post(path, headers=api.auth(api.admin_key))
    assert cancelled.json() == {"was_pending": True, "was_running": False, "newly_ended": True}
    again = await api.http.post(path, headers=api.auth(api.admin_key))
    assert again.json()["newly_ended"] is False
    row = await db.fetchrow(
        "SELECT outcome, ended_by FROM ended_executions WHERE job_execution_id = $1",
        uuid.UUID(execution),
    )
    assert row is not None and (row["outcome"], row["ended_by"]) == ("cancelled", "orchestrator")
    unknown = await api.http.post(
        f"/v1/admin/jobs/{uuid.uuid4()}/cancel", headers=api.auth(api.admin_key)
    )
    assert unknown.status_code == 404
    assert await db.fetchval("SELECT count(*) FROM ended_executions") == 1
