"""Provisioner-side helpers for tests over a real control session and real HTTP."""

from __future__ import annotations

from typing import Any
from uuid import UUID

import anyio
import asyncpg
from websockets.asyncio.client import ClientConnection

from controlplane.store import provisioners
from tests.web.conftest import Api
from tests.web.control_client import hello, open_session, receive, send

TEMPLATE = {"template_key": "small", "labels": ["linux", "x64"], "available_slots": 4}


async def until(ws: ClientConnection, kind: str, **match: Any) -> dict[str, Any]:
    """The next message of type `kind` (and with the given fields), skipping others."""
    with anyio.fail_after(10):
        while True:
            message = await receive(ws)
            if message["type"] == kind and all(message.get(k) == v for k, v in match.items()):
                return message


async def next_grant(ws: ClientConnection) -> dict[str, Any]:
    with anyio.fail_after(10):
        while True:
            message = await until(ws, "demand")
            if message["grants"]:
                grant: dict[str, Any] = message["grants"][0]
                return grant


async def workspace_provisioner(api: Api, db: asyncpg.Connection) -> tuple[UUID, str]:
    created, raw = await provisioners.create(db, name="fleet", workspace_id=api.workspace)
    return created.id, raw


async def advertise(ws: ClientConnection, expect: int | None = None, **extra: Any) -> None:
    """Advertise TEMPLATE (or `templates=`); `expect`: templates the server keeps."""
    await send(
        ws,
        {
            "type": "advertise",
            "request_id": "a1",
            "templates": [TEMPLATE],
            "max_reservations": 10,
            **extra,
        },
    )
    answer = await until(ws, "advertised")
    expected = len(extra.get("templates", [TEMPLATE])) if expect is None else expect
    assert answer == {"type": "advertised", "request_id": "a1", "templates": expected}


async def granted(
    api: Api, db: asyncpg.Connection, **advertised: Any
) -> tuple[ClientConnection, dict[str, Any]]:
    """A workspace provisioner's open session that advertised (TEMPLATE, or `templates=`) and
    was granted the launch of one runner for one enqueued `linux` job: (session, grant)."""
    _, token = await workspace_provisioner(api, db)
    ws = await open_session(api.daemon, token)
    await hello(ws)
    await advertise(ws, **advertised)
    await api.enqueue(api.job(["linux"]))
    return ws, await next_grant(ws)


async def create_instance(
    ws: ClientConnection, reservation_id: str | None, provider_runner_id: str
) -> dict[str, Any]:
    """One instance for the grant (or a warm one), with its provider identity attached."""
    entry: dict[str, Any] = {"template_key": "small"}
    if reservation_id is not None:
        entry["reservation_id"] = reservation_id
    await send(
        ws,
        {
            "type": "create_instances",
            "request_id": "c1",
            "provider_kind": "local",
            "instances": [entry],
        },
    )
    created = await until(ws, "instances_created")
    [instance] = created["runner_instances"]
    await send(
        ws,
        {
            "type": "attach_provider",
            "request_id": "p1",
            "runner_instance_id": instance["runner_instance_id"],
            "provider_runner_id": provider_runner_id,
        },
    )
    assert (await until(ws, "attached"))["attached"] is True
    found: dict[str, Any] = instance
    return found


async def boot(api: Api, bootstrap_token: str) -> tuple[str, str | None]:
    """The machine's side: exchange and enroll; (control token, activation token or None)."""
    exchanged = await api.http.post(
        "/v1/runner-enrollment/exchange", json={"bootstrap_token": bootstrap_token}
    )
    assert exchanged.status_code == 200, exchanged.text
    control: str = exchanged.json()["control_session_token"]
    enrolled = await api.http.post(
        "/v1/runner-control/enrollment",
        json={"labels": ["linux", "x64"], "provider_kind": "local", "protocol_version": "1"},
        headers=api.auth(control),
    )
    assert enrolled.status_code == 200, enrolled.text
    activation: str | None = enrolled.json()["activation_token"]
    return control, activation


async def activate(api: Api, activation: str) -> str:
    """Register the one-claim session; its session token."""
    registered = await api.http.post(
        "/v1/runners/register", json={"labels": ["linux", "x64"]}, headers=api.auth(activation)
    )
    assert registered.status_code == 200, registered.text
    assert registered.json()["max_claims"] == 1
    token: str = registered.json()["session_token"]
    return token


async def instance_row(db: asyncpg.Connection, instance_id: str) -> asyncpg.Record:
    row = await db.fetchrow("SELECT * FROM runner_instances WHERE id = $1", UUID(instance_id))
    assert row is not None
    return row
