"""Ephemeral registration tokens over a real WebSocket and real HTTP against one daemon: minting
on the provisioner control session, registration with `cp_ert_`, its rate limit, and the
one-claim session it gives (spec provisioning 4.15; jobs J-105..J-120; surface S-22..S-82)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

import anyio
import asyncpg
import httpx
import pytest
from websockets.asyncio.client import ClientConnection

from controlplane.domain import tokens
from controlplane.store import credentials, ephemeral, locks, provisioners
from tests import provisioning
from tests.factories import holding, holding_lock
from tests.web import conftest
from tests.web.conftest import Api
from tests.web.control_client import closed_with, hello, open_session, receive, send
from tests.web.metrics_client import Samples, mover, scrape
from tests.web.provisioning_client import (
    advertise,
    next_grant,
    until,
    workspace_provisioner,
)

pytestmark = pytest.mark.anyio

LINUX = {"labels": ["linux", "x64"]}


def error_code(response: httpx.Response) -> str:
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"code", "message", "details"}, body
    return str(body["error"]["code"])


async def register(api: Api, token: str, body: Any = None) -> httpx.Response:
    return await api.http.post(
        "/v1/runners/register", json=LINUX if body is None else body, headers=api.auth(token)
    )


async def minted(
    db: asyncpg.Connection,
    workspace_id: UUID,
    *,
    installation: bool = False,
    ttl: timedelta = timedelta(seconds=300),
    provider_runner_id: str = "pr-1",
) -> ephemeral.MintedToken:
    """A token minted through the store by a new workspace (or installation) provisioner."""
    prov = await provisioning.provisioner(db, None if installation else workspace_id)
    reservation = None
    if installation:
        reservation = await provisioning.reservation(
            db, workspace_id=workspace_id, provisioner_id=prov.id
        )
    [token] = await ephemeral.mint(
        db,
        provisioner_id=prov.id,
        workspace_id=prov.workspace_id,
        provider_runner_ids=[provider_runner_id],
        ttl=ttl,
        reservation_id=reservation,
    )
    return token


async def token_row(db: asyncpg.Connection, token_id: UUID) -> asyncpg.Record:
    row = await db.fetchrow("SELECT * FROM ephemeral_registration_tokens WHERE id = $1", token_id)
    assert row is not None
    return row


async def attempts(db: asyncpg.Connection, token_id: UUID) -> int | None:
    value = await db.fetchval(
        "SELECT attempts FROM ephemeral_registration_attempts WHERE token_id = $1", token_id
    )
    assert value is None or isinstance(value, int)
    return value


async def session_count(db: asyncpg.Connection) -> int:
    value = await db.fetchval("SELECT count(*) FROM runner_sessions")
    assert isinstance(value, int)
    return value


@pytest.fixture
async def reserved_api(database_url: str) -> AsyncIterator[Api]:
    """A daemon whose reserved label is `managed`."""
    config = conftest.test_settings(runners__reserved_labels="managed")
    async for daemon in conftest.run_daemon(database_url, config):
        async with httpx.AsyncClient(base_url=daemon.address, timeout=30) as http:
            client = Api(http=http, database_url=database_url, daemon=daemon)
            conn = await asyncpg.connect(database_url)
            try:
                _, client.orchestrator_key = await credentials.create_api_key(
                    conn, kind="orchestrator", name="orchestrator"
                )
            finally:
                await conn.close()
            yield client


# Registration ----------------------------------------------------------------------------------


async def test_j105_s23_j110_an_ephemeral_token_registers_once(
    api: Api, db: asyncpg.Connection
) -> None:
    token = await minted(db, api.workspace)
    first = await register(api, token.token)
    assert first.status_code == 200, first.text
    body = first.json()
    assert (body["mode"], body["max_claims"], body["labels"]) == ("ephemeral", 1, ["linux", "x64"])
    assert body["session_token"].startswith("cp_rs_")
    row = await token_row(db, token.id)
    assert row["consumed_at"] is not None
    assert row["consumed_session_id"] == UUID(body["session_id"])
    session = await db.fetchrow(
        "SELECT * FROM runner_sessions WHERE id = $1", row["consumed_session_id"]
    )
    assert session is not None
    assert (session["registration_token_kind"], session["workspace_id"]) == (
        "ephemeral",
        api.workspace,
    )

    again = await register(api, token.token)
    assert again.status_code == 409, again.text
    assert error_code(again) == "registration-token-consumed"
    assert await session_count(db) == 1
    assert await attempts(db, token.id) == 2  # a used token still spends budget


async def test_s22_j114_unknown_expired_and_malformed_ephemeral_tokens_get_401(
    api: Api, db: asyncpg.Connection
) -> None:
    unknown = tokens.new_opaque(tokens.Kind.EPHEMERAL_REGISTRATION).raw
    expired = await minted(db, api.workspace, ttl=timedelta(seconds=-1))
    cases = {unknown: "unauthorized", expired.token: "registration-token-expired"}
    cases["cp_ert_not-a-token"] = "unauthorized"
    for token, code in cases.items():
        response = await register(api, token)
        assert response.status_code == 401, response.text
        assert error_code(response) == code
    assert await session_count(db) == 0
    assert await db.fetchval("SELECT count(*) FROM ephemeral_registration_attempts") == 0


async def test_a_token_of_a_revoked_provisioner_is_refused(
    api: Api, db: asyncpg.Connection
) -> None:
    token = await minted(db, api.workspace)
    await db.execute("UPDATE provisioner_tokens SET revoked_at = now()")
    response = await register(api, token.token)
    assert response.status_code == 401, response.text
    assert error_code(response) == "unauthorized"
    assert (await token_row(db, token.id))["consumed_at"] is None


async def test_j106_s82_reserved_labels_follow_the_minting_provisioners_scope(
    reserved_api: Api, db: asyncpg.Connection
) -> None:
    api = reserved_api
    workspace = await minted(db, api.workspace)
    installation = await minted(db, api.workspace, installation=True)
    body = {"labels": ["Managed", "linux"]}
    stripped = await register(api, workspace.token, body)
    kept = await register(api, installation.token, body)
    assert stripped.status_code == kept.status_code == 200, (stripped.text, kept.text)
    assert stripped.json()["labels"] == ["linux"]
    assert kept.json()["labels"] == ["linux", "managed"]
    rows = await db.fetch("SELECT labels FROM runner_sessions ORDER BY created_at")
    assert [row["labels"] for row in rows] == [["linux"], ["linux", "managed"]]

    only_reserved = await minted(db, api.workspace, provider_runner_id="pr-2")
    refused = await register(api, only_reserved.token, {"labels": ["managed"]})
    assert refused.status_code == 400, refused.text
    assert error_code(refused) == "runner-labels-reserved"
    assert (await token_row(db, only_reserved.id))["consumed_at"] is None


async def _checks(api: Api, before: Samples) -> dict[str, float]:
    """How far each outcome of the limiter's checks moved since `before`."""
    moved = mover(before, await scrape(api))
    return {
        outcome: moved(
            "controlplane_rate_limit_checks_total", action="ephemeral-register", outcome=outcome
        )
        for outcome in ("allowed", "blocked", "unavailable")
    }


async def test_j111_s73_s102_the_sixth_attempt_in_a_window_gets_429_and_leaves_the_token_unused(
    reserved_api: Api, db: asyncpg.Connection
) -> None:
    api = reserved_api
    before = await scrape(api)
    token = await minted(db, api.workspace)
    # Five attempts the handler refuses after the limiter counted them (every label reserved).
    for _ in range(5):
        refused = await register(api, token.token, {"labels": ["managed"]})
        assert refused.status_code == 400, refused.text
    limited = await register(api, token.token)
    assert limited.status_code == 429, limited.text
    assert error_code(limited) == "rate-limited"
    retry_after = limited.json()["error"]["details"]["retry_after_seconds"]
    assert isinstance(retry_after, int)
    assert 1 <= retry_after <= 60
    assert limited.headers["Retry-After"] == str(retry_after)
    assert (await token_row(db, token.id))["consumed_at"] is None
    assert await session_count(db) == 0
    assert await attempts(db, token.id) == 6
    assert await _checks(api, before) == {"allowed": 5, "blocked": 1, "unavailable": 0}


async def test_j112_s74_s102_a_limiter_row_locked_past_250_ms_gets_503_and_leaves_the_token_unused(
    api: Api, db: asyncpg.Connection, database_url: str
) -> None:
    token = await minted(db, api.workspace)
    before = await scrape(api)
    await db.execute(
        "INSERT INTO ephemeral_registration_attempts (token_id, window_start, attempts)"
        " VALUES ($1, now(), 1)",
        token.id,
    )
    lock_row = "SELECT 1 FROM ephemeral_registration_attempts WHERE token_id = $1 FOR UPDATE"
    async with holding(database_url, lock_row, token.id):
        response = await register(api, token.token)
        assert response.status_code == 503, response.text
        assert error_code(response) == "runners-rate-limit-unavailable"
    assert (await token_row(db, token.id))["consumed_at"] is None
    assert await attempts(db, token.id) == 1
    assert (await register(api, token.token)).status_code == 200
    assert await _checks(api, before) == {"allowed": 1, "blocked": 0, "unavailable": 1}


async def test_s78_an_invalid_body_spends_no_rate_limit_budget(
    api: Api, db: asyncpg.Connection
) -> None:
    token = await minted(db, api.workspace)
    for body in ({"labels": ["linux/amd64"]}, {"labels": ["linux"], "name": "x"}, {}):
        response = await register(api, token.token, body)
        assert response.status_code == 400, response.text
        assert error_code(response) == "validation-error"
    assert await attempts(db, token.id) is None
    assert (await register(api, token.token)).status_code == 200
    assert await attempts(db, token.id) == 1


async def test_two_concurrent_registrations_with_one_token_give_one_session(
    api: Api, db: asyncpg.Connection, database_url: str
) -> None:
    token = await minted(db, api.workspace)
    answers: list[int] = []

    async def attempt() -> None:
        answers.append((await register(api, token.token)).status_code)

    # Both pass the limiter and wait on the workspace lock, which every consumption takes.
    async with (
        anyio.create_task_group() as tasks,
        holding_lock(database_url, locks.workspace(api.workspace)) as holder,
    ):
        tasks.start_soon(attempt)
        tasks.start_soon(attempt)
        with anyio.fail_after(10):
            while (
                await db.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
                    holder.get_server_pid(),
                )
                < 2
            ):
                await anyio.sleep(0.005)
    assert sorted(answers) == [200, 409]
    assert await session_count(db) == 1


# Minting over the control session, and the whole legacy path ------------------------------------


async def mint_message(ws: ClientConnection, ids: list[str], **extra: Any) -> dict[str, Any]:
    """Send `mint_ephemeral` and return its answer (`ephemeral_minted` or `error`)."""
    request = {"type": "mint_ephemeral", "request_id": "m1", "provider_runner_ids": ids, **extra}
    await send(ws, request)
    with anyio.fail_after(10):
        while True:
            message = await receive(ws)
            if message["type"] in ("ephemeral_minted", "error") and message["request_id"] == "m1":
                return message


async def test_mint_ephemeral_answers_one_token_per_runner_or_refuses_them_all(
    api: Api, db: asyncpg.Connection
) -> None:
    _, raw = await workspace_provisioner(api, db)
    ws = await open_session(api.daemon, raw)
    await hello(ws)
    answer = await mint_message(ws, ["b", "a"])
    assert answer["type"] == "ephemeral_minted", answer
    assert [t["provider_runner_id"] for t in answer["tokens"]] == ["b", "a"]
    for token in answer["tokens"]:
        assert token["token"].startswith("cp_ert_")
        expires = datetime.fromisoformat(token["expires_at"])
        assert timedelta(seconds=250) < expires - datetime.now(UTC) <= timedelta(seconds=300)
    refusals = [
        (["c", "a"], {}, "ephemeral-token-active"),
        (["c", "c"], {}, "validation-error"),
        (["c"], {"reservation_id": str(uuid.uuid4())}, "reservation-not-found"),
    ]
    for ids, extra, code in refusals:
        refused = await mint_message(ws, ids, **extra)
        assert (refused["type"], refused["code"]) == ("error", code), refused
    assert await db.fetchval("SELECT count(*) FROM ephemeral_registration_tokens") == 2
    await send(ws, {"type": "ping", "request_id": "p1"})
    assert (await until(ws, "pong"))["request_id"] == "p1"  # the session stayed open

    # Each token registers a runner of the provisioner's workspace.
    registered = await register(api, answer["tokens"][0]["token"])
    assert registered.status_code == 200, registered.text
    await ws.close()


async def test_mint_ephemeral_against_a_reservation_is_capped_by_its_count(
    api: Api, db: asyncpg.Connection
) -> None:
    prov, raw = await workspace_provisioner(api, db)
    res = await provisioning.reservation(
        db, workspace_id=api.workspace, provisioner_id=prov, count=2
    )
    ws = await open_session(api.daemon, raw)
    await hello(ws)
    too_many = await mint_message(ws, ["a", "b", "c"], reservation_id=str(res))
    assert (too_many["type"], too_many["code"]) == ("error", "reservation-capacity-exhausted")
    fits = await mint_message(ws, ["a", "b"], reservation_id=str(res))
    assert fits["type"] == "ephemeral_minted", fits
    more = await mint_message(ws, ["c"], reservation_id=str(res))
    assert (more["type"], more["code"]) == ("error", "reservation-capacity-exhausted")
    await ws.close()


async def test_an_installation_provisioner_must_name_a_reservation(
    api: Api, db: asyncpg.Connection
) -> None:
    prov, raw = await provisioners.create(db, name="fleet", workspace_id=None)
    ws = await open_session(api.daemon, raw)
    await hello(ws)
    refused = await mint_message(ws, ["a"])
    assert (refused["type"], refused["code"]) == ("error", "validation-error")
    res = await provisioning.reservation(db, workspace_id=api.workspace, provisioner_id=prov.id)
    answer = await mint_message(ws, ["a"], reservation_id=str(res))
    assert answer["type"] == "ephemeral_minted", answer
    registered = await register(api, answer["tokens"][0]["token"])
    assert registered.status_code == 200, registered.text
    session = await db.fetchrow(
        "SELECT workspace_id, provisioner_id FROM runner_sessions WHERE id = $1",
        UUID(registered.json()["session_id"]),
    )
    assert session is not None
    assert (session["workspace_id"], session["provisioner_id"]) == (api.workspace, prov.id)
    await ws.close()


@pytest.mark.parametrize(
    "message",
    [
        {"provider_runner_ids": []},
        {"provider_runner_ids": [f"r{i}" for i in range(501)]},
        {"provider_runner_ids": ["a"], "extra": 1},
        {"provider_runner_ids": [""]},
    ],
    ids=["none", "501", "unknown-field", "empty-id"],
)
async def test_a_mint_the_schema_refuses_closes_the_session_and_mints_nothing(
    api: Api, db: asyncpg.Connection, message: dict[str, Any]
) -> None:
    _, raw = await workspace_provisioner(api, db)
    ws = await open_session(api.daemon, raw)
    await hello(ws)
    await send(ws, {"type": "mint_ephemeral", "request_id": "m1", **message})
    code, _ = await closed_with(ws)
    assert code == 4400
    assert await db.fetchval("SELECT count(*) FROM ephemeral_registration_tokens") == 0


async def test_j91_j120_p95_a_reported_runner_registers_ephemerally_and_claims_once(
    api: Api, db: asyncpg.Connection
) -> None:
    """The legacy path end to end: a grant, a runner the provisioner reports with it, a token
    minted for that reservation, registration (which links the runner), one claim (which gives
    the unit back), then 409 although another job is pending."""
    prov, raw = await workspace_provisioner(api, db)
    ws = await open_session(api.daemon, raw)
    await hello(ws)
    await advertise(ws)
    assert (await api.enqueue(api.job(["linux"]))).status_code == 200
    grant = await next_grant(ws)
    reported_at = datetime.now(UTC).isoformat()
    event = {"provider_runner_id": "vm-1", "state": "running", "reported_at": reported_at,
             "reservation_id": grant["reservation_id"]}  # fmt: skip
    await send(ws, {"type": "report", "request_id": "r1", "events": [event]})
    assert (await until(ws, "reported"))["accepted"] == 1
    answer = await mint_message(ws, ["vm-1"], reservation_id=grant["reservation_id"])
    assert answer["type"] == "ephemeral_minted", answer

    registered = await register(api, answer["tokens"][0]["token"])
    assert registered.status_code == 200, registered.text
    session_id = UUID(registered.json()["session_id"])
    runner = await db.fetchrow(
        "SELECT * FROM runner_instances WHERE provisioner_id = $1 AND provider_runner_id = 'vm-1'",
        prov,
    )
    assert runner is not None
    assert runner["runner_session_id"] == session_id

    session = registered.json()["session_token"]
    claimed = await api.request_job(session, wait=5)
    assert claimed.status_code == 200, claimed.text
    assert claimed.json()["required_labels"] == ["linux"]
    released = await db.fetchrow(
        "SELECT first_claimed_at, reservation_released_at FROM runner_instances WHERE id = $1",
        runner["id"],
    )
    assert released is not None
    assert released["first_claimed_at"] is not None
    assert released["reservation_released_at"] is not None
    assert await db.fetchval("SELECT count(*) FROM reservations WHERE id = $1",
                             UUID(grant["reservation_id"])) == 0  # fmt: skip

    assert (await api.enqueue(api.job(["linux"]))).status_code == 200
    again = await api.request_job(session, wait=0)
    assert again.status_code == 409, again.text
    assert error_code(again) == "runner-session-exhausted"
    await ws.close()
