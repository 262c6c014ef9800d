"""Provisioner tokens over real HTTP: authentication order, identity, last-seen, admin routes."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import asyncpg
import pytest

from controlplane.store import provisioners
from tests.web.conftest import Api

ME = "/v1/provisioners/me"


async def _token(db: asyncpg.Connection, workspace: uuid.UUID | None) -> tuple[uuid.UUID, str]:
    created, raw = await provisioners.create(db, name="p", workspace_id=workspace)
    return created.id, raw


def _code(response: Any) -> str:
    code: str = response.json()["error"]["code"]
    return code


async def test_s1_s2_missing_or_non_bearer_authorization_is_unauthorized(api: Api) -> None:
    assert _code(await api.http.get(ME)) == "unauthorized"
    assert _code(await api.http.get(ME, headers={"Authorization": "Basic abc"})) == "unauthorized"


async def test_s3_a_token_of_another_kind_is_refused_before_any_lookup(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    looked_up: list[str] = []
    real = provisioners.by_digest

    async def spy(conn: Any, sha256: str) -> Any:
        looked_up.append(sha256)
        return await real(conn, sha256)

    monkeypatch.setattr(provisioners, "by_digest", spy)
    response = await api.http.get(ME, headers=api.auth(api.registration_token))
    assert (response.status_code, _code(response)) == (401, "unauthorized")
    assert looked_up == []


async def test_s4_a_well_formed_unknown_token_is_unauthorized(api: Api) -> None:
    unknown = "cp_pt_" + "A" * 43
    response = await api.http.get(ME, headers=api.auth(unknown))
    assert (response.status_code, _code(response)) == (401, "unauthorized")


@pytest.mark.parametrize("scope", ["workspace", "installation"])
async def test_s5_s6_a_revoked_token_is_refused(
    api: Api, db: asyncpg.Connection, scope: str
) -> None:
    token_id, raw = await _token(db, api.workspace if scope == "workspace" else None)
    revoked = await api.http.post(
        f"/v1/admin/provisioner-tokens/{token_id}/revoke", headers=api.auth(api.admin_key)
    )
    assert revoked.status_code == 200
    response = await api.http.get(ME, headers=api.auth(raw))
    assert (response.status_code, _code(response)) == (401, "provisioner-token-revoked")


async def test_s7_s8_s9_expiry_at_or_before_now_and_revocation_first(
    api: Api, db: asyncpg.Connection
) -> None:
    token_id, raw = await _token(db, api.workspace)
    await db.execute(
        "UPDATE provisioner_tokens SET expires_at = now() - interval '1 second' WHERE id = $1",
        token_id,
    )
    assert _code(await api.http.get(ME, headers=api.auth(raw))) == "provisioner-token-expired"
    # Expiring at this very instant is expired too: the server's clock is past it by the time
    # it compares (expires_at <= now).
    await db.execute("UPDATE provisioner_tokens SET expires_at = now() WHERE id = $1", token_id)
    assert _code(await api.http.get(ME, headers=api.auth(raw))) == "provisioner-token-expired"
    await provisioners.revoke(db, token_id)
    assert _code(await api.http.get(ME, headers=api.auth(raw))) == "provisioner-token-revoked"


async def test_s10_identity_by_scope(api: Api, db: asyncpg.Connection) -> None:
    workspace_id, workspace_raw = await _token(db, api.workspace)
    installation_id, installation_raw = await _token(db, None)
    mine = await api.http.get(ME, headers=api.auth(workspace_raw))
    assert mine.json() == {
        "id": str(workspace_id),
        "scope": "workspace",
        "workspace_id": str(api.workspace),
    }
    theirs = await api.http.get(ME, headers=api.auth(installation_raw))
    assert theirs.json() == {"id": str(installation_id), "scope": "installation"}


async def test_s11_last_seen_is_stamped_at_most_once_per_throttle(
    api: Api, db: asyncpg.Connection
) -> None:
    token_id, raw = await _token(db, api.workspace)
    seen = "SELECT last_seen_at FROM provisioner_tokens WHERE id = $1"
    assert await db.fetchval(seen, token_id) is None
    await api.http.get(ME, headers=api.auth(raw))
    first = await db.fetchval(seen, token_id)
    assert first is not None
    await api.http.get(ME, headers=api.auth(raw))
    assert await db.fetchval(seen, token_id) == first
    await db.execute(
        "UPDATE provisioner_tokens SET last_seen_at = now() - interval '11 seconds' WHERE id = $1",
        token_id,
    )
    aged = await db.fetchval(seen, token_id)
    await api.http.get(ME, headers=api.auth(raw))
    assert await db.fetchval(seen, token_id) > aged


async def test_s12_a_failing_last_seen_write_does_not_fail_the_request(
    api: Api, db: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, raw = await _token(db, api.workspace)

    async def broken(conn: Any, provisioner_id: uuid.UUID, throttle: timedelta) -> None:
        raise asyncpg.QueryCanceledError("statement timeout")

    monkeypatch.setattr(provisioners, "touch", broken)
    response = await api.http.get(ME, headers=api.auth(raw))
    assert response.status_code == 200


async def test_s54_creating_a_workspace_provisioner_token(api: Api, db: asyncpg.Connection) -> None:
    """Through the admin route (no users here, so no created_by_user_id): 201, scope workspace,
    the raw token once with our prefix, only its digest stored."""
    created = await api.http.post(
        "/v1/admin/provisioner-tokens",
        json={"name": "s54", "workspace_id": str(api.workspace)},
        headers=api.auth(api.admin_key),
    )
    assert created.status_code == 201, created.text
    body = created.json()
    assert body["token"].startswith("cp_pt_")
    assert body["provisioner"]["scope"] == "workspace"
    assert body["provisioner"]["workspace_id"] == str(api.workspace)
    assert body["provisioner"]["expires_at"] is None
    assert await db.fetchval("SELECT count(*) FROM provisioner_tokens WHERE name = 's54'") == 1


@pytest.mark.parametrize("ttl", [31_536_001, 0, -1, 1.5])
async def test_s55_a_provisioner_token_ttl_past_a_year_or_not_whole_is_400(
    api: Api, db: asyncpg.Connection, ttl: float
) -> None:
    refused = await api.http.post(
        "/v1/admin/provisioner-tokens",
        json={"name": "s55", "workspace_id": str(api.workspace), "ttl_seconds": ttl},
        headers=api.auth(api.admin_key),
    )
    assert (refused.status_code, _code(refused)) == (400, "validation-error")
    assert await db.fetchval("SELECT count(*) FROM provisioner_tokens") == 0
    accepted = await api.http.post(
        "/v1/admin/provisioner-tokens",
        json={"name": "s55", "workspace_id": str(api.workspace), "ttl_seconds": 31_536_000},
        headers=api.auth(api.admin_key),
    )
    assert accepted.status_code == 201, accepted.text


@pytest.mark.parametrize("workspace", ["not-a-uuid", "", 42])
async def test_s57_a_workspace_id_that_is_not_a_uuid_is_400(
    api: Api, db: asyncpg.Connection, workspace: object
) -> None:
    """On the admin route, where the workspace is a body field rather than a path segment."""
    refused = await api.http.post(
        "/v1/admin/provisioner-tokens",
        json={"name": "s57", "workspace_id": workspace},
        headers=api.auth(api.admin_key),
    )
    assert (refused.status_code, _code(refused)) == (400, "validation-error")
    assert await db.fetchval("SELECT count(*) FROM provisioner_tokens") == 0


async def test_admin_create_list_revoke_and_bad_input(api: Api, db: asyncpg.Connection) -> None:
    admin = api.auth(api.admin_key)
    created = await api.http.post(
        "/v1/admin/provisioner-tokens",
        json={"name": "fleet", "workspace_id": str(api.workspace), "ttl_seconds": 3600},
        headers=admin,
    )
    assert created.status_code == 201
    body = created.json()
    assert body["token"].startswith("cp_pt_")
    assert body["provisioner"]["scope"] == "workspace"
    assert body["provisioner"]["expires_at"] is not None
    stored = await db.fetchval("SELECT token_sha256 FROM provisioner_tokens")
    assert body["token"] not in stored
    listed = await api.http.get("/v1/admin/provisioner-tokens", headers=admin)
    assert [item["id"] for item in listed.json()["items"]] == [body["provisioner"]["id"]]
    assert body["token"] not in listed.text
    for bad in ({"name": ""}, {"name": "x", "ttl_seconds": 0}, {"name": "x", "extra": 1}):
        refused = await api.http.post("/v1/admin/provisioner-tokens", json=bad, headers=admin)
        assert (refused.status_code, _code(refused)) == (400, "validation-error")
    assert await db.fetchval("SELECT count(*) FROM provisioner_tokens") == 1
    first = await api.http.post(
        f"/v1/admin/provisioner-tokens/{body['provisioner']['id']}/revoke", headers=admin
    )
    again = await api.http.post(
        f"/v1/admin/provisioner-tokens/{body['provisioner']['id']}/revoke", headers=admin
    )
    assert first.json()["revoked_at"] == again.json()["revoked_at"]
    missing = await api.http.post(
        f"/v1/admin/provisioner-tokens/{uuid.uuid4()}/revoke", headers=admin
    )
    assert (missing.status_code, _code(missing)) == (404, "not-found")
    # An orchestrator key is not an admin key.
    wrong = await api.http.get(
        "/v1/admin/provisioner-tokens", headers=api.auth(api.orchestrator_key)
    )
    assert wrong.status_code == 401
