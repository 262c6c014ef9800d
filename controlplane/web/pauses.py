"""Admin routes that pause and resume a workspace's queue or a runner session, and drain a
provisioner's runner (admin API key). The rules are docs/policies.md's "Pause, resume, drain";
the writes, their locks and the notifications that make them effective on every replica are
store/pauses.py's."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from uuid import UUID

import asyncpg
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from controlplane import metrics
from controlplane.domain.fields import by_name
from controlplane.domain.pauses import Operator, PauseKind, PauseState
from controlplane.settings import Settings
from controlplane.store import pauses
from controlplane.web import auth
from controlplane.web.edge import json_response, path_uuid, read_json
from controlplane.web.endpoints import bound
from controlplane.web.operations import ADM, KNOBS, Op, operation
from controlplane.wire import admin as wire

log = logging.getLogger("controlplane.pauses")

_R = KNOBS.runners


@dataclass(frozen=True, slots=True)
class Deps:
    settings: Settings
    pool: asyncpg.Pool
    auth: auth.Authenticator
    heard: PauseHeard  # the dispatcher's `runner_paused`: see heard_here


_BODY = (
    "The body is optional (`{{}}`, `null` or none): `reason`, 1-512 characters, not blank, no "
    "control or format characters, is kept in the audit event. Idempotent: when the target is "
    "already so, nothing is written, no event is added, and the answer has `changed: false` and "
    "the first change's `since` and `reason`. Effective at once on the replica that answers "
    "and on every other within a second: each replica's claims read the state from the "
    "database, and a notification reaches the parked requests. Audited in the event feed "
    "({events}) with `by` (the admin key's id), `by_name` and `reason`. 409 `conflict` only "
    "when concurrent pauses and resumes of the target kept changing it while this one read it "
    "three times; retry."
)


def _op(summary: str, events: str, notes: str, errors: str = "") -> Op:
    return Op(
        summary,
        ADM,
        wire.PauseRequest,
        wire.PauseOut,
        f"{errors} conflict".strip(),
        optional_body=True,
        notes=f"{notes} {_BODY.format(events=events)}",
    )


_WORKSPACE = (
    "Workspaces are not registered, so any id may be paused, even before its first job. While "
    "paused, enqueue is accepted and no runner is handed a job of the workspace; runners "
    "already parked stay parked and claim the moment it is resumed; leases run to their end."
)
_RUNNER = (
    "An unknown runner session is 404. While paused, the session's lease, if any, runs to its "
    "end; it is handed no new job; its job requests, parked ones included, are answered 204 "
    "with `Controlplane-Paused: runner` and `Retry-After` of runners.paused_retry_seconds "
    f"(default {_R.paused_retry_seconds})."
)
_DRAIN = (
    "An unknown runner instance is 404. A drained runner instance (a provisioner's runner) is "
    "never bound to new demand and no longer counts toward its template's warm pool (so a "
    "replacement may be launched); what it runs already is untouched. To stop its runner "
    "session from claiming too, pause the session."
)


def _out(state: PauseState) -> wire.PauseOut:
    return by_name(wire.PauseOut, state, id=state.target_id)


# (workspace id, runner session id, paused): actors/dispatch.py Dispatcher.runner_paused.
PauseHeard = Callable[[UUID, UUID, bool], None]


def heard_here(heard: PauseHeard, state: PauseState) -> None:
    """This replica made the change: its own runner requests see it at once, not when its
    listener hears the NOTIFY (a runner resumed here and asking here next must not be answered
    "paused" from the replica's memory). Every other replica learns it from the NOTIFY; hearing
    it here too changes nothing (noting a pause twice is noting it once)."""
    if state.kind is PauseKind.RUNNER and state.workspace_id is not None:
        heard(state.workspace_id, state.target_id, state.paused)


async def _change(
    svc: Deps, request: Request, kind: PauseKind, param: str, action: str, *, paused: bool
) -> Response:
    actor = await svc.auth.admin(request)
    target = path_uuid(request, param)
    body = await read_json(
        request, wire.PauseRequest, svc.settings.server.max_body_bytes, optional=True
    )
    async with svc.pool.acquire() as conn:
        state = await pauses.change(
            conn,
            kind,
            target,
            paused=paused,
            operator=Operator(actor.id, actor.name),
            reason=body.reason,
        )
    heard_here(svc.heard, state)
    if state.changed:
        metrics.pause_changes.labels(kind.value, action).inc()
        log.info(
            "pause.changed",
            extra={"kind": kind.value, "id": str(target), "action": action, "by": str(actor.id)},
        )
    return json_response(_out(state))


@operation(_op("Pause a workspace's queue", "`workspace.paused`", _WORKSPACE))
async def pause_workspace(svc: Deps, request: Request) -> Response:
    return await _change(svc, request, PauseKind.WORKSPACE, "workspace_id", "pause", paused=True)


@operation(_op("Resume a workspace's queue", "`workspace.resumed`", _WORKSPACE))
async def resume_workspace(svc: Deps, request: Request) -> Response:
    return await _change(svc, request, PauseKind.WORKSPACE, "workspace_id", "resume", paused=False)


@operation(_op("Pause a runner session", "`runner.paused`", _RUNNER, "not-found"))
async def pause_runner(svc: Deps, request: Request) -> Response:
    return await _change(svc, request, PauseKind.RUNNER, "runner_session_id", "pause", paused=True)


@operation(_op("Resume a runner session", "`runner.resumed`", _RUNNER, "not-found"))
async def resume_runner(svc: Deps, request: Request) -> Response:
    return await _change(
        svc, request, PauseKind.RUNNER, "runner_session_id", "resume", paused=False
    )


@operation(
    _op("Drain a provisioner's runner instance", "`runner_instance.drained`", _DRAIN, "not-found")
)
async def drain_runner_instance(svc: Deps, request: Request) -> Response:
    return await _change(
        svc, request, PauseKind.RUNNER_INSTANCE, "runner_instance_id", "drain", paused=True
    )


@operation(
    _op("Undo a runner instance's drain", "`runner_instance.undrained`", _DRAIN, "not-found")
)
async def undrain_runner_instance(svc: Deps, request: Request) -> Response:
    return await _change(
        svc, request, PauseKind.RUNNER_INSTANCE, "runner_instance_id", "undrain", paused=False
    )


def routes(svc: Deps | None) -> list[BaseRoute]:
    workspace = "/v1/admin/workspaces/{workspace_id}"
    runner = "/v1/admin/runners/{runner_session_id}"
    instance = "/v1/admin/runner-instances/{runner_instance_id}"
    return [
        Route(f"{workspace}/pause", bound(pause_workspace, svc), methods=["POST"]),
        Route(f"{workspace}/resume", bound(resume_workspace, svc), methods=["POST"]),
        Route(f"{runner}/pause", bound(pause_runner, svc), methods=["POST"]),
        Route(f"{runner}/resume", bound(resume_runner, svc), methods=["POST"]),
        Route(f"{instance}/drain", bound(drain_runner_instance, svc), methods=["POST"]),
        Route(f"{instance}/undrain", bound(undrain_runner_instance, svc), methods=["POST"]),
    ]
