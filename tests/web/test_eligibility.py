"""Installation-scope eligibility (spec 3.5) over real HTTP and a real control session: an
operator sets which workspaces an installation provisioner may serve; its allocation grants
launches and binds idle runners only there, and a change applies without reconnecting it."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any
from uuid import UUID

import asyncpg
import httpx
import pytest

from controlplane import app
from controlplane.store import provisioners
from tests.web import conftest
from tests.web.conftest import Api, open_api, run_daemon
from tests.web.control_client import hello, open_session
from tests.web.provisioning_client import (
    TEMPLATE,
    advertise,
    boot,
    create_instance,
    instance_row,
    next_grant,
    until,
)
from tests.web.test_admin_routes import admin_post, error_code

pytestmark = pytest.mark.anyio


def route(provisioner_id: UUID | str) -> str:
    return f"/v1/admin/provisioner-tokens/{provisioner_id}/eligibility"


async def put(api: Api, provisioner_id: UUID | str, body: Any, key: str = "") -> httpx.Response:
    return await api.http.put(
        route(provisioner_id), json=body, headers=api.auth(key or api.admin_key)
    )


async def installation(db: asyncpg.Connection) -> tuple[UUID, str]:
    created, raw = await provisioners.create(db, name="fleet", workspace_id=None)
    return created.id, raw


# The admin API ---------------------------------------------------------------------------------


async def test_eligibility_is_all_until_set_and_reads_back_as_set(
    api: Api, db: asyncpg.Connection
) -> None:
    inst, _ = await installation(db)
    shown = await api.http.get(route(inst), headers=api.auth(api.admin_key))
    assert shown.status_code == 200, shown.text
    assert shown.json() == {
        "provisioner_id": str(inst), "mode": "all", "workspace_ids": [], "updated_at": None,
    }  # fmt: skip
    listed = sorted([str(uuid.uuid4()), str(uuid.uuid4())])
    changed = await put(api, inst, {"mode": "deny", "workspace_ids": listed[::-1]})
    assert changed.status_code == 200, changed.text
    assert changed.json()["mode"] == "deny"
    assert changed.json()["workspace_ids"] == listed
    assert changed.json()["updated_at"] is not None
    shown = await api.http.get(route(inst), headers=api.auth(api.admin_key))
    assert shown.json() == changed.json()
    reset = await put(api, inst, {"mode": "all"})
    assert reset.json()["mode"] == "all"
    assert reset.json()["updated_at"] is None
    assert await db.fetchval("SELECT count(*) FROM provisioner_eligibility") == 0


@pytest.mark.parametrize(
    "body",
    [
        {"mode": "all", "workspace_ids": [str(uuid.uuid4())]},
        {"mode": "allow", "workspace_ids": [str(UUID(int=1)), str(UUID(int=1))]},
        {"mode": "allow", "workspace_ids": ["not-a-uuid"]},
        {"mode": "some"},
        {"workspace_ids": []},
        {"mode": "allow", "workspace_ids": [], "scope": "x"},
    ],
    ids=["all-with-ids", "repeated", "bad-id", "bad-mode", "no-mode", "unknown-field"],
)
async def test_a_bad_eligibility_is_400_and_changes_nothing(
    api: Api, db: asyncpg.Connection, body: dict[str, Any]
) -> None:
    inst, _ = await installation(db)
    refused = await put(api, inst, body)
    assert refused.status_code == 400, refused.text
    assert error_code(refused) == "validation-error"
    assert await db.fetchval("SELECT count(*) FROM provisioner_eligibility") == 0


async def test_who_may_set_eligibility_and_for_which_tokens(
    api: Api, db: asyncpg.Connection
) -> None:
    inst, _ = await installation(db)
    body = {"mode": "allow", "workspace_ids": [str(api.workspace)]}
    own, _ = await provisioners.create(db, name="own", workspace_id=api.workspace)
    conflict = await put(api, own.id, body)
    assert conflict.status_code == 409
    assert error_code(conflict) == "conflict"
    for unknown in (
        await put(api, uuid.uuid4(), body),
        await api.http.get(route(uuid.uuid4()), headers=api.auth(api.admin_key)),
    ):
        assert unknown.status_code == 404
    observer = await admin_post(
        api, "/api-keys", {"kind": "admin", "name": "o", "role": "observer"}
    )
    observer_key = observer.json()["token"]
    refused = await put(api, inst, body, observer_key)
    assert error_code(refused) == "admin-key-read-only"
    read = await api.http.get(route(inst), headers=api.auth(observer_key))
    assert read.status_code == 200
    team = await admin_post(
        api,
        "/api-keys",
        {"kind": "workspace-admin", "name": "t", "workspace_id": str(api.workspace)},
    )
    assert error_code(await put(api, inst, body, team.json()["token"])) == "forbidden"
    assert await db.fetchval("SELECT count(*) FROM provisioner_eligibility") == 0


@pytest.fixture
async def small_lists(database_url: str) -> AsyncIterator[app.Daemon]:
    config = conftest.test_settings(provisioners__eligibility_max_workspaces=2)
    async for running in run_daemon(database_url, config):
        yield running


async def test_a_list_over_the_configured_maximum_is_400(
    small_lists: app.Daemon, database_url: str, db: asyncpg.Connection
) -> None:
    async with open_api(small_lists, database_url) as api:
        inst, _ = await installation(db)
        two = [str(uuid.uuid4()) for _ in range(2)]
        assert (await put(api, inst, {"mode": "deny", "workspace_ids": two})).status_code == 200
        three = [*two, str(uuid.uuid4())]
        refused = await put(api, inst, {"mode": "deny", "workspace_ids": three})
        assert refused.status_code == 400
        assert "eligibility_max_workspaces" in refused.json()["error"]["message"]
        served = (await api.http.get("/openapi.json")).json()["components"]["schemas"]
        assert served["SetEligibility"]["properties"]["workspace_ids"]["maxItems"] == 2


# Allocation and binding over a control session ---------------------------------------------------


async def test_an_allow_list_limits_the_launch_grants(api: Api, db: asyncpg.Connection) -> None:
    """The job outside the allow list is older, so a walk that ignored the list would serve it
    first; only the listed workspace gets a grant, and the other never a reservation."""
    inst, raw = await installation(db)
    elsewhere = uuid.uuid4()
    allowed = await put(api, inst, {"mode": "allow", "workspace_ids": [str(api.workspace)]})
    assert allowed.status_code == 200
    ws = await open_session(api.daemon, raw)
    await hello(ws)
    await advertise(ws)
    await until(ws, "demand")
    await api.enqueue(api.job(["linux"], workspace_id=str(elsewhere)))
    await api.enqueue(api.job(["linux"]))
    grant = await next_grant(ws)
    assert grant["workspace_id"] == str(api.workspace)
    held = await db.fetchval("SELECT count(*) FROM reservations WHERE workspace_id = $1", elsewhere)
    assert held == 0
    await ws.close()


@pytest.fixture
async def slow_ticks(database_url: str) -> AsyncIterator[app.Daemon]:
    """A daemon whose provisioner actors run a round only when woken (the safety tick is ten
    minutes): a round that happens is one something asked for."""
    config = conftest.test_settings(provisioners__demand_safety_tick_seconds=600)
    async for running in run_daemon(database_url, config):
        yield running


async def test_a_denied_workspace_gets_no_idle_runner_and_a_change_needs_no_reconnect(
    slow_ticks: app.Daemon, database_url: str, db: asyncpg.Connection
) -> None:
    """An idle warm runner of the installation provisioner is bound to the younger demand of an
    admitted workspace, not to the older demand of the denied one. Then the operator admits
    every workspace, which wakes the provisioner's actor (no tick would come in time), and the
    same session gets a grant for the once-denied workspace."""
    async with open_api(slow_ticks, database_url) as api:
        await _deny_then_admit(api, db)


async def _deny_then_admit(api: Api, db: asyncpg.Connection) -> None:
    inst, raw = await installation(db)
    denied, admitted = api.workspace, uuid.uuid4()
    assert (await put(api, inst, {"mode": "deny", "workspace_ids": [str(denied)]})).is_success
    ws = await open_session(api.daemon, raw)
    await hello(ws)
    await advertise(ws, templates=[{**TEMPLATE, "idle_target": 1}])
    demand = await until(ws, "demand")
    assert [launch["count"] for launch in demand["warm"]] == [1]
    instance = await create_instance(ws, None, "warm-1")
    _control, activation = await boot(api, instance["bootstrap_token"])
    assert activation is None  # warm and idle

    await api.enqueue(api.job(["linux"]))  # the denied workspace's, the oldest demand
    await api.enqueue(api.job(["linux"], workspace_id=str(admitted)))
    bound = await until(ws, "demand", newly_reserved=1)
    assert bound["grants"] == []
    assert {stat["workspace_id"] for stat in bound["stats"]} == {str(admitted)}
    row = await instance_row(db, instance["runner_instance_id"])
    assert row["workspace_id"] == admitted
    held = await db.fetchval("SELECT count(*) FROM reservations WHERE workspace_id = $1", denied)
    assert held == 0

    assert (await put(api, inst, {"mode": "all"})).is_success
    grant = await next_grant(ws)
    assert grant["workspace_id"] == str(denied)
    await ws.close()
