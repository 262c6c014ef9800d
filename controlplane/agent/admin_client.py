"""What an operator runs against a daemon with an admin key: list, show and cancel job
executions, list runners and provisioners, pause and resume workspaces and runners. Tables for
people; `--json` for scripts (the API's own objects, one JSON document)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar
from uuid import UUID

import msgspec

from controlplane.agent import api
from controlplane.agent.queue_client import call, decode, provisioner_pages, table, when
from controlplane.wire.admin import ActiveRunners, PauseOut, WorkspaceSettingsOut
from controlplane.wire.jobs import JobCancelled, JobDetail, JobList, JobOut

T = TypeVar("T")

_encoder = msgspec.json.Encoder()


def _json(value: Any) -> None:
    sys.stdout.write(_encoder.encode(msgspec.to_builtins(value)).decode() + "\n")


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")


async def _ask(
    url: str,
    key: str,
    method: str,
    path: str,
    kind: type[T],
    params: dict[str, str] | None = None,
    body: dict[str, Any] | None = None,
) -> T:
    """One admin request, its answer decoded as `kind`."""
    extra: dict[str, Any] = {} if body is None else {"json": body}
    async with api.client(url) as http:
        answer = await call(http, method, path, headers=api.bearer(key), params=params, **extra)
        return decode(answer, kind)


def _labels(labels: Sequence[str] | None) -> str:
    return "-" if labels is None else ",".join(labels)


def _age(moment: datetime | None, now: datetime) -> str:
    if moment is None:
        return "-"
    seconds = max(0, int((now - moment).total_seconds()))
    for unit, size in (("d", 86_400), ("h", 3_600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit} ago"
    return f"{seconds}s ago"


def jobs_table(items: Sequence[JobOut], now: datetime) -> str:
    rows = [
        [
            str(job.job_execution_id),
            job.status,
            str(job.workspace_id or "-"),
            _labels(job.required_labels),
            _age(job.ended_at or job.started_at or job.enqueued_at, now),
            job.outcome or "-",
            "-" if job.exit_code is None else str(job.exit_code),
        ]
        for job in items
    ]
    return table(["EXECUTION", "STATUS", "WORKSPACE", "LABELS", "CHANGED", "OUTCOME", "EXIT"], rows)


async def jobs_list(
    url: str,
    key: str,
    *,
    workspace: UUID | None,
    status: str | None,
    labels: Sequence[str] | None,
    limit: int,
    as_json: bool,
) -> int:
    params: dict[str, str] = {"limit": str(min(limit, 100))}
    if workspace is not None:
        params["workspace_id"] = str(workspace)
    if status is not None:
        params["status"] = status
    if labels:
        params["labels"] = ",".join(labels)
    found: list[JobOut] = []
    async with api.client(url) as http:
        while len(found) < limit:
            page = decode(await call(http, "GET", "/v1/admin/jobs", headers=api.bearer(key),
                                     params=params), JobList)  # fmt: skip
            found += page.items
            if page.next_cursor is None:
                break
            params["cursor"] = page.next_cursor
    found = found[:limit]
    if as_json:
        _json(found)
    elif found:
        _say(jobs_table(found, datetime.now(UTC)))
    else:
        _say("no job executions match")
    return 0


def job_lines(detail: JobDetail, now: datetime) -> list[str]:
    job = detail.job
    lines = [
        f"execution:   {job.job_execution_id}",
        f"status:      {job.status}" + ("  (cancel requested)" if job.cancel_requested else ""),
        f"workspace:   {job.workspace_id or '-'}",
        f"labels:      {_labels(job.required_labels)}",
    ]
    for name, moment in (
        ("enqueued", job.enqueued_at),
        ("started", job.started_at),
        ("ended", job.ended_at),
    ):
        if moment is not None:
            lines.append(f"{name + ':':<12} {when(moment)} ({_age(moment, now)})")
    if job.runner_session_id is not None:
        lines.append(f"runner:      session {job.runner_session_id}")
    if job.outcome is not None:
        lines.append(f"outcome:     {job.outcome} (ended by {job.ended_by})")
    if job.exit_code is not None:
        lines.append(f"exit code:   {job.exit_code}")
    if detail.waiting is not None:
        waiting = detail.waiting
        lines.append(f"waiting:     {'STUCK: ' if waiting.stuck else ''}{waiting.reason}")
        if waiting.position is not None:
            lines.append(
                f"position:    {waiting.position} (1: a runner with its labels takes it next)"
            )
        lines += [f"held back:   {reason.code}: {reason.message}" for reason in waiting.reasons]
    if detail.output_tail:
        lines += ["output (tail):", detail.output_tail.rstrip("\n")]
    return lines


async def jobs_show(url: str, key: str, execution: UUID, *, as_json: bool) -> int:
    detail = await _ask(url, key, "GET", f"/v1/admin/jobs/{execution}", JobDetail)
    if as_json:
        _json(detail)
    else:
        _say("\n".join(job_lines(detail, datetime.now(UTC))))
    return 0


async def jobs_cancel(url: str, key: str, execution: UUID, *, as_json: bool) -> int:
    done = await _ask(url, key, "POST", f"/v1/admin/jobs/{execution}/cancel", JobCancelled)
    if as_json:
        _json(done)
    elif not done.newly_ended:
        _say(f"{execution} had already ended")
    elif done.was_running:
        _say(f"cancelled {execution}; its runner is told to stop")
    else:
        _say(f"cancelled {execution}")
    return 0


async def workspace_settings(
    url: str, key: str, workspace: UUID, *, ordering: str, as_json: bool
) -> int:
    path = f"/v1/admin/workspaces/{workspace}/settings"
    done = await _ask(url, key, "PUT", path, WorkspaceSettingsOut, body={"ordering": ordering})
    if as_json:
        _json(done)
    else:
        change = "set" if done.changed else "already set"
        _say(f"workspace {workspace}: ordering {done.ordering} ({change})")
    return 0


def pause_line(state: PauseOut, now: datetime) -> str:
    """One line: what the target is now, and whether this request changed it."""
    kind = state.kind.replace("_", " ")
    if not state.paused:
        verb = "drained" if state.kind == "runner_instance" else "paused"
        return f"{kind} {state.id} {'is no longer' if state.changed else 'was not'} {verb}"
    verb = "drained" if state.kind == "runner_instance" else "paused"
    how = verb if state.changed else f"was already {verb}"
    reason = "" if state.reason is None else f" ({state.reason})"
    return f"{kind} {state.id} {how}, since {_age(state.since, now)}{reason}"


async def pause_change(url: str, key: str, path: str, reason: str | None, *, as_json: bool) -> int:
    """POST one pause, resume, drain or undrain (`path`), with the reason when given."""
    body = {} if reason is None else {"reason": reason}
    async with api.client(url) as http:
        answer = await call(http, "POST", path, headers=api.bearer(key), json=body)
    state = decode(answer, PauseOut)
    if as_json:
        _json(state)
    else:
        _say(pause_line(state, datetime.now(UTC)))
    return 0


async def runners_list(
    url: str, key: str, *, workspace: UUID | None, window: int, as_json: bool
) -> int:
    params = {"window_seconds": str(window)}
    if workspace is not None:
        params["workspace_id"] = str(workspace)
    found = await _ask(url, key, "GET", "/v1/admin/runners", ActiveRunners, params)
    if as_json:
        _json(found.items)
        return 0
    if not found.items:
        _say(f"no runner seen in the last {window} s")
        return 0
    now = datetime.now(UTC)
    rows = [
        [str(r.runner_session_id), str(r.workspace_id), r.mode, ",".join(r.labels),
         "busy" if r.running else "idle", _age(r.last_seen_at, now)]
        for r in found.items
    ]  # fmt: skip
    _say(table(["SESSION", "WORKSPACE", "MODE", "LABELS", "STATE", "LAST_SEEN"], rows))
    return 0


async def provisioners_list(url: str, key: str, *, everything: bool, as_json: bool) -> int:
    async with api.client(url) as http:
        found = await provisioner_pages(http, api.bearer(key), active=not everything)
    if as_json:
        _json(found.items)
        return 0
    if not found.items:
        _say("no provisioner" + ("" if everything else " seen in the last 120 s"))
        return 0
    now = datetime.now(UTC)
    rows = [
        [p.name.replace(" ", "_"), p.scope, str(p.workspace_id or "-"),
         "revoked" if p.revoked_at else "valid", _age(p.last_seen_at, now)]
        for p in found.items
    ]  # fmt: skip
    _say(table(["PROVISIONER", "SCOPE", "WORKSPACE", "TOKEN", "LAST_SEEN"], rows))
    return 0
