"""The `controlplane` command.

Building the parser imports nothing but the standard library: `--help` and a mistyped command
answer at once, and each command imports what it needs when it runs (`server.py` for the commands
on the database, `clients.py` for those that talk HTTP to a daemon).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from uuid import UUID


def _handler(reference: str) -> Callable[..., Any]:
    module, _, name = reference.partition(":")
    found: Callable[..., Any] = getattr(importlib.import_module(f"controlplane.cli.{module}"), name)
    return found


def _from_env(variable: str) -> dict[str, Any]:
    """An option that defaults to an environment variable, and is required when that is unset."""
    value = os.environ.get(variable)
    return {"default": value} if value else {"required": True}


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
and exit 0. $CONTROLPLANE_BOOTSTRAP_TOKEN is removed from the environment once read, so the job
never sees it.

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
    runner.set_defaults(client="clients:_cmd_runner")

    enqueue = commands.add_parser(
        "enqueue",
        help="enqueue one job that runs a command",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="""\
Enqueue one job whose payload is {"script": "<the command, shell-quoted>"}, with fresh ids and
queued_at = now, and print its execution id. With --wait, follow the execution until it ends,
print the end of its output (the last runners.output_tail_bytes bytes, 16 KiB by default) and
`outcome: <outcome>` (with the exit code when it is not 0), and exit with the job's exit code
(0 or 1 by outcome when it has none; 2 when --timeout runs out). Ctrl-C while waiting leaves
the job running and says how to cancel it, or cancels it with --cancel-on-interrupt (exit 130).

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
    enqueue.add_argument(
        "--wait",
        action="store_true",
        help="wait for the outcome, print the end of the job's output, exit with its exit code",
    )
    enqueue.add_argument(
        "--cancel-on-interrupt",
        action="store_true",
        help="with --wait, Ctrl-C cancels the job (default: it goes on, and we say how to "
        "cancel it)",
    )
    enqueue.add_argument(
        "--timeout",
        type=float,
        default=0.0,
        metavar="S",
        help="with --wait, give up after S seconds (exit 2); default 0: no limit",
    )
    enqueue.add_argument(
        "--project", type=UUID, help="project id (UUID; fair share counts by it); default: new"
    )
    enqueue.add_argument(
        "--priority", type=int, help="higher runs first (queue.priority_min..priority_max); 0"
    )
    enqueue.add_argument(
        "--concurrency-key", help="at most --concurrency-limit jobs with this key run at once"
    )
    enqueue.add_argument("--concurrency-limit", type=int, help="the key's limit (1 or more)")
    enqueue.add_argument(
        "--run-timeout",
        type=int,
        metavar="S",
        help="the job's run timeout (timeout_seconds): past it the runner is told to stop, and "
        "the lease ends timed_out after queue.timeout_grace_seconds; default: the server's "
        "queue.default_timeout_seconds (6 h)",
    )
    enqueue.add_argument(
        "--queue-timeout",
        type=int,
        metavar="S",
        help="how long the job may wait for a runner (queue_timeout_seconds) before it ends "
        "queue_expired; default: the server's queue.default_queue_timeout_seconds (24 h)",
    )
    enqueue.add_argument(
        "--retries-on-lost",
        type=int,
        metavar="N",
        help="put the job back in the queue up to N times when its runner vanishes "
        "(retries_on_lost); default 0",
    )
    enqueue.add_argument("command", nargs="*", help="the command and its arguments, after --")
    enqueue.set_defaults(client="clients:_cmd_enqueue")

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
    status.set_defaults(client="clients:_cmd_status")

    _admin_commands(commands, url_help)

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
    local.set_defaults(client="clients:_cmd_provisioner_local")


def _admin_options(command: argparse.ArgumentParser, url_help: str) -> None:
    command.add_argument("--url", **_from_env("CONTROLPLANE_URL"), help=url_help)
    command.add_argument("--key", help="admin API key (cp_adm_…); default $CONTROLPLANE_ADMIN_KEY")
    command.add_argument(
        "--json", action="store_true", help="print the API's JSON instead of a table"
    )


_WORKSPACE_PAUSE = (
    "its jobs are still enqueued but none is handed to a runner until it is resumed; runners "
    "wait, and running jobs finish"
)
_RUNNER_PAUSE = (
    "its running job finishes; it takes no new one, and its job requests are answered "
    '"paused" (it asks again after runners.paused_retry_seconds) until it is resumed'
)


def _pause_commands(actions: Any, url_help: str, noun: str, what: str, effect: str) -> None:
    """`pause ID` and `resume ID` (idempotent; audited in the event feed with --reason)."""
    for action, help_text in (("pause", f"pause a {what}: {effect}"), ("resume", "undo a pause")):
        command = actions.add_parser(action, help=help_text)
        _admin_options(command, url_help)
        command.add_argument("id", type=UUID, help=f"the {what} id")
        command.add_argument("--reason", help="why, kept in the audit event (1-512 characters)")
        command.set_defaults(client="clients:_cmd_pause", noun=noun)


def _admin_commands(commands: Any, url_help: str) -> None:
    """jobs, runners and provisioners: what an operator looks at and steers (admin key)."""
    jobs = commands.add_parser(
        "jobs",
        help="list, show or cancel job executions",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="""\
Job executions across the queue (pending), the runners (running) and the tombstones (ended).

examples:
  controlplane jobs list --status pending --labels linux
  controlplane jobs show 59ef630e-144a-4ff9-abbe-69642a043207
  controlplane jobs cancel 59ef630e-144a-4ff9-abbe-69642a043207""",
    )
    actions = jobs.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = actions.add_parser("list", help="newest change first: enqueued, started or ended")
    _admin_options(listing, url_help)
    listing.add_argument("--workspace", type=UUID, help="only this workspace")
    listing.add_argument(
        "--status", choices=["pending", "running", "ended"], help="only executions in this state"
    )
    listing.add_argument(
        "--labels",
        help="comma-separated: only pending and running executions requiring all of them "
        "(ended ones keep no labels)",
    )
    listing.add_argument(
        "--limit", type=int, default=50, help="at most this many (1-1000, default 50)"
    )
    listing.set_defaults(client="clients:_cmd_jobs_list")
    show = actions.add_parser(
        "show",
        help="one execution: timestamps, runner, outcome, exit code, output tail, and for a "
        "pending one why it waits",
    )
    _admin_options(show, url_help)
    show.add_argument("id", type=UUID, help="the job execution id")
    show.set_defaults(client="clients:_cmd_jobs_show")
    cancel = actions.add_parser(
        "cancel", help="cancel an execution: pending leaves the queue, running is told to stop"
    )
    _admin_options(cancel, url_help)
    cancel.add_argument("id", type=UUID, help="the job execution id")
    cancel.set_defaults(client="clients:_cmd_jobs_cancel")

    workspaces = commands.add_parser(
        "workspaces",
        help="set a workspace's settings, pause or resume its queue",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="""\
A workspace's settings, and pausing its queue. `ordering`: fifo (the default: priority, then
age) or fair (the project with the fewest running executions first, then priority, then age).
`pause` stops claims in the workspace (enqueue still works); `resume` lifts it.

example: controlplane workspaces settings 59ef630e-144a-4ff9-abbe-69642a043207 --ordering fair""",
    )
    workspace_actions = workspaces.add_subparsers(dest="action", required=True, metavar="ACTION")
    settings = workspace_actions.add_parser("settings", help="set the workspace's queue ordering")
    _admin_options(settings, url_help)
    settings.add_argument("workspace", type=UUID, help="the workspace id")
    settings.add_argument("--ordering", required=True, choices=["fifo", "fair"])
    settings.set_defaults(client="clients:_cmd_workspaces_settings")
    _pause_commands(workspace_actions, url_help, "workspaces", "workspace", _WORKSPACE_PAUSE)

    runners = commands.add_parser("runners", help="list, pause or resume runners")
    runner_actions = runners.add_subparsers(dest="action", required=True, metavar="ACTION")
    _pause_commands(runner_actions, url_help, "runners", "runner session", _RUNNER_PAUSE)
    runner_list = runner_actions.add_parser(
        "list", help="runner sessions seen recently, busy or idle (manual and provisioned)"
    )
    _admin_options(runner_list, url_help)
    runner_list.add_argument("--workspace", type=UUID, help="only this workspace")
    runner_list.add_argument(
        "--window",
        type=int,
        default=60,
        help="seen within this many seconds (1-86400, default 60)",
    )
    runner_list.set_defaults(client="clients:_cmd_runners_list")

    provisioners = commands.add_parser("provisioners", help="list provisioners")
    provisioner_actions = provisioners.add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    provisioner_list = provisioner_actions.add_parser(
        "list", help="provisioners seen in the last 120 s (--all: every token)"
    )
    _admin_options(provisioner_list, url_help)
    provisioner_list.add_argument(
        "--all", action="store_true", help="every provisioner token, revoked ones included"
    )
    provisioner_list.set_defaults(client="clients:_cmd_provisioners_list")


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
    serve.set_defaults(run="server:_cmd_serve")

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
    development.set_defaults(run="server:_cmd_dev")

    migrate = commands.add_parser(
        "migrate",
        help="apply pending migrations",
        description="Apply the migrations in sql/ that the database lacks; refuse edited ones.",
    )
    migrate.set_defaults(run="server:_cmd_migrate")

    tokens = commands.add_parser(
        "tokens",
        help="create, list or revoke credentials",
        description="Orchestrator, admin and workspace admin API keys, manual runner "
        "registration tokens, and provisioner tokens (--workspace for workspace scope, omitted "
        "for installation scope). "
        "A created token is printed once; only its SHA-256 is stored.",
    )
    actions = tokens.add_subparsers(dest="action", required=True, metavar="ACTION")
    kinds = ["orchestrator", "admin", "workspace-admin", "registration", "provisioner"]
    create = actions.add_parser("create", help="create a credential and print it once")
    create.add_argument("kind", choices=kinds)
    create.add_argument("--name", required=True, help="a label for people (1-200 characters)")
    create.add_argument(
        "--workspace", type=UUID, help="scope to one workspace (workspace-admin: required)"
    )
    create.add_argument("--ttl", type=int, help="lifetime in seconds (default: no expiry)")
    create.add_argument(
        "--role",
        choices=["owner", "observer"],
        default="owner",
        help="admin and workspace-admin keys: owner (default) or observer (read only)",
    )
    listing = actions.add_parser("list", help="list credentials (never their secrets)")
    listing.add_argument("kind", choices=kinds)
    listing.add_argument("--workspace", type=UUID, help="registration tokens of one workspace")
    revoke = actions.add_parser("revoke", help="revoke a credential (idempotent)")
    revoke.add_argument("kind", choices=kinds)
    revoke.add_argument("id", type=UUID)
    eligible = actions.add_parser(
        "eligibility",
        help="show or set which workspaces an installation provisioner may serve",
        description="Without an option, print the provisioner token's eligibility; --all, "
        "--allow or --deny set it (applied from the provisioner's next round, no reconnect).",
    )
    eligible.add_argument("id", type=UUID, help="an installation provisioner token's id")
    choice = eligible.add_mutually_exclusive_group()
    choice.add_argument("--all", action="store_true", help="every workspace (the default)")
    choice.add_argument("--allow", type=UUID, nargs="+", metavar="W", help="only these")
    choice.add_argument("--deny", type=UUID, nargs="+", metavar="W", help="all but these")
    tokens.set_defaults(run="server:_cmd_tokens")
    eligible.set_defaults(run="server:_cmd_eligibility")
    _client_commands(commands)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from controlplane import logs
    from controlplane.errors import ControlPlaneError

    logs.configure(args.log_level)
    try:
        if hasattr(args, "client"):
            code: int = _handler(args.client)(args)
            return code
        from controlplane import settings
        from controlplane.cli.server import with_address

        config = with_address(settings.load(args.config), args)
        try:
            _handler(args.run)(config, args)
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
