"""Admin revokes over real HTTP: an optional reason, and an optional Idempotency-Key whose replay
answers the first answer without revoking twice. Our admin keys have no roles (spec S-64 does not
apply) and the Idempotency-Key stays optional (S-62 adapted)."""

from __future__ import annotations

import hashlib
import logging
import uuid
from typing import Any
from uuid import UUID

import anyio
import asyncpg
import httpx
import pytest

from controlplane.store import locks, provisioners
from tests import provisioning
from tests.factories import holding_lock
from tests.web.conftest import Api

KINDS = ("api-keys", "registration-tokens", "provisioner-tokens")
TABLES = {
    "api-keys": "api_keys",
    "registration-tokens": "manual_registration_tokens",
    "provisioner-tokens": "provisioner_tokens",
}


def _code(response: httpx.Response) -> str:
    code: str = response.json()["error"]["code"]
    return code


async def _target(api: Api, db: asyncpg.Connection, kind: str) -> UUID:
    """A fresh, unrevoked token of `kind`."""
    if kind == "api-keys":
        body: dict[str, Any] = {"kind": "orchestrator", "name": "target"}
    elif kind == "registration-tokens":
        body = {"workspace_id": str(api.workspace), "name": "target"}
    else:
        body = {"name": "target"}
    created = await api.http.post(f"/v1/admin/{kind}", json=body, headers=api.auth(api.admin_key))
    assert created.status_code == 201, created.text
    answer = created.json()
    return UUID((answer.get("credential") or answer["provisioner"])["id"])


async def _revoke(
    api: Api, kind: str, target: UUID, key: str | None = None, body: Any = None
) -> httpx.Response:
    headers = api.auth(api.admin_key) | ({} if key is None else {"Idempotency-Key": key})
    return await api.http.post(f"/v1/admin/{kind}/{target}/revoke", json=body, headers=headers)


async def _revoked_at(db: asyncpg.Connection, kind: str, target: UUID) -> Any:
    return await db.fetchval(f"SELECT revoked_at FROM {TABLES[kind]} WHERE id = $1", target)  # noqa: S608 -- interpolates constants only: TABLES


@pytest.mark.parametrize("kind", KINDS)
async def test_s69_a_replay_answers_the_first_answer_and_a_new_key_changes_nothing(
    api: Api, db: asyncpg.Connection, kind: str
) -> None:
    """S-69 without roles, correlation ids or audit events: the replay's body is the first
    answer, byte for byte, and a new key is a no-op that keeps the first `revoked_at` and
    reason."""
    target = await _target(api, db, kind)
    first = await _revoke(api, kind, target, "rk-1", {"reason": "rotated after the leak"})
    assert first.status_code == 200, first.text
    assert first.json()["revoked_at"] is not None
    assert first.json()["revocation_reason"] == "rotated after the leak"
    stored = await _revoked_at(db, kind, target)
    replay = await _revoke(api, kind, target, "rk-1", {"reason": "rotated after the leak"})
    assert replay.status_code == 200
    assert replay.content == first.content
    fresh = await _revoke(api, kind, target, "rk-2", {"reason": "another reason"})
    plain = await _revoke(api, kind, target)
    for later in (fresh, plain):
        assert later.status_code == 200, later.text
        assert later.json()["revoked_at"] == first.json()["revoked_at"]
        assert later.json()["revocation_reason"] == "rotated after the leak"
    assert await _revoked_at(db, kind, target) == stored
    assert await db.fetchval("SELECT count(*) FROM admin_commands WHERE answer IS NOT NULL") == 2


async def test_s69_the_provisioner_cascade_runs_once(
    api: Api, db: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = await provisioning.provisioner(db, None)
    sessionless = await provisioning.runner(db, p.id, state="starting")
    revokes: list[UUID] = []
    cascades: list[UUID] = []
    real_revoke, real_cascade = provisioners.revoke, provisioners._cascade

    async def count_revoke(conn: Any, provisioner_id: UUID, **kwargs: Any) -> Any:
        revokes.append(provisioner_id)
        return await real_revoke(conn, provisioner_id, **kwargs)

    async def count_cascade(conn: Any, provisioner_id: UUID, ids: list[UUID]) -> None:
        cascades.append(provisioner_id)
        await real_cascade(conn, provisioner_id, ids)

    monkeypatch.setattr(provisioners, "revoke", count_revoke)
    monkeypatch.setattr(provisioners, "_cascade", count_cascade)
    kind = "provisioner-tokens"
    first = await _revoke(api, kind, p.id, "once")
    assert first.status_code == 200, first.text
    ended = "SELECT state, terminated_at FROM runner_instances WHERE id = $1"
    terminated = await db.fetchrow(ended, sessionless)
    assert terminated is not None and terminated["state"] == "terminated"
    assert (await _revoke(api, kind, p.id, "once")).content == first.content
    assert revokes == [p.id]  # the replay never reached the store
    assert (await _revoke(api, kind, p.id, "twice")).status_code == 200
    assert (await _revoke(api, kind, p.id)).status_code == 200
    assert cascades == [p.id]
    assert await db.fetchrow(ended, sessionless) == terminated


@pytest.mark.parametrize("kind", KINDS)
async def test_s69_the_same_key_for_another_request_is_refused(
    api: Api, db: asyncpg.Connection, kind: str
) -> None:
    target, other = await _target(api, db, kind), await _target(api, db, kind)
    assert (await _revoke(api, kind, target, "k", {"reason": "first"})).status_code == 200
    for refused in (
        await _revoke(api, kind, other, "k", {"reason": "first"}),  # another target
        await _revoke(api, kind, target, "k", {"reason": "second"}),  # another body
        await _revoke(api, kind, target, "k"),  # no reason is another body too
    ):
        assert (refused.status_code, _code(refused)) == (409, "idempotency-key-reused")
    assert await _revoked_at(db, kind, other) is None
    # A create's key cannot be replayed as a revoke, nor a revoke's as a create.
    made = await api.http.post(
        "/v1/admin/provisioner-tokens",
        json={"name": "x"},
        headers=api.auth(api.admin_key) | {"Idempotency-Key": "made"},
    )
    assert made.status_code == 201
    reused = await _revoke(api, kind, other, "made")
    assert (reused.status_code, _code(reused)) == (409, "idempotency-key-reused")
    again = await api.http.post(
        "/v1/admin/provisioner-tokens",
        json={"name": "x"},
        headers=api.auth(api.admin_key) | {"Idempotency-Key": "k"},
    )
    assert (again.status_code, _code(again)) == (409, "idempotency-key-reused")
    assert await _revoked_at(db, kind, other) is None


async def test_two_concurrent_revokes_with_one_key_revoke_once(
    api: Api, db: asyncpg.Connection, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = await provisioning.provisioner(db, api.workspace)
    revokes: list[UUID] = []
    real_revoke = provisioners.revoke

    async def count_revoke(conn: Any, provisioner_id: UUID, **kwargs: Any) -> Any:
        revokes.append(provisioner_id)
        return await real_revoke(conn, provisioner_id, **kwargs)

    monkeypatch.setattr(provisioners, "revoke", count_revoke)
    admin_id = await db.fetchval("SELECT id FROM api_keys WHERE kind = 'admin'")
    key = "together"
    lock = locks.key(locks.ADMIN_COMMAND, admin_id, hashlib.sha256(key.encode()).hexdigest())
    answers: list[httpx.Response] = []

    async def revoke() -> None:
        answers.append(await _revoke(api, "provisioner-tokens", p.id, key, {"reason": "r"}))

    async with anyio.create_task_group() as group, holding_lock(database_url, lock):
        group.start_soon(revoke)
        group.start_soon(revoke)
        with anyio.fail_after(10):  # both requests now wait on the key's lock we hold
            while (
                await db.fetchval(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                )
                < 2
            ):
                await anyio.sleep(0.01)
    assert [answer.status_code for answer in answers] == [200, 200]
    assert answers[0].content == answers[1].content
    assert revokes == [p.id]


@pytest.mark.parametrize("kind", KINDS)
async def test_s70_an_unknown_id_is_404_and_nothing_is_remembered(
    api: Api, db: asyncpg.Connection, kind: str
) -> None:
    unknown = uuid.uuid4()
    for _ in range(2):  # the same key again is 404 again: the 404 was not remembered
        missing = await _revoke(api, kind, unknown, "gone", {"reason": "r"})
        assert (missing.status_code, _code(missing)) == (404, "not-found")
    assert await db.fetchval("SELECT count(*) FROM admin_commands") == 0
    malformed = await api.http.post(f"/v1/admin/{kind}/12/revoke", headers=api.auth(api.admin_key))
    assert (malformed.status_code, _code(malformed)) == (400, "validation-error")


async def test_s70_a_workspace_provisioner_token_is_revoked_not_hidden(
    api: Api, db: asyncpg.Connection
) -> None:
    """The reference's installation route answers 404 for a workspace token's id (S-70). Here
    the admin route revokes a provisioner token of either scope: admin keys are
    installation-wide, and there is no separate workspace route."""
    workspace = await provisioning.provisioner(db, api.workspace)
    revoked = await _revoke(api, "provisioner-tokens", workspace.id, "ws")
    assert revoked.status_code == 200, revoked.text
    assert revoked.json()["scope"] == "workspace"
    assert revoked.json()["revoked_at"] is not None


@pytest.mark.parametrize(
    "reason",
    ["", " ", "\t\n", "x" * 513, "line\nbreak", "bell\x07", "del\x7f", "c1\x85", "rtl\u202eo",
     "zero\u200bwidth", 5],
    ids=["empty", "blank", "whitespace", "513", "newline", "bell", "del", "c1", "rtl-override",
         "zero-width", "number"],
)  # fmt: skip
async def test_s63_a_bad_reason_is_refused_and_revokes_nothing(
    api: Api, db: asyncpg.Connection, reason: Any
) -> None:
    """S-63 is about a create's required reason; ours is a revoke's optional one, refused when
    blank, over 512 characters, or with a control (Cc) or format (Cf) character."""
    for kind in KINDS:
        target = await _target(api, db, kind)
        refused = await _revoke(api, kind, target, "bad", {"reason": reason})
        assert (refused.status_code, _code(refused)) == (400, "validation-error"), kind
        assert await _revoked_at(db, kind, target) is None
    assert await db.fetchval("SELECT count(*) FROM admin_commands WHERE answer IS NOT NULL") == 0


async def test_a_reason_is_stored_listed_and_logged_as_text(
    api: Api, db: asyncpg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="controlplane.admin")
    longest = "é" * 512
    for kind in KINDS:
        target = await _target(api, db, kind)
        revoked = await _revoke(api, kind, target, body={"reason": longest})
        assert revoked.status_code == 200, revoked.text
        stored = await db.fetchval(
            f"SELECT revocation_reason FROM {TABLES[kind]} WHERE id = $1",  # noqa: S608 -- interpolates constants only: TABLES
            target,
        )
        assert stored == longest
        listed = await api.http.get(f"/v1/admin/{kind}", headers=api.auth(api.admin_key))
        [item] = [item for item in listed.json()["items"] if item["id"] == str(target)]
        assert item["revocation_reason"] == longest
        [record] = [
            r for r in caplog.records if r.getMessage() == "admin.revoked"
            and getattr(r, "target_id", None) == str(target)
        ]  # fmt: skip
        assert getattr(record, "reason") == longest  # noqa: B009
        assert getattr(record, "replayed") is False  # noqa: B009
    # No body, an empty object or null: no reason.
    for body in (None, {}, {"reason": None}):
        target = await _target(api, db, "api-keys")
        plain = await _revoke(api, "api-keys", target, body=body)
        assert plain.status_code == 200, plain.text
        assert plain.json()["revocation_reason"] is None
    unknown = await _revoke(api, "api-keys", target, body={"reason": "x", "by": "me"})
    assert (unknown.status_code, _code(unknown)) == (400, "validation-error")
