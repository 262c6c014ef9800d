"""The commands that talk to a running daemon over HTTP: runner, enqueue, status and
provisioner local. They read no settings file and import no server code; each imports its
agent module when it runs.
"""

from __future__ import annotations

import argparse
import os

import anyio
import msgspec

from controlplane.errors import InvalidInput
from controlplane.wire import runners as runner_wire


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
    from controlplane.agent.runner import Runner, RunnerOptions

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
        # Read once: the jobs this runner starts inherit its environment, and must not see it.
        os.environ.pop("CONTROLPLANE_BOOTSTRAP_TOKEN", None)
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
    from controlplane.agent import queue_client

    key = _secret(args.key, "CONTROLPLANE_ORCHESTRATOR_KEY", "cp_oak_", "an orchestrator key")
    if not args.command:
        raise InvalidInput("give the command to run after --")
    labels = _labels(args.labels)
    given = {
        "project_id": None if args.project is None else str(args.project),
        "priority": args.priority,
        "concurrency_key": args.concurrency_key,
        "concurrency_limit": args.concurrency_limit,
    }
    fields = {name: value for name, value in given.items() if value is not None}
    return anyio.run(
        lambda: queue_client.enqueue(
            args.url,
            key,
            args.workspace,
            labels,
            args.command,
            wait=args.wait,
            give_up_after=args.timeout,
            cancel_on_interrupt=args.cancel_on_interrupt,
            fields=fields,
            lifetime=queue_client.Lifetime(
                timeout_seconds=args.run_timeout,
                queue_timeout_seconds=args.queue_timeout,
                retries_on_lost=args.retries_on_lost,
            ),
        )
    )


def _cmd_provisioner_local(args: argparse.Namespace) -> int:
    from controlplane.agent import provisioner as local_provisioner

    token = _secret(args.token, "CONTROLPLANE_PROVISIONER_TOKEN", "cp_pt_", "a provisioner token")
    if not 1 <= args.slots <= 1000:
        raise InvalidInput("--slots must be between 1 and 1000")
    if not 0 <= args.idle_target <= args.slots:
        raise InvalidInput("--idle-target must be between 0 and --slots")
    options = local_provisioner.ProvisionerOptions(
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
    from controlplane.agent import queue_client

    key = _admin_key(args)
    return anyio.run(lambda: queue_client.status(args.url, key))


def _admin_key(args: argparse.Namespace) -> str:
    return _secret(args.key, "CONTROLPLANE_ADMIN_KEY", "cp_adm_", "an admin key")


def _cmd_jobs_list(args: argparse.Namespace) -> int:
    from controlplane.agent import admin_client

    if not 1 <= args.limit <= 1000:
        raise InvalidInput("--limit must be between 1 and 1000")
    return anyio.run(
        lambda: admin_client.jobs_list(
            args.url,
            _admin_key(args),
            workspace=args.workspace,
            status=args.status,
            labels=None if args.labels is None else _labels(args.labels),
            limit=args.limit,
            as_json=args.json,
        )
    )


def _cmd_jobs_show(args: argparse.Namespace) -> int:
    from controlplane.agent import admin_client

    key = _admin_key(args)
    return anyio.run(lambda: admin_client.jobs_show(args.url, key, args.id, as_json=args.json))


def _cmd_jobs_cancel(args: argparse.Namespace) -> int:
    from controlplane.agent import admin_client

    key = _admin_key(args)
    return anyio.run(lambda: admin_client.jobs_cancel(args.url, key, args.id, as_json=args.json))


def _cmd_workspaces_settings(args: argparse.Namespace) -> int:
    from controlplane.agent import admin_client

    key = _admin_key(args)
    return anyio.run(
        lambda: admin_client.workspace_settings(
            args.url, key, args.workspace, ordering=args.ordering, as_json=args.json
        )
    )


def _cmd_runners_list(args: argparse.Namespace) -> int:
    from controlplane.agent import admin_client

    if not 1 <= args.window <= 86_400:
        raise InvalidInput("--window must be between 1 and 86400 seconds")
    key = _admin_key(args)
    return anyio.run(
        lambda: admin_client.runners_list(
            args.url, key, workspace=args.workspace, window=args.window, as_json=args.json
        )
    )


def _cmd_pause(args: argparse.Namespace) -> int:
    """workspaces pause|resume, runners pause|resume: `args.noun` and `args.action` name the
    route (/v1/admin/<noun>/<id>/<action>)."""
    from controlplane.agent import admin_client

    key = _admin_key(args)
    path = f"/v1/admin/{args.noun}/{args.id}/{args.action}"
    return anyio.run(
        lambda: admin_client.pause_change(args.url, key, path, args.reason, as_json=args.json)
    )


def _cmd_provisioners_list(args: argparse.Namespace) -> int:
    from controlplane.agent import admin_client

    key = _admin_key(args)
    return anyio.run(
        lambda: admin_client.provisioners_list(
            args.url, key, everything=args.all, as_json=args.json
        )
    )
