"""`controlplane provisioner local` as a real process beside a real daemon process.

It keeps one idle runner ready (a warm launch through the bootstrap flow), a job is bound to that
runner and runs, and after the provisioner restarts it adopts the runner it left running (state
file + reconcile) instead of launching another, and that runner takes the next job.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import httpx
import pytest

from controlplane.store import provisioners
from tests.system.conftest import DaemonProcess, SpawnDaemon
from tests.system.wire import job_body, orchestrator_and_registration

pytestmark = pytest.mark.system


def _provisioner(
    daemon: DaemonProcess, token: str, state: Path, log: Path, *extra: str
) -> subprocess.Popen[bytes]:
    env = {**os.environ, "CONTROLPLANE_PROVISIONER_TOKEN": token}
    with log.open("ab") as sink:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "controlplane.cli",
                "provisioner",
                "local",
                "--url",
                daemon.address,
                "--labels",
                "linux",
                "--slots",
                "2",
                "--idle-target",
                "1",
                "--state-file",
                str(state),
                *extra,
            ],
            env=env,
            stdout=sink,
            stderr=sink,
        )


async def _idle_runners(db: asyncpg.Connection) -> list[asyncpg.Record]:
    """Enrolled (an open control session, a protocol version), running, never activated."""
    rows: list[asyncpg.Record] = await db.fetch(
        "SELECT id, provider_runner_id FROM runner_instances ri"
        " WHERE state = 'running' AND runner_session_id IS NULL AND labels = '{linux}'"
        " AND reservation_released_at IS NULL AND protocol_version IS NOT NULL"
        " AND EXISTS (SELECT 1 FROM runner_control_sessions c"
        "             WHERE c.runner_instance_id = ri.id AND c.closed_at IS NULL)"
        " ORDER BY created_at"
    )
    return rows


async def _until(check: Any, seconds: float = 60) -> Any:
    with anyio.fail_after(seconds):
        while not (found := await check()):
            await anyio.sleep(0.1)
    return found


async def _run_job(http: httpx.AsyncClient, key: str, db: asyncpg.Connection, ws: uuid.UUID) -> str:
    job = job_body(ws)
    job["payload"] = {"script": "echo provisioned"}
    response = await http.post("/v1/jobs", json={"jobs": [job]}, headers={"Authorization": key})
    assert response.status_code == 200, response.text
    execution = uuid.UUID(job["job_execution_id"])

    async def ended() -> str | None:
        outcome: str | None = await db.fetchval(
            "SELECT outcome FROM ended_executions WHERE job_execution_id = $1", execution
        )
        return outcome

    outcome: str = await _until(ended)
    return outcome


async def _runner_of(db: asyncpg.Connection) -> set[uuid.UUID]:
    rows = await db.fetch("SELECT id FROM runner_instances WHERE first_claimed_at IS NOT NULL")
    return {row["id"] for row in rows}


async def test_local_provisioner_serves_jobs_and_adopts_its_runners_after_a_restart(
    spawn_daemon: SpawnDaemon, database_url: str, tmp_path: Path
) -> None:
    workspace = uuid.uuid4()
    orchestrator, _ = await orchestrator_and_registration(database_url, workspace)
    key = f"Bearer {orchestrator}"
    state, log = tmp_path / "provisioner.json", tmp_path / "provisioner.log"
    db = await asyncpg.connect(database_url)
    first: subprocess.Popen[bytes] | None = None
    second: subprocess.Popen[bytes] | None = None
    try:
        _, token = await provisioners.create(db, name="local", workspace_id=workspace)
        async with (
            spawn_daemon() as daemon,
            httpx.AsyncClient(base_url=daemon.address, timeout=30) as http,
        ):
            first = _provisioner(daemon, token, state, log)
            [warm] = await _until(lambda: _idle_runners(db))
            assert await _run_job(http, key, db, workspace) == "succeeded"
            assert await _runner_of(db) == {warm["id"]}  # the idle runner took it
            # The warm pool refills: a new idle runner, and the one that ran has exited.
            [refill] = await _until(lambda: _idle_runners(db))
            assert refill["id"] != warm["id"]

            first.send_signal(signal.SIGTERM)
            assert await anyio.to_thread.run_sync(first.wait, 20) == 0
            assert refill["provider_runner_id"] in state.read_text()

            second = _provisioner(daemon, token, state, log, "--stop-runners-on-exit")
            with anyio.fail_after(30):
                while "provisioner.adopted" not in log.read_text():
                    await anyio.sleep(0.1)
            # The adopted runner takes the next job: nothing new had to be launched for it.
            assert await _run_job(http, key, db, workspace) == "succeeded"
            assert await _runner_of(db) == {warm["id"], refill["id"]}
            second.send_signal(signal.SIGTERM)
            assert await anyio.to_thread.run_sync(second.wait, 20) == 0
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.kill()
        await db.close()
