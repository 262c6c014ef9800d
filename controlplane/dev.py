"""`controlplane dev`: a whole local control plane in one command.

The daemon runs in this process (embedded PostgreSQL unless a URL is configured); a local
provisioner (`controlplane provisioner local`, a subprocess) holds a control session for a fixed
dev workspace and launches reference runners as its own subprocesses for the demand it is
granted, keeping one idle runner ready. The credentials are printed and written to `dev.env`
beside the embedded data folder, so a second shell can `. var/dev.env` and use
`controlplane enqueue`, `controlplane status` and `controlplane runner` as they are.
"""

from __future__ import annotations

import os
import signal
import sys
import uuid
from pathlib import Path

import anyio
from anyio.abc import Process

from controlplane import app
from controlplane.settings import Settings
from controlplane.store import credentials, provisioners
from controlplane.store.embedded import mask_password
from controlplane.store.pool import connect

DEV_WORKSPACE = uuid.UUID("00000000-0000-4000-8000-00000000d0d0")


async def _credentials(config: Settings, url: str) -> dict[str, str]:
    conn = await connect(app.pool_settings(config, url))
    try:
        _, orchestrator = await credentials.create_api_key(conn, kind="orchestrator", name="dev")
        _, admin = await credentials.create_api_key(conn, kind="admin", name="dev")
        _, registration = await credentials.create_manual_token(
            conn, workspace_id=DEV_WORKSPACE, name="dev runners"
        )
        _, provisioner = await provisioners.create(
            conn, name="dev local provisioner", workspace_id=DEV_WORKSPACE
        )
    finally:
        await conn.close()
    return {
        "CONTROLPLANE_WORKSPACE": str(DEV_WORKSPACE),
        "CONTROLPLANE_ORCHESTRATOR_KEY": orchestrator,
        "CONTROLPLANE_ADMIN_KEY": admin,
        "CONTROLPLANE_RUNNER_TOKEN": registration,
        "CONTROLPLANE_PROVISIONER_TOKEN": provisioner,
    }


def _write_env(data_dir: Path, values: dict[str, str]) -> Path:
    path = data_dir.resolve().parent / "dev.env"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)  # it holds secrets
    path.write_text("".join(f"export {name}={value}\n" for name, value in values.items()))
    return path


async def _start(
    config: Settings, url: str, address: str, runners: int, labels: str
) -> list[Process]:
    values = {"CONTROLPLANE_URL": address, **await _credentials(config, url)}
    env_file = await anyio.to_thread.run_sync(
        _write_env, Path(config.database.embedded_data_dir), values
    )
    state_file = env_file.parent / "provisioner.json"
    processes = [
        await anyio.open_process(
            [
                sys.executable,
                "-m",
                "controlplane.cli",
                "provisioner",
                "local",
                "--labels",
                labels,
                "--slots",
                str(runners),
                "--idle-target",
                "1",
                "--state-file",
                str(state_file),
                "--stop-runners-on-exit",
            ],
            env={**os.environ, **values},
            stdout=None,
            stderr=None,
            # Its own session: a Ctrl-C reaches only us, and we stop it once.
            start_new_session=True,
        )
    ]
    sys.stdout.write(
        f"controlplane dev\n"
        f"  API        {address}  (docs: {address}/openapi.json)\n"
        f"  database   {mask_password(url)}\n"
        f"  workspace  {DEV_WORKSPACE}\n"
        f"  runners    a local provisioner launching up to {runners} reference runners with\n"
        f"             labels {labels}, one kept idle and ready\n"
        f"  secrets    {env_file}\n\n"
        f"In another shell:\n"
        f"  . {env_file}\n"
        f"  controlplane enqueue --labels {labels.split(',')[0]} --wait -- echo hello\n"
        f"  controlplane status\n\n"
        f"Ctrl-C stops everything.\n"
    )
    sys.stdout.flush()
    return processes


async def _stop(processes: list[Process]) -> None:
    """SIGTERM once (a runner finishes its job first), then kill what is left after 15 s."""
    for process in processes:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
    with anyio.move_on_after(15):
        for process in processes:
            await process.wait()
    for process in processes:
        if process.returncode is None:
            process.kill()


async def run(config: Settings, *, runners: int, labels: str) -> None:
    async with app.database(config) as url:
        daemon = app.Daemon(config, url)
        ready = anyio.Event()
        # The receiver stays open until everything has stopped, so a second Ctrl-C during the
        # shutdown is absorbed instead of interrupting it.
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with anyio.create_task_group() as group:
                group.start_soon(lambda: daemon.run(on_ready=lambda _address: ready.set()))
                await ready.wait()
                processes = await _start(config, url, daemon.address, runners, labels)
                async for _signum in signals:
                    break
                await _stop(processes)
                daemon.shutdown()
