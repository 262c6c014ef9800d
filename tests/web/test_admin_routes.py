"""The admin routes (API keys, registration tokens, the queue) and the health endpoints."""

from __future__ import annotations

import hashlib
import uuid
from typing import Any
from uuid import UUID

import asyncpg
import httpx
import pytest

from tests.web.conftest import Api


def error_code(response: httpx.Response) -> str:
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"code", "message", "details"}, body
    return str(body["error"]["code"])


async def admin_post(api: Api, path: str, body: Any = None) -> httpx.Response:
    return await api.http.post(f"/v1/admin{path}", json=body, headers=api.auth(api.admin_key))


async def admin_get(api: Api, path: str) -> httpx.Response:
    return await api.http.get(f"/v1/admin{path}", headers=api.auth(api.admin_key))


async def api_key_count(db: asyncpg.Connection) -> int:
    count: int = await db.fetchval("SELECT count(*) FROM api_keys")
    return count


# API keys -------------------------------------------------------------------------------------


async def test_created_orchestrator_key_is_shown_once_stored_hashed_and_works(
    api: Api, db: asyncpg.Connection
) -> None:
    response = await admin_post(api, "/api-keys", {"kind": "orchestrator", "name": "ci"})
    assert response.status_code == 201, response.text
    body = response.json()
    raw = body["token"]
    assert raw.startswith("cp_oak_")
    credential = body["credential"]
    assert credential["kind"] == "orchestrator"
    assert credential["name"] == "ci"
    assert credential["workspace_id"] is None
    assert credential["expires_at"] is None
    assert credential["revoked_at"] is None
    assert credential["display_prefix"] == raw[:12]
    row = await db.fetchrow("SELECT * FROM api_keys WHERE id = $1", UUID(credential["id"]))
    assert row is not None
    assert row["token_sha256"] == hashlib.sha256(raw.encode()).hexdigest()
    assert raw not in [str(value) for value in row.values()]
    enqueued = await api.http.post("/v1/jobs", json={"jobs": [api.job()]}, headers=api.auth(raw))
    assert enqueued.status_code == 200


async def test_created_admin_key_works_on_admin_routes_and_ttl_sets_an_expiry(
    api: Api,
) -> None:
    response = await admin_post(
        api, "/api-keys", {"kind": "admin", "name": "ops 2", "ttl_seconds": 3600}
    )
    assert response.status_code == 201, response.text
    assert response.json()["credential"]["expires_at"] is not None
    raw = response.json()["token"]
    assert raw.startswith("cp_adm_")
    listed = await api.http.get("/v1/admin/api-keys", headers=api.auth(raw))
    assert listed.status_code == 200


async def test_a_created_workspace_key_is_scoped_to_its_workspace(api: Api) -> None:
    response = await admin_post(
        api,
        "/api-keys",
        {"kind": "orchestrator", "name": "ws", "workspace_id": str(api.workspace)},
    )
    assert response.status_code == 201, response.text
    raw = response.json()["token"]
    assert response.json()["credential"]["workspace_id"] == str(api.workspace)
    own = await api.http.post("/v1/jobs", json={"jobs": [api.job()]}, headers=api.auth(raw))
    assert own.status_code == 200
    foreign = api.job(workspace_id=str(uuid.uuid4()))
    other = await api.http.post("/v1/jobs", json={"jobs": [foreign]}, headers=api.auth(raw))
    assert other.status_code == 403
    assert error_code(other) == "forbidden"


@pytest.mark.parametrize(
    "body",
    [
        {"kind": "admin", "name": "x", "workspace_id": str(uuid.uuid4())},
        {"kind": "runner", "name": "x"},
        {"kind": "orchestrator", "name": ""},
        {"kind": "orchestrator", "name": "a" * 201},
        {"kind": "orchestrator", "name": "tab\there"},
        {"kind": "orchestrator", "name": "x", "ttl_seconds": 0},
        {"kind": "orchestrator", "name": "x", "ttl_seconds": 31_536_001},
        {"kind": "orchestrator", "name": "x", "ttl_seconds": 1.5},
        {"kind": "orchestrator", "name": "x", "workspace_id": "abc"},
        {"kind": "orchestrator", "name": "x", "scopes": ["all"]},
        {"name": "x"},
    ],
    ids=[
        "admin-with-workspace",
        "unknown-kind",
        "empty-name",
        "long-name",
        "control-char",
        "ttl-zero",
        "ttl-too-long",
        "ttl-fraction",
        "bad-workspace",
        "unknown-field",
        "no-kind",
    ],
)
async def test_creating_an_api_key_with_a_bad_body_is_400_and_creates_nothing(
    api: Api, db: asyncpg.Connection, body: dict[str, Any]
) -> None:
    before = await api_key_count(db)
    response = await admin_post(api, "/api-keys", body)
    assert response.status_code == 400, response.text
    assert error_code(response) == "validation-error"
    assert await api_key_count(db) == before


async def test_listing_api_keys_shows_metadata_but_never_a_token_or_hash(
    api: Api, db: asyncpg.Connection
) -> None:
    response = await admin_get(api, "/api-keys")
    assert response.status_code == 200
    items = response.json()["items"]
    assert sorted(item["kind"] for item in items) == ["admin", "orchestrator"]
    hashes = [row["token_sha256"] for row in await db.fetch("SELECT token_sha256 FROM api_keys")]
    text = response.text
    for secret in (api.admin_key, api.orchestrator_key, *hashes):
        assert secret not in text
    assert all("token" not in item and "token_sha256" not in item for item in items)


async def test_revoking_an_api_key_stops_it_at_once_and_is_idempotent(
    api: Api, db: asyncpg.Connection
) -> None:
    key_id = await db.fetchval("SELECT id FROM api_keys WHERE kind = 'orchestrator'")
    response = await admin_post(api, f"/api-keys/{key_id}/revoke")
    assert response.status_code == 200, response.text
    revoked_at = response.json()["revoked_at"]
    assert revoked_at is not None
    refused = await api.enqueue(api.job())
    assert refused.status_code == 401
    assert error_code(refused) == "api-key-revoked"
    again = await admin_post(api, f"/api-keys/{key_id}/revoke")
    assert again.status_code == 200
    assert again.json()["revoked_at"] == revoked_at
    assert await db.fetchval("SELECT count(*) FROM pending_jobs") == 0


async def test_revoking_an_unknown_or_malformed_api_key_id(api: Api) -> None:
    unknown = await admin_post(api, f"/api-keys/{uuid.uuid4()}/revoke")
    assert unknown.status_code == 404
    assert error_code(unknown) == "not-found"
    malformed = await admin_post(api, "/api-keys/12/revoke")
    assert malformed.status_code == 400
    assert error_code(malformed) == "validation-error"


async def test_an_expired_admin_key_is_401_expired(api: Api, db: asyncpg.Connection) -> None:
    await db.execute(
        "UPDATE api_keys SET expires_at = now() - interval '1 second' WHERE kind = 'admin'"
    )
    response = await admin_get(api, "/api-keys")
    assert response.status_code == 401
    assert error_code(response) == "api-key-expired"


# Registration tokens --------------------------------------------------------------------------


async def test_a_created_registration_token_registers_runners_of_its_workspace(
    api: Api, db: asyncpg.Connection
) -> None:
    workspace = uuid.uuid4()
    response = await admin_post(
        api,
        "/registration-tokens",
        {"workspace_id": str(workspace), "name": "fleet", "ttl_seconds": 3600},
    )
    assert response.status_code == 201, response.text
    raw = response.json()["token"]
    assert raw.startswith("cp_mrt_")
    credential = response.json()["credential"]
    assert credential["kind"] == "manual-registration"
    assert credential["workspace_id"] == str(workspace)
    assert credential["expires_at"] is not None
    stored = await db.fetchval(
        "SELECT token_sha256 FROM manual_registration_tokens WHERE id = $1",
        UUID(credential["id"]),
    )
    assert stored == hashlib.sha256(raw.encode()).hexdigest()
    await api.register(token=raw)
    assert await db.fetchval("SELECT workspace_id FROM runner_sessions") == workspace


@pytest.mark.parametrize(
    "body",
    [
        {"name": "x"},
        {"workspace_id": "abc", "name": "x"},
        {"workspace_id": str(uuid.uuid4()), "name": ""},
        {"workspace_id": str(uuid.uuid4()), "name": "x", "ttl_seconds": -1},
        {"workspace_id": str(uuid.uuid4()), "name": "x", "labels": ["a"]},
    ],
    ids=["no-workspace", "bad-workspace", "empty-name", "negative-ttl", "unknown-field"],
)
async def test_creating_a_registration_token_with_a_bad_body_is_400(
    api: Api, db: asyncpg.Connection, body: dict[str, Any]
) -> None:
    response = await admin_post(api, "/registration-tokens", body)
    assert response.status_code == 400, response.text
    assert error_code(response) == "validation-error"
    assert await db.fetchval("SELECT count(*) FROM manual_registration_tokens") == 1


async def test_listing_registration_tokens_filters_by_workspace(api: Api) -> None:
    other = uuid.uuid4()
    created = await admin_post(
        api, "/registration-tokens", {"workspace_id": str(other), "name": "o"}
    )
    raw = created.json()["token"]
    everything = (await admin_get(api, "/registration-tokens")).json()["items"]
    assert sorted(item["workspace_id"] for item in everything) == sorted(
        [str(api.workspace), str(other)]
    )
    only = await admin_get(api, f"/registration-tokens?workspace_id={other}")
    assert [item["id"] for item in only.json()["items"]] == [created.json()["credential"]["id"]]
    assert raw not in only.text
    assert api.registration_token not in (await admin_get(api, "/registration-tokens")).text
    bad = await admin_get(api, "/registration-tokens?workspace_id=nope")
    assert bad.status_code == 400
    assert error_code(bad) == "validation-error"


async def test_s46_revoking_a_registration_token_stops_new_registrations(
    api: Api, db: asyncpg.Connection
) -> None:
    token_id = await db.fetchval("SELECT id FROM manual_registration_tokens")
    response = await admin_post(api, f"/registration-tokens/{token_id}/revoke")
    assert response.status_code == 200, response.text
    revoked_at = response.json()["revoked_at"]
    assert revoked_at is not None
    refused = await api.http.post(
        "/v1/runners/register", json={"labels": ["linux"]}, headers=api.auth(api.registration_token)
    )
    assert refused.status_code == 401
    assert error_code(refused) == "manual-registration-token-revoked"
    # Idempotent; unlike the reference (S-46) the first revocation time is kept.
    again = await admin_post(api, f"/registration-tokens/{token_id}/revoke")
    assert again.status_code == 200
    assert again.json()["revoked_at"] == revoked_at
    assert await db.fetchval("SELECT count(*) FROM runner_sessions") == 0


async def test_revoking_an_unknown_or_malformed_registration_token_id(api: Api) -> None:
    unknown = await admin_post(api, f"/registration-tokens/{uuid.uuid4()}/revoke")
    assert unknown.status_code == 404
    assert error_code(unknown) == "not-found"
    malformed = await admin_post(api, "/registration-tokens/xyz/revoke")
    assert malformed.status_code == 400
    assert error_code(malformed) == "validation-error"


# Queue ----------------------------------------------------------------------------------------


async def test_queue_overview_counts_pending_and_running_per_workspace(api: Api) -> None:
    empty = await admin_get(api, "/queue")
    assert empty.status_code == 200
    assert empty.json() == {"pending": 0, "running": 0, "workspaces": []}
    other = uuid.uuid4()
    await api.enqueue(api.job(), api.job(), api.job(workspace_id=str(other)))
    assert (await api.request_job(await api.register())).status_code == 200
    body = (await admin_get(api, "/queue")).json()
    assert (body["pending"], body["running"]) == (2, 1)
    by_workspace = {item["workspace_id"]: item for item in body["workspaces"]}
    assert {w: (i["queued"], i["running"]) for w, i in by_workspace.items()} == {
        str(api.workspace): (1, 1),
        str(other): (1, 0),
    }
    [mine] = by_workspace[str(api.workspace)]["labels"]
    assert (mine["labels"], mine["queued"], mine["running"]) == (["linux"], 1, 1)
    assert mine["oldest_queued_at"] is not None


async def test_queue_overview_breaks_a_workspace_down_by_label_set(api: Api) -> None:
    await api.enqueue(api.job(["linux", "x64"]), api.job(["linux", "x64"]), api.job(["gpu"]))
    session = await api.register(["gpu", "linux"])
    assert (await api.request_job(session)).status_code == 200  # takes the gpu job
    [workspace] = (await admin_get(api, "/queue")).json()["workspaces"]
    assert (workspace["queued"], workspace["running"]) == (2, 1)
    groups = [(g["labels"], g["queued"], g["running"]) for g in workspace["labels"]]
    assert groups == [(["linux", "x64"], 2, 0), (["gpu"], 0, 1)]
    assert workspace["labels"][1]["oldest_queued_at"] is None  # nothing of it queued


# Health ---------------------------------------------------------------------------------------


async def test_healthz_and_readyz_answer_without_credentials(api: Api) -> None:
    live = await api.http.get("/healthz")
    assert live.status_code == 200
    assert live.json() == {"status": "ok"}
    ready = await api.http.get("/readyz")
    assert ready.status_code == 200, ready.text
    assert ready.json() == {
        "ready": True,
        "checks": {"database": "ok", "migrations": "ok", "listener": "ok"},
    }


async def test_metrics_expose_the_queue_gauges(api: Api) -> None:
    await api.enqueue(api.job(), api.job())
    assert (await api.request_job(await api.register())).status_code == 200
    response = await api.http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    lines = response.text.splitlines()
    assert "controlplane_pending_job_executions 1.0" in lines
    assert "controlplane_running_job_executions 1.0" in lines
    assert "controlplane_listener_connected 1.0" in lines
    assert "controlplane_parked_runners 0.0" in lines
