"""`controlplane dev` as a real process: a job enqueued from a second shell runs and completes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

pytestmark = pytest.mark.system


def _env_file_values(path: Path) -> dict[str, str]:
    values = {}
    for line in path.read_text().splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        values[name] = value
    return values


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
        shell = {**os.environ, **_env_file_values(env_file)}
        with anyio.fail_after(60):
            enqueued = await anyio.run_process(
                [
                    sys.executable,
                    "-m",
                    "controlplane.cli",
                    "enqueue",
                    "--labels",
                    "linux",
                    "--wait",
                    "--",
                    "echo",
                    "hello",
                ],
                env=shell,
                check=False,
            )
        assert enqueued.returncode == 0, enqueued.stderr.decode()
        assert "outcome: succeeded" in enqueued.stdout.decode()
        status = await anyio.run_process(
            [sys.executable, "-m", "controlplane.cli", "status"], env=shell, check=False
        )
        assert status.returncode == 0
        assert "TOTAL" in status.stdout.decode()
        dev.send_signal(signal.SIGINT)
        assert await anyio.to_thread.run_sync(lambda: dev.wait(30)) == 0
        # The runners write job output to dev's stdout: the job really ran there.
        assert "hello" in dev.stdout.read().decode()
    finally:
        if dev.poll() is None:
            dev.kill()
            dev.wait()
