"""What an operator runs against a daemon by hand: enqueue one job, and look at the queue and
the provisioned fleet."""

from __future__ import annotations

import shlex
import signal
import sys
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TypeVar
from uuid import UUID

import anyio
import httpx
import msgspec
from anyio.abc import TaskStatus

from controlplane.agent import api
from controlplane.wire.admin import QueueOut, ReservationList, RunnerInstanceCounts
from controlplane.wire.jobs import PendingGroupList
from controlplane.wire.orchestrator import EnqueueResponse, ExecutionState
from controlplane.wire.provisioners import ProvisionerTokenList

_FIRST_POLL_SECONDS = 0.2
_MAX_POLL_SECONDS = 2.0

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Lifetime:
    """The job's life policies (docs/policies.md); None leaves each to the server's default."""

    timeout_seconds: int | None = None
    queue_timeout_seconds: int | None = None
    retries_on_lost: int | None = None

    def fields(self) -> dict[str, int]:
        return {
            name: value
            for name, value in (
                ("timeout_seconds", self.timeout_seconds),
                ("queue_timeout_seconds", self.queue_timeout_seconds),
                ("retries_on_lost", self.retries_on_lost),
            )
            if value is not None
        }


def enqueue_body(
    workspace: UUID,
    labels: Sequence[str],
    command: Sequence[str],
    now: datetime,
    fields: Mapping[str, object] | None = None,
    lifetime: Lifetime = Lifetime(),
) -> dict[str, object]:
    """One job running `command`, with fresh ids; `fields` adds or replaces job fields
    (`project_id`, `priority`, `concurrency_key`, `concurrency_limit`), `lifetime` adds the life
    policies it sets."""
    return {
        "jobs": [
            {
                "job_execution_id": str(uuid.uuid4()),
                "job_id": str(uuid.uuid4()),
                "workflow_run_id": str(uuid.uuid4()),
                "workflow_run_attempt_id": str(uuid.uuid4()),
                "workspace_id": str(workspace),
                "project_id": str(uuid.uuid4()),
                "required_labels": list(labels),
                "queued_at": now.isoformat(),
                "payload": {"script": shlex.join(command)},
                **(fields or {}),
                **lifetime.fields(),
            }
        ]
    }


async def call(http: httpx.AsyncClient, method: str, path: str, **kwargs: object) -> bytes:
    try:
        response = await http.request(method, path, **kwargs)  # type: ignore[arg-type]
    except httpx.TransportError as error:
        raise api.ApiError(api.unreachable(str(http.base_url).rstrip("/"), error)) from error
    if response.status_code != 200:
        raise api.ApiError(f"{method} {path}: {api.describe(response)}")
    return response.content


def decode(content: bytes, kind: type[T]) -> T:
    try:
        return msgspec.json.decode(content, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        raise api.ApiError(f"unexpected answer: {error}") from error


async def enqueue(
    url: str,
    key: str,
    workspace: UUID,
    labels: Sequence[str],
    command: Sequence[str],
    *,
    wait: bool,
    give_up_after: float,
    cancel_on_interrupt: bool = False,
    fields: Mapping[str, object] | None = None,
    lifetime: Lifetime = Lifetime(),
) -> int:
    """Print the new execution's id. With `wait`, follow it to its end, print the end of its
    output and its outcome, and exit as the job did: its exit code when it has one, else 0 for
    success and 1 otherwise; 2 when we gave up waiting. Ctrl-C while waiting leaves the job
    running (and says how to cancel it), or cancels it with `cancel_on_interrupt`."""
    body = enqueue_body(workspace, labels, command, datetime.now(UTC), fields, lifetime)
    async with api.client(url) as http:
        headers = api.bearer(key)
        if not wait:
            _say(str(await _enqueue_one(http, headers, body)))
            return 0
        execution: UUID | None = None
        interrupted = False
        state: ExecutionState | None = None
        try:
            async with anyio.create_task_group() as group:

                async def on_interrupt(*, task_status: TaskStatus[None]) -> None:
                    nonlocal interrupted
                    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                        task_status.started()
                        async for _ in signals:
                            interrupted = True
                            group.cancel_scope.cancel()
                            return

                async def follow() -> None:
                    nonlocal execution, state
                    execution = await _enqueue_one(http, headers, body)
                    _say(str(execution))
                    state = await _until_ended(http, headers, execution, give_up_after)
                    group.cancel_scope.cancel()

                # Ctrl-C is ours from before the job exists, so it never meets a default handler.
                await group.start(on_interrupt)
                group.start_soon(follow)
        except BaseExceptionGroup as failed:
            # One task's failure (a refused key, an unreachable daemon) is raised as itself, so
            # the command prints its one line instead of an exception group.
            if len(failed.exceptions) == 1:
                raise failed.exceptions[0] from None
            raise
        if interrupted:
            if execution is None:
                _warn("interrupted before the job was enqueued")
                return 130
            return await _interrupted(http, headers, execution, cancel_on_interrupt)
        assert execution is not None
        if state is None:
            raise api.ApiError(
                f"gave up waiting after {give_up_after:g} s; {execution} has not ended "
                f"(`controlplane jobs show {execution}` follows it)"
            )
    return _report(state)


async def _enqueue_one(
    http: httpx.AsyncClient, headers: dict[str, str], body: dict[str, object]
) -> UUID:
    answer = decode(
        await call(http, "POST", "/v1/jobs", json=body, headers=headers), EnqueueResponse
    )
    return answer.results[0].job_execution_id


async def _until_ended(
    http: httpx.AsyncClient, headers: dict[str, str], execution: UUID, give_up_after: float
) -> ExecutionState | None:
    """The execution's state once it has ended; None past `give_up_after` (0: no limit)."""
    path = f"/v1/jobs/{execution}"
    pause = _FIRST_POLL_SECONDS
    warned = False
    with anyio.move_on_after(give_up_after if give_up_after > 0 else float("inf")):
        while True:
            state = decode(await call(http, "GET", path, headers=headers), ExecutionState)
            if state.state == "ended":
                return state
            if state.waiting is not None and state.waiting.stuck and not warned:
                # Said once: it may still be taken if a runner or provisioner with its labels
                # comes along, so we keep waiting, but the person at the terminal should know.
                _warn(
                    f"{execution} is stuck: {state.waiting.reason}; still waiting "
                    "(Ctrl-C stops waiting, --timeout S gives up)"
                )
                warned = True
            await anyio.sleep(pause)
            pause = min(pause * 2, _MAX_POLL_SECONDS)
    return None


async def _interrupted(
    http: httpx.AsyncClient, headers: dict[str, str], execution: UUID, cancel: bool
) -> int:
    if not cancel:
        _warn(
            f"stopped waiting; {execution} goes on. Cancel it with "
            f"`controlplane jobs cancel {execution}`"
        )
        return 130
    await call(
        http,
        "POST",
        f"/v1/jobs/{execution}/outcome",
        json={"status": "cancelled", "reason": "interrupted while waiting (enqueue --wait)"},
        headers=headers,
    )
    _warn(f"cancelled {execution}")
    return 130


def exit_status(state: ExecutionState) -> int:
    """What `enqueue --wait` exits with: the job's own exit code when it reported one (a shell's
    0..255), else 0 for success and 1 for anything else."""
    if state.exit_code is not None and 0 <= state.exit_code <= 255:
        return state.exit_code
    return 0 if state.outcome == "succeeded" else 1


def _report(state: ExecutionState) -> int:
    if state.output_tail:
        sys.stdout.write(
            state.output_tail if state.output_tail.endswith("\n") else state.output_tail + "\n"
        )
    code = exit_status(state)
    detail = f" (exit code {state.exit_code})" if state.exit_code not in (None, 0) else ""
    _say(f"outcome: {state.outcome}{detail}")
    return code


def _warn(line: str) -> None:
    sys.stderr.write(f"controlplane: {line}\n")
    sys.stderr.flush()


def queue_table(queue: QueueOut) -> str:
    """The queue as a fixed-width table: one row per workspace, busiest first, then the totals."""
    rows = [
        (str(item.workspace_id), item.queued, item.running)
        for item in sorted(
            queue.workspaces, key=lambda w: (-w.queued, -w.running, str(w.workspace_id))
        )
    ]
    width = max([len("WORKSPACE"), len("TOTAL"), *(len(row[0]) for row in rows)])
    lines = [f"{'WORKSPACE':<{width}}  {'PENDING':>8}  {'RUNNING':>8}"]
    lines += [f"{name:<{width}}  {pending:>8}  {running:>8}" for name, pending, running in rows]
    lines.append(f"{'TOTAL':<{width}}  {queue.pending:>8}  {queue.running:>8}")
    return "\n".join(lines)


def labels_table(queue: QueueOut) -> str | None:
    """Each workspace's jobs per required label set (busiest workspace first), or None."""
    rows = [
        [str(item.workspace_id), ",".join(group.labels), str(group.queued), str(group.running)]
        for item in sorted(
            queue.workspaces, key=lambda w: (-w.queued, -w.running, str(w.workspace_id))
        )
        for group in item.labels
    ]
    return table(["QUEUED_IN", "LABELS", "PENDING", "RUNNING"], rows) if rows else None


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    )


def when(moment: datetime | None) -> str:
    return "-" if moment is None else moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def fleet_tables(
    provisioners: ProvisionerTokenList, reservations: ReservationList, counts: RunnerInstanceCounts
) -> list[str]:
    """Active provisioners, live reservations and runner instances per state: one table each,
    and none for what is empty (a daemon without provisioning prints only the queue)."""
    tables = []
    if provisioners.items:
        rows = [
            [p.name.replace(" ", "_"), p.scope, str(p.workspace_id or "-"), when(p.last_seen_at)]
            for p in provisioners.items
        ]
        tables.append(table(["PROVISIONER", "SCOPE", "WORKSPACE", "LAST_SEEN"], rows))
    if reservations.items:
        rows = [
            [str(r.workspace_id), ",".join(r.labels), r.kind, str(r.units), when(r.next_expiry)]
            for r in reservations.items
        ]
        tables.append(table(["RESERVED_IN", "LABELS", "KIND", "UNITS", "NEXT_EXPIRY"], rows))
    if counts.states:
        rows = [[c.state, str(c.count)] for c in counts.states]
        tables.append(table(["INSTANCE_STATE", "COUNT"], rows))
    return tables


async def provisioner_pages(
    http: httpx.AsyncClient, headers: dict[str, str], *, active: bool = True
) -> ProvisionerTokenList:
    """Every page of the provisioners (only the active ones, by default), as one list."""
    found = ProvisionerTokenList(items=[], next_cursor=None)
    params: dict[str, str] = {"limit": "100", **({"active": "true"} if active else {})}
    while True:
        page = decode(
            await call(http, "GET", "/v1/admin/provisioner-tokens", headers=headers, params=params),
            ProvisionerTokenList,
        )
        found.items += page.items
        if page.next_cursor is None:
            return found
        params["cursor"] = page.next_cursor


def stuck_table(groups: PendingGroupList) -> str | None:
    """Pending label sets nothing can take, with the labels nobody offers; None when none."""
    rows = [
        [str(group.workspace_id), ",".join(group.labels), str(group.pending),
         ",".join(group.waiting.missing_labels) or "-", group.waiting.reason]
        for group in groups.items
        if group.waiting.stuck
    ]  # fmt: skip
    if not rows:
        return None
    return table(["STUCK_IN", "LABELS", "PENDING", "MISSING", "WHY"], rows)


async def status(url: str, key: str) -> int:
    headers = api.bearer(key)
    async with api.client(url) as http:
        content = await call(http, "GET", "/v1/admin/queue", headers=headers)
        queue = decode(content, QueueOut)
        pending = decode(
            await call(http, "GET", "/v1/admin/queue/pending", headers=headers), PendingGroupList
        )
        provisioners = await provisioner_pages(http, headers)
        reservations = decode(
            await call(http, "GET", "/v1/admin/reservations", headers=headers), ReservationList
        )
        counts = decode(
            await call(http, "GET", "/v1/admin/runner-instances/counts", headers=headers),
            RunnerInstanceCounts,
        )
    _say(queue_table(queue))
    by_labels = labels_table(queue)
    stuck = stuck_table(pending)
    for section in [
        *([stuck] if stuck else []),
        *([by_labels] if by_labels else []),
        *fleet_tables(provisioners, reservations, counts),
    ]:
        _say("")
        _say(section)
    return 0


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
