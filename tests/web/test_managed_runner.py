"""The managed runner's way in (agent/managed.py) against a real daemon: what it asks, in
which order, and what it keeps of its bootstrap token."""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import anyio
import asyncpg
import httpx
import pytest

from controlplane.agent import managed
from controlplane.agent import runner as runner_agent
from controlplane.cli import clients
from controlplane.store import runner_instances
from tests import provisioning
from tests.web.conftest import Api

pytestmark = pytest.mark.anyio


async def _bootstrap_token(api: Api, db: asyncpg.Connection, *, reserved: bool) -> str:
    p = await provisioning.provisioner(db, api.workspace)
    reservation = None
    if reserved:
        reservation = await provisioning.reservation(
            db, workspace_id=api.workspace, provisioner_id=p.id
        )
    batch = await runner_instances.create_batch(
        db, p.id, provider_kind="docker", entries=[("small", reservation)],
        bootstrap_ttl=timedelta(minutes=5),
    )  # fmt: skip
    (created,) = batch.instances
    return created.bootstrap_token


async def test_s113_an_activation_token_at_enrollment_skips_the_assignment_poll(
    api: Api, db: asyncpg.Connection
) -> None:
    token = await _bootstrap_token(api, db, reserved=True)
    asked: list[str] = []

    async def record(request: httpx.Request) -> None:
        asked.append(f"{request.method} {request.url.path}")

    hooks = {"request": [record]}
    async with httpx.AsyncClient(base_url=api.http.base_url, event_hooks=hooks) as http:
        activation = await managed.activate(http, token, ["linux"], provider_runner_id="vm-113")
        registered = await http.post(
            "/v1/runners/register",
            json={"labels": ["linux"]},
            headers={"Authorization": f"Bearer {activation}"},
        )
    assert registered.status_code == 200, registered.text
    assert asked == [
        "POST /v1/runner-enrollment/exchange",
        "POST /v1/runner-control/provider-runner",
        "POST /v1/runner-control/enrollment",
        "POST /v1/runners/register",
    ]


async def test_s113_without_a_reservation_the_runner_polls_for_its_assignment(
    api: Api, db: asyncpg.Connection
) -> None:
    """The other branch, so the test above cannot pass by never polling at all: an idle runner
    polls; the poll is cut short here by a bootstrap-refused answer to a revoked control."""
    token = await _bootstrap_token(api, db, reserved=False)
    asked: list[str] = []

    async def record(request: httpx.Request) -> None:
        asked.append(f"{request.method} {request.url.path}")
        if request.url.path == "/v1/runner-control/assignment":
            await db.execute("UPDATE runner_control_sessions SET closed_at = now()")

    hooks = {"request": [record]}
    async with httpx.AsyncClient(base_url=api.http.base_url, event_hooks=hooks) as http:
        with pytest.raises(managed.BootstrapRefused):
            await managed.activate(http, token, ["linux"])
    assert asked[-1] == "GET /v1/runner-control/assignment"


async def test_s120_the_bootstrap_token_leaves_the_environment_and_exchanges_once(
    api: Api, db: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = await _bootstrap_token(api, db, reserved=False)
    seen: dict[str, object] = {}

    class Recorder:
        def __init__(self, options: runner_agent.RunnerOptions) -> None:
            seen["token"] = options.bootstrap_token
            seen["environment"] = os.environ.get("CONTROLPLANE_BOOTSTRAP_TOKEN")

        async def run(self) -> int:
            return 0

    monkeypatch.setattr(runner_agent, "Runner", Recorder)
    monkeypatch.setenv("CONTROLPLANE_BOOTSTRAP_TOKEN", token)
    monkeypatch.delenv("CONTROLPLANE_RUNNER_TOKEN", raising=False)
    args = argparse.Namespace(
        url=str(api.http.base_url), token=None, bootstrap_token=None, provider_runner_id=None,
        labels="linux", once=True, max_idle_seconds=0,
    )  # fmt: skip
    # The command runs its own event loop, so it gets a thread of its own.
    assert await anyio.to_thread.run_sync(clients._cmd_runner, args) == 0
    assert seen == {"token": token, "environment": None}
    assert "CONTROLPLANE_BOOTSTRAP_TOKEN" not in os.environ
    exchange = {"bootstrap_token": token}
    first = await api.http.post("/v1/runner-enrollment/exchange", json=exchange)
    second = await api.http.post("/v1/runner-enrollment/exchange", json=exchange)
    assert (first.status_code, second.status_code) == (200, 401)
