"""The HTTP clients (`controlplane runner`, `enqueue`, `status`) as real processes, and the
credentials a daemon needs for them."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import UUID

import anyio
import asyncpg
import httpx
from anyio.abc import ByteReceiveStream, Process

from controlplane.store import credentials

CLI = [sys.executable, "-m", "controlplane.cli"]
# Short intervals so a test sees a heartbeat and a long-poll cycle within a second or five.
DAEMON_KNOBS = {
    "CONTROLPLANE_RUNNERS_HEARTBEAT_INTERVAL_SECONDS": "1",
    "CONTROLPLANE_RUNNERS_LONG_POLL_MAX_SECONDS": "5",
}


@dataclass
class Credentials:
    workspace: UUID
    orchestrator_key: str
    admin_key: str
    registration_token: str


async def make_credentials(database_url: str) -> Credentials:
    workspace = uuid.uuid4()
    conn = await asyncpg.connect(database_url)
    try:
        _, orchestrator = await credentials.create_api_key(conn, kind="orchestrator", name="o")
        _, admin = await credentials.create_api_key(conn, kind="admin", name="a")
        _, registration = await credentials.create_manual_token(
            conn, workspace_id=workspace, name="r"
        )
    finally:
        await conn.close()
    return Credentials(workspace, orchestrator, admin, registration)


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


async def run_client(*args: str, **env: str) -> Ran:
    with anyio.fail_after(60):
        done = await anyio.run_process(
            [*CLI, "--log-level", "warning", *args], env={**os.environ, **env}, check=False
        )
    return Ran(done.returncode, done.stdout.decode(), done.stderr.decode())


async def enqueue(address: str, creds: Credentials, *command: str, wait: bool = False) -> Ran:
    return await run_client(
        "enqueue",
        "--url",
        address,
        "--workspace",
        str(creds.workspace),
        "--labels",
        "linux",
        *(["--wait", "--timeout", "60"] if wait else []),
        "--",
        *command,
        CONTROLPLANE_ORCHESTRATOR_KEY=creds.orchestrator_key,
    )


@dataclass
class RunnerProcess:
    process: Process
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)

    def logs(self, event: str) -> list[dict[str, Any]]:
        found = []
        for line in self.stderr.decode(errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("event") == event:
                found.append(entry)
        return found

    async def printed(self, text: str, within: float = 30) -> None:
        with anyio.fail_after(within):
            while text.encode() not in self.stdout:
                await anyio.sleep(0.02)

    async def logged(self, event: str, count: int = 1, within: float = 30) -> None:
        with anyio.fail_after(within):
            while len(self.logs(event)) < count:
                await anyio.sleep(0.02)

    async def exited(self, within: float = 30) -> int:
        with anyio.fail_after(within):
            return await self.process.wait()

    def send_signal(self, signum: signal.Signals) -> None:
        self.process.send_signal(signum)


async def _collect(stream: ByteReceiveStream | None, sink: bytearray) -> None:
    assert stream is not None
    async for chunk in stream:
        sink.extend(chunk)


@asynccontextmanager
async def runner(address: str, token: str, *extra: str) -> AsyncIterator[RunnerProcess]:
    """`controlplane runner` with labels linux,x64; stopped (job included) when the block ends."""
    process = await anyio.open_process(
        [*CLI, "runner", "--url", address, "--labels", "linux,x64", *extra],
        env={**os.environ, "CONTROLPLANE_RUNNER_TOKEN": token},
    )
    running = RunnerProcess(process)
    async with anyio.create_task_group() as group:
        group.start_soon(_collect, process.stdout, running.stdout)
        group.start_soon(_collect, process.stderr, running.stderr)
        try:
            yield running
        finally:
            with anyio.CancelScope(shield=True):
                await _stop(running)
            group.cancel_scope.cancel()
            # pytest shows captured output only for a failing test: the runner's side of it.
            print(f"runner stdout:\n{running.stdout.decode(errors='replace')}")
            print(f"runner stderr:\n{running.stderr.decode(errors='replace')}")


async def _stop(running: RunnerProcess) -> None:
    if running.process.returncode is not None:
        return
    running.send_signal(signal.SIGTERM)
    with anyio.move_on_after(10):
        await running.logged("runner.stopping")
        # A second signal aborts (and kills) a job that is still running.
        if running.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                running.send_signal(signal.SIGTERM)
        await running.process.wait()
    if running.process.returncode is None:
        running.process.kill()
        await running.process.wait()


async def execution_state(address: str, key: str, execution: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=address, timeout=10) as http:
        response = await http.get(
            f"/v1/jobs/{execution}", headers={"Authorization": f"Bearer {key}"}
        )
    assert response.status_code == 200, response.text
    state: dict[str, Any] = response.json()
    return state


async def ended(address: str, key: str, execution: str, within: float = 30) -> dict[str, Any]:
    with anyio.fail_after(within):
        while (state := await execution_state(address, key, execution))["state"] != "ended":
            await anyio.sleep(0.05)
    return state


def alive(pid: int) -> bool:
    """Whether the process exists and is not a zombie (one nobody has reaped yet is dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
