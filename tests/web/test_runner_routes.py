"""The runner routes over real HTTP: register, request a job, heartbeat, complete (J-101..J-130)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

import anyio
import asyncpg
import httpx
import pytest

from controlplane.domain import tokens
from controlplane.store import credentials
from tests.web import conftest
from tests.web.conftest import Api


def error_code(response: httpx.Response) -> str:
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"code", "message", "details"}, body
    return str(body["error"]["code"])


@dataclass(frozen=True)
class Claimed:
    session: str
    job: dict[str, Any]
    lease: str

    @property
    def execution(self) -> str:
        return str(self.job["job_execution_id"])


async def claimed(api: Api, labels: list[str] | None = None) -> Claimed:
    session = await api.register()
    job = api.job(labels)
    assert (await api.enqueue(job)).status_code == 200
    response = await api.request_job(session)
    assert response.status_code == 200, response.text
    return Claimed(session, job, response.json()["lease_token"])


async def register_body(api: Api, body: dict[str, Any], token: str | None = None) -> httpx.Response:
    return await api.http.post(
        "/v1/runners/register", json=body, headers=api.auth(token or api.registration_token)
    )


async def heartbeat(
    api: Api, execution: str, lease: str, *, wait: float | None = None, **kwargs: Any
) -> httpx.Response:
    query = "" if wait is None else f"?wait={wait}"
    return await api.http.post(
        f"/v1/runners/jobs/{execution}/heartbeat{query}", headers=api.auth(lease), **kwargs
    )


async def complete(api: Api, execution: str, lease: str, body: dict[str, Any]) -> httpx.Response:
    return await api.http.post(
        f"/v1/runners/jobs/{execution}/complete", json=body, headers=api.auth(lease)
    )


async def lease_claims(db: asyncpg.Connection, token: str) -> dict[str, Any]:
    keys = await credentials.signing_keys(db)
    return tokens.verify(token, tokens.Kind.JOB_LEASE, keys, datetime.now(UTC))


async def session_count(db: asyncpg.Connection) -> int:
    count: int = await db.fetchval("SELECT count(*) FROM runner_sessions")
    return count


async def lease_row(db: asyncpg.Connection, execution: str) -> asyncpg.Record:
    row = await db.fetchrow(
        """
        SELECT r.*, s.tool_capabilities::text AS caps, s.tool_capabilities_reported_at
        FROM running_jobs r JOIN runner_sessions s ON s.id = r.runner_session_id
        WHERE r.job_execution_id = $1
        """,
        UUID(execution),
    )
    assert row is not None
    return row


async def wait_until_parked(api: Api, count: int) -> None:
    assert api.daemon.replica is not None
    with anyio.fail_after(5):
        while api.daemon.replica.dispatcher.parked != count:
            await anyio.sleep(0.01)


@pytest.fixture
async def reserved_api(database_url: str) -> AsyncIterator[Api]:
    """A daemon whose reserved labels are `managed` (and `ci.pool`)."""
    config = conftest.test_settings(runners__reserved_labels="managed, CI.pool")
    async for daemon in conftest.run_daemon(database_url, config):
        async with httpx.AsyncClient(base_url=daemon.address, timeout=30) as http:
            client = Api(http=http, database_url=database_url, daemon=daemon)
            conn = await asyncpg.connect(database_url)
            try:
                _, client.orchestrator_key = await credentials.create_api_key(
                    conn, kind="orchestrator", name="orchestrator"
                )
                _, client.registration_token = await credentials.create_manual_token(
                    conn, workspace_id=client.workspace, name="runners"
                )
            finally:
                await conn.close()
            yield client


# Register -------------------------------------------------------------------------------------


async def test_j101_s80_register_canonicalises_labels_into_a_manual_session(
    api: Api, db: asyncpg.Connection
) -> None:
    response = await register_body(api, {"labels": ["Linux", "x64", "linux"]})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["mode"] == "manual"
    assert body["max_claims"] is None
    assert body["labels"] == ["linux", "x64"]
    assert body["session_token"].startswith("cp_rs_")
    row = await db.fetchrow("SELECT * FROM runner_sessions WHERE id = $1", UUID(body["session_id"]))
    assert row is not None
    assert row["labels"] == ["linux", "x64"]
    assert row["workspace_id"] == api.workspace
    assert row["registration_token_kind"] == "manual"
    assert row["tool_capabilities"] is None
    assert row["tool_capabilities_reported_at"] is None


async def test_j102_register_persists_capabilities_with_their_timestamp(
    api: Api, db: asyncpg.Connection
) -> None:
    capabilities = {"harnesses": {"pi": {"tools": ["bash", "git"]}}}
    response = await register_body(api, {"labels": ["linux"], "capabilities": capabilities})
    assert response.status_code == 200, response.text
    row = await db.fetchrow(
        """
        SELECT tool_capabilities::text AS caps, tool_capabilities_reported_at
        FROM runner_sessions WHERE id = $1
        """,
        UUID(response.json()["session_id"]),
    )
    assert row is not None
    assert json.loads(row["caps"]) == capabilities
    assert row["tool_capabilities_reported_at"] is not None


@pytest.mark.parametrize(
    "capabilities",
    [
        {"harnesses": {"pi": {"tools": ["bash", "bash"]}}},
        {"harnesses": {"pi": {"tools": "bash"}}},
        {"harnesses": {"Not A Harness": {"tools": []}}},
        {"harnesses": {"pi": {"tools": [""]}}},
        {"harnesses": {"pi": {"tools": [], "extra": 1}}},
        {"tools": []},
    ],
    ids=[
        "duplicate-tool",
        "tools-not-a-list",
        "bad-harness-name",
        "empty-tool",
        "extra-key",
        "no-harnesses",
    ],
)
async def test_j107_s83_bad_capabilities_are_rejected_and_create_no_session(
    api: Api, db: asyncpg.Connection, capabilities: dict[str, Any]
) -> None:
    response = await register_body(api, {"labels": ["linux"], "capabilities": capabilities})
    assert response.status_code == 400, response.text
    assert error_code(response) == "validation-error"
    assert await session_count(db) == 0


async def test_j108_s21_one_manual_token_gives_independent_sessions(
    api: Api, db: asyncpg.Connection
) -> None:
    first = await register_body(api, {"labels": ["linux"]})
    second = await register_body(api, {"labels": ["linux"]})
    assert first.status_code == second.status_code == 200
    assert first.json()["session_id"] != second.json()["session_id"]
    assert first.json()["mode"] == second.json()["mode"] == "manual"
    assert first.json()["max_claims"] is second.json()["max_claims"] is None
    assert await session_count(db) == 2


async def test_j113_s75_manual_registration_is_not_rate_limited(
    api: Api, db: asyncpg.Connection
) -> None:
    statuses = [(await register_body(api, {"labels": ["linux"]})).status_code for _ in range(6)]
    assert statuses == [200] * 6
    assert await session_count(db) == 6


@pytest.mark.parametrize(
    "labels",
    [
        [f"l{i}" for i in range(21)],
        ["a" * 129],
        ["linux/amd64"],
        [],
        [""],
        ["-linux"],
        ["linux", " x64"],
    ],
    ids=["21-labels", "129-chars", "slash", "none", "empty", "leading-hyphen", "leading-space"],
)
async def test_j115_s79_labels_outside_the_grammar_get_400_and_no_session(
    api: Api, db: asyncpg.Connection, labels: list[str]
) -> None:
    response = await register_body(api, {"labels": labels})
    assert response.status_code == 400, response.text
    assert error_code(response) == "validation-error"
    assert await session_count(db) == 0


@pytest.mark.parametrize(
    "labels",
    [[f"l{i}" for i in range(20)], ["a" * 128], ["Linux.x86_64-v3"]],
    ids=["20-labels", "128-chars", "dots-underscores-hyphens"],
)
async def test_j115_s79_labels_at_the_limits_are_accepted(api: Api, labels: list[str]) -> None:
    response = await register_body(api, {"labels": labels})
    assert response.status_code == 200, response.text
    assert response.json()["labels"] == sorted(label.lower() for label in labels)


@pytest.mark.parametrize(
    "body",
    [{"labels": ["linux"], "name": "r1"}, {"label": ["linux"]}, {}, [], {"labels": "linux"}],
    ids=["unknown-field", "misspelt-field", "empty-object", "array", "labels-not-a-list"],
)
async def test_register_body_is_strict(api: Api, db: asyncpg.Connection, body: Any) -> None:
    response = await register_body(api, body)
    assert response.status_code == 400, response.text
    assert error_code(response) == "validation-error"
    assert await session_count(db) == 0


async def test_j104_s81_only_reserved_labels_get_runner_labels_reserved(
    reserved_api: Api, db: asyncpg.Connection
) -> None:
    response = await register_body(reserved_api, {"labels": ["Managed", "ci.pool", "managed"]})
    assert response.status_code == 400, response.text
    assert error_code(response) == "runner-labels-reserved"
    assert response.json()["error"]["details"] == {"labels": ["ci.pool", "managed"]}
    assert await session_count(db) == 0


async def test_j103_s81_reserved_labels_are_stripped_from_a_manual_session(
    reserved_api: Api, db: asyncpg.Connection
) -> None:
    response = await register_body(reserved_api, {"labels": ["linux", "MANAGED", "x64"]})
    assert response.status_code == 200, response.text
    assert response.json()["labels"] == ["linux", "x64"]
    stored = await db.fetchval(
        "SELECT labels FROM runner_sessions WHERE id = $1", UUID(response.json()["session_id"])
    )
    assert stored == ["linux", "x64"]


async def test_s16_register_without_authorization_is_401(api: Api, db: asyncpg.Connection) -> None:
    response = await api.http.post("/v1/runners/register", json={"labels": ["linux"]})
    assert response.status_code == 401
    assert error_code(response) == "unauthorized"
    assert await session_count(db) == 0


async def test_s17_j114_register_with_a_token_of_another_kind_is_401(
    api: Api, db: asyncpg.Connection
) -> None:
    provisioner = tokens.new_opaque(tokens.Kind.PROVISIONER).raw
    for token in (provisioner, api.orchestrator_key, api.admin_key, "cp_unknown_token"):
        response = await register_body(api, {"labels": ["linux"]}, token)
        assert response.status_code == 401
        assert error_code(response) == "unauthorized"
    assert await session_count(db) == 0


async def test_s18_register_with_an_unknown_manual_token_is_401(
    api: Api, db: asyncpg.Connection
) -> None:
    unknown = tokens.new_opaque(tokens.Kind.MANUAL_REGISTRATION).raw
    for token in (unknown, unknown[:-1], api.registration_token + "x"):
        response = await register_body(api, {"labels": ["linux"]}, token)
        assert response.status_code == 401
        assert error_code(response) == "unauthorized"
    assert await session_count(db) == 0


async def test_s19_j109_revoked_manual_token_is_401_revoked(
    api: Api, db: asyncpg.Connection
) -> None:
    await db.execute("UPDATE manual_registration_tokens SET revoked_at = now()")
    response = await register_body(api, {"labels": ["linux"]})
    assert response.status_code == 401
    assert error_code(response) == "manual-registration-token-revoked"
    assert await session_count(db) == 0


async def test_s20_j109_expired_manual_token_is_401_expired_even_when_revoked(
    api: Api, db: asyncpg.Connection
) -> None:
    await db.execute(
        "UPDATE manual_registration_tokens SET expires_at = now() - interval '1 minute'"
    )
    response = await register_body(api, {"labels": ["linux"]})
    assert response.status_code == 401
    assert error_code(response) == "registration-token-expired"
    await db.execute("UPDATE manual_registration_tokens SET revoked_at = now()")
    response = await register_body(api, {"labels": ["linux"]})
    assert response.status_code == 401
    assert error_code(response) == "registration-token-expired"
    assert await session_count(db) == 0


async def test_register_with_a_future_expiry_is_accepted(api: Api, db: asyncpg.Connection) -> None:
    await db.execute("UPDATE manual_registration_tokens SET expires_at = now() + interval '1 hour'")
    response = await register_body(api, {"labels": ["linux"]})
    assert response.status_code == 200, response.text


# Request a job --------------------------------------------------------------------------------


async def test_s84_j117_request_job_answers_204_then_200_with_the_job_and_a_lease(
    api: Api, db: asyncpg.Connection
) -> None:
    registered = await register_body(api, {"labels": ["linux", "x64"]})
    session = registered.json()["session_token"]
    empty = await api.request_job(session)
    assert empty.status_code == 204
    assert empty.content == b""
    assert "retry-after" in empty.headers
    job = api.job(["x64", "Linux"], payload={"script": "make test"})
    assert (await api.enqueue(job)).status_code == 200
    response = await api.request_job(session)
    assert response.status_code == 200, response.text
    body = response.json()
    for key in ("job_execution_id", "job_id", "workflow_run_id", "workflow_run_attempt_id"):
        assert body[key] == job[key]
    assert body["payload"] == {"script": "make test"}
    assert body["required_labels"] == ["linux", "x64"]
    assert "job_name" not in body
    assert "steps" not in body
    claims = await lease_claims(db, body["lease_token"])
    assert claims["ex"] == job["job_execution_id"]
    assert claims["job"] == job["job_id"]
    assert claims["run"] == job["workflow_run_id"]
    assert claims["att"] == job["workflow_run_attempt_id"]
    assert claims["prj"] == job["project_id"]
    assert claims["ws"] == str(api.workspace)
    assert claims["sid"] == registered.json()["session_id"]
    row = await lease_row(db, job["job_execution_id"])
    assert str(row["runner_session_id"]) == registered.json()["session_id"]
    assert row["first_heartbeat_at"] is None
    assert await db.fetchval("SELECT count(*) FROM pending_jobs") == 0


async def test_j118_s86_request_job_skips_other_workspaces_and_unmatched_labels(
    api: Api, db: asyncpg.Connection
) -> None:
    session = await api.register(["linux", "x64"])
    elsewhere = api.job(["linux"], workspace_id=str(uuid.uuid4()))
    needs_macos = api.job(["macos"])
    needs_more = api.job(["linux", "x64", "gpu"])
    assert (await api.enqueue(elsewhere, needs_macos, needs_more)).status_code == 200
    response = await api.request_job(session)
    assert response.status_code == 204
    assert await db.fetchval("SELECT count(*) FROM pending_jobs") == 3
    assert await db.fetchval("SELECT count(*) FROM running_jobs") == 0
    subset = api.job(["x64"])
    assert (await api.enqueue(subset)).status_code == 200
    response = await api.request_job(session)
    assert response.status_code == 200
    assert response.json()["job_execution_id"] == subset["job_execution_id"]


async def test_j119_s85_a_manual_session_claims_jobs_in_fifo_order(api: Api) -> None:
    session = await api.register()
    now = datetime.now(UTC)
    later = api.job(queued_at=now.isoformat())
    earlier = api.job(queued_at=(now - timedelta(minutes=1)).isoformat())
    assert (await api.enqueue(later)).status_code == 200
    assert (await api.enqueue(earlier)).status_code == 200
    first = await api.request_job(session)
    second = await api.request_job(session)
    third = await api.request_job(session)
    assert first.status_code == second.status_code == 200
    assert first.json()["job_execution_id"] == earlier["job_execution_id"]
    assert second.json()["job_execution_id"] == later["job_execution_id"]
    assert third.status_code == 204


async def test_request_job_long_poll_answers_204_when_its_wait_passes(api: Api) -> None:
    session = await api.register()
    with anyio.fail_after(5):
        response = await api.request_job(session, wait=0.3)
    assert response.status_code == 204
    assert "retry-after" in response.headers


async def test_request_job_long_poll_is_not_woken_by_a_job_it_cannot_take(
    api: Api, db: asyncpg.Connection
) -> None:
    session = await api.register(["linux"])
    statuses: list[int] = []

    async def runner() -> None:
        statuses.append((await api.request_job(session, wait=0.5)).status_code)

    async with anyio.create_task_group() as group:
        group.start_soon(runner)
        await wait_until_parked(api, 1)
        assert (await api.enqueue(api.job(["macos"]))).status_code == 200
    assert statuses == [204]
    assert await db.fetchval("SELECT count(*) FROM pending_jobs") == 1


@pytest.mark.parametrize("wait", ["11", "-1", "soon", "nan"])
async def test_request_job_wait_out_of_bounds_is_400(api: Api, wait: str) -> None:
    session = await api.register()
    response = await api.http.post(
        f"/v1/runners/jobs/request?wait={wait}", headers=api.auth(session)
    )
    assert response.status_code == 400
    assert error_code(response) == "validation-error"


async def _sign(
    db: asyncpg.Connection, kind: tokens.Kind, claims: dict[str, Any], **ttl: float
) -> str:
    key = await credentials.current_signing_key(db)
    return tokens.sign(kind, claims, key, datetime.now(UTC) + timedelta(**ttl))


async def test_s36_j116_request_job_with_an_invalid_or_expired_session_is_401(
    api: Api, db: asyncpg.Connection
) -> None:
    assert (await api.enqueue(api.job())).status_code == 200
    good = await api.register()
    session_id = await db.fetchval("SELECT id FROM runner_sessions")
    claims = {"sid": str(session_id), "ws": str(api.workspace), "labels": ["linux"], "max": None}
    expired = await _sign(db, tokens.Kind.RUNNER_SESSION, claims, seconds=-5)
    forged = tokens.sign(
        tokens.Kind.RUNNER_SESSION,
        claims,
        tokens.SigningKey(good.split("_", 2)[2].split(".")[0], b"x" * 32),
        datetime.now(UTC) + timedelta(hours=1),
    )
    unknown_kid = tokens.sign(
        tokens.Kind.RUNNER_SESSION,
        claims,
        tokens.SigningKey("0123456789abcdef", b"y" * 32),
        datetime.now(UTC) + timedelta(hours=1),
    )
    head, body, mac = good.split(".")
    tampered = f"{head}.{body}x.{mac}"
    for token in (expired, forged, unknown_kid, tampered, "cp_rs_nonsense", "garbage"):
        response = await api.request_job(token)
        assert response.status_code == 401, token
        assert error_code(response) == "unauthorized"
    response = await api.http.post("/v1/runners/jobs/request?wait=0")
    assert response.status_code == 401
    assert await db.fetchval("SELECT count(*) FROM running_jobs") == 0
    assert (await api.request_job(good)).status_code == 200


# Put-back when the runner is gone ---------------------------------------------------------------


async def _park_then_vanish(api: Api, session: str) -> None:
    """Park a long poll on its own connection, then drop that connection."""
    async with httpx.AsyncClient(base_url=api.http.base_url, timeout=30) as vanishing:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as group:
                group.start_soon(
                    lambda: vanishing.post(
                        "/v1/runners/jobs/request?wait=10", headers=api.auth(session)
                    )
                )
                await wait_until_parked(api, 1)
                scope.cancel()
        assert scope.cancelled_caught


async def test_a_runner_that_vanishes_while_parked_never_takes_a_later_job(
    api: Api, db: asyncpg.Connection
) -> None:
    session = await api.register()
    await _park_then_vanish(api, session)
    # The server notices the disconnect and drops the waiter (a waiter it still believed in
    # would stay parked and be tried on every tick).
    await wait_until_parked(api, 0)
    job = api.job()
    assert (await api.enqueue(job)).json()["results"][0]["result"] == "enqueued"
    state = await api.http.get(
        f"/v1/jobs/{job['job_execution_id']}", headers=api.auth(api.orchestrator_key)
    )
    assert state.json()["state"] == "pending"
    assert await db.fetchval("SELECT count(*) FROM running_jobs") == 0
    assert await db.fetchval("SELECT count(*) FROM events WHERE event_type = 'job.claimed'") == 0
    # Still claimable by a runner that is there.
    other = await api.register()
    assert (await api.request_job(other)).status_code == 200


async def test_a_claim_made_for_a_runner_that_vanished_is_put_back_in_place(
    api: Api, db: asyncpg.Connection
) -> None:
    registered = await register_body(api, {"labels": ["linux"]})
    session, session_id = registered.json()["session_token"], UUID(registered.json()["session_id"])
    job = api.job()
    async with httpx.AsyncClient(base_url=api.http.base_url, timeout=30) as vanishing:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as group:
                group.start_soon(
                    lambda: vanishing.post(
                        "/v1/runners/jobs/request?wait=10", headers=api.auth(session)
                    )
                )
                await wait_until_parked(api, 1)
                # Hold the session row so the claim stalls inside its transaction (the lease
                # insert needs a key-share lock on the session), then let the runner vanish.
                async with db.transaction():
                    await db.execute(
                        "SELECT 1 FROM runner_sessions WHERE id = $1 FOR UPDATE", session_id
                    )
                    assert (await api.enqueue(job)).status_code == 200
                    pending_id = await db.fetchval(
                        "SELECT id FROM pending_jobs WHERE job_execution_id = $1",
                        UUID(job["job_execution_id"]),
                    )
                    with anyio.fail_after(4):
                        while not await db.fetchval(
                            """
                            SELECT count(*) FROM pg_stat_activity
                            WHERE datname = current_database() AND wait_event_type = 'Lock'
                            """
                        ):
                            await anyio.sleep(0.01)
                    scope.cancel()
                    await vanishing.aclose()
                    assert (await api.http.get("/healthz")).status_code == 200
    assert scope.cancelled_caught
    # Until the stalled claim commits, the pending row is still visible to us: wait for the end
    # of the story (a put-back writes `job.requeued`) rather than for the row.
    with anyio.fail_after(5):
        while not await db.fetchval(
            "SELECT count(*) FROM events WHERE event_type = 'job.requeued'"
        ):
            await anyio.sleep(0.01)
    assert await db.fetchval("SELECT count(*) FROM running_jobs") == 0
    # Back at its original queue position, and the claim is on record as undone.
    assert await db.fetchval("SELECT id FROM pending_jobs") == pending_id
    kinds = await db.fetch("SELECT event_type FROM events ORDER BY xid::text::bigint, seq")
    assert [row["event_type"] for row in kinds] == ["job.claimed", "job.requeued"]
    other = await api.register()
    taken = await api.request_job(other)
    assert taken.status_code == 200
    assert taken.json()["job_execution_id"] == job["job_execution_id"]


# Heartbeat ------------------------------------------------------------------------------------


async def test_j122_heartbeat_on_a_fresh_lease_renews_it_and_stamps_the_first_heartbeat(
    api: Api, db: asyncpg.Connection
) -> None:
    job = await claimed(api)
    before = await lease_row(db, job.execution)
    assert before["first_heartbeat_at"] is None
    response = await heartbeat(api, job.execution, job.lease)
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) == {"cancel", "lease_token"}
    assert body["cancel"] is False
    old, new = await lease_claims(db, job.lease), await lease_claims(db, body["lease_token"])
    assert {k: v for k, v in new.items() if k != "exp"} == {
        k: v for k, v in old.items() if k != "exp"
    }
    assert new["exp"] >= old["exp"]
    after = await lease_row(db, job.execution)
    assert after["first_heartbeat_at"] is not None
    assert after["last_heartbeat_at"] >= before["last_heartbeat_at"]
    # The renewed lease is itself a working lease.
    again = await heartbeat(api, job.execution, body["lease_token"])
    assert again.status_code == 200
    assert (await lease_row(db, job.execution))["first_heartbeat_at"] == after["first_heartbeat_at"]


async def test_j123_s42_heartbeat_capabilities_are_stored_kept_when_omitted_and_cleared_by_null(
    api: Api, db: asyncpg.Connection
) -> None:
    job = await claimed(api)
    capabilities = {"harnesses": {"claude": {"tools": ["read", "edit"]}}}
    response = await heartbeat(api, job.execution, job.lease, json={"capabilities": capabilities})
    assert response.status_code == 200, response.text
    row = await lease_row(db, job.execution)
    assert json.loads(row["caps"]) == capabilities
    assert row["tool_capabilities_reported_at"] is not None
    # Deliberate change from the reference: omitting capabilities keeps the report.
    response = await heartbeat(api, job.execution, job.lease, json={})
    assert response.status_code == 200
    assert json.loads((await lease_row(db, job.execution))["caps"]) == capabilities
    response = await heartbeat(api, job.execution, job.lease, json={"capabilities": None})
    assert response.status_code == 200
    row = await lease_row(db, job.execution)
    assert row["caps"] is None
    assert row["tool_capabilities_reported_at"] is None


async def test_heartbeat_accepts_an_absent_or_null_body(api: Api) -> None:
    job = await claimed(api)
    assert (await heartbeat(api, job.execution, job.lease)).status_code == 200
    response = await api.http.post(
        f"/v1/runners/jobs/{job.execution}/heartbeat",
        content=b"null",
        headers={**api.auth(job.lease), "content-type": "application/json"},
    )
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "body",
    [
        {"capabilities": {"harnesses": {"pi": {"tools": ["x", "x"]}}}},
        {"capabilities": {"harnesses": {"pi": {"tools": 3}}}},
        {"capabilities": "all"},
        {"foo": 1},
        [1],
    ],
    ids=["duplicate-tool", "tools-not-a-list", "not-an-object", "j129-unknown-key", "array"],
)
async def test_j124_j129_s39_a_rejected_heartbeat_body_records_nothing(
    api: Api, db: asyncpg.Connection, body: Any
) -> None:
    job = await claimed(api)
    kept = {"harnesses": {"pi": {"tools": ["bash"]}}}
    await db.execute(
        """
        UPDATE runner_sessions SET tool_capabilities = $1::jsonb,
            tool_capabilities_reported_at = now() - interval '1 hour'
        """,
        json.dumps(kept),
    )
    await db.execute("UPDATE running_jobs SET last_heartbeat_at = now() - interval '5 seconds'")
    before = await lease_row(db, job.execution)
    response = await heartbeat(api, job.execution, job.lease, json=body)
    assert response.status_code == 400, response.text
    assert error_code(response) == "validation-error"
    after = await lease_row(db, job.execution)
    assert after["first_heartbeat_at"] is None
    assert after["last_heartbeat_at"] == before["last_heartbeat_at"]
    assert json.loads(after["caps"]) == kept
    assert after["tool_capabilities_reported_at"] == before["tool_capabilities_reported_at"]


async def test_j121_s39_heartbeat_without_authorization_is_401(
    api: Api, db: asyncpg.Connection
) -> None:
    job = await claimed(api)
    response = await api.http.post(f"/v1/runners/jobs/{job.execution}/heartbeat")
    assert response.status_code == 401
    assert error_code(response) == "unauthorized"
    assert (await lease_row(db, job.execution))["first_heartbeat_at"] is None


async def test_j125_s41_heartbeat_after_the_orchestrator_cancels_says_cancel(
    api: Api, db: asyncpg.Connection
) -> None:
    job = await claimed(api)
    outcome = await api.http.post(
        f"/v1/jobs/{job.execution}/outcome",
        json={"status": "cancelled", "reason": "user pressed stop"},
        headers=api.auth(api.orchestrator_key),
    )
    assert outcome.status_code == 200, outcome.text
    response = await heartbeat(api, job.execution, job.lease)
    assert response.status_code == 200
    assert response.json()["cancel"] is True
    renewed = await lease_claims(db, response.json()["lease_token"])
    assert renewed["ex"] == job.execution
    assert renewed["job"] == job.job["job_id"]
    assert renewed["run"] == job.job["workflow_run_id"]


async def test_cancellation_reaches_a_held_heartbeat_before_its_wait_elapses(
    api: Api, db: asyncpg.Connection
) -> None:
    job = await claimed(api)
    answers: list[httpx.Response] = []

    async def runner() -> None:
        answers.append(await heartbeat(api, job.execution, job.lease, wait=10))

    assert api.daemon.replica is not None
    board = api.daemon.replica.cancels
    # The whole exchange fits well inside the heartbeat's 10 s wait: it answered on the cancel.
    with anyio.fail_after(5):
        async with anyio.create_task_group() as group:
            group.start_soon(runner)
            # Held: registered for cancels, and past its database read (it stamped the lease).
            while (
                board.parked == 0
                or (await lease_row(db, job.execution))["first_heartbeat_at"] is None
            ):
                await anyio.sleep(0.01)
            assert answers == []
            outcome = await api.http.post(
                f"/v1/jobs/{job.execution}/outcome",
                json={"status": "cancelled"},
                headers=api.auth(api.orchestrator_key),
            )
            assert outcome.json()["was_running"] is True
    assert len(answers) == 1
    assert answers[0].status_code == 200, answers[0].text
    assert answers[0].json()["cancel"] is True
    assert (await lease_claims(db, answers[0].json()["lease_token"]))["ex"] == job.execution


async def test_a_held_heartbeat_without_a_cancel_answers_false_when_its_wait_passes(
    api: Api,
) -> None:
    job = await claimed(api)
    with anyio.fail_after(5):
        response = await heartbeat(api, job.execution, job.lease, wait=0.3)
    assert response.status_code == 200
    assert response.json()["cancel"] is False


@pytest.mark.parametrize("wait", ["31", "-1", "x"])
async def test_heartbeat_wait_out_of_bounds_is_400_and_records_nothing(
    api: Api, db: asyncpg.Connection, wait: str
) -> None:
    job = await claimed(api)
    response = await api.http.post(
        f"/v1/runners/jobs/{job.execution}/heartbeat?wait={wait}", headers=api.auth(job.lease)
    )
    assert response.status_code == 400
    assert error_code(response) == "validation-error"
    assert (await lease_row(db, job.execution))["first_heartbeat_at"] is None


async def test_j127_s38_heartbeat_for_an_unknown_execution_or_another_session_is_404(
    api: Api, db: asyncpg.Connection
) -> None:
    job = await claimed(api)
    claims = await lease_claims(db, job.lease)
    del claims["exp"]
    unknown_execution = str(uuid.uuid4())
    foreign = await _sign(db, tokens.Kind.JOB_LEASE, {**claims, "ex": unknown_execution}, minutes=5)
    response = await heartbeat(api, unknown_execution, foreign)
    assert response.status_code == 404
    assert error_code(response) == "running-job-execution-not-found"
    await api.register()  # a second session, which holds no lease
    other_id = await db.fetchval(
        "SELECT id FROM runner_sessions WHERE id <> (SELECT runner_session_id FROM running_jobs)"
    )
    stolen = await _sign(db, tokens.Kind.JOB_LEASE, {**claims, "sid": str(other_id)}, minutes=5)
    response = await heartbeat(api, job.execution, stolen)
    assert response.status_code == 404
    assert error_code(response) == "running-job-execution-not-found"
    assert (await lease_row(db, job.execution))["first_heartbeat_at"] is None


async def test_j128_s37_heartbeat_with_a_path_other_than_the_lease_is_404_mismatch(
    api: Api, db: asyncpg.Connection
) -> None:
    job = await claimed(api)
    response = await heartbeat(api, str(uuid.uuid4()), job.lease)
    assert response.status_code == 404
    assert error_code(response) == "lease-job-mismatch"
    assert (await lease_row(db, job.execution))["first_heartbeat_at"] is None


async def test_heartbeat_with_a_non_uuid_path_is_400(api: Api) -> None:
    job = await claimed(api)
    response = await heartbeat(api, "not-a-uuid", job.lease)
    assert response.status_code == 400
    assert error_code(response) == "validation-error"


async def test_j130_heartbeat_after_the_reaper_took_the_lease_is_404(
    api: Api, db: asyncpg.Connection
) -> None:
    job = await claimed(api)
    # Never heartbeated, and started long before the no-first-heartbeat grace.
    await db.execute(
        """
        UPDATE running_jobs SET started_at = now() - interval '1 hour',
                                last_heartbeat_at = now() - interval '1 hour'
        """
    )
    with anyio.fail_after(5):
        while await db.fetchval("SELECT count(*) FROM running_jobs"):
            await anyio.sleep(0.02)
    assert await db.fetchval("SELECT outcome FROM ended_executions") == "expired"
    response = await heartbeat(api, job.execution, job.lease)
    assert response.status_code == 404
    assert error_code(response) == "running-job-execution-not-found"


# Complete -------------------------------------------------------------------------------------


async def test_complete_records_the_outcome_and_ends_the_lease(
    api: Api, db: asyncpg.Connection
) -> None:
    job = await claimed(api)
    response = await complete(api, job.execution, job.lease, {"outcome": "failed", "exit_code": 2})
    assert response.status_code == 200, response.text
    assert response.json() == {"recorded": True}
    assert await db.fetchval("SELECT count(*) FROM running_jobs") == 0
    ended = await db.fetchrow("SELECT outcome, ended_by FROM ended_executions")
    assert ended is not None
    assert (ended["outcome"], ended["ended_by"]) == ("failed", "runner")
    assert await db.fetchval("SELECT count(*) FROM events WHERE event_type = 'job.completed'") == 1
    again = await complete(api, job.execution, job.lease, {"outcome": "failed"})
    assert again.status_code == 404
    assert error_code(again) == "running-job-execution-not-found"
    beat = await heartbeat(api, job.execution, job.lease)
    assert beat.status_code == 404
    assert error_code(beat) == "running-job-execution-not-found"


async def test_complete_after_the_orchestrator_cancelled_is_not_recorded_again(
    api: Api, db: asyncpg.Connection
) -> None:
    job = await claimed(api)
    await api.http.post(
        f"/v1/jobs/{job.execution}/outcome",
        json={"status": "cancelled"},
        headers=api.auth(api.orchestrator_key),
    )
    response = await complete(api, job.execution, job.lease, {"outcome": "cancelled"})
    assert response.status_code == 200
    assert response.json() == {"recorded": False}
    assert await db.fetchval("SELECT count(*) FROM running_jobs") == 0
    ended = await db.fetchrow("SELECT outcome, ended_by FROM ended_executions")
    assert ended is not None
    assert (ended["outcome"], ended["ended_by"]) == ("cancelled", "orchestrator")


@pytest.mark.parametrize(
    "body",
    [
        {"outcome": "expired"},
        {"outcome": "passed"},
        {},
        {"outcome": "succeeded", "exit_code": 256},
        {"outcome": "succeeded", "log": "..."},
    ],
    ids=["expired", "unknown-outcome", "missing", "exit-code-range", "unknown-field"],
)
async def test_complete_with_a_bad_body_is_400_and_keeps_the_lease(
    api: Api, db: asyncpg.Connection, body: dict[str, Any]
) -> None:
    job = await claimed(api)
    response = await complete(api, job.execution, job.lease, body)
    assert response.status_code == 400, response.text
    assert error_code(response) == "validation-error"
    await lease_row(db, job.execution)
    assert await db.fetchval("SELECT count(*) FROM ended_executions") == 0


async def test_complete_for_another_execution_is_404_mismatch_and_unauthenticated_is_401(
    api: Api, db: asyncpg.Connection
) -> None:
    job = await claimed(api)
    response = await complete(api, str(uuid.uuid4()), job.lease, {"outcome": "succeeded"})
    assert response.status_code == 404
    assert error_code(response) == "lease-job-mismatch"
    response = await api.http.post(
        f"/v1/runners/jobs/{job.execution}/complete", json={"outcome": "succeeded"}
    )
    assert response.status_code == 401
    assert error_code(response) == "unauthorized"
    await lease_row(db, job.execution)
    assert await db.fetchval("SELECT count(*) FROM ended_executions") == 0
