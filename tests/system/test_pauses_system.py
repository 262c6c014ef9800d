"""Pauses across real daemon processes (docs/policies.md Q-80), and the reference runner's
handling of the "paused" answer (Q-81)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import anyio
import httpx
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from controlplane.agent.runner import Runner, RunnerOptions
from tests.system import agents
from tests.system.conftest import SpawnDaemon
from tests.system.test_runner_agent import ScriptedControlPlane, serving
from tests.system.wire import job_body

pytestmark = pytest.mark.system


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def _register(client: httpx.AsyncClient, token: str) -> tuple[str, str]:
    response = await client.post(
        "/v1/runners/register", json={"labels": ["linux"]}, headers=_bearer(token)
    )
    assert response.status_code == 200, response.text
    return response.json()["session_token"], response.json()["session_id"]


async def _parked(client: httpx.AsyncClient, count: int) -> None:
    """Until the replica reports `count` parked job requests (a deadline, not a sleep)."""
    with anyio.fail_after(10):
        while f"controlplane_parked_runners {count}.0" not in (await client.get("/metrics")).text:
            await anyio.sleep(0.01)


async def test_q80_a_pause_and_a_resume_on_one_replica_reach_runners_parked_on_the_other(
    spawn_daemon: SpawnDaemon, database_url: str
) -> None:
    creds = await agents.make_credentials(database_url)
    admin = _bearer(creds.admin_key)
    async with (
        spawn_daemon() as replica_a,
        spawn_daemon() as replica_b,
        httpx.AsyncClient(base_url=replica_a.address, timeout=30) as a,
        httpx.AsyncClient(base_url=replica_b.address, timeout=30) as b,
    ):
        # A runner parked on B is answered "paused" by a pause made through A.
        token, session_id = await _register(b, creds.registration_token)
        order: list[str] = []
        answers: list[httpx.Response] = []

        async def poll(client: httpx.AsyncClient, session: str) -> None:
            # `wait` longer than the test's deadline: only a pause or a job can end it in time.
            answers.append(
                await client.post("/v1/runners/jobs/request?wait=50", headers=_bearer(session))
            )
            order.append("answered")

        with anyio.fail_after(30):
            async with anyio.create_task_group() as group:
                group.start_soon(poll, b, token)
                await _parked(b, 1)
                order.append("pausing")
                paused = await a.post(f"/v1/admin/runners/{session_id}/pause", headers=admin)
                assert paused.status_code == 200, paused.text
        assert order == ["pausing", "answered"]
        assert answers[0].status_code == 204
        assert answers[0].headers["Controlplane-Paused"] == "runner"

        # A workspace resumed through A serves a runner parked on B.
        other, _ = await _register(b, creds.registration_token)
        workspace = creds.workspace
        paused = await a.post(f"/v1/admin/workspaces/{workspace}/pause", headers=admin)
        assert paused.status_code == 200, paused.text
        job = job_body(workspace, ["linux"])
        enqueued = await a.post(
            "/v1/jobs", json={"jobs": [job]}, headers=_bearer(creds.orchestrator_key)
        )
        assert enqueued.status_code == 200, enqueued.text
        order.clear()
        answers.clear()
        with anyio.fail_after(30):
            async with anyio.create_task_group() as group:
                group.start_soon(poll, b, other)
                await _parked(b, 1)
                order.append("resuming")
                resumed = await a.post(f"/v1/admin/workspaces/{workspace}/resume", headers=admin)
                assert resumed.status_code == 200, resumed.text
        assert order == ["resuming", "answered"]
        assert answers[0].status_code == 200, answers[0].text
        assert answers[0].json()["job_execution_id"] == job["job_execution_id"]


# a scripted server answers the first job request "paused" with Retry-After 6 (more than
# the 5 s the runner allows any other Retry-After), the next
# one with 409 runner-session-exhausted, so the runner exits 0 after the second request.


class PausingControlPlane(ScriptedControlPlane):
    def __init__(self) -> None:
        super().__init__([])

    async def request_job(self, _request: Request) -> Response:
        self.requests.append(anyio.current_time())
        if len(self.requests) == 1:
            return Response(
                status_code=204, headers={"Retry-After": "6", "Controlplane-Paused": "runner"}
            )
        error: dict[str, Any] = {"code": "runner-session-exhausted", "message": "", "details": {}}
        return JSONResponse({"error": error}, status_code=409)


async def test_q81_the_reference_runner_waits_the_paused_retry_after_before_asking_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    scripted = PausingControlPlane()
    caplog.set_level("INFO", logger="controlplane.agent.runner")
    async with serving(scripted) as address:
        options = RunnerOptions(url=address, token="cp_mrt_x", labels=["linux"])
        with anyio.fail_after(30):
            assert await Runner(options, handle_signals=False).run() == 0
    paused = [r for r in caplog.records if r.getMessage() == "runner.paused"]
    assert len(paused) == 1 and getattr(paused[0], "retry_after_seconds", None) == 6.0
    # It waited at least the 6 s asked for (a timer never fires early; how late it fires
    # depends on the machine, so there is no upper bound).
    first, second = scripted.requests
    assert second - first >= 6.0


async def test_the_cli_pauses_and_resumes_workspaces_and_runners(
    spawn_daemon: SpawnDaemon, database_url: str
) -> None:
    creds = await agents.make_credentials(database_url)
    env = {"CONTROLPLANE_ADMIN_KEY": creds.admin_key}
    workspace = str(creds.workspace)
    async with (
        spawn_daemon() as daemon,
        httpx.AsyncClient(base_url=daemon.address, timeout=30) as client,
    ):
        url = ("--url", daemon.address)
        _, session_id = await _register(client, creds.registration_token)

        async def cli(*args: str) -> agents.Ran:
            return await agents.run_client(*args, *url, **env)

        first = await cli("workspaces", "pause", workspace, "--reason", "release freeze")
        assert first.returncode == 0, first.stderr
        assert first.stdout.startswith(f"workspace {workspace} paused, since ")
        assert first.stdout.rstrip().endswith("(release freeze)")
        again = await cli("workspaces", "pause", workspace)
        assert f"workspace {workspace} was already paused" in again.stdout
        resumed = await cli("workspaces", "resume", workspace, "--json")
        assert resumed.returncode == 0, resumed.stderr
        answer = json.loads(resumed.stdout)
        assert (answer["kind"], answer["paused"], answer["changed"]) == ("workspace", False, True)

        runner = await cli("runners", "pause", session_id)
        assert runner.stdout.startswith(f"runner {session_id} paused, since "), runner.stderr
        back = await cli("runners", "resume", session_id)
        assert back.stdout.strip() == f"runner {session_id} is no longer paused"
        unknown = await cli("runners", "resume", str(uuid.uuid4()))
        assert unknown.returncode == 2 and "404 not-found" in unknown.stderr
