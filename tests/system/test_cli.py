"""The `controlplane` command, run as a process against the test database."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import anyio
import asyncpg
import pytest

pytestmark = pytest.mark.system


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


async def run_cli(database_url: str, *args: str, **env: str) -> Ran:
    with anyio.fail_after(120):
        done = await anyio.run_process(
            [sys.executable, "-m", "controlplane.cli", "--log-level", "warning", *args],
            env={**os.environ, "DATABASE_URL": database_url, **env},
            check=False,
        )
    return Ran(done.returncode, done.stdout.decode(), done.stderr.decode())


def test_help_lists_every_command() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "controlplane.cli", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    for command in ("serve", "migrate", "tokens"):
        assert command in result.stdout


async def test_migrate_twice_on_an_empty_database(empty_database_url: str) -> None:
    first = await run_cli(empty_database_url, "migrate")
    assert first.returncode == 0, first.stderr
    assert "applied 0001_queue" in first.stdout
    second = await run_cli(empty_database_url, "migrate")
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == "database is up to date"


async def test_tokens_create_list_revoke(database_url: str) -> None:
    workspace = str(uuid.uuid4())
    created = await run_cli(
        database_url, "tokens", "create", "registration", "--name", "pool", "--workspace", workspace
    )
    assert created.returncode == 0, created.stderr
    body = json.loads(created.stdout)
    assert body["token"].startswith("cp_mrt_")
    conn = await asyncpg.connect(database_url)
    try:
        stored = await conn.fetchval("SELECT token_sha256 FROM manual_registration_tokens")
        assert body["token"] not in stored
    finally:
        await conn.close()
    listed = await run_cli(database_url, "tokens", "list", "registration")
    assert listed.returncode == 0
    assert body["token"] not in listed.stdout
    assert json.loads(listed.stdout.splitlines()[0])["id"] == body["credential"]["id"]
    revoked = await run_cli(
        database_url, "tokens", "revoke", "registration", body["credential"]["id"]
    )
    assert revoked.returncode == 0
    assert json.loads(revoked.stdout)["revoked_at"] is not None
    key = await run_cli(database_url, "tokens", "create", "orchestrator", "--name", "ci")
    assert json.loads(key.stdout)["token"].startswith("cp_oak_")


async def test_bad_input_exits_2_with_a_message(database_url: str) -> None:
    no_workspace = await run_cli(database_url, "tokens", "create", "registration", "--name", "x")
    assert no_workspace.returncode == 2
    assert "--workspace" in no_workspace.stderr
    bad_ttl = await run_cli(
        database_url, "tokens", "create", "orchestrator", "--name", "x", "--ttl", "0"
    )
    assert bad_ttl.returncode == 2
    assert "ttl_seconds" in bad_ttl.stderr
    bad_knob = await run_cli(database_url, "migrate", CONTROLPLANE_SERVER_PORT="-1")
    assert bad_knob.returncode == 2
    assert "server.port" in bad_knob.stderr


async def test_a_shell_that_sourced_dev_env_can_run_every_server_command(
    empty_database_url: str,
) -> None:
    """var/dev.env exports the client variables; `migrate` (like `serve`, `dev`, `tokens`) loads
    the server settings in that shell, and must not refuse them as unknown settings."""
    sourced = {
        "CONTROLPLANE_URL": "http://127.0.0.1:8080",
        "CONTROLPLANE_WORKSPACE": str(uuid.uuid4()),
        "CONTROLPLANE_ORCHESTRATOR_KEY": "cp_oak_" + "x" * 40,
        "CONTROLPLANE_ADMIN_KEY": "cp_adm_" + "x" * 40,
        "CONTROLPLANE_RUNNER_TOKEN": "cp_mrt_" + "x" * 40,
        "CONTROLPLANE_PROVISIONER_TOKEN": "cp_pt_" + "x" * 40,
    }
    migrated = await run_cli(empty_database_url, "migrate", **sourced)
    assert migrated.returncode == 0, migrated.stderr
    listed = await run_cli(empty_database_url, "tokens", "list", "admin", **sourced)
    assert listed.returncode == 0, listed.stderr


def _one_line(ran: Ran) -> str:
    """A start-up failure we can name: exit 2, one line on stderr, no traceback."""
    assert ran.returncode == 2, (ran.returncode, ran.stderr)
    assert "Traceback" not in ran.stderr, ran.stderr
    lines = ran.stderr.strip().splitlines()
    assert len(lines) == 1, ran.stderr
    return lines[0]


@pytest.mark.parametrize("command", ["serve", "dev"])
async def test_a_busy_port_is_one_clear_line(database_url: str, command: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ran = await run_cli(database_url, command, "--port", str(port))
    line = _one_line(ran)
    assert f"cannot listen on 127.0.0.1:{port}" in line and "--port" in line, line


async def test_an_unreachable_database_is_one_clear_line() -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: connections are refused
        ran = await run_cli(f"postgresql://postgres@127.0.0.1:{port}/x", "migrate")
    line = _one_line(ran)
    assert f"cannot reach the database at 127.0.0.1:{port}" in line, line
    assert "DATABASE_URL" in line


async def test_an_unknown_database_host_is_one_clear_line() -> None:
    ran = await run_cli("postgresql://postgres@no-such-host.invalid/x", "serve")
    line = _one_line(ran)
    assert "cannot resolve the host of the database at no-such-host.invalid:5432" in line, line


async def test_serve_listens_where_host_and_port_say(database_url: str) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = await anyio.open_process(
        [sys.executable, "-m", "controlplane.cli", "serve", "--host", "127.0.0.1", "--port",
         str(port)],
        env={**os.environ, "DATABASE_URL": database_url},
    )  # fmt: skip
    async with process:
        assert process.stdout is not None
        with anyio.fail_after(60):
            line = (await process.stdout.receive()).decode()
        assert line.strip() == f"controlplane listening on http://127.0.0.1:{port}"
        process.terminate()
        with anyio.fail_after(30):
            assert await process.wait() == 0


async def test_a_url_without_its_scheme_is_named_with_the_fix() -> None:
    ran = await run_cli("", "status", "--url", "127.0.0.1:8080", "--key", "cp_adm_" + "x" * 40)
    line = _one_line(ran)
    assert "must look like http://HOST:PORT (got '127.0.0.1:8080')" in line, line


async def test_a_daemon_that_is_not_there_is_named() -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
        ran = await run_cli("", "status", "--url", url, "--key", "cp_adm_" + "x" * 40)
    line = _one_line(ran)
    assert f"cannot reach the control plane at {url}: " in line, line
    assert not line.endswith("ConnectError"), line


async def test_tokens_where_there_is_no_database_says_so_and_creates_none(
    tmp_path: Path,
) -> None:
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in ("DATABASE_URL", "CONTROLPLANE_DATABASE_URL")
    }
    with anyio.fail_after(60):
        done = await anyio.run_process(
            [sys.executable, "-m", "controlplane.cli", "tokens", "create", "admin", "--name", "x"],
            cwd=tmp_path,
            env=env,
            check=False,
        )
    ran = Ran(done.returncode, done.stdout.decode(), done.stderr.decode())
    line = _one_line(ran)
    assert "no database here: var/postgres holds no embedded PostgreSQL" in line, line
    assert "DATABASE_URL" in line
    assert ran.stdout == ""  # no token printed
    assert not (tmp_path / "var").exists()
