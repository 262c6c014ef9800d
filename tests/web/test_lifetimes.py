"""The life of an execution through real HTTP (docs/policies.md Q-40..Q-69): the enqueue fields
and their bounds, a held heartbeat that meets its run deadline, the attempts of a retried job,
and the `enqueue` command's flags."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import anyio
import asyncpg
import httpx
import pytest

from controlplane.agent.queue_client import Lifetime, enqueue_body
from tests.web.conftest import Api

KNOBS = {"timeout": 21_600, "queue": 86_400}


def error_of(response: httpx.Response) -> dict[str, Any]:
    body: dict[str, Any] = response.json()["error"]
    return body


async def policies(db: asyncpg.Connection, execution: str) -> tuple[int, int, int, float]:
    row = await db.fetchrow(
        """
        SELECT timeout_seconds, queue_timeout_seconds, retries_on_lost,
               EXTRACT(epoch FROM expires_at - enqueued_at)::float8 AS queue_window
        FROM pending_jobs WHERE job_execution_id = $1
        """,
        UUID(execution),
    )
    assert row is not None
    return (row[0], row[1], row[2], row[3])


async def test_q40_enqueue_defaults_each_life_policy_from_the_settings(
    api: Api, db: asyncpg.Connection
) -> None:
    # A whole number may be written as 900.0, as JSON Schema's `integer` admits.
    plain, chosen = api.job(), api.job(timeout_seconds=900.0, queue_timeout_seconds=60)
    chosen["retries_on_lost"] = 2.0
    response = await api.enqueue(plain, chosen)
    assert response.status_code == 200, response.text

    assert await policies(db, plain["job_execution_id"]) == (
        KNOBS["timeout"],
        KNOBS["queue"],
        0,
        float(KNOBS["queue"]),
    )
    assert await policies(db, chosen["job_execution_id"]) == (900, 60, 2, 60.0)


@pytest.mark.parametrize(
    ("field", "value", "code_field"),
    [
        ("timeout_seconds", 432_001, "timeout_seconds"),
        ("queue_timeout_seconds", 604_801, "queue_timeout_seconds"),
        ("retries_on_lost", 6, "retries_on_lost"),
    ],
)
async def test_q40_a_life_policy_beyond_its_setting_is_400_naming_it_and_enqueues_nothing(
    api: Api, db: asyncpg.Connection, field: str, value: int, code_field: str
) -> None:
    fine, beyond = api.job(), api.job()
    beyond[field] = value
    response = await api.enqueue(fine, beyond)

    assert response.status_code == 400
    error = error_of(response)
    assert error["code"] == "validation-error"
    assert error["details"]["field"] == code_field and error["details"]["index"] == 1
    # The published schema says the same bound.
    schema = (await api.http.get("/openapi.json")).json()["components"]["schemas"]["EnqueueJob"]
    prop = schema["properties"][field]
    published = [b["maximum"] for b in prop.get("anyOf", [prop]) if "maximum" in b]
    assert published == [value - 1]
    assert f"jobs[1].{field}" in error["message"]
    assert await db.fetchval("SELECT count(*) FROM pending_jobs") == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("timeout_seconds", 0),
        ("timeout_seconds", "60"),
        ("queue_timeout_seconds", -1),
        ("queue_timeout_seconds", 1.5),
        ("retries_on_lost", -1),
        ("retries_on_lost", None),
    ],
)
async def test_q40_a_life_policy_of_the_wrong_type_or_sign_is_400(
    api: Api, db: asyncpg.Connection, field: str, value: object
) -> None:
    job = api.job()
    job[field] = value
    response = await api.enqueue(job)

    assert response.status_code == 400
    assert error_of(response)["code"] == "validation-error"
    assert field in error_of(response)["message"]
    assert await db.fetchval("SELECT count(*) FROM pending_jobs") == 0


async def test_q42_a_heartbeat_held_across_the_run_deadline_answers_cancel_at_it(
    api: Api, db: asyncpg.Connection
) -> None:
    session = await api.register()
    job = api.job(timeout_seconds=1)
    assert (await api.enqueue(job)).status_code == 200
    claim = await api.request_job(session)
    assert claim.status_code == 200, claim.text
    lease = claim.json()["lease_token"]

    # Held for up to 30 s, it is answered once the 1 s timeout has passed: the fail_after is
    # a deadline on the test, far inside the wait.
    with anyio.fail_after(15):
        answer = await api.http.post(
            f"/v1/runners/jobs/{job['job_execution_id']}/heartbeat?wait=30",
            headers=api.auth(lease),
        )
    assert answer.status_code == 200, answer.text
    assert answer.json()["cancel"] is True
    past: bool = await db.fetchval(
        "SELECT started_at + interval '1 second' <= now() FROM running_jobs"
        " WHERE job_execution_id = $1",
        UUID(job["job_execution_id"]),
    )
    assert past
    # Every heartbeat after the deadline answers cancel at once, held or not.
    again = await api.http.post(
        f"/v1/runners/jobs/{job['job_execution_id']}/heartbeat?wait=30",
        headers=api.auth(answer.json()["lease_token"]),
    )
    assert again.json()["cancel"] is True


async def test_q61_the_execution_read_lists_the_lost_attempts(
    api: Api, db: asyncpg.Connection
) -> None:
    first = await api.register()
    job = api.job(retries_on_lost=1)
    assert (await api.enqueue(job)).status_code == 200
    assert (await api.request_job(first)).status_code == 200
    execution = UUID(job["job_execution_id"])
    # The runner vanished long ago: its lease is stale, and the daemon's reaper retries it.
    await db.execute(
        """
        UPDATE running_jobs SET started_at = now() - interval '20 minutes',
               first_heartbeat_at = now() - interval '19 minutes',
               last_heartbeat_at = now() - interval '15 minutes'
        WHERE job_execution_id = $1
        """,
        execution,
    )
    with anyio.fail_after(15):
        while not await db.fetchval(
            "SELECT EXISTS (SELECT 1 FROM pending_jobs WHERE job_execution_id = $1)", execution
        ):
            await anyio.sleep(0.05)

    read = await api.http.get(f"/v1/jobs/{execution}", headers=api.auth(api.orchestrator_key))

    assert read.status_code == 200, read.text
    body = read.json()
    assert body["state"] == "pending" and body["attempt"] == 2
    [lost] = body["lost_attempts"]
    assert lost["attempt"] == 1 and lost["outcome"] == "lost"
    assert lost["started_at"] < lost["ended_at"]
    session_id = await db.fetchval("SELECT runner_session_id FROM execution_attempts")
    assert lost["runner_session_id"] == str(session_id)


def test_the_enqueue_command_sends_only_the_life_policies_it_was_given() -> None:
    now = datetime.now(UTC)
    plain = enqueue_body(UUID(int=1), ["linux"], ["true"], now)
    chosen = enqueue_body(
        UUID(int=1),
        ["linux"],
        ["true"],
        now,
        lifetime=Lifetime(timeout_seconds=60, retries_on_lost=2),
    )
    plain_job: dict[str, object] = plain["jobs"][0]  # type: ignore[index]
    chosen_job: dict[str, object] = chosen["jobs"][0]  # type: ignore[index]
    assert "timeout_seconds" not in plain_job and "retries_on_lost" not in plain_job
    assert chosen_job["timeout_seconds"] == 60 and chosen_job["retries_on_lost"] == 2
    assert "queue_timeout_seconds" not in chosen_job
