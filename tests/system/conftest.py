"""Real daemon processes (`controlplane serve`) on the test database."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest


@dataclass
class DaemonProcess:
    process: subprocess.Popen[bytes]
    address: str
    log: Path

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)


@contextmanager
def _popen(database_url: str, log: Path, env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    environment = {
        **os.environ,
        "DATABASE_URL": database_url,
        "CONTROLPLANE_SERVER_PORT": "0",
        "CONTROLPLANE_SERVER_SHUTDOWN_GRACE_SECONDS": "2",
        "CONTROLPLANE_MAINTENANCE_DISPATCH_SAFETY_TICK_SECONDS": "1",
        **env,
    }
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "controlplane.cli", "serve"],
            stdout=subprocess.PIPE,
            stderr=sink,
            env=environment,
        )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


SpawnDaemon = Callable[..., AbstractAsyncContextManager[DaemonProcess]]


@pytest.fixture
def spawn_daemon(database_url: str, tmp_path: Path) -> SpawnDaemon:
    counter = iter(range(1000))

    @asynccontextmanager
    async def spawn(**env: str) -> AsyncIterator[DaemonProcess]:
        log = tmp_path / f"daemon-{next(counter)}.log"
        with _popen(database_url, log, env) as process:
            assert process.stdout is not None
            line = b""
            with anyio.fail_after(60):
                line = await anyio.to_thread.run_sync(process.stdout.readline)
            text = line.decode().strip()
            if not text.startswith("controlplane listening on "):
                raise RuntimeError(f"daemon did not start: {text!r}\n{log.read_text()[-3000:]}")
            yield DaemonProcess(process, text.rsplit(" ", 1)[1], log)

    return spawn
