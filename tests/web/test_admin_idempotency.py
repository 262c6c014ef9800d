"""Idempotency-Key on admin creates, over real HTTP."""

from __future__ import annotations

import contextlib
import hashlib
import json
import uuid
from typing import Any

import anyio
import asyncpg
import httpx

from controlplane.store import credentials, locks
from tests.factories import holding_lock
from tests.web.conftest import Api

KEYS = "/v1/admin/api-keys"


async def _raw_post(api: Api, path: str, body: object, key: str) -> tuple[int, Any]:
    """POST over a plain socket, with the Idempotency-Key header exactly as given."""
    url = httpx.URL(api.daemon.address)
    content = json.dumps(body).encode()
    request = (
        f"POST {path} HTTP/1.1\r\nHost: {url.host}\r\nConnection: close\r\n"
        f"Authorization: Bearer {api.admin_key}\r\nIdempotency-Key:{key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(content)}\r\n\r\n"
    ).encode() + content
    assert url.port is not None
    with anyio.fail_after(10):
        async with await anyio.connect_tcp(url.host, url.port) as stream:
            await stream.send(request)
            received = b""
            with contextlib.suppress(anyio.EndOfStream):
                while True:
                    received += await stream.receive()
    head, _, payload = received.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)


def _headers(api: Api, key: str) -> dict[str, str]:
    return {**api.auth(api.admin_key), "Idempotency-Key": key}


async def _admin_id(db: asyncpg.Connection) -> uuid.UUID:
    found: uuid.UUID = await db.fetchval("SELECT id FROM api_keys WHERE kind = 'admin'")
    return found


async def test_s59_s60_a_replay_answers_the_same_credential_and_token(
    api: Api, db: asyncpg.Connection
) -> None:
    body = {"kind": "orchestrator", "name": "ci"}
    first = await api.http.post(KEYS, json=body, headers=_headers(api, "create-ci-1"))
    again = await api.http.post(KEYS, json=body, headers=_headers(api, "create-ci-1"))
    assert (first.status_code, again.status_code) == (201, 201)
    assert first.json() == again.json()
    assert await db.fetchval("SELECT count(*) FROM api_keys WHERE name = 'ci'") == 1
    stored = await db.fetch("SELECT * FROM admin_commands")
    assert len(stored) == 1
    assert first.json()["token"] not in str(dict(stored[0]))
    # The replayed token authenticates: it is the one that was stored (hashed).
    probe = await api.http.get("/v1/events", headers=api.auth(again.json()["token"]))
    assert probe.status_code == 200
    # Another key creates another credential.
    other = await api.http.post(KEYS, json=body, headers=_headers(api, "create-ci-2"))
    assert other.json()["credential"]["id"] != first.json()["credential"]["id"]


async def test_s61_the_same_key_with_another_body_is_refused_and_changes_nothing(
    api: Api, db: asyncpg.Connection
) -> None:
    await api.http.post(
        KEYS, json={"kind": "orchestrator", "name": "a"}, headers=_headers(api, "k")
    )
    before = await db.fetchval("SELECT count(*) FROM api_keys")
    reused = await api.http.post(
        KEYS, json={"kind": "orchestrator", "name": "b"}, headers=_headers(api, "k")
    )
    assert reused.status_code == 409
    assert reused.json()["error"]["code"] == "idempotency-key-reused"
    assert await db.fetchval("SELECT count(*) FROM api_keys") == before


async def test_s62_the_key_is_optional_but_a_bad_one_is_refused(
    api: Api, db: asyncpg.Connection
) -> None:
    """S-62 refuses a create without a key; ours is a plain create then (a demanding operator
    wants retries safe, not refused). A key over 256 characters, empty or blank is refused as
    the spec's is, with our code `idempotency-key-invalid`, on creates and on revokes alike."""
    body = {"kind": "orchestrator", "name": "a"}
    before = await db.fetchval("SELECT count(*) FROM api_keys")
    target = await db.fetchval("SELECT id FROM api_keys WHERE kind = 'orchestrator'")
    for key in ("x" * 257, ""):
        refused = await api.http.post(KEYS, json=body, headers=_headers(api, key))
        assert refused.status_code == 400, repr(key)
        assert refused.json()["error"]["code"] == "idempotency-key-invalid"
        revoke = await api.http.post(
            f"{KEYS}/{target}/revoke", json={"reason": "r"}, headers=_headers(api, key)
        )
        assert revoke.status_code == 400, repr(key)
        assert revoke.json()["error"]["code"] == "idempotency-key-invalid"
    # httpx will not send a whitespace-only header value; a client on a raw socket can.
    for key in (" ", "  \t "):
        for path, sent in ((KEYS, body), (f"{KEYS}/{target}/revoke", {"reason": "r"})):
            status, answer = await _raw_post(api, path, sent, key)
            assert status == 400, (repr(key), path)
            assert answer["error"]["code"] == "idempotency-key-invalid"
    assert await db.fetchval("SELECT count(*) FROM api_keys") == before
    assert await db.fetchval("SELECT revoked_at FROM api_keys WHERE id = $1", target) is None
    assert await db.fetchval("SELECT count(*) FROM admin_commands") == 0
    # Without the header: a plain create. The longest key is fine.
    plain = await api.http.post(KEYS, json=body, headers=api.auth(api.admin_key))
    assert plain.status_code == 201
    longest = await api.http.post(KEYS, json=body, headers=_headers(api, "k" * 256))
    assert longest.status_code == 201
    assert await db.fetchval("SELECT count(*) FROM api_keys") == before + 2


async def test_s65_a_replay_after_the_signing_key_rotated_is_unavailable(
    api: Api, db: asyncpg.Connection
) -> None:
    body = {"kind": "orchestrator", "name": "rotating"}
    assert (await api.http.post(KEYS, json=body, headers=_headers(api, "r"))).status_code == 201
    await credentials.rotate_signing_key(db)
    replica = api.daemon.replica
    assert replica is not None
    await replica.keys.load()
    replay = await api.http.post(KEYS, json=body, headers=_headers(api, "r"))
    assert replay.status_code == 409
    assert replay.json()["error"]["code"] == "idempotency-replay-unavailable"


async def test_two_concurrent_requests_with_one_key_create_once(
    api: Api, db: asyncpg.Connection, database_url: str
) -> None:
    body = {"workspace_id": str(api.workspace), "name": "pool"}
    key = "concurrent"
    lock = locks.key(
        locks.ADMIN_COMMAND, await _admin_id(db), hashlib.sha256(key.encode()).hexdigest()
    )
    answers: list[httpx.Response] = []

    async def create() -> None:
        answers.append(
            await api.http.post(
                "/v1/admin/registration-tokens", json=body, headers=_headers(api, key)
            )
        )

    async with anyio.create_task_group() as group, holding_lock(database_url, lock):
        group.start_soon(create)
        group.start_soon(create)
        with anyio.fail_after(10):  # both requests now wait on the key's lock we hold
            while (
                await db.fetchval(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                )
                < 2
            ):
                await anyio.sleep(0.01)
        # Leaving `holding_lock` lets them go: one creates, the other replays it.
    assert [answer.status_code for answer in answers] == [201, 201]
    assert answers[0].json() == answers[1].json()
    assert await db.fetchval("SELECT count(*) FROM manual_registration_tokens") == 2  # + fixture's


async def test_provisioner_token_creates_are_idempotent_too(
    api: Api, db: asyncpg.Connection
) -> None:
    body = {"name": "fleet"}
    path = "/v1/admin/provisioner-tokens"
    first = await api.http.post(path, json=body, headers=_headers(api, "p1"))
    again = await api.http.post(path, json=body, headers=_headers(api, "p1"))
    assert first.status_code == again.status_code == 201
    assert first.json()["token"] == again.json()["token"]
    assert await db.fetchval("SELECT count(*) FROM provisioner_tokens") == 1
