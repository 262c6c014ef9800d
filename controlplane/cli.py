"""The `controlplane` command."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any
from uuid import UUID

import anyio
import msgspec

from controlplane import app, dev, logs, settings
from controlplane.agent import provisioner as local_provisioner
from controlplane.agent import queue_client
from controlplane.agent.provisioner import ProvisionerOptions
from controlplane.agent.runner import Runner, RunnerOptions
from controlplane.errors import ControlPlaneError, InvalidInput
from controlplane.store import credentials, provisioners
from controlplane.store.pool import connect
from controlplane.wire import admin as admin_wire
from controlplane.wire import provisioners as provisioner_wire
from controlplane.wire import runners as runner_wire

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


def _from_env(variable: str) -> dict[str, Any]:
    """An option that defaults to an environment variable, and is required when that is unset."""
    value = os.environ.get(variable)
    return {"default": value} if value else {"required": True}


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
        elif args.kind == "provisioner":
            msgspec.convert(fields, provisioner_wire.CreateProvisionerToken)
        else:
            msgspec.convert({**fields, "kind": args.kind}, admin_wire.CreateApiKey)
    except msgspec.ValidationError as error:
        raise InvalidInput(f"invalid token request: {error}") from error


async def _create_token(conn: Any, args: argparse.Namespace) -> tuple[Any, str]:
    ttl = _ttl(args.ttl)
    if args.kind == "registration":
        return await credentials.create_manual_token(
            conn, workspace_id=args.workspace, name=args.name, ttl=ttl
        )
    if args.kind == "provisioner":
        return await provisioners.create(conn, name=args.name, workspace_id=args.workspace, ttl=ttl)
    return await credentials.create_api_key(
        conn, kind=args.kind, name=args.name, workspace_id=args.workspace, ttl=ttl
    )


async def _list_tokens(conn: Any, args: argparse.Namespace) -> list[Any]:
    if args.kind == "registration":
        return list(await credentials.list_manual_tokens(conn, args.workspace))
    if args.kind == "provisioner":
        return list(await provisioners.list_all(conn, args.workspace))
    return list(await credentials.list_api_keys(conn, args.kind))


async def _revoke_token(conn: Any, args: argparse.Namespace) -> Any:
    if args.kind == "registration":
        return await credentials.revoke_manual_token(conn, args.id)
    if args.kind == "provisioner":
        return await provisioners.revoke(conn, args.id)
    return await credentials.revoke_api_key(conn, args.id)


def _cmd_tokens(config: settings.Settings, args: argparse.Namespace) -> None:
    if args.action == "create":
        if args.kind == "registration" and args.workspace is None:
            raise InvalidInput("registration tokens need --workspace")
        if args.kind == "admin" and args.workspace is not None:
            raise InvalidInput("admin keys are installation-wide: omit --workspace")
        _checked_create(args)

    async def work(conn: Any) -> None:
        if args.action == "create":
            created, raw = await _create_token(conn, args)
            _print({"credential": created, "token": raw})
        elif args.action == "list":
            for item in await _list_tokens(conn, args):
                _print(item)
        else:
            _print(await _revoke_token(conn, args))

    anyio.run(lambda: _with_db(config, work))


def _secret(given: str | None, variable: str, prefix: str, what: str) -> str:
    """A token from its option or its environment variable; never echoed back in a message."""
    value = given or os.environ.get(variable, "")
    if not value:
        raise InvalidInput(f"{what} is required: pass it in ${variable} (or the option)")
    if not value.startswith(prefix):
        raise InvalidInput(f"{what} must be a {prefix}… token")
    return value


def _labels(raw: str) -> list[str]:
    labels = [label.strip() for label in raw.split(",") if label.strip()]
    if not labels:
        raise InvalidInput("--labels needs at least one label")
    try:
        msgspec.convert({"labels": labels}, runner_wire.RegisterRequest)
    except msgspec.ValidationError as error:
        raise InvalidInput(f"invalid --labels: {error}") from error
    return labels


def _cmd_runner(args: argparse.Namespace) -> int:
    if args.max_idle_seconds < 0:
        raise InvalidInput("--max-idle-seconds must be 0 (for ever) or more")
    bootstrap = args.bootstrap_token or os.environ.get("CONTROLPLANE_BOOTSTRAP_TOKEN") or None
    if bootstrap is not None:
        if args.token or os.environ.get("CONTROLPLANE_RUNNER_TOKEN"):
            raise InvalidInput("give a registration token or a bootstrap token, not both")
        bootstrap = _secret(
            bootstrap, "CONTROLPLANE_BOOTSTRAP_TOKEN", "cp_rbt_", "a bootstrap token"
        )
        token = ""
    else:
        token = _secret(args.token, "CONTROLPLANE_RUNNER_TOKEN", "cp_mrt_", "a registration token")
    options = RunnerOptions(
        url=args.url,
        token=token,
        bootstrap_token=bootstrap,
        provider_runner_id=args.provider_runner_id,
        labels=_labels(args.labels),
        once=args.once,
        max_idle_seconds=args.max_idle_seconds,
    )
    return anyio.run(Runner(options).run)


def _cmd_enqueue(args: argparse.Namespace) -> int:
    key = _secret(args.key, "CONTROLPLANE_ORCHESTRATOR_KEY", "cp_oak_", "an orchestrator key")
    if not args.command:
        raise InvalidInput("give the command to run after --")
    labels = _labels(args.labels)
    return anyio.run(
        lambda: queue_client.enqueue(
            args.url,
            key,
            args.workspace,
            labels,
            args.command,
            wait=args.wait,
            give_up_after=args.timeout,
        )
    )


def _cmd_provisioner_local(args: argparse.Namespace) -> int:
    token = _secret(args.token, "CONTROLPLANE_PROVISIONER_TOKEN", "cp_pt_", "a provisioner token")
    if not 1 <= args.slots <= 1000:
        raise InvalidInput("--slots must be between 1 and 1000")
    if not 0 <= args.idle_target <= args.slots:
        raise InvalidInput("--idle-target must be between 0 and --slots")
    options = ProvisionerOptions(
        url=args.url,
        token=token,
        labels=_labels(args.labels),
        slots=args.slots,
        idle_target=args.idle_target,
        template_key=args.template_key,
        state_file=args.state_file,
        stop_runners_on_exit=args.stop_runners_on_exit,
    )
    return anyio.run(lambda: local_provisioner.run(options))


def _cmd_status(args: argparse.Namespace) -> int:
    key = _secret(args.key, "CONTROLPLANE_ADMIN_KEY", "cp_adm_", "an admin key")
    return anyio.run(lambda: queue_client.status(args.url, key))


def _client_commands(commands: Any) -> None:
    """Commands that talk to a running daemon over HTTP; they read no settings file."""
    url_help = "the control plane's base URL, e.g. http://127.0.0.1:8080; default $CONTROLPLANE_URL"
    runner = commands.add_parser(
        "runner",
        help="run the reference runner agent",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="""\
Register with a manual registration token, then long-poll for jobs and run them one at a time.

A job's payload is {"script": "<shell>", "env": {"NAME": "value"}}. The script runs as
`/bin/sh -c <script>` in its own process group, in a fresh temporary directory, with a minimal
environment (PATH, HOME, LANG, LC_ALL, TZ, TMPDIR, USER, LOGNAME, CI=true,
CONTROLPLANE_JOB_EXECUTION_ID, CONTROLPLANE_JOB_ID) plus the payload's env. Its output goes to
this process's stdout; the runner's own JSON logs go to stderr. While it runs, one held
heartbeat keeps the lease alive and hears a cancel at once: the group then gets SIGTERM, and
SIGKILL 2 s later, and the job completes `cancelled`. Exit status 0 completes `succeeded`,
anything else `failed` with the exit code.

Managed mode (--bootstrap-token): trade the bootstrap token for a control session, enroll,
wait for an assignment, register a one-claim session with the activation token, run that one job
and exit 0.

Retries: a 401 on the job request registers again with the same token; 5xx and transport errors
back off with full jitter from 1 s up to 5 s; 409 runner-session-exhausted exits 0; a refused
registration (400/401/403) exits 1.

Signals: the first SIGTERM/SIGINT stops asking for jobs, lets a running job finish and exits 0;
a second one kills the job's process group, completes it `cancelled` and exits 1.""",
    )
    runner.add_argument("--url", **_from_env("CONTROLPLANE_URL"), help=url_help)
    runner.add_argument(
        "--token",
        help="manual registration token (cp_mrt_…); default $CONTROLPLANE_RUNNER_TOKEN, which "
        "keeps it out of the process list",
    )
    runner.add_argument(
        "--bootstrap-token",
        help="managed mode, for a runner a provisioner launched: its one-use bootstrap token "
        "(cp_rbt_…); default $CONTROLPLANE_BOOTSTRAP_TOKEN. The runner enrolls, waits for an "
        "assignment, runs one job and exits",
    )
    runner.add_argument(
        "--provider-runner-id", help="managed mode: this machine's identity at its provider"
    )
    runner.add_argument(
        "--labels", required=True, help="comma-separated labels this runner offers, e.g. linux,x64"
    )
    runner.add_argument("--once", action="store_true", help="exit 0 after one job")
    runner.add_argument(
        "--max-idle-seconds",
        type=float,
        default=0.0,
        metavar="S",
        help="exit after S seconds without a job: 0 if the last request was answered, 1 if the "
        "control plane kept failing (default 0: wait for ever)",
    )
    runner.set_defaults(client=_cmd_runner)

    enqueue = commands.add_parser(
        "enqueue",
        help="enqueue one job that runs a command",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="""\
Enqueue one job whose payload is {"script": "<the command, shell-quoted>"}, with fresh ids and
queued_at = now, and print its execution id. With --wait, follow the execution until it ends,
print `outcome: <outcome>` and exit 0 if it succeeded, 1 otherwise.

example: controlplane enqueue --url $CP --workspace $WS --labels linux --wait -- make test""",
    )
    enqueue.add_argument("--url", **_from_env("CONTROLPLANE_URL"), help=url_help)
    enqueue.add_argument(
        "--key", help="orchestrator API key (cp_oak_…); default $CONTROLPLANE_ORCHESTRATOR_KEY"
    )
    enqueue.add_argument(
        "--workspace",
        type=UUID,
        **_from_env("CONTROLPLANE_WORKSPACE"),
        help="workspace id (UUID); default $CONTROLPLANE_WORKSPACE",
    )
    enqueue.add_argument(
        "--labels", required=True, help="comma-separated labels the runner must have"
    )
    enqueue.add_argument("--wait", action="store_true", help="wait for the outcome")
    enqueue.add_argument(
        "--timeout",
        type=float,
        default=0.0,
        metavar="S",
        help="with --wait, give up after S seconds (exit 2); default 0: no limit",
    )
    enqueue.add_argument("command", nargs="*", help="the command and its arguments, after --")
    enqueue.set_defaults(client=_cmd_enqueue)

    status = commands.add_parser(
        "status",
        help="show the queue, and the provisioned fleet when there is one",
        description="Print GET /v1/admin/queue as a table: one row per workspace with pending "
        "or running jobs, busiest first, then the totals. Then, each only when not empty: the "
        "same jobs per workspace and required label set, the active provisioners with when "
        "they were last seen, live reservations per workspace, "
        "labels and kind, and runner instances per state.",
    )
    status.add_argument("--url", **_from_env("CONTROLPLANE_URL"), help=url_help)
    status.add_argument("--key", help="admin API key (cp_adm_…); default $CONTROLPLANE_ADMIN_KEY")
    status.set_defaults(client=_cmd_status)

    provisioner = commands.add_parser(
        "provisioner",
        help="run a provisioner",
        description="Provisioners hold a control session with the control plane and launch "
        "runners for the demand it grants them.",
    )
    kinds = provisioner.add_subparsers(dest="kind", required=True, metavar="KIND")
    local = kinds.add_parser(
        "local",
        help="launch reference runners as local subprocesses",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="""\
Hold a control session (WS /v1/provisioners/session) with a provisioner token, advertise one
template (--labels, --slots free slots, --idle-target idle runners to keep ready), and for each
grant or warm launch the server pushes, create runner instances and start
`controlplane runner --bootstrap-token …` subprocesses. Each runner enrolls, is activated, runs
one job and exits; its state is reported (starting, running, stopped/failed).

Runners survive a restart of the provisioner: their pids are kept in --state-file, and after a
restart it adopts the live ones and reconciles with the server. SIGTERM/SIGINT stops the
provisioner and leaves the runners running. Exits 1 when the server refuses the token or
another process takes the token over (close 4401/4403/4404/4406/4409).""",
    )
    local.add_argument("--url", **_from_env("CONTROLPLANE_URL"), help=url_help)
    local.add_argument(
        "--token", help="provisioner token (cp_pt_…); default $CONTROLPLANE_PROVISIONER_TOKEN"
    )
    local.add_argument("--labels", required=True, help="the template's labels, comma-separated")
    local.add_argument(
        "--slots", type=int, default=2, help="runners at most at once (1..1000, default 2)"
    )
    local.add_argument(
        "--idle-target",
        type=int,
        default=0,
        help="idle runners to keep ready for new jobs (0..slots, default 0)",
    )
    local.add_argument("--template-key", default="local", help="the template's key")
    local.add_argument(
        "--state-file",
        type=Path,
        default=Path("var/provisioner-local.json"),
        help="where the runners' pids are kept across restarts"
        " (default var/provisioner-local.json)",
    )
    local.add_argument(
        "--stop-runners-on-exit",
        action="store_true",
        help="send SIGTERM to the runners when the provisioner stops (default: leave them)",
    )
    local.set_defaults(client=_cmd_provisioner_local)


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
    _address_options(serve)
    serve.set_defaults(run=_cmd_serve)

    development = commands.add_parser(
        "dev",
        help="run a local control plane with reference runners",
        description="Start the daemon (embedded PostgreSQL unless database.url is set), create "
        "an orchestrator key, an admin key and a registration token for a dev workspace, start "
        "reference runners as subprocesses, and print where everything is. The credentials are "
        "also written to <embedded_data_dir>/../dev.env, to source in another shell. Ctrl-C "
        "stops it all.",
    )
    development.add_argument(
        "--runners", type=int, default=2, help="how many runners at most at once (default 2)"
    )
    development.add_argument(
        "--labels", default="linux", help="the runners' labels, comma-separated (default linux)"
    )
    _address_options(development)
    development.set_defaults(run=_cmd_dev)

    migrate = commands.add_parser(
        "migrate",
        help="apply pending migrations",
        description="Apply the migrations in sql/ that the database lacks; refuse edited ones.",
    )
    migrate.set_defaults(run=_cmd_migrate)

    tokens = commands.add_parser(
        "tokens",
        help="create, list or revoke credentials",
        description="Orchestrator and admin API keys, manual runner registration tokens, and "
        "provisioner tokens (--workspace for workspace scope, omitted for installation scope). "
        "A created token is printed once; only its SHA-256 is stored.",
    )
    actions = tokens.add_subparsers(dest="action", required=True, metavar="ACTION")
    kinds = ["orchestrator", "admin", "registration", "provisioner"]
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
    _client_commands(commands)
    return top


def _with_address(config: settings.Settings, args: argparse.Namespace) -> settings.Settings:
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


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65_535:
        raise argparse.ArgumentTypeError("a port is a number from 0 to 65535 (0: any free one)")
    return int(text)


def _address_options(command: argparse.ArgumentParser) -> None:
    command.add_argument("--host", help="address to listen on (default: server.host, 127.0.0.1)")
    command.add_argument(
        "--port",
        type=_port,
        help="port to listen on, 0 for any free one (default: server.port, 8080)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logs.configure(args.log_level)
    try:
        if hasattr(args, "client"):
            code: int = args.client(args)
            return code
        config = _with_address(settings.load(args.config), args)
        try:
            args.run(config, args)
        except (Exception, BaseExceptionGroup) as error:
            from controlplane import startup_errors

            line = startup_errors.explain(error, config)
            if line is None:
                raise
            sys.stderr.write(f"controlplane: {line}\n")
            return 2
    except ControlPlaneError as error:
        sys.stderr.write(f"controlplane: {error.message}\n")
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
