"""The pages' actions: cancel a job, create and revoke credentials, pause and resume a workspace
or a runner. Each is a form POST that must carry the session's CSRF token, is allowed only where
`roles.may_act` says so, and writes an audit entry to the event feed in the transaction that
makes the change: a `ui.*` entry, or for a pause the queue's own (`workspace.paused`, ...,
naming the admin key), as the admin API writes it.
"""

from __future__ import annotations

from datetime import timedelta
from uuid import UUID

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from controlplane import metrics
from controlplane.domain.credential_rules import Family, NewCredential
from controlplane.domain.jobs import Outcome
from controlplane.domain.pauses import Operator, PauseKind
from controlplane.errors import ControlPlaneError
from controlplane.store import credentials, job_views, leases, pauses, ui_sessions
from controlplane.web.pauses import heard_here
from controlplane.web.ui import roles
from controlplane.web.ui.render import page
from controlplane.web.ui.roles import Principal
from controlplane.web.ui.sessions import Deps, checked_form, signed_in

_NAME_MAX = 200
_TTL_MAX_DAYS = 3650


async def _acting(svc: Deps, request: Request) -> tuple[Principal, dict[str, str]]:
    """The operator and their form, once the form is theirs and they may act."""
    who = await signed_in(svc, request)
    fields = await checked_form(svc, request, who)
    if not roles.may_act(who):
        raise HTTPException(403, "this admin key may only look")
    return who, fields


def _uuid(raw: str, what: str) -> UUID:
    try:
        return UUID(raw)
    except ValueError as error:
        raise HTTPException(400, f"{what} must be a UUID") from error


async def cancel(svc: Deps, request: Request) -> Response:
    """Cancel as the admin API does (a held heartbeat hears it at once), and audit it."""
    who, _fields = await _acting(svc, request)
    execution = _uuid(request.path_params["job_execution_id"], "job execution id")
    async with svc.pool.acquire() as conn:
        view = await job_views.one_job(conn, execution)
        if view is None:
            raise HTTPException(404, "no such job execution")
        async with conn.transaction():
            result = await leases.reconcile(
                conn, execution, Outcome.CANCELLED, "cancelled by an operator"
            )
            await ui_sessions.audit(
                conn,
                "job_cancelled",
                who.key,
                workspace_id=view.workspace_id,
                job_execution_id=execution,
                details={"was_pending": result.was_pending, "was_running": result.was_running},
            )
    svc.feed.poke()
    return RedirectResponse(f"/ui/jobs/{execution}", status_code=303)


def _new_credential(fields: dict[str, str]) -> NewCredential:
    try:
        family = Family(fields.get("family", ""))
    except ValueError as error:
        raise HTTPException(400, "family must be one of " + ", ".join(Family)) from error
    name = fields.get("name", "").strip()
    if not 1 <= len(name) <= _NAME_MAX:
        raise HTTPException(400, f"name must be 1 to {_NAME_MAX} characters")
    workspace = fields.get("workspace", "").strip()
    days = fields.get("ttl_days", "").strip()
    ttl = None
    if days:
        if not days.isdigit() or not 1 <= int(days) <= _TTL_MAX_DAYS:
            raise HTTPException(400, f"ttl_days must be a whole number 1 to {_TTL_MAX_DAYS}")
        ttl = timedelta(days=int(days))
    try:
        return NewCredential(
            family=family,
            name=name,
            workspace_id=_uuid(workspace, "workspace") if workspace else None,
            ttl=ttl,
        )
    except ControlPlaneError as error:
        raise HTTPException(400, str(error)) from error


async def create_credential(svc: Deps, request: Request) -> Response:
    """Issue a credential; the page that answers shows its token this once (never stored)."""
    who, fields = await _acting(svc, request)
    new = _new_credential(fields)
    async with svc.pool.acquire() as conn, conn.transaction():
        made, raw = await credentials.issue(conn, new)
        await ui_sessions.audit(
            conn,
            "credential_created",
            who.key,
            workspace_id=new.workspace_id,
            details={"family": str(new.family), "id": str(made.id), "name": new.name},
        )
    svc.feed.poke()
    return page(
        request,
        "created.html",
        who,
        {"family": str(new.family), "made": made, "token": raw},
        201,
    )


async def revoke_credential(svc: Deps, request: Request) -> Response:
    who, fields = await _acting(svc, request)
    try:
        family = Family(request.path_params["family"])
    except ValueError as error:
        raise HTTPException(404, "no such credential family") from error
    target = _uuid(request.path_params["credential_id"], "credential id")
    reason = fields.get("reason", "").strip() or "revoked on the operator pages"
    async with svc.pool.acquire() as conn, conn.transaction():
        try:
            revoked = await credentials.revoke(conn, family, target, reason=reason[:512])
        except ControlPlaneError as error:
            raise HTTPException(404, str(error)) from error
        await ui_sessions.audit(
            conn,
            "credential_revoked",
            who.key,
            details={"family": str(family), "id": str(revoked.id), "name": revoked.name},
        )
    svc.feed.poke()
    return RedirectResponse("/ui/credentials", status_code=303)


_PAUSE_REASON_MAX = 512
# Where each pause kind's form sends the operator back to.
_BACK = {PauseKind.WORKSPACE: "/ui/", PauseKind.RUNNER: "/ui/runners"}


async def _pause_change(svc: Deps, request: Request, kind: PauseKind, *, paused: bool) -> Response:
    """Pause or resume a workspace or a runner session as the admin API does (every replica
    hears it at once; the change is audited with the admin key), then back to its page."""
    who, fields = await _acting(svc, request)
    target = _uuid(request.path_params["target_id"], f"{kind.value} id")
    reason = fields.get("reason", "").strip() or None
    if reason is not None and (len(reason) > _PAUSE_REASON_MAX or not reason.isprintable()):
        raise HTTPException(400, f"reason must be 1 to {_PAUSE_REASON_MAX} printable characters")
    async with svc.pool.acquire() as conn:
        try:
            state = await pauses.change(
                conn,
                kind,
                target,
                paused=paused,
                operator=Operator(who.key.id, who.key.name),
                reason=reason,
            )
        except ControlPlaneError as error:
            raise HTTPException(404, str(error)) from error
    heard_here(svc.heard, state)
    if state.changed:
        metrics.pause_changes.labels(kind.value, "pause" if paused else "resume").inc()
    svc.feed.poke()
    return RedirectResponse(_BACK[kind], status_code=303)


async def pause_workspace(svc: Deps, request: Request) -> Response:
    return await _pause_change(svc, request, PauseKind.WORKSPACE, paused=True)


async def resume_workspace(svc: Deps, request: Request) -> Response:
    return await _pause_change(svc, request, PauseKind.WORKSPACE, paused=False)


async def pause_runner(svc: Deps, request: Request) -> Response:
    return await _pause_change(svc, request, PauseKind.RUNNER, paused=True)


async def resume_runner(svc: Deps, request: Request) -> Response:
    return await _pause_change(svc, request, PauseKind.RUNNER, paused=False)
