"""Provisioning scenarios of spec section 8 that live on the control session (P-39..P-69 as they
apply to a pushed, WebSocket design), against a real daemon and real WebSockets."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

import anyio
import asyncpg
import pytest
from websockets.exceptions import ConnectionClosed

from controlplane import app
from controlplane.store import provisioners
from controlplane.store.embedded import EmbeddedPostgres
from tests.web import conftest
from tests.web.conftest import Api, run_daemon
from tests.web.control_client import closed_with, hello, open_session, send
from tests.web.provisioning_client import (
    TEMPLATE,
    activate,
    advertise,
    boot,
    create_instance,
    next_grant,
    until,
    workspace_provisioner,
)

pytestmark = pytest.mark.anyio


@pytest.fixture
async def no_installation(database_url: str) -> AsyncIterator[app.Daemon]:
    config = conftest.test_settings(provisioners__installation_enabled=False)
    async for running in run_daemon(database_url, config):
        yield running


async def test_p39_installation_token_on_a_host_without_installation_provisioning(
    no_installation: app.Daemon, db: asyncpg.Connection
) -> None:
    _, raw = await provisioners.create(db, name="fleet", workspace_id=None)
    ws = await open_session(no_installation, raw)
    await send(ws, {"type": "hello", "protocol_version": 1, "request_id": "h"})
    code, reason = await closed_with(ws)
    assert code == 4406
    assert reason.startswith("forbidden")
    assert await db.fetchval("SELECT count(*) FROM provisioner_sessions") == 0


async def test_p41_workspace_tokens_work_beside_installation_provisioning(
    api: Api, db: asyncpg.Connection
) -> None:
    _, installation = await provisioners.create(db, name="fleet", workspace_id=None)
    _, token = await workspace_provisioner(api, db)
    for raw in (installation, token):
        ws = await open_session(api.daemon, raw)
        await hello(ws)
        await advertise(ws)
        assert (await until(ws, "demand"))["seq"] == 1
        await ws.close()


async def test_p63_a_grant_with_stats_and_a_default_lifetime(
    api: Api, db: asyncpg.Connection
) -> None:
    _, token = await workspace_provisioner(api, db)
    ws = await open_session(api.daemon, token)
    await hello(ws)
    await advertise(ws)
    await until(ws, "demand")
    await api.enqueue(api.job(["linux"]))
    demand = await until(ws, "demand", newly_reserved=1)
    [stat] = demand["stats"]
    assert (stat["labels"], stat["queued"], stat["reserved"]) == (["linux"], 1, 1)
    [grant] = demand["grants"]
    lifetime = await db.fetchval(
        "SELECT extract(epoch FROM expires_at - created_at) FROM reservations WHERE id = $1",
        grant["reservation_id"],
    )
    assert 59 <= float(lifetime) <= 61
    assert datetime.fromisoformat(grant["expires_at"]) > datetime.fromisoformat(
        stat["oldest_queued_at"]
    )
    await ws.close()


@pytest.mark.parametrize(("asked", "kept"), [(601, 600), (540, 540), (120, 120)])
async def test_p64_requested_lifetime_is_capped_by_the_ceiling(
    api: Api, db: asyncpg.Connection, asked: int, kept: int
) -> None:
    _, token = await workspace_provisioner(api, db)
    ws = await open_session(api.daemon, token)
    await hello(ws)
    await advertise(ws, reservation_ttl_seconds=asked)
    await api.enqueue(api.job(["linux"]))
    grant = await next_grant(ws)
    lifetime = await db.fetchval(
        "SELECT extract(epoch FROM expires_at - created_at) FROM reservations WHERE id = $1",
        grant["reservation_id"],
    )
    assert kept - 1 <= float(lifetime) <= kept + 1
    await ws.close()


async def test_p65_advertising_publishes_templates_and_an_empty_list_withdraws_them(
    api: Api, db: asyncpg.Connection
) -> None:
    _, token = await workspace_provisioner(api, db)
    ws = await open_session(api.daemon, token)
    await hello(ws)
    await advertise(ws, max_reservations=0)  # observe only: no reservation is written
    await api.enqueue(api.job(["linux"]))
    demand = await until(ws, "demand")
    assert demand["grants"] == []
    rows = await db.fetch("SELECT template_key, labels FROM provisioner_templates")
    assert [(r["template_key"], r["labels"]) for r in rows] == [("small", ["linux", "x64"])]
    await advertise(ws, templates=[])
    assert await db.fetchval("SELECT count(*) FROM provisioner_templates") == 0
    assert await db.fetchval("SELECT count(*) FROM reservations") == 0
    await ws.close()


async def test_p66_reserved_labels_are_stripped_from_workspace_advertisements(
    database_url: str, db: asyncpg.Connection
) -> None:
    config = conftest.test_settings(runners__reserved_labels="managed")
    async for daemon in run_daemon(database_url, config):
        _, raw = await provisioners.create(db, name="fleet", workspace_id=uuid.uuid4())
        ws = await open_session(daemon, raw)
        await hello(ws)
        template: dict[str, Any] = {**TEMPLATE, "labels": ["linux", "managed"]}
        await advertise(
            ws,
            expect=1,
            templates=[
                template,
                {**TEMPLATE, "template_key": "only-reserved", "labels": ["managed"]},
            ],
        )
        labels = await db.fetchval("SELECT labels FROM provisioner_templates")
        assert labels == ["linux"]
        assert await db.fetchval("SELECT count(*) FROM provisioner_templates") == 1
        await ws.close()


async def test_p55_j140_a_cancelled_job_pushes_a_terminate_intent_at_once(
    api: Api, db: asyncpg.Connection
) -> None:
    _, token = await workspace_provisioner(api, db)
    ws = await open_session(api.daemon, token)
    await hello(ws)
    await advertise(ws)
    job = api.job(["linux"])
    await api.enqueue(job)
    grant = await next_grant(ws)
    instance = await create_instance(ws, grant["reservation_id"], "vm-cancel")
    _, activation = await boot(api, instance["bootstrap_token"])
    assert activation is not None
    session = await activate(api, activation)
    claimed = await api.request_job(session, wait=5)
    assert claimed.status_code == 200
    cancelled = await api.http.post(
        f"/v1/jobs/{job['job_execution_id']}/outcome",
        json={"status": "cancelled", "reason": "stop"},
        headers=api.auth(api.orchestrator_key),
    )
    assert cancelled.status_code == 200, cancelled.text
    # No advertisement, no grant, no tick needed: the cancel alone wakes a round whose push
    # names the runner.
    pushed = await until(ws, "demand", terminate_provider_runner_ids=["vm-cancel"])
    assert pushed["grants"] == []
    await ws.close()


async def test_a_database_fault_during_a_request_closes_1013_and_the_next_session_works(
    database_url: str, embedded_server: EmbeddedPostgres, db: asyncpg.Connection
) -> None:
    _, raw = await provisioners.create(db, name="fleet", workspace_id=uuid.uuid4())
    await db.close()
    async for daemon in run_daemon(database_url, conftest.test_settings()):
        ws = await open_session(daemon, raw)
        await hello(ws)
        await anyio.to_thread.run_sync(embedded_server.stop, "fast")
        try:
            await send(
                ws,
                {"type": "advertise", "request_id": "a", "templates": [], "max_reservations": 0},
            )
            code, reason = await closed_with(ws)
            assert (code, reason) == (1013, "unavailable")
        finally:
            await anyio.to_thread.run_sync(embedded_server.start)
        again = await open_session(daemon, raw)
        with anyio.fail_after(30):
            while True:  # the pool reconnects on its own
                try:
                    await hello(again)
                    break
                except ConnectionClosed:
                    again = await open_session(daemon, raw)
                    await anyio.sleep(0.2)
        await advertise(again, templates=[])
        await again.close()
