"""The `controlplane` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any
from uuid import UUID

import anyio
import msgspec

from controlplane import app, logs, settings
from controlplane.errors import ConfigError, ControlPlaneError, InvalidInput
from controlplane.store import credentials
from controlplane.store.pool import connect
from controlplane.wire import admin as admin_wire

_encoder = msgspec.json.Encoder()


def _print(value: Any) -> None:
    sys.stdout.write(_encoder.encode(msgspec.to_builtins(value)).decode() + "\n")
    sys.stdout.flush()


async def _with_db(
    config: settings.Settings, work: Callable[[Any], Awaitable[None]], *, migrate: bool = True
) -> None:
    async with app.database(config) as url:
        if migrate:
            await app.migrate(url, config)
        conn = await connect(app.pool_settings(config, url))
        try:
            await work(conn)
        finally:
            await conn.close()


def _cmd_serve(config: settings.Settings, _args: argparse.Namespace) -> None:
    def ready(address: str) -> None:
        sys.stdout.write(f"controlplane listening on {address}\n")
        sys.stdout.flush()

    anyio.run(lambda: app.serve(config, on_ready=ready))


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


def _ttl(seconds: int | None) -> timedelta | None:
    return None if seconds is None else timedelta(seconds=seconds)


def _checked_create(args: argparse.Namespace) -> None:
    """The admin API's rules for creates, so the CLI cannot store what HTTP refuses."""
    fields: dict[str, Any] = {"name": args.name, "ttl_seconds": args.ttl}
    try:
        if args.kind == "registration":
            msgspec.convert(
                {**fields, "workspace_id": str(args.workspace)}, admin_wire.CreateRegistrationToken
            )
        else:
            msgspec.convert({**fields, "kind": args.kind}, admin_wire.CreateApiKey)
    except msgspec.ValidationError as error:
        raise InvalidInput(f"invalid token request: {error}") from error


def _cmd_tokens(config: settings.Settings, args: argparse.Namespace) -> None:
    if args.action == "create":
        if args.kind == "registration" and args.workspace is None:
            raise InvalidInput("registration tokens need --workspace")
        _checked_create(args)

    async def work(conn: Any) -> None:
        if args.action == "create":
            if args.kind == "registration":
                created, raw = await credentials.create_manual_token(
                    conn, workspace_id=args.workspace, name=args.name, ttl=_ttl(args.ttl)
                )
            else:
                if args.kind == "admin" and args.workspace is not None:
                    raise ConfigError("admin keys are installation-wide: omit --workspace")
                created, raw = await credentials.create_api_key(
                    conn,
                    kind=args.kind,
                    name=args.name,
                    workspace_id=args.workspace,
                    ttl=_ttl(args.ttl),
                )
            _print({"credential": created, "token": raw})
        elif args.action == "list":
            if args.kind == "registration":
                found = await credentials.list_manual_tokens(conn, args.workspace)
            else:
                found = await credentials.list_api_keys(conn, args.kind)
            for item in found:
                _print(item)
        else:
            if args.kind == "registration":
                _print(await credentials.revoke_manual_token(conn, args.id))
            else:
                _print(await credentials.revoke_api_key(conn, args.id))

    anyio.run(lambda: _with_db(config, work))


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="controlplane",
        description="Dispatch CI job executions to self-hosted runners.",
    )
    top.add_argument(
        "--config",
        type=Path,
        help="TOML settings file (default: $CONTROLPLANE_CONFIG, else built-in defaults)",
    )
    top.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="run the daemon",
        description="Run the daemon: embedded PostgreSQL unless database.url is set, "
        "migrations, the HTTP API. Stops cleanly on SIGTERM/SIGINT.",
    )
    serve.set_defaults(run=_cmd_serve)

    migrate = commands.add_parser(
        "migrate",
        help="apply pending migrations",
        description="Apply the migrations in sql/ that the database lacks; refuse edited ones.",
    )
    migrate.set_defaults(run=_cmd_migrate)

    tokens = commands.add_parser(
        "tokens",
        help="create, list or revoke credentials",
        description="Orchestrator and admin API keys, and manual runner registration tokens. "
        "A created token is printed once; only its SHA-256 is stored.",
    )
    actions = tokens.add_subparsers(dest="action", required=True, metavar="ACTION")
    kinds = ["orchestrator", "admin", "registration"]
    create = actions.add_parser("create", help="create a credential and print it once")
    create.add_argument("kind", choices=kinds)
    create.add_argument("--name", required=True, help="a label for people (1-200 characters)")
    create.add_argument("--workspace", type=UUID, help="scope to one workspace")
    create.add_argument("--ttl", type=int, help="lifetime in seconds (default: no expiry)")
    listing = actions.add_parser("list", help="list credentials (never their secrets)")
    listing.add_argument("kind", choices=kinds)
    listing.add_argument("--workspace", type=UUID, help="registration tokens of one workspace")
    revoke = actions.add_parser("revoke", help="revoke a credential (idempotent)")
    revoke.add_argument("kind", choices=kinds)
    revoke.add_argument("id", type=UUID)
    tokens.set_defaults(run=_cmd_tokens)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logs.configure(args.log_level)
    try:
        config = settings.load(args.config)
        args.run(config, args)
    except ControlPlaneError as error:
        sys.stderr.write(f"controlplane: {error.message}\n")
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
