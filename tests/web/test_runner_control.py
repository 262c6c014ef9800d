"""The provisioned runner's boot path over real HTTP: bootstrap exchange, control session,
assignment long-poll, activation registration (spec 4.3-4.7, surface S-24..S-35)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from uuid import UUID

import anyio
import asyncpg
import httpx
import pytest

from controlplane import app
from controlplane.domain import tokens
from controlplane.store import provisioners, runner_instances
from controlplane.web.runner_control import await_activation, resolve_wait
from tests import provisioning
from tests.web.conftest import Api, run_daemon
from tests.web.conftest import test_settings as settings_for_tests

TTL = timedelta(minutes=5)
RESERVED = "shipfox-managed"


@pytest.fixture
async def daemon(database_url: str) -> AsyncIterator[app.Daemon]:
    """The shared daemon, with one reserved label (for the scope rules of J-96 and P-116)."""
    config = settings_for_tests(runners__reserved_labels=RESERVED)
    async for running in run_daemon(database_url, config):
        yield running


@dataclass
class Booted:
    provisioner_id: UUID
    runner_id: UUID
    bootstrap_token: str
    control_token: str = ""


def code(response: httpx.Response) -> str:
    value: str = response.json()["error"]["code"]
    return value


async def exchange(api: Api, token: str) -> httpx.Response:
    return await api.http.post("/v1/runner-enrollment/exchange", json={"bootstrap_token": token})


async def boot(
    api: Api,
    db: asyncpg.Connection,
    *,
    installation: bool = False,
    reservation_id: UUID | None = None,
    provisioner_id: UUID | None = None,
) -> Booted:
    """A batch-created instance that exchanged its bootstrap token for a control session."""
    if provisioner_id is None:
        found = await provisioning.provisioner(db, None if installation else api.workspace)
        provisioner_id = found.id
    batch = await runner_instances.create_batch(
        db, provisioner_id, provider_kind="docker", entries=[("small", reservation_id)],
        bootstrap_ttl=TTL,
    )  # fmt: skip
    (created,) = batch.instances
    booted = Booted(provisioner_id, created.runner_instance_id, created.bootstrap_token)
    response = await exchange(api, created.bootstrap_token)
    assert response.status_code == 200, response.text
    booted.control_token = response.json()["control_session_token"]
    return booted


async def attach(api: Api, booted: Booted, provider_runner_id: str | None = None) -> bool:
    response = await api.http.post(
        "/v1/runner-control/provider-runner",
        json={"provider_runner_id": provider_runner_id or f"c-{uuid.uuid4().hex[:8]}"},
        headers=api.auth(booted.control_token),
    )
    assert response.status_code == 200, response.text
    attached: bool = response.json()["attached"]
    return attached


async def enroll(api: Api, token: str, labels: list[str] | None = None) -> httpx.Response:
    body = {"labels": labels or ["linux"], "provider_kind": "docker", "protocol_version": "1"}
    return await api.http.post("/v1/runner-control/enrollment", json=body, headers=api.auth(token))


async def ready(api: Api, db: asyncpg.Connection, **kwargs: Any) -> Booted:
    """Booted, attached and enrolled (no reservation: idle)."""
    booted = await boot(api, db, **kwargs)
    assert await attach(api, booted)
    response = await enroll(api, booted.control_token)
    assert response.status_code == 200, response.text
    return booted


async def assigned(api: Api, db: asyncpg.Connection) -> Booted:
    """Ready and assigned by its provisioner to a live launch reservation."""
    booted = await ready(api, db)
    r = await provisioning.reservation(
        db, workspace_id=api.workspace, provisioner_id=booted.provisioner_id
    )
    await runner_instances.assign(db, booted.provisioner_id, r, [booted.runner_id])
    return booted


async def poll(api: Api, token: str, query: str = "?wait_seconds=1") -> httpx.Response:
    return await api.http.get(f"/v1/runner-control/assignment{query}", headers=api.auth(token))


async def activation_token(api: Api, booted: Booted) -> str:
    response = await poll(api, booted.control_token)
    assert response.status_code == 200, response.text
    token: str | None = response.json()["activation_token"]
    assert token is not None
    return token


async def register(api: Api, token: str, labels: list[str] | None = None) -> httpx.Response:
    return await api.http.post(
        "/v1/runners/register", json={"labels": labels or ["linux"]}, headers=api.auth(token)
    )


# --------------------------------------------------------------------------- exchange (4.3)


async def test_s29_a_bootstrap_token_exchanges_once(api: Api, db: asyncpg.Connection) -> None:
    booted = await boot(api, db)
    again = await exchange(api, booted.bootstrap_token)
    assert again.status_code == 401
    assert code(again) == "runner-bootstrap-token-invalid"


async def test_p115_bootstrap_reuse_is_401_and_control_tokens_cannot_claim_jobs(
    api: Api, db: asyncpg.Connection
) -> None:
    booted = await boot(api, db)
    stored = await db.fetchval(
        "SELECT token_sha256 FROM runner_bootstrap_tokens WHERE runner_instance_id = $1",
        booted.runner_id,
    )
    assert stored == tokens.digest(booted.bootstrap_token)
    assert (await exchange(api, booted.bootstrap_token)).status_code == 401
    assert (await api.enqueue(api.job())).status_code == 200
    response = await api.request_job(booted.control_token)
    assert response.status_code == 401
    assert await db.fetchval("SELECT count(*) FROM running_jobs") == 0


async def test_s32_a_control_token_is_refused_by_the_job_route(
    api: Api, db: asyncpg.Connection
) -> None:
    booted = await ready(api, db)
    response = await api.request_job(booted.control_token)
    assert response.status_code == 401
    assert code(response) == "unauthorized"


@pytest.mark.parametrize("how", ["expired", "revoked", "unknown", "malformed"])
async def test_s30_an_expired_or_revoked_bootstrap_token_is_refused(
    api: Api, db: asyncpg.Connection, how: str
) -> None:
    p = await provisioning.provisioner(db, api.workspace)
    batch = await runner_instances.create_batch(
        db, p.id, provider_kind=None, entries=[(None, None)], bootstrap_ttl=TTL
    )
    token = batch.instances[0].bootstrap_token
    if how == "expired":
        await db.execute("UPDATE runner_bootstrap_tokens SET expires_at = now()")
    elif how == "revoked":
        await db.execute("UPDATE runner_bootstrap_tokens SET revoked_at = now()")
    elif how == "unknown":
        token = tokens.new_opaque(tokens.Kind.BOOTSTRAP).raw
    else:
        token = "cp_rbt_short"
    response = await exchange(api, token)
    assert response.status_code == 401
    assert code(response) == "runner-bootstrap-token-invalid"
    assert await db.fetchval("SELECT count(*) FROM runner_control_sessions") == 0


async def test_s31_an_exchange_body_with_an_extra_key_is_400(api: Api) -> None:
    response = await api.http.post(
        "/v1/runner-enrollment/exchange", json={"bootstrap_token": "x", "extra": 1}
    )
    assert response.status_code == 400
    assert code(response) == "validation-error"


# ------------------------------------------------------------- control session auth (4.4)


async def test_s33_validation_precedes_control_auth(api: Api) -> None:
    for path, body in [
        ("/v1/runner-control/enrollment", {"labels": []}),
        ("/v1/runner-control/provider-runner", {"provider_runner_id": ""}),
    ]:
        response = await api.http.post(path, json=body)
        assert response.status_code == 400, path
        assert code(response) == "validation-error"
    assert (await api.http.get("/v1/runner-control/assignment?wait_seconds=0")).status_code == 400


async def test_s34_enrollment_of_a_terminated_instance_is_409(
    api: Api, db: asyncpg.Connection
) -> None:
    booted = await boot(api, db)
    await db.execute(
        "UPDATE runner_instances SET state = 'terminated' WHERE id = $1", booted.runner_id
    )
    response = await enroll(api, booted.control_token)
    assert response.status_code == 409
    assert code(response) == "runner-control-session-invalid"


@pytest.mark.parametrize("how", ["expired", "closed", "provisioner-revoked"])
async def test_s35_a_dead_control_session_is_401(
    api: Api, db: asyncpg.Connection, how: str
) -> None:
    booted = await boot(api, db)
    if how == "expired":
        await db.execute("UPDATE runner_control_sessions SET expires_at = now()")
    elif how == "closed":
        await db.execute(
            "UPDATE runner_control_sessions SET closed_at = now(), close_reason = 'activated'"
        )
    else:
        await provisioners.revoke(db, booted.provisioner_id)
    for response in (
        await api.http.post("/v1/runner-control/heartbeat", headers=api.auth(booted.control_token)),
        await enroll(api, booted.control_token),
        await poll(api, booted.control_token),
    ):
        assert response.status_code == 401
        assert code(response) == "unauthorized"


async def test_heartbeat_bumps_liveness_but_not_state(api: Api, db: asyncpg.Connection) -> None:
    booted = await boot(api, db)
    await db.execute(
        "UPDATE runner_instances SET reported_at = now() - interval '1 hour' WHERE id = $1",
        booted.runner_id,
    )
    response = await api.http.post(
        "/v1/runner-control/heartbeat", headers=api.auth(booted.control_token)
    )
    assert response.status_code == 200 and response.json() == {"ok": True}
    row = await db.fetchrow(
        "SELECT state, reported_at > now() - interval '1 minute' AS fresh FROM runner_instances"
        " WHERE id = $1",
        booted.runner_id,
    )
    assert row is not None and (row["state"], row["fresh"]) == ("starting", True)


CONTROL_ROUTES = [
    ("POST", "/v1/runner-control/enrollment",
     {"labels": ["linux"], "provider_kind": "d", "protocol_version": "1"}),
    ("POST", "/v1/runner-control/provider-runner", {"provider_runner_id": "c-1"}),
    ("POST", "/v1/runner-control/heartbeat", None),
    ("GET", "/v1/runner-control/assignment?wait_seconds=1", None),
]  # fmt: skip


async def test_tokens_of_other_kinds_are_refused_by_control_routes(
    api: Api, db: asyncpg.Connection
) -> None:
    booted = await boot(api, db)
    session = await api.register()
    others = [
        api.registration_token,
        session,
        api.orchestrator_key,
        api.admin_key,
        booted.bootstrap_token,
        (await provisioners.create(db, name="p", workspace_id=api.workspace))[1],
        tokens.new_opaque(tokens.Kind.ACTIVATION).raw,
    ]
    for method, path, body in CONTROL_ROUTES:
        for token in others:
            response = await api.http.request(method, path, json=body, headers=api.auth(token))
            assert response.status_code == 401, (path, token[:7])
    state = await db.fetchval("SELECT state FROM runner_instances WHERE id = $1", booted.runner_id)
    assert state == "starting"


# ------------------------------------------------------------------------- enrollment (4.5)


async def test_p116_enrollment_labels_follow_the_provisioner_scope(
    api: Api, db: asyncpg.Connection
) -> None:
    workspace = await boot(api, db)
    installation = await boot(api, db, installation=True)
    declared = ["Linux", RESERVED, "x64", "linux"]
    for booted in (workspace, installation):
        response = await enroll(api, booted.control_token, declared)
        assert response.status_code == 200 and response.json() == {"activation_token": None}
    labels = {
        row["id"]: list(row["labels"])
        for row in await db.fetch("SELECT id, labels FROM runner_instances")
    }
    assert labels[workspace.runner_id] == ["linux", "x64"]
    assert labels[installation.runner_id] == ["linux", RESERVED, "x64"]


async def test_p120_enrollment_answers_an_activation_token_for_a_demand_runner(
    api: Api, db: asyncpg.Connection
) -> None:
    p = await provisioning.provisioner(db, api.workspace)
    r = await provisioning.reservation(db, workspace_id=api.workspace, provisioner_id=p.id)
    booted = await boot(api, db, provisioner_id=p.id, reservation_id=r)
    assert await attach(api, booted)
    response = await enroll(api, booted.control_token)
    assert response.status_code == 200
    token = response.json()["activation_token"]
    assert token is not None
    registered = await register(api, token)
    assert registered.status_code == 200, registered.text
    assert registered.json()["mode"] == "activation"


async def test_p132_attach_over_the_control_session_happens_once(
    api: Api, db: asyncpg.Connection
) -> None:
    booted = await boot(api, db)
    assert await attach(api, booted, "c-1")
    assert not await attach(api, booted, "c-2")
    other = await boot(api, db, provisioner_id=booted.provisioner_id)
    response = await api.http.post(
        "/v1/runner-control/provider-runner",
        json={"provider_runner_id": "c-1"},
        headers=api.auth(other.control_token),
    )
    assert response.status_code == 409
    assert code(response) == "provider-runner-id-taken"


# --------------------------------------------------------------- assignment poll (4.7)


def test_j135_s87_the_wait_resolution_caps_31_at_30_and_absent_is_30() -> None:
    assert [resolve_wait(n, 30) for n in (5, 0, 30, 31, None)] == [5, 1, 30, 30, 30]


@pytest.mark.parametrize("query", ["?wait_seconds=-1", "?wait_seconds=0", "?wait_seconds=1.5",
                                   "?wait_seconds=x", "?wait=1"])  # fmt: skip
async def test_j135_s87_the_wait_query_is_an_integer_of_at_least_1(
    api: Api, db: asyncpg.Connection, query: str
) -> None:
    booted = await boot(api, db)
    response = await poll(api, booted.control_token, query)
    assert response.status_code == 400
    assert code(response) == "validation-error"


async def test_j136_s88_the_poll_keeps_reading_until_a_token_and_never_past_its_deadline() -> None:
    now = [0.0]
    reads: list[float] = []
    parks: list[float] = []
    answers = iter([None, None, "cp_rat_token"])

    async def read() -> str | None:
        reads.append(now[0])
        return next(answers)

    async def park(seconds: float) -> bool:
        parks.append(seconds)
        now[0] += seconds
        return False

    token = await await_activation(read, park, wait=5, interval=1, clock=lambda: now[0])
    assert token == "cp_rat_token"
    assert reads == [0.0, 1.0, 2.0] and parks == [1, 1]

    now[0], reads[:], parks[:] = 0.0, [], []
    answers = iter([None] * 10)
    assert await await_activation(read, park, wait=2.5, interval=1, clock=lambda: now[0]) is None
    assert reads == [0.0, 1.0, 2.0]  # no read at or after the deadline
    assert parks == [1, 1, 0.5]  # the last park ends exactly at the deadline
    assert now[0] == 2.5


async def test_j136_a_disconnect_ends_the_poll() -> None:
    async def read() -> str | None:
        return None

    async def park(_seconds: float) -> bool:
        return True

    assert await await_activation(read, park, wait=30, interval=1, clock=lambda: 0.0) is None


async def test_j136_s89_the_poll_picks_up_a_runner_that_becomes_running(
    api: Api, db: asyncpg.Connection
) -> None:
    booted = await assigned(api, db)
    await db.execute("UPDATE runner_instances SET state = 'starting' WHERE id = $1",
                     booted.runner_id)  # fmt: skip
    answered: list[httpx.Response] = []
    async with anyio.create_task_group() as group:

        async def waiting() -> None:
            answered.append(await poll(api, booted.control_token, "?wait_seconds=10"))

        group.start_soon(waiting)
        await db.execute(
            "UPDATE runner_instances SET state = 'running' WHERE id = $1", booted.runner_id
        )
    assert answered[0].status_code == 200
    assert answered[0].json()["activation_token"] is not None


async def test_p130_s88_an_unassigned_runner_times_out_with_null(
    api: Api, db: asyncpg.Connection
) -> None:
    booted = await ready(api, db)
    started = anyio.current_time()
    response = await poll(api, booted.control_token, "?wait_seconds=1")
    elapsed = anyio.current_time() - started
    assert response.status_code == 200 and response.json() == {"activation_token": None}
    # It waited what was asked; the answer came from the one-second wait ending, not from an
    # assignment (none exists) or the longest wait (how late is the machine's business).
    assert elapsed >= 1.0
    assert await db.fetchval("SELECT count(*) FROM runner_activation_tokens") == 0


# ------------------------------------------------------------ activation registration


async def test_p129_j137_s27_activation_registers_once_and_closes_control_access(
    api: Api, db: asyncpg.Connection
) -> None:
    booted = await assigned(api, db)
    token = await activation_token(api, booted)
    assert token.startswith("cp_rat_")
    response = await register(api, token, ["linux", "x64"])
    assert response.status_code == 200, response.text
    body = response.json()
    assert (body["mode"], body["max_claims"], body["labels"]) == ("activation", 1, ["linux", "x64"])
    session = await db.fetchrow("SELECT * FROM runner_sessions WHERE id = $1",
                                uuid.UUID(body["session_id"]))  # fmt: skip
    assert session is not None
    assert session["registration_token_kind"] == "activation"
    assert session["runner_instance_id"] == booted.runner_id
    closed = await db.fetchrow("SELECT closed_at, close_reason FROM runner_control_sessions")
    assert closed is not None and closed["close_reason"] == "activated"
    heartbeat = await api.http.post(
        "/v1/runner-control/heartbeat", headers=api.auth(booted.control_token)
    )
    assert heartbeat.status_code == 401


async def test_s24_an_activation_token_for_an_unassigned_instance_is_401(
    api: Api, db: asyncpg.Connection
) -> None:
    booted = await assigned(api, db)
    token = await activation_token(api, booted)
    await db.execute("UPDATE runner_instances SET workspace_id = NULL WHERE id = $1",
                     booted.runner_id)  # fmt: skip
    response = await register(api, token)
    assert response.status_code == 401 and code(response) == "unauthorized"


async def test_s25_an_activation_token_after_the_instance_has_a_session_is_401(
    api: Api, db: asyncpg.Connection
) -> None:
    booted = await assigned(api, db)
    token = await activation_token(api, booted)
    await db.execute("UPDATE runner_instances SET runner_session_id = $2 WHERE id = $1",
                     booted.runner_id, uuid.uuid4())  # fmt: skip
    response = await register(api, token)
    assert response.status_code == 401 and code(response) == "unauthorized"


async def test_s26_j138_an_expired_activation_token_is_401(
    api: Api, db: asyncpg.Connection
) -> None:
    booted = await assigned(api, db)
    token = await activation_token(api, booted)
    await db.execute("UPDATE runner_activation_tokens SET expires_at = now()")
    response = await register(api, token)
    assert response.status_code == 401 and code(response) == "unauthorized"
    assert await db.fetchval("SELECT count(*) FROM runner_sessions") == 0


async def test_s28_a_second_activation_token_revokes_the_first(
    api: Api, db: asyncpg.Connection
) -> None:
    booted = await assigned(api, db)
    first = await activation_token(api, booted)
    second = await activation_token(api, booted)
    assert (await register(api, first)).status_code == 401
    assert (await register(api, second)).status_code == 200


async def test_activation_of_a_revoked_provisioner_is_401(api: Api, db: asyncpg.Connection) -> None:
    booted = await assigned(api, db)
    token = await activation_token(api, booted)
    await db.execute("UPDATE provisioner_tokens SET revoked_at = now()")
    assert (await register(api, token)).status_code == 401


async def test_j95_two_concurrent_registrations_with_one_token_make_one_session(
    api: Api, db: asyncpg.Connection
) -> None:
    booted = await assigned(api, db)
    token = await activation_token(api, booted)
    statuses: list[int] = []

    async def attempt() -> None:
        statuses.append((await register(api, token)).status_code)

    async with anyio.create_task_group() as group:
        group.start_soon(attempt)
        group.start_soon(attempt)
    assert sorted(statuses) == [200, 401]
    assert await db.fetchval(
        "SELECT count(*) FROM runner_sessions WHERE runner_instance_id = $1", booted.runner_id
    ) == 1  # fmt: skip
    assert await db.fetchval("SELECT consumed_at IS NOT NULL FROM runner_activation_tokens")


async def test_j96_a_workspace_provisioners_runner_loses_reserved_labels(
    api: Api, db: asyncpg.Connection
) -> None:
    booted = await assigned(api, db)
    response = await register(api, await activation_token(api, booted), ["linux", RESERVED])
    assert response.status_code == 200
    assert response.json()["labels"] == ["linux"]
    stored = await db.fetchval("SELECT labels FROM runner_sessions")
    assert list(stored) == ["linux"]
    only_reserved = await assigned(api, db)
    refused = await register(api, await activation_token(api, only_reserved), [RESERVED])
    assert refused.status_code == 400 and code(refused) == "runner-labels-reserved"


async def test_p131_j139_a_stranded_rebound_runner_activates_and_claims_the_job(
    api: Api, db: asyncpg.Connection
) -> None:
    p = await provisioning.provisioner(db, api.workspace)
    stranded = await provisioning.reservation(db, workspace_id=api.workspace, provisioner_id=p.id)
    booted = await boot(api, db, provisioner_id=p.id, reservation_id=stranded)
    assert await attach(api, booted)
    # The reservation expires before the runner enrolls: enrollment cannot promote it.
    await db.execute("UPDATE reservations SET expires_at = now() - interval '1 second'")
    response = await enroll(api, booted.control_token)
    assert response.status_code == 200 and response.json() == {"activation_token": None}
    job = api.job(["linux"])
    assert (await api.enqueue(job)).status_code == 200
    # The next allocation binds the idle runner (store/demand.py); written here as it would.
    bound = await provisioning.reservation(
        db, workspace_id=api.workspace, provisioner_id=p.id, kind="bound"
    )
    await db.execute(
        """
        UPDATE runner_instances SET workspace_id = $2, reservation_id = $3, assigned_at = now(),
               intended_reservation_id = NULL WHERE id = $1
        """,
        booted.runner_id,
        api.workspace,
        bound,
    )
    registered = await register(api, await activation_token(api, booted))
    assert registered.status_code == 200
    claimed = await api.request_job(registered.json()["session_token"])
    assert claimed.status_code == 200, claimed.text
    assert claimed.json()["job_execution_id"] == job["job_execution_id"]
    session = await db.fetchrow("SELECT * FROM runner_sessions")
    assert session is not None
    assert (session["registration_token_kind"], session["max_claims"], session["claims_used"]) == (
        "activation", 1, 1,
    )  # fmt: skip
