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
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import Process

from controlplane import app
from controlplane.domain import tokens
from controlplane.domain.credentials import Credential
from controlplane.domain.provisioners import Provisioner
from controlplane.settings import Settings
from controlplane.store import credentials, provisioners, ui_sessions
from controlplane.store.embedded import mask_password
from controlplane.store.pool import connect

DEV_WORKSPACE = uuid.UUID("00000000-0000-4000-8000-00000000d0d0")


_PREVIOUS = (
    "CONTROLPLANE_ORCHESTRATOR_KEY",
    "CONTROLPLANE_ADMIN_KEY",
    "CONTROLPLANE_RUNNER_TOKEN",
    "CONTROLPLANE_PROVISIONER_TOKEN",
)


def _usable(found: Credential | Provisioner | None, now: datetime) -> bool:
    return (
        found is not None
        and found.revoked_at is None
        and (found.expires_at is None or found.expires_at > now)
    )


async def _previous(conn: Any, values: dict[str, str]) -> dict[str, Any]:
    """The stored credentials behind a previous dev.env, by variable (None when unknown here)."""
    digest = {name: tokens.digest(values.get(name, "")) for name in _PREVIOUS}
    return {
        "CONTROLPLANE_ORCHESTRATOR_KEY": await credentials.api_key_by_digest(
            conn, "orchestrator", digest["CONTROLPLANE_ORCHESTRATOR_KEY"]
        ),
        "CONTROLPLANE_ADMIN_KEY": await credentials.api_key_by_digest(
            conn, "admin", digest["CONTROLPLANE_ADMIN_KEY"]
        ),
        "CONTROLPLANE_RUNNER_TOKEN": await credentials.manual_token_by_digest(
            conn, digest["CONTROLPLANE_RUNNER_TOKEN"]
        ),
        "CONTROLPLANE_PROVISIONER_TOKEN": await provisioners.by_digest(
            conn, digest["CONTROLPLANE_PROVISIONER_TOKEN"]
        ),
    }


async def _credentials(config: Settings, url: str, env_file: Path) -> dict[str, str]:
    """The credentials of the last `dev` on this database when they all still work, else new
    ones, with the last ones revoked: every start used to mint four keys that never expired."""
    previous = _read_env(env_file)
    conn = await connect(app.pool_settings(config, url))
    try:
        found = await _previous(conn, previous)
        now = await conn.fetchval("SELECT now()")
        if all(_usable(found[name], now) for name in _PREVIOUS):
            return {
                "CONTROLPLANE_WORKSPACE": str(DEV_WORKSPACE),
                **{name: previous[name] for name in _PREVIOUS},
            }
        reason = "replaced by a new controlplane dev"
        for name, stored in found.items():
            if stored is None or stored.revoked_at is not None:
                continue
            if name == "CONTROLPLANE_PROVISIONER_TOKEN":
                await provisioners.revoke(conn, stored.id, reason=reason)
            elif name == "CONTROLPLANE_RUNNER_TOKEN":
                await credentials.revoke_manual_token(conn, stored.id, reason=reason)
            else:
                await credentials.revoke_api_key(conn, stored.id, reason=reason)
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


async def _sign_in_link(config: Settings, url: str, admin_key: str) -> str:
    """A one-time link that signs a browser in to the pages with dev's admin key."""
    conn = await connect(app.pool_settings(config, url))
    try:
        key = await credentials.api_key_by_digest(conn, "admin", tokens.digest(admin_key))
        assert key is not None  # made or checked by _credentials just now
        ttl = timedelta(seconds=config.pages.sign_in_link_ttl_seconds)
        return await ui_sessions.create_link(conn, key.id, ttl)
    finally:
        await conn.close()


def _env_path(data_dir: Path) -> Path:
    return data_dir.resolve().parent / "dev.env"


def _read_env(path: Path) -> dict[str, str]:
    try:
        text = path.read_text()
    except OSError:
        return {}
    values = {}
    for line in text.splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        values[name.strip()] = value.strip()
    return values


def _write_env(data_dir: Path, values: dict[str, str]) -> Path:
    path = _env_path(data_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)  # it holds secrets
    path.write_text("".join(f"export {name}={value}\n" for name, value in values.items()))
    return path


async def _start(
    config: Settings, url: str, address: str, runners: int, labels: str
) -> list[Process]:
    env_path = _env_path(Path(config.database.embedded_data_dir))
    values = {"CONTROLPLANE_URL": address, **await _credentials(config, url, env_path)}
    env_file = await anyio.to_thread.run_sync(
        _write_env, Path(config.database.embedded_data_dir), values
    )
    state_file = env_file.parent / "provisioner.json"
    link = await _sign_in_link(config, url, values["CONTROLPLANE_ADMIN_KEY"])
    link_minutes = config.pages.sign_in_link_ttl_seconds // 60
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
        f"  pages      {address}/ui/sign-in/{link}\n"
        f"             (a one-time sign-in link, for {link_minutes} min; later, sign in at\n"
        f"             {address}/ui/ with CONTROLPLANE_ADMIN_KEY from the secrets file)\n"
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
