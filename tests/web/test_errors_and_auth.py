"""Authentication at the edge and the error envelope, across every route."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import asyncpg
import httpx
import pytest

from controlplane.domain import tokens
from controlplane.store import credentials
from tests.web.conftest import Api


def error_code(response: httpx.Response) -> str:
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"code", "message", "details"}, body
    assert isinstance(body["error"]["message"], str)
    assert isinstance(body["error"]["details"], dict)
    return str(body["error"]["code"])


@dataclass
class Tokens:
    """One live credential of every kind, all for `api.workspace`."""

    manual: str
    session: str
    lease: str
    execution: str
    orchestrator: str
    admin: str

    def of(self, kind: str) -> str:
        value: str = getattr(self, kind)
        return value


@pytest.fixture
async def live(api: Api) -> Tokens:
    session = await api.register()
    job = api.job()
    assert (await api.enqueue(job)).status_code == 200
    claimed = await api.request_job(session)
    assert claimed.status_code == 200
    # Enqueue one more so that a job request that got through would visibly claim it.
    assert (await api.enqueue(api.job())).status_code == 200
    return Tokens(
        manual=api.registration_token,
        session=session,
        lease=claimed.json()["lease_token"],
        execution=job["job_execution_id"],
        orchestrator=api.orchestrator_key,
        admin=api.admin_key,
    )


async def snapshot(db: asyncpg.Connection) -> dict[str, Any]:
    """Every row count and lease stamp a request could change."""
    counts = {
        table: await db.fetchval(f"SELECT count(*) FROM {table}")  # noqa: S608 -- table names from the literal tuple
        for table in (
            "runner_sessions",
            "pending_jobs",
            "running_jobs",
            "ended_executions",
            "events",
            "api_keys",
            "manual_registration_tokens",
        )
    }
    stamps = await db.fetch(
        "SELECT job_execution_id, first_heartbeat_at, last_heartbeat_at FROM running_jobs"
    )
    revoked = await db.fetch(
        """
        SELECT revoked_at FROM api_keys
        UNION ALL SELECT revoked_at FROM manual_registration_tokens
        """
    )
    return {
        "counts": counts,
        "stamps": sorted(tuple(row.values()) for row in stamps),
        "revoked": sorted(str(row["revoked_at"]) for row in revoked),
    }


def route(name: str, t: Tokens) -> tuple[str, str, Any]:
    """(method, path, json body) of a valid request to the named route."""
    job = {
        "job_execution_id": str(uuid.uuid4()),
        "job_id": str(uuid.uuid4()),
        "workflow_run_id": str(uuid.uuid4()),
        "workflow_run_attempt_id": str(uuid.uuid4()),
        "workspace_id": str(uuid.uuid4()),
        "project_id": str(uuid.uuid4()),
        "required_labels": ["linux"],
        "queued_at": "2030-01-01T00:00:00Z",
    }
    some_id = str(uuid.uuid4())
    return {
        "register": ("POST", "/v1/runners/register", {"labels": ["linux"]}),
        "request": ("POST", "/v1/runners/jobs/request?wait=0", None),
        "heartbeat": ("POST", f"/v1/runners/jobs/{t.execution}/heartbeat", None),
        "complete": ("POST", f"/v1/runners/jobs/{t.execution}/complete", {"outcome": "failed"}),
        "enqueue": ("POST", "/v1/jobs", {"jobs": [job]}),
        "outcome": ("POST", f"/v1/jobs/{t.execution}/outcome", {"status": "cancelled"}),
        "state": ("GET", f"/v1/jobs/{t.execution}", None),
        "events": ("GET", "/v1/events", None),
        "create-api-key": ("POST", "/v1/admin/api-keys", {"kind": "admin", "name": "x"}),
        "list-api-keys": ("GET", "/v1/admin/api-keys", None),
        "revoke-api-key": ("POST", f"/v1/admin/api-keys/{some_id}/revoke", None),
        "create-registration-token": (
            "POST",
            "/v1/admin/registration-tokens",
            {"workspace_id": str(uuid.uuid4()), "name": "x"},
        ),
        "list-registration-tokens": ("GET", "/v1/admin/registration-tokens", None),
        "revoke-registration-token": (
            "POST",
            f"/v1/admin/registration-tokens/{some_id}/revoke",
            None,
        ),
        "queue": ("GET", "/v1/admin/queue", None),
    }[name]


# The kind each route accepts; every other kind must get 401.
ACCEPTS = {
    "register": "manual",
    "request": "session",
    "heartbeat": "lease",
    "complete": "lease",
    "enqueue": "orchestrator",
    "outcome": "orchestrator",
    "state": "orchestrator",
    "events": "orchestrator",
    "create-api-key": "admin",
    "list-api-keys": "admin",
    "revoke-api-key": "admin",
    "create-registration-token": "admin",
    "list-registration-tokens": "admin",
    "revoke-registration-token": "admin",
    "queue": "admin",
}
KINDS = ["manual", "session", "lease", "orchestrator", "admin"]


@pytest.mark.parametrize("name", list(ACCEPTS))
async def test_a_token_of_another_kind_gets_401_and_changes_nothing(
    api: Api, db: asyncpg.Connection, live: Tokens, name: str
) -> None:
    method, path, body = route(name, live)
    before = await snapshot(db)
    for kind in KINDS:
        if kind == ACCEPTS[name]:
            continue
        response = await api.http.request(method, path, json=body, headers=api.auth(live.of(kind)))
        assert response.status_code == 401, (kind, response.text)
        assert error_code(response) == "unauthorized"
    assert await snapshot(db) == before


@pytest.mark.parametrize("name", list(ACCEPTS))
async def test_the_right_kind_of_token_is_accepted(api: Api, live: Tokens, name: str) -> None:
    """The other half of the matrix above: the same requests go through with the right token."""
    method, path, body = route(name, live)
    response = await api.http.request(
        method, path, json=body, headers=api.auth(live.of(ACCEPTS[name]))
    )
    # Revoking an id nobody has is the only valid request here that cannot succeed.
    expected = 404 if name.startswith("revoke-") else (201 if name.startswith("create-") else 200)
    assert response.status_code == expected, response.text


MALFORMED = [
    None,
    "",
    "Basic abc",
    "Bearer",
    "Token {token}",
    "{token}",
    "Bearer:{token}",
]


@pytest.mark.parametrize("name", ["register", "request", "heartbeat", "enqueue", "queue"])
async def test_s1_s2_s16_malformed_authorization_is_401(
    api: Api, db: asyncpg.Connection, live: Tokens, name: str
) -> None:
    method, path, body = route(name, live)
    before = await snapshot(db)
    for header in MALFORMED:
        token = live.of(ACCEPTS[name])
        headers = {} if header is None else {"Authorization": header.format(token=token)}
        response = await api.http.request(method, path, json=body, headers=headers)
        assert response.status_code == 401, header
        assert error_code(response) == "unauthorized"
    assert await snapshot(db) == before


async def test_the_bearer_scheme_is_case_insensitive(api: Api) -> None:
    response = await api.http.get(
        "/v1/admin/queue", headers={"Authorization": f"bEaReR {api.admin_key}"}
    )
    assert response.status_code == 200


async def test_a_token_with_a_swapped_kind_prefix_is_401(api: Api) -> None:
    """An admin key relabelled as an orchestrator key (and back) finds nothing."""
    body = api.admin_key.split("_", 2)[2]
    relabelled = f"cp_oak_{body}"
    response = await api.http.get("/v1/events", headers=api.auth(relabelled))
    assert response.status_code == 401
    assert error_code(response) == "unauthorized"
    body = api.orchestrator_key.split("_", 2)[2]
    response = await api.http.get("/v1/admin/queue", headers=api.auth(f"cp_adm_{body}"))
    assert response.status_code == 401


@pytest.mark.parametrize("name", ["register", "enqueue", "create-api-key", "heartbeat"])
async def test_authentication_comes_before_body_validation(
    api: Api, db: asyncpg.Connection, live: Tokens, name: str
) -> None:
    method, path, _ = route(name, live)
    before = await snapshot(db)
    response = await api.http.request(
        method, path, content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 401
    assert error_code(response) == "unauthorized"
    assert await snapshot(db) == before


async def test_j116_s32_a_lease_or_registration_token_cannot_request_a_job(
    api: Api, db: asyncpg.Connection, live: Tokens
) -> None:
    for token in (live.lease, live.manual, tokens.new_opaque(tokens.Kind.CONTROL_SESSION).raw):
        response = await api.request_job(token)
        assert response.status_code == 401
        assert error_code(response) == "unauthorized"
    assert await db.fetchval("SELECT count(*) FROM pending_jobs") == 1


async def test_s47_revoking_a_manual_token_leaves_its_sessions_working(
    api: Api, db: asyncpg.Connection
) -> None:
    session = await api.register()
    token_id = await db.fetchval("SELECT id FROM manual_registration_tokens")
    revoked = await api.http.post(
        f"/v1/admin/registration-tokens/{token_id}/revoke", headers=api.auth(api.admin_key)
    )
    assert revoked.status_code == 200
    refused = await api.http.post(
        "/v1/runners/register", json={"labels": ["linux"]}, headers=api.auth(api.registration_token)
    )
    assert refused.status_code == 401
    assert error_code(refused) == "manual-registration-token-revoked"
    first, second = api.job(), api.job()
    await api.enqueue(first, second)
    claimed = await api.request_job(session)
    assert claimed.status_code == 200
    execution = claimed.json()["job_execution_id"]
    beat = await api.http.post(
        f"/v1/runners/jobs/{execution}/heartbeat", headers=api.auth(claimed.json()["lease_token"])
    )
    assert beat.status_code == 200
    assert (await api.request_job(session)).status_code == 200


async def test_a_workspace_scoped_key_never_reaches_another_workspace(
    api: Api, db: asyncpg.Connection, live: Tokens
) -> None:
    other = uuid.uuid4()
    _, key = await credentials.create_api_key(
        db, kind="orchestrator", name="other team", workspace_id=other
    )
    before = await snapshot(db)
    theirs = api.job()
    enqueue = await api.http.post("/v1/jobs", json={"jobs": [theirs]}, headers=api.auth(key))
    assert enqueue.status_code == 403
    assert error_code(enqueue) == "forbidden"
    for method, path, body in [
        ("GET", f"/v1/jobs/{live.execution}", None),
        ("POST", f"/v1/jobs/{live.execution}/outcome", {"status": "cancelled"}),
    ]:
        response = await api.http.request(method, path, json=body, headers=api.auth(key))
        assert response.status_code == 404, path
        assert error_code(response) == "not-found"
    feed = await api.http.get("/v1/events", headers=api.auth(key))
    assert feed.status_code == 200
    assert feed.json()["events"] == []
    filtered = await api.http.get(f"/v1/events?workspace_id={api.workspace}", headers=api.auth(key))
    assert filtered.status_code == 403
    assert error_code(filtered) == "forbidden"
    # Nor can it stand in for any other kind of credential.
    for method, path, body in [
        route(name, live) for name in ACCEPTS if ACCEPTS[name] != "orchestrator"
    ]:
        response = await api.http.request(method, path, json=body, headers=api.auth(key))
        assert response.status_code == 401, path
    assert await snapshot(db) == before
    # While the installation key still sees the execution untouched.
    found = await api.http.get(f"/v1/jobs/{live.execution}", headers=api.auth(live.orchestrator))
    assert found.json()["state"] == "running"
    assert found.json()["cancel_requested"] is False


# The error envelope ---------------------------------------------------------------------------


async def test_an_unknown_route_is_a_json_404(api: Api) -> None:
    response = await api.http.get("/v1/nothing-here", headers=api.auth(api.admin_key))
    assert response.status_code == 404
    assert error_code(response) == "not-found"


async def test_a_wrong_method_is_a_json_405(api: Api) -> None:
    response = await api.http.delete("/v1/jobs", headers=api.auth(api.orchestrator_key))
    assert response.status_code == 405
    assert error_code(response) == "method-not-allowed"


@pytest.mark.parametrize(
    "content",
    [b"", b"{", b"\xff\xfe", b'{"labels": ["linux"]} trailing'],
    ids=["empty", "truncated", "not-utf8", "trailing-garbage"],
)
async def test_an_unreadable_body_is_400_validation_error(
    api: Api, db: asyncpg.Connection, content: bytes
) -> None:
    response = await api.http.post(
        "/v1/runners/register",
        content=content,
        headers={**api.auth(api.registration_token), "content-type": "application/json"},
    )
    assert response.status_code == 400
    assert error_code(response) == "validation-error"
    assert await db.fetchval("SELECT count(*) FROM runner_sessions") == 0


async def test_a_declared_oversized_body_is_refused_before_it_is_read(api: Api) -> None:
    limit = api.daemon.settings.server.max_body_bytes
    response = await api.http.post(
        "/v1/runners/register",
        content=b"x" * (limit + 1),
        headers={**api.auth(api.registration_token), "content-type": "application/json"},
    )
    assert response.status_code == 413
    assert error_code(response) == "payload-too-large"
    assert response.json()["error"]["details"] == {"limit": limit}
