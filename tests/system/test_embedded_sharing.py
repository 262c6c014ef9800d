"""Several processes on one embedded PostgreSQL, as a user runs them from one folder: the second
attaches (and says so), the first leaves the server running for it, the last one out stops it,
and the next start reuses the port, so a URL copied from a log keeps working."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import httpx
import pytest

from controlplane.store.embedded import EmbeddedPostgres

pytestmark = pytest.mark.system


def _events(log: Path) -> list[dict[str, object]]:
    found = []
    for line in log.read_text().splitlines():
        if line.startswith("{"):
            found.append(json.loads(line))
    return found


def _named(log: Path, event: str) -> list[dict[str, object]]:
    return [entry for entry in _events(log) if entry.get("event") == event]


@contextmanager
def _folder() -> Iterator[Path]:
    # Not under pytest's tmp_path: as root the server runs as its own user, which must reach it.
    with tempfile.TemporaryDirectory(prefix="cp-test-sharing-") as name:
        folder = Path(name)
        folder.chmod(0o755)
        yield folder


class _Serve:
    def __init__(self, folder: Path, name: str) -> None:
        self.log = folder / f"{name}.log"
        env = {
            key: value
            for key, value in os.environ.items()
            if key not in ("DATABASE_URL", "CONTROLPLANE_DATABASE_URL")
        }
        env["CONTROLPLANE_SERVER_PORT"] = "0"
        with self.log.open("wb") as sink:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "controlplane.cli", "serve"],
                cwd=folder, env=env, stdout=subprocess.PIPE, stderr=sink,
            )  # fmt: skip
        self.address = ""

    async def ready(self) -> str:
        assert self.process.stdout is not None
        with anyio.fail_after(120):
            line = (await anyio.to_thread.run_sync(self.process.stdout.readline)).decode()
        assert line.startswith("controlplane listening on "), (line, self.log.read_text())
        self.address = line.split()[-1]
        return self.address

    async def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        with anyio.fail_after(60):
            return await anyio.to_thread.run_sync(self.process.wait)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


async def _ready(address: str) -> int:
    async with httpx.AsyncClient(base_url=address, timeout=10) as http:
        return (await http.get("/readyz")).status_code


async def test_the_last_process_out_stops_the_shared_embedded_server() -> None:
    with _folder() as folder:
        first, second = _Serve(folder, "first"), None
        try:
            await first.ready()
            port = (folder / "var" / "postgres.port").read_text().strip()
            assert _named(first.log, "embedded_postgres.started")
            second = _Serve(folder, "second")
            await second.ready()
            attached = _named(second.log, "embedded_postgres.attached")
            assert attached and f":{port}/" in str(attached[0]["url"])
            assert not _named(second.log, "embedded_postgres.started")

            assert await first.stop() == 0
            left = _named(first.log, "embedded_postgres.left_running")
            assert left and int(str(left[0]["other_connections"])) > 0
            assert await _ready(second.address) == 200  # the database is still there for it

            assert await second.stop() == 0
            assert _named(second.log, "embedded_postgres.stopped")
            assert not (folder / "var" / "postgres" / "postmaster.pid").exists()

            third = _Serve(folder, "third")
            try:
                await third.ready()
                started = _named(third.log, "embedded_postgres.started")
                assert started and f":{port}/" in str(started[0]["url"])  # the same port again
            finally:
                assert await third.stop() == 0
                third.kill()
        finally:
            first.kill()
            if second is not None:
                second.kill()
            leftover = EmbeddedPostgres(folder / "var" / "postgres")
            if leftover.initialised() and leftover.running():
                leftover.stop("immediate")
