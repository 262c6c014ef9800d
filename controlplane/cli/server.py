"""The commands that run on the database: serve, dev, migrate and tokens.

Imported only when one of them runs, so `controlplane --help` and the client commands do not pay
for the server stack.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec

from controlplane import app, dev, settings
from controlplane.domain.credential_rules import (
    Family,
    NewCredential,
    lifetime,
    role_problem,
    scope_problem,
)
from controlplane.domain.credentials import Role
from controlplane.domain.eligibility import EVERY_WORKSPACE, Eligibility, Mode, eligibility_problem
from controlplane.errors import InvalidInput, NotFound
from controlplane.store import credentials, eligibility, provisioners
from controlplane.store.pool import connect
from controlplane.wire import admin as admin_wire
from controlplane.wire import provisioners as provisioner_wire

_encoder = msgspec.json.Encoder()


def _print(value: Any) -> None:
    sys.stdout.write(_encoder.encode(msgspec.to_builtins(value)).decode() + "\n")
    sys.stdout.flush()


def _existing_database(config: settings.Settings) -> None:
    """Only serve, dev and migrate may create an embedded database. Any other command run where
    there is none would create a new, empty one and mint credentials no running server knows."""
    if config.database.url:
        return
    from controlplane.store.embedded import EmbeddedPostgres

    folder = Path(config.database.embedded_data_dir)
    if not EmbeddedPostgres(folder).initialised():
        raise InvalidInput(
            f"no database here: {folder} holds no embedded PostgreSQL. Run this in the folder "
            "where `controlplane serve` or `dev` runs, or point it at the server's database "
            "with DATABASE_URL (or CONTROLPLANE_DATABASE_EMBEDDED_DATA_DIR)"
        )


async def _with_db(
    config: settings.Settings, work: Callable[[Any], Awaitable[None]], *, migrate: bool = True
) -> None:
    _existing_database(config)
    async with app.database(config) as url:
        if migrate:
            await app.migrate(url, config)
        conn = await connect(app.pool_settings(config, url))
        try:
            await work(conn)
        finally:
            await conn.close()


def _cmd_dev(config: settings.Settings, args: argparse.Namespace) -> None:
    anyio.run(lambda: dev.run(config, runners=args.runners, labels=args.labels))


def _cmd_serve(config: settings.Settings, _args: argparse.Namespace) -> None:
    def ready(address: str) -> None:
        sys.stdout.write(f"controlplane listening on {address}\n")
        sys.stdout.flush()

    anyio.run(lambda: app.serve(config, on_ready=ready), backend_options=_loop_options())


def _loop_options() -> dict[str, Any]:
    """uvloop for a replica when it is installed (a dependency everywhere but Windows): with
    uvicorn's httptools parser it cut the replica's CPU per request by about a third
    (docs/benchmarks.md)."""
    return {"use_uvloop": importlib.util.find_spec("uvloop") is not None}


def _cmd_migrate(config: settings.Settings, _args: argparse.Namespace) -> None:
    async def run() -> None:
        async with app.database(config) as url:
            applied = await app.migrate(url, config)
        if applied:
            for migration in applied:
                sys.stdout.write(f"applied {migration.version:04d}_{migration.name}\n")
        else:
            sys.stdout.write("database is up to date\n")

    anyio.run(run)


def _checked_create(args: argparse.Namespace) -> None:
    """The request bodies' field rules (name, ttl), so the CLI cannot store what HTTP refuses."""
    fields: dict[str, Any] = {"name": args.name, "ttl_seconds": args.ttl}
    try:
        if args.kind == "registration":
            msgspec.convert(
                {**fields, "workspace_id": str(args.workspace)}, admin_wire.CreateRegistrationToken
            )
        elif args.kind == "provisioner":
            msgspec.convert(fields, provisioner_wire.CreateProvisionerToken)
        else:
            workspace = None if args.workspace is None else str(args.workspace)
            key = {**fields, "kind": args.kind, "workspace_id": workspace, "role": args.role}
            msgspec.convert(key, admin_wire.CreateApiKey)
    except msgspec.ValidationError as error:
        raise InvalidInput(f"invalid token request: {error}") from error


def _new_credential(args: argparse.Namespace) -> NewCredential:
    """What `tokens create` asks for, under the admin API's rules: the scope rule (in the
    command's words), then the body's field rules."""
    family = Family(args.kind)
    role = Role(args.role)
    if problem := scope_problem(family, args.workspace, field="--workspace"):
        raise InvalidInput(problem)
    if problem := role_problem(family, role, field="--role"):
        raise InvalidInput(problem)
    _checked_create(args)
    return NewCredential(family, args.name, args.workspace, lifetime(args.ttl), role)


def _cmd_tokens(config: settings.Settings, args: argparse.Namespace) -> None:
    """Create, list or revoke through store/credentials.py, as the admin routes do; the raw
    token is printed once, by create."""
    family = Family(args.kind)
    new = _new_credential(args) if args.action == "create" else None

    async def work(conn: Any) -> None:
        if new is not None:
            created, raw = await credentials.issue(conn, new)
            _print({"credential": created, "token": raw})
        elif args.action == "list":
            for item in await credentials.listed(conn, family, args.workspace):
                _print(item)
        else:
            _print(await credentials.revoke(conn, family, args.id))

    anyio.run(lambda: _with_db(config, work))


def _wanted_eligibility(config: settings.Settings, args: argparse.Namespace) -> Eligibility | None:
    """What `tokens eligibility` sets, under the admin API's rules; None: only show it."""
    if args.all:
        return EVERY_WORKSPACE
    mode, listed = (Mode.ALLOW, args.allow) if args.allow else (Mode.DENY, args.deny)
    if listed is None:
        return None
    limit = config.provisioners.eligibility_max_workspaces
    if problem := eligibility_problem(mode, listed, limit=limit):
        raise InvalidInput(problem)
    return Eligibility(mode, frozenset(listed))


def _cmd_eligibility(config: settings.Settings, args: argparse.Namespace) -> None:
    """Show or set an installation provisioner token's eligibility (store/eligibility.py, as
    `PUT /v1/admin/provisioner-tokens/{id}/eligibility` does); prints it as that route answers."""
    wanted = _wanted_eligibility(config, args)

    async def work(conn: Any) -> None:
        # An unknown token or a workspace one exits 2 with the store's message.
        if wanted is None:
            if await provisioners.by_id(conn, args.id) is None:
                raise NotFound(f"no provisioner token {args.id}")
            rule, updated_at = await eligibility.read(conn, args.id)
        else:
            rule, updated_at = await eligibility.replace(conn, args.id, wanted)
        _print(
            provisioner_wire.EligibilityOut(
                provisioner_id=args.id,
                mode=rule.mode.value,
                workspace_ids=sorted(rule.workspaces),
                updated_at=updated_at,
            )
        )

    anyio.run(lambda: _with_db(config, work))


def with_address(config: settings.Settings, args: argparse.Namespace) -> settings.Settings:
    """`--host` and `--port` (serve, dev) over the settings file and environment."""
    host, port = getattr(args, "host", None), getattr(args, "port", None)
    if host is None and port is None:
        return config
    if host is not None and (not host or host != host.strip() or " " in host):
        raise InvalidInput("--host must be an address or host name, without spaces")
    server = msgspec.structs.replace(
        config.server,
        host=config.server.host if host is None else host,
        port=config.server.port if port is None else port,
    )
    return msgspec.structs.replace(config, server=server)
