"""Workspace admin keys (`cp_wak_`) and admin key roles, through real HTTP (spec S-48..S-53).

A workspace admin key manages its own workspace's registration and provisioner tokens and sees
its runners, under /v1/workspaces/{workspace_id}/...; another workspace's path is 403, another
workspace's token 404, and every installation route 403. An observer key of either kind reads.
"""

from __future__ import annotations

import hashlib
import uuid
from typing import Any
from uuid import UUID

import asyncpg
import httpx
import pytest

from tests.web.conftest import Api
from tests.web.test_admin_routes import admin_post, error_code


async def new_key(
    api: Api, kind: str, workspace: UUID | None = None, role: str | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {"kind": kind, "name": f"{kind} key"}
    if workspace is not None:
        body["workspace_id"] = str(workspace)
    if role is not None:
        body["role"] = role
    response = await admin_post(api, "/api-keys", body)
    assert response.status_code == 201, response.text
    created: dict[str, Any] = response.json()
    return created


async def workspace_key(api: Api, workspace: UUID | None = None, role: str | None = None) -> str:
    raw: str = (await new_key(api, "workspace-admin", workspace or api.workspace, role))["token"]
    return raw


def path(workspace: UUID, tail: str) -> str:
    return f"/v1/workspaces/{workspace}{tail}"


async def ws_post(
    api: Api, key: str, tail: str, body: Any = None, workspace: UUID | None = None
) -> httpx.Response:
    return await api.http.post(
        path(workspace or api.workspace, tail), json=body, headers=api.auth(key)
    )


async def ws_get(api: Api, key: str, tail: str, workspace: UUID | None = None) -> httpx.Response:
    return await api.http.get(path(workspace or api.workspace, tail), headers=api.auth(key))


# Creating the key ----------------------------------------------------------------------------


async def test_a_workspace_admin_key_is_created_by_an_admin_stored_hashed_and_listed(
    api: Api, db: asyncpg.Connection
) -> None:
    created = await new_key(api, "workspace-admin", api.workspace)
    raw = created["token"]
    assert raw.startswith("cp_wak_")
    credential = created["credential"]
    assert credential["kind"] == "workspace-admin"
    assert credential["workspace_id"] == str(api.workspace)
    assert credential["role"] == "owner"
    stored = await db.fetchval(
        "SELECT token_sha256 FROM api_keys WHERE id = $1", UUID(credential["id"])
    )
    assert stored == hashlib.sha256(raw.encode()).hexdigest()
    listed = await api.http.get("/v1/admin/api-keys", headers=api.auth(api.admin_key))
    mine = [item for item in listed.json()["items"] if item["id"] == credential["id"]]
    assert mine == [credential]
    assert raw not in listed.text


@pytest.mark.parametrize(
    "body",
    [
        {"kind": "workspace-admin", "name": "x"},
        {"kind": "workspace-admin", "name": "x", "workspace_id": None},
        {"kind": "orchestrator", "name": "x", "role": "observer"},
        {"kind": "admin", "name": "x", "role": "auditor"},
    ],
    ids=["no-workspace", "null-workspace", "orchestrator-observer", "unknown-role"],
)
async def test_a_bad_workspace_key_or_role_request_is_400_and_creates_nothing(
    api: Api, db: asyncpg.Connection, body: dict[str, Any]
) -> None:
    before = await db.fetchval("SELECT count(*) FROM api_keys")
    response = await admin_post(api, "/api-keys", body)
    assert response.status_code == 400, response.text
    assert error_code(response) == "validation-error"
    assert await db.fetchval("SELECT count(*) FROM api_keys") == before


# S-48: who may use the routes -------------------------------------------------------------------


async def test_s48_workspace_routes_need_that_workspaces_key(api: Api) -> None:
    own = await workspace_key(api)
    other = await workspace_key(api, uuid.uuid4())
    anonymous = await api.http.get(path(api.workspace, "/registration-tokens"))
    assert anonymous.status_code == 401
    assert error_code(anonymous) == "unauthorized"
    foreign = await ws_get(api, other, "/registration-tokens")
    assert foreign.status_code == 403
    assert error_code(foreign) == "forbidden"
    wrong_kind = await ws_get(api, api.orchestrator_key, "/registration-tokens")
    assert wrong_kind.status_code == 401
    assert (await ws_get(api, own, "/registration-tokens")).status_code == 200
    # An installation admin key administers every workspace.
    assert (await ws_get(api, api.admin_key, "/registration-tokens")).status_code == 200
    for tail in ("/registration-tokens", "/provisioner-tokens", "/runners"):
        refused = await ws_get(api, other, tail)
        assert refused.status_code == 403, tail
    for tail in ("/registration-tokens", "/provisioner-tokens"):
        created = await ws_post(api, other, tail, {"name": "x"})
        assert created.status_code == 403, tail
    not_a_uuid = await api.http.get("/v1/workspaces/abc/registration-tokens", headers=api.auth(own))
    assert not_a_uuid.status_code == 400
    assert error_code(not_a_uuid) == "validation-error"


async def test_a_workspace_key_is_refused_by_every_installation_route(api: Api) -> None:
    key = await workspace_key(api)
    for method, route in (
        ("GET", "/v1/admin/api-keys"),
        ("POST", "/v1/admin/api-keys"),
        ("GET", "/v1/admin/registration-tokens"),
        ("POST", "/v1/admin/registration-tokens"),
        ("GET", "/v1/admin/provisioner-tokens"),
        ("GET", "/v1/admin/queue"),
        ("GET", "/v1/admin/runners"),
        ("GET", "/v1/admin/jobs"),
        ("GET", "/v1/admin/runner-instances"),
    ):
        body = {"name": "x", "workspace_id": str(api.workspace), "kind": "orchestrator"}
        response = await api.http.request(
            method, route, json=body if method == "POST" else None, headers=api.auth(key)
        )
        assert response.status_code == 403, (method, route, response.text)
        assert error_code(response) == "forbidden"
    # Not an orchestrator key either: the kind prefix refuses it before any lookup.
    enqueued = await api.http.post("/v1/jobs", json={"jobs": [api.job()]}, headers=api.auth(key))
    assert enqueued.status_code == 401


async def test_a_revoked_or_forged_workspace_key_is_401(api: Api) -> None:
    created = await new_key(api, "workspace-admin", api.workspace)
    key = created["token"]
    revoked = await admin_post(api, f"/api-keys/{created['credential']['id']}/revoke", {})
    assert revoked.status_code == 200
    answer = await ws_get(api, key, "/registration-tokens")
    assert answer.status_code == 401
    assert error_code(answer) == "api-key-revoked"
    forged = "cp_wak_" + "A" * 43
    assert (await ws_get(api, forged, "/registration-tokens")).status_code == 401
    # Revoked, it is 401 on installation routes too (not 403: it is no longer a key at all).
    admin_route = await api.http.get("/v1/admin/queue", headers=api.auth(key))
    assert admin_route.status_code == 401


# S-49..S-53: registration tokens -----------------------------------------------------------------


async def test_s49_listing_shows_only_usable_tokens_of_the_workspace_newest_first(
    api: Api, db: asyncpg.Connection
) -> None:
    key = await workspace_key(api)
    ids = []
    for name in ("first", "expired", "revoked", "last"):
        response = await ws_post(api, key, "/registration-tokens", {"name": name})
        assert response.status_code == 201, response.text
        ids.append(response.json()["credential"]["id"])
    await db.execute(
        "UPDATE manual_registration_tokens SET expires_at = now() - interval '1 second'"
        " WHERE id = $1",
        UUID(ids[1]),
    )
    assert (await ws_post(api, key, f"/registration-tokens/{ids[2]}/revoke")).status_code == 200
    elsewhere = await admin_post(
        api, "/registration-tokens", {"name": "other", "workspace_id": str(uuid.uuid4())}
    )
    assert elsewhere.status_code == 201
    listed = await ws_get(api, key, "/registration-tokens")
    assert listed.status_code == 200
    names = [item["name"] for item in listed.json()["items"]]
    # The fixture's own token of this workspace is usable and oldest.
    assert names == ["last", "first", "runners"]
    paged = await ws_get(api, key, "/registration-tokens?limit=1")
    assert [item["name"] for item in paged.json()["items"]] == ["last"]
    cursor = paged.json()["next_cursor"]
    second = await ws_get(api, key, f"/registration-tokens?limit=1&cursor={cursor}")
    assert [item["name"] for item in second.json()["items"]] == ["first"]
    unknown = await ws_get(api, key, "/registration-tokens?workspace_id=" + str(uuid.uuid4()))
    assert unknown.status_code == 400


async def test_s50_created_token_with_ttl_expires_and_without_does_not(api: Api) -> None:
    key = await workspace_key(api)
    with_ttl = await ws_post(api, key, "/registration-tokens", {"name": "a", "ttl_seconds": 3600})
    assert with_ttl.status_code == 201, with_ttl.text
    body = with_ttl.json()
    assert body["token"].startswith("cp_mrt_")
    assert body["credential"]["workspace_id"] == str(api.workspace)
    assert body["credential"]["expires_at"] is not None
    without = await ws_post(api, key, "/registration-tokens", {"name": "b"})
    assert without.status_code == 201
    assert without.json()["credential"]["expires_at"] is None
    # The token registers a runner of this workspace.
    session = await api.register(token=body["token"])
    assert session.startswith("cp_rs_")


@pytest.mark.parametrize("ttl", [0, -1, 1.5, 31_536_001])
async def test_s51_a_bad_ttl_is_400_and_creates_nothing(
    api: Api, db: asyncpg.Connection, ttl: float
) -> None:
    key = await workspace_key(api)
    before = await db.fetchval("SELECT count(*) FROM manual_registration_tokens")
    for tail in ("/registration-tokens", "/provisioner-tokens"):
        response = await ws_post(api, key, tail, {"name": "x", "ttl_seconds": ttl})
        assert response.status_code == 400, response.text
        assert error_code(response) == "validation-error"
    assert await db.fetchval("SELECT count(*) FROM manual_registration_tokens") == before


@pytest.mark.parametrize(
    "body",
    [{"name": ""}, {"name": "a" * 201}, {}, {"name": "x", "workspace_id": str(uuid.uuid4())}],
    ids=["empty-name", "long-name", "no-name", "workspace-in-body"],
)
async def test_s52_a_bad_name_or_an_unknown_field_is_400(api: Api, body: dict[str, Any]) -> None:
    key = await workspace_key(api)
    for tail in ("/registration-tokens", "/provisioner-tokens"):
        response = await ws_post(api, key, tail, body)
        assert response.status_code == 400, response.text
        assert error_code(response) == "validation-error"


async def test_s53_revoking_another_workspaces_token_is_404_and_revokes_nothing(
    api: Api, db: asyncpg.Connection
) -> None:
    key = await workspace_key(api)
    other = await admin_post(
        api, "/registration-tokens", {"name": "theirs", "workspace_id": str(uuid.uuid4())}
    )
    theirs = other.json()["credential"]["id"]
    refused = await ws_post(api, key, f"/registration-tokens/{theirs}/revoke", {"reason": "x"})
    assert refused.status_code == 404
    assert error_code(refused) == "not-found"
    unknown = await ws_post(api, key, f"/registration-tokens/{uuid.uuid4()}/revoke")
    assert unknown.status_code == 404
    assert (
        await db.fetchval(
            "SELECT revoked_at FROM manual_registration_tokens WHERE id = $1", UUID(theirs)
        )
        is None
    )
    mine = (await ws_post(api, key, "/registration-tokens", {"name": "mine"})).json()
    revoked = await ws_post(
        api, key, f"/registration-tokens/{mine['credential']['id']}/revoke", {"reason": "leaked"}
    )
    assert revoked.status_code == 200
    assert revoked.json()["revocation_reason"] == "leaked"
    registered = await api.http.post(
        "/v1/runners/register", json={"labels": ["linux"]}, headers=api.auth(mine["token"])
    )
    assert registered.status_code == 401


async def test_an_idempotent_create_replays_alike_through_the_workspace_route(api: Api) -> None:
    key = await workspace_key(api)
    headers = {**api.auth(key), "Idempotency-Key": "once"}
    route = path(api.workspace, "/registration-tokens")
    first = await api.http.post(route, json={"name": "ci"}, headers=headers)
    again = await api.http.post(route, json={"name": "ci"}, headers=headers)
    assert first.status_code == again.status_code == 201
    assert first.json() == again.json()
    other = await api.http.post(route, json={"name": "other"}, headers=headers)
    assert other.status_code == 409


# Provisioner tokens and runners ------------------------------------------------------------------


async def test_s56_workspace_provisioner_tokens_are_created_listed_and_revoked_in_scope(
    api: Api,
) -> None:
    key = await workspace_key(api)
    created = await ws_post(api, key, "/provisioner-tokens", {"name": "pool", "ttl_seconds": 60})
    assert created.status_code == 201, created.text
    body = created.json()
    assert body["token"].startswith("cp_pt_")
    assert body["provisioner"]["scope"] == "workspace"
    assert body["provisioner"]["workspace_id"] == str(api.workspace)
    installation = await admin_post(api, "/provisioner-tokens", {"name": "fleet"})
    foreign = await admin_post(
        api, "/provisioner-tokens", {"name": "theirs", "workspace_id": str(uuid.uuid4())}
    )
    listed = await ws_get(api, key, "/provisioner-tokens")
    assert [item["id"] for item in listed.json()["items"]] == [body["provisioner"]["id"]]
    # Never seen yet: not active.
    active = await ws_get(api, key, "/provisioner-tokens?active=true")
    assert active.json()["items"] == []
    seen = await api.http.get("/v1/provisioners/me", headers=api.auth(body["token"]))
    assert seen.status_code == 200
    active = await ws_get(api, key, "/provisioner-tokens?active=true")
    assert [item["id"] for item in active.json()["items"]] == [body["provisioner"]["id"]]
    for other in (installation, foreign):
        target = other.json()["provisioner"]["id"]
        refused = await ws_post(api, key, f"/provisioner-tokens/{target}/revoke")
        assert refused.status_code == 404
        assert error_code(refused) == "not-found"
    revoked = await ws_post(api, key, f"/provisioner-tokens/{body['provisioner']['id']}/revoke")
    assert revoked.status_code == 200
    assert revoked.json()["revoked_at"] is not None
    after = await api.http.get("/v1/provisioners/me", headers=api.auth(body["token"]))
    assert after.status_code == 401


async def test_workspace_runners_lists_only_its_own_runners(api: Api) -> None:
    key = await workspace_key(api)
    session = await api.register(["linux"])
    other_ws = uuid.uuid4()
    made = await admin_post(
        api, "/registration-tokens", {"name": "theirs", "workspace_id": str(other_ws)}
    )
    await api.register(["linux"], token=made.json()["token"])
    assert (await api.request_job(session)).status_code in (200, 204)
    listed = await ws_get(api, key, "/runners")
    assert listed.status_code == 200, listed.text
    items = listed.json()["items"]
    assert [item["workspace_id"] for item in items] == [str(api.workspace)]
    bad = await ws_get(api, key, "/runners?window_seconds=0")
    assert bad.status_code == 400


# Roles -------------------------------------------------------------------------------------------


async def test_an_observer_admin_key_reads_but_changes_nothing(
    api: Api, db: asyncpg.Connection
) -> None:
    created = await new_key(api, "admin", role="observer")
    assert created["credential"]["role"] == "observer"
    observer = api.auth(created["token"])
    for route in ("/v1/admin/api-keys", "/v1/admin/queue", "/v1/admin/provisioner-tokens"):
        assert (await api.http.get(route, headers=observer)).status_code == 200, route
    before = await db.fetchval("SELECT count(*) FROM api_keys")
    for route, body in (
        ("/v1/admin/api-keys", {"kind": "admin", "name": "escalate"}),
        ("/v1/admin/provisioner-tokens", {"name": "x"}),
        (f"/v1/admin/api-keys/{created['credential']['id']}/revoke", {}),
        (path(api.workspace, "/registration-tokens"), {"name": "x"}),
    ):
        refused = await api.http.post(route, json=body, headers=observer)
        assert refused.status_code == 403, route
        assert error_code(refused) == "admin-key-read-only"
    assert await db.fetchval("SELECT count(*) FROM api_keys") == before
    assert (await ws_get(api, created["token"], "/registration-tokens")).status_code == 200


async def test_an_observer_workspace_key_reads_its_workspace_only(api: Api) -> None:
    key = await workspace_key(api, role="observer")
    assert (await ws_get(api, key, "/provisioner-tokens")).status_code == 200
    refused = await ws_post(api, key, "/provisioner-tokens", {"name": "x"})
    assert refused.status_code == 403
    assert error_code(refused) == "admin-key-read-only"
    foreign = await ws_get(api, key, "/provisioner-tokens", workspace=uuid.uuid4())
    assert error_code(foreign) == "forbidden"
