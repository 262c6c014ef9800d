"""`controlplane dev` as a real process, and the README's walkthrough from a second shell that
sourced var/dev.env: a job's output and exit code come back, a job nothing can take is flagged
with the label nobody offers, and jobs, runners and provisioners are listed and a job cancelled."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import asyncpg
import httpx
import msgspec
import pytest

from controlplane import dev, settings
from controlplane.domain import tokens
from controlplane.store import credentials

pytestmark = pytest.mark.system


def _env_file_values(path: Path) -> dict[str, str]:
    values = {}
    for line in path.read_text().splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        values[name] = value
    return values


async def _cli(shell: dict[str, str], *args: str) -> tuple[int, str, str]:
    with anyio.fail_after(60):
        done = await anyio.run_process(
            [sys.executable, "-m", "controlplane.cli", "--log-level", "warning", *args],
            env=shell,
            check=False,
        )
    return done.returncode, done.stdout.decode(), done.stderr.decode()


async def _the_readme_walkthrough(shell: dict[str, str]) -> None:
    code, out, err = await _cli(
        shell, "enqueue", "--labels", "linux", "--wait", "--", "echo", "hello"
    )
    assert code == 0, err
    assert out.splitlines()[1:] == ["hello", "outcome: succeeded"]

    code, out, err = await _cli(
        shell, "enqueue", "--labels", "linux", "--wait", "--", "sh", "-c", "echo bye; exit 3"
    )
    assert code == 3, err
    assert out.splitlines()[1:] == ["bye", "outcome: failed (exit code 3)"]

    code, out, err = await _cli(shell, "enqueue", "--labels", "linux,gpu", "--", "true")
    assert code == 0, err
    stuck = out.strip()
    code, out, err = await _cli(shell, "status")
    assert code == 0, err
    assert "STUCK_IN" in out and "gpu,linux" in out
    assert "no live runner or connected provisioner offers gpu" in out

    code, out, err = await _cli(shell, "jobs", "list")
    assert code == 0, err
    assert stuck in out and out.count("succeeded") == 1 and out.count("failed") == 1
    code, out, err = await _cli(shell, "jobs", "show", stuck)
    assert code == 0, err
    assert "waiting:     STUCK: no live runner or connected provisioner offers gpu" in out
    code, out, err = await _cli(shell, "jobs", "cancel", stuck)
    assert (code, out.strip()) == (0, f"cancelled {stuck}"), err
    code, out, err = await _cli(shell, "jobs", "show", stuck, "--json")
    assert code == 0, err
    shown = json.loads(out)
    assert (shown["job"]["status"], shown["job"]["outcome"]) == ("ended", "cancelled")

    code, out, err = await _cli(shell, "runners", "list")
    assert code == 0 and "LABELS" in out, err
    code, out, err = await _cli(shell, "provisioners", "list")
    assert code == 0, err
    assert "dev_local_provisioner" in out


async def _the_sign_in_link_opens_the_pages(lines: list[str]) -> None:
    (link,) = [line.split()[1] for line in lines if line.strip().startswith("pages ")]
    async with httpx.AsyncClient(timeout=30) as browser:
        signed_in = await browser.get(link)
        assert signed_in.status_code == 303, signed_in.text
        overview = await browser.get(link.split("/ui/")[0] + "/ui/")
        assert overview.status_code == 200 and "Overview" in overview.text


async def test_dev_runs_a_job_enqueued_from_another_shell(
    database_url: str, tmp_path: Path
) -> None:
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "CONTROLPLANE_SERVER_PORT": "0",
        "CONTROLPLANE_DATABASE_EMBEDDED_DATA_DIR": str(tmp_path / "var" / "postgres"),
    }
    dev = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "controlplane.cli",
            "--log-level",
            "warning",
            "dev",
            "--runners",
            "2",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert dev.stdout is not None
    try:
        lines: list[str] = []
        with anyio.fail_after(60):
            while not lines or "Ctrl-C stops everything" not in lines[-1]:
                lines.append((await anyio.to_thread.run_sync(dev.stdout.readline)).decode())
                assert lines[-1], "dev exited early"
        env_file = tmp_path / "var" / "dev.env"
        assert oct(env_file.stat().st_mode & 0o777) == "0o600"
        await _the_sign_in_link_opens_the_pages(lines)
        shell = {**os.environ, **_env_file_values(env_file)}
        await _the_readme_walkthrough(shell)
        dev.send_signal(signal.SIGINT)
        assert await anyio.to_thread.run_sync(lambda: dev.wait(30)) == 0
        # The runners write job output to dev's stdout: the job really ran there.
        assert "hello" in dev.stdout.read().decode()
    finally:
        if dev.poll() is None:
            dev.kill()
            dev.wait()


async def test_dev_reuses_its_credentials_and_revokes_them_when_replaced(
    database_url: str, tmp_path: Path
) -> None:
    """Each start used to mint four never-expiring credentials and leave the old ones valid."""
    config = msgspec.structs.replace(
        settings.Settings(),
        database=msgspec.structs.replace(settings.Settings().database, url=database_url),
    )
    env_file = tmp_path / "dev.env"
    first = await dev._credentials(config, database_url, env_file)
    env_file.write_text("".join(f"export {name}={value}\n" for name, value in first.items()))
    again = await dev._credentials(config, database_url, env_file)
    assert again == first  # all four still work: reused, nothing minted
    conn = await asyncpg.connect(database_url)
    try:
        assert await conn.fetchval("SELECT count(*) FROM api_keys") == 2
        admin = await credentials.api_key_by_digest(
            conn, "admin", tokens.digest(first["CONTROLPLANE_ADMIN_KEY"])
        )
        assert admin is not None
        await credentials.revoke_api_key(conn, admin.id)
        replaced = await dev._credentials(config, database_url, env_file)
        assert set(replaced.values()).isdisjoint(
            value for name, value in first.items() if name != "CONTROLPLANE_WORKSPACE"
        )
        # The old ones no longer work: each is revoked, none left valid beside the new ones.
        assert await conn.fetchval("SELECT count(*) FROM api_keys WHERE revoked_at IS NULL") == 2
        assert (
            await conn.fetchval(
                "SELECT count(*) FROM manual_registration_tokens WHERE revoked_at IS NULL"
            )
            == 1
        )
        assert (
            await conn.fetchval("SELECT count(*) FROM provisioner_tokens WHERE revoked_at IS NULL")
            == 1
        )
    finally:
        await conn.close()
