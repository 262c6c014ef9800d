"""Why a pending job waits, through real HTTP against a real daemon (docs/policies.md Q-82..Q-88):
its position among the jobs a runner with its labels takes first, and every policy holding it
back, on the orchestrator's and the operators' reads alike."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import asyncpg
import httpx
import msgspec

from controlplane.agent.admin_client import job_lines
from controlplane.wire.jobs import JobDetail
from tests.web.conftest import Api


async def _waiting(api: Api, job: dict[str, Any]) -> Any:
    """The orchestrator's `waiting` of one job, checked equal to the operators' one."""
    execution = job["job_execution_id"]
    state = await api.http.get(f"/v1/jobs/{execution}", headers=api.auth(api.orchestrator_key))
    assert state.status_code == 200, state.text
    detail = await api.http.get(f"/v1/admin/jobs/{execution}", headers=api.auth(api.admin_key))
    assert detail.status_code == 200, detail.text
    assert state.json()["waiting"] == detail.json()["waiting"]
    return state.json()["waiting"]


def _codes(waiting: Any) -> list[str]:
    return [reason["code"] for reason in waiting["reasons"]]


async def _enqueue(api: Api, *jobs: dict[str, Any]) -> None:
    response = await api.enqueue(*jobs)
    assert response.status_code == 200, response.text


async def _register(api: Api, labels: list[str]) -> tuple[str, str]:
    response = await api.http.post(
        "/v1/runners/register",
        json={"labels": labels},
        headers=api.auth(api.registration_token),
    )
    assert response.status_code == 200, response.text
    body = response.json()
    return body["session_token"], body["session_id"]


async def _admin(api: Api, path: str) -> httpx.Response:
    response = await api.http.post(f"/v1/admin/{path}", headers=api.auth(api.admin_key))
    assert response.status_code == 200, response.text
    return response


async def test_q82_the_position_counts_only_what_a_runner_with_its_labels_takes_first(
    api: Api,
) -> None:
    # A keyed job runs, so its key (limit 1) is full.
    keyed_first = api.job(["linux"], concurrency_key="deploy", concurrency_limit=1)
    await _enqueue(api, keyed_first)
    session, _ = await _register(api, ["linux"])
    claimed = await api.request_job(session)
    assert claimed.json()["job_execution_id"] == keyed_first["job_execution_id"]
    # In queue order (each job's queued_at is when it was made here):
    older = api.job(["linux"])
    urgent = api.job(["linux"], priority=5)
    other_labels = api.job(["gpu"])  # a runner with only linux never takes it
    keyed_waiting = api.job(["linux"], concurrency_key="deploy", concurrency_limit=1)
    wider = api.job(["linux", "x64"])  # a runner with only linux cannot take it
    me = api.job(["linux"])
    behind_me = api.job(["linux"])
    await _enqueue(api, older, urgent, other_labels, keyed_waiting, wider, me, behind_me)
    # Ahead of `me`: urgent (higher priority), then older; not the gpu job, not the keyed job
    # (its key is full), not the wider job (a linux runner cannot take it), not what is behind.
    assert (await _waiting(api, me))["position"] == 3
    assert (await _waiting(api, urgent))["position"] == 1
    assert (await _waiting(api, behind_me))["position"] == 4
    # A wider job's runner could take every linux job too, but `me` is behind it.
    assert (await _waiting(api, wider))["position"] == 3
    other_workspace = {**api.job(["linux"]), "workspace_id": str(uuid.uuid4())}
    await _enqueue(api, other_workspace)
    assert (await _waiting(api, behind_me))["position"] == 4
    # The runner takes the next job (urgent): it is running, with no `waiting`, and `me` moves up.
    claimed = await api.request_job(session)
    assert claimed.json()["job_execution_id"] == urgent["job_execution_id"]
    running = await api.http.get(
        f"/v1/jobs/{urgent['job_execution_id']}", headers=api.auth(api.orchestrator_key)
    )
    assert running.json()["state"] == "running" and running.json()["waiting"] is None
    assert (await _waiting(api, me))["position"] == 2


async def test_q83_labels_nobody_offers_are_named_until_a_runner_offers_them(api: Api) -> None:
    job = api.job(["linux", "gpu"])
    await _enqueue(api, job)
    await _register(api, ["linux", "x64"])
    waiting = await _waiting(api, job)
    assert waiting["stuck"] is True
    assert waiting["reasons"] == [
        {"code": "no-taker", "message": "no live runner or connected provisioner offers gpu"}
    ]
    assert waiting["position"] == 1
    await _register(api, ["gpu", "linux"])
    waiting = await _waiting(api, job)
    assert waiting["stuck"] is False and waiting["reasons"] == []


async def test_q84_a_full_concurrency_key_is_a_reason_until_its_running_job_ends(
    api: Api,
) -> None:
    first = api.job(["linux"], concurrency_key="deploy/prod", concurrency_limit=1)
    second = api.job(["linux"], concurrency_key="deploy/prod", concurrency_limit=1)
    await _enqueue(api, first, second)
    session, _ = await _register(api, ["linux"])
    claimed = await api.request_job(session)
    assert claimed.json()["job_execution_id"] == first["job_execution_id"]
    waiting = await _waiting(api, second)
    full = [r for r in waiting["reasons"] if r["code"] == "concurrency-key-full"]
    assert full == [
        {
            "code": "concurrency-key-full",
            "message": "concurrency key 'deploy/prod' is at its limit (1 of 1 running)",
        }
    ]
    done = await api.http.post(
        f"/v1/runners/jobs/{first['job_execution_id']}/complete",
        json={"outcome": "succeeded"},
        headers=api.auth(claimed.json()["lease_token"]),
    )
    assert done.status_code == 200, done.text
    assert "concurrency-key-full" not in _codes(await _waiting(api, second))


async def test_q85_a_paused_workspace_and_paused_runners_are_reasons_until_resumed(
    api: Api,
) -> None:
    job = api.job(["linux"])
    await _enqueue(api, job)
    _, session_id = await _register(api, ["linux"])
    assert _codes(await _waiting(api, job)) == []  # an idle runner takes it at its next poll
    await _admin(api, f"workspaces/{api.workspace}/pause")
    assert _codes(await _waiting(api, job)) == ["workspace-paused"]
    await _admin(api, f"runners/{session_id}/pause")
    waiting = await _waiting(api, job)
    assert _codes(waiting) == ["workspace-paused", "runners-paused"]
    assert (waiting["live_runners"], waiting["paused_runners"]) == (1, 1)
    assert waiting["reason"] == "all 1 matching runners are paused"
    await _admin(api, f"workspaces/{api.workspace}/resume")
    await _admin(api, f"runners/{session_id}/resume")
    waiting = await _waiting(api, job)
    assert _codes(waiting) == [] and waiting["paused_runners"] == 0


async def test_q86_jobs_of_a_higher_priority_ahead_are_a_reason_and_counted(api: Api) -> None:
    same = api.job(["linux"], priority=1)
    await _enqueue(api, same)
    await _register(api, ["linux"])
    me = api.job(["linux"], priority=1)
    await _enqueue(api, me)
    assert "behind-higher-priority" not in _codes(await _waiting(api, me))
    await _enqueue(api, api.job(["linux"], priority=7), api.job(["linux"], priority=3))
    waiting = await _waiting(api, me)
    ahead = [r for r in waiting["reasons"] if r["code"] == "behind-higher-priority"]
    assert ahead == [
        {
            "code": "behind-higher-priority",
            "message": "2 jobs of a higher priority than 1 are ahead of it",
        }
    ]
    assert waiting["position"] == 4


async def test_q87_a_job_past_its_queue_deadline_says_so_until_the_leader_removes_it(
    api: Api,
) -> None:
    job = api.job(["linux"], queue_timeout_seconds=3600)
    await _enqueue(api, job)
    await _register(api, ["linux"])
    assert "queue-expired" not in _codes(await _waiting(api, job))
    execution = uuid.UUID(job["job_execution_id"])
    # The leader's expiry locks pending rows FOR UPDATE SKIP LOCKED (store/deadlines.py). The
    # holder takes FOR KEY SHARE before the deadline moves: that lock lets the UPDATE of the
    # non-key expires_at through but makes the expiry skip the row, so the job stays pending
    # for both reads however soon the leader's next round comes.
    async with (
        asyncpg_connection(api) as db,
        asyncpg_connection(api) as holder,
        holder.transaction(),
    ):
        await holder.execute(
            "SELECT 1 FROM pending_jobs WHERE job_execution_id = $1 FOR KEY SHARE", execution
        )
        await db.execute(  # the deadline passes (no sleep standing in)
            "UPDATE pending_jobs SET expires_at = now() - interval '1 second'"
            " WHERE job_execution_id = $1",
            execution,
        )
        assert _codes(await _waiting(api, job))[0] == "queue-expired"
        skipped = await db.fetch(  # the expiry's row lock, as it takes it, finds nothing
            "SELECT 1 FROM pending_jobs WHERE job_execution_id = $1 FOR UPDATE SKIP LOCKED",
            execution,
        )
        assert skipped == []


async def test_q88_both_reads_agree_and_the_cli_prints_the_position_and_reasons(
    api: Api,
) -> None:
    job = api.job(["linux", "gpu"], priority=-1)
    await _enqueue(api, job, api.job(["linux"]))
    await _register(api, ["linux"])
    await _waiting(api, job)  # asserts the two reads are equal
    detail = await api.http.get(
        f"/v1/admin/jobs/{job['job_execution_id']}", headers=api.auth(api.admin_key)
    )
    lines = job_lines(msgspec.json.decode(detail.content, type=JobDetail), datetime.now(UTC))
    assert "position:    2 (1: a runner with its labels takes it next)" in lines
    assert "held back:   no-taker: no live runner or connected provisioner offers gpu" in lines
    assert any(line.startswith("held back:   behind-higher-priority: 1 jobs") for line in lines)


class asyncpg_connection:
    """A connection of the test's own to the daemon's database."""

    def __init__(self, api: Api) -> None:
        self.url = api.database_url

    async def __aenter__(self) -> asyncpg.Connection:
        self.conn: asyncpg.Connection = await asyncpg.connect(self.url)
        return self.conn

    async def __aexit__(self, *exc: object) -> None:
        await self.conn.close()
