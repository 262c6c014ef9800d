"""Admin routes (admin API key): API keys, manual registration tokens, the queue, and the
provisioned fleet (runner instances, live reservations). Admin keys are installation-wide, so the
fleet views list every provisioner's instances, of either scope."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from uuid import UUID

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from controlplane.domain import fleet as views
from controlplane.domain import tokens
from controlplane.domain.credentials import Credential
from controlplane.domain.labels import label_error
from controlplane.domain.runner_instances import RunnerState
from controlplane.errors import InvalidInput
from controlplane.store import credentials, executions, fleet, queries
from controlplane.store.pool import Conn
from controlplane.web import auth
from controlplane.web.edge import (
    json_response,
    path_uuid,
    query_integer,
    query_only,
    query_uuid,
    query_value,
    read_json,
)
from controlplane.web.idempotency import create_once, revoke_once
from controlplane.web.paging import PAGE_QUERY, Page, cut, page_of
from controlplane.wire import admin as wire


def _out(credential: Credential) -> wire.CredentialOut:
    return wire.CredentialOut(
        id=credential.id,
        kind=credential.kind,
        name=credential.name,
        workspace_id=credential.workspace_id,
        display_prefix=credential.display_prefix,
        created_at=credential.created_at,
        expires_at=credential.expires_at,
        revoked_at=credential.revoked_at,
        revocation_reason=credential.revocation_reason,
    )


def _ttl(seconds: float | None) -> timedelta | None:
    return None if seconds is None else timedelta(seconds=seconds)


async def create_api_key(request: Request) -> Response:
    actor = await auth.api_key(request, "admin")
    svc = auth.services(request)
    body = await read_json(request, wire.CreateApiKey, svc.settings.server.max_body_bytes)
    kind = tokens.Kind.ADMIN_KEY if body.kind == "admin" else tokens.Kind.ORCHESTRATOR_KEY

    async def create(conn: Conn, token: tokens.Opaque | None) -> tuple[Credential, str]:
        return await credentials.create_api_key(
            conn,
            kind=body.kind,
            name=body.name,
            workspace_id=body.workspace_id,
            ttl=_ttl(body.ttl_seconds),
            token=token,
        )

    created, raw = await create_once(
        request, svc, actor, "api_key.create", body, kind, create,
        credentials.api_key_by_id, lambda found: found.id,
    )  # fmt: skip
    return json_response(wire.CreatedCredential(credential=_out(created), token=raw), 201)


def _position(credential: Credential) -> tuple[datetime, UUID]:
    return credential.created_at, credential.id


def _credentials(found: list[Credential], page: Page) -> Response:
    shown, next_cursor = cut(found, page, _position)
    return json_response(
        wire.CredentialList(items=[_out(item) for item in shown], next_cursor=next_cursor)
    )


async def list_api_keys(request: Request) -> Response:
    svc = await auth.admin(request)
    query_only(request, *PAGE_QUERY)
    page = page_of(request)
    async with svc.pool.acquire() as conn:
        found = await credentials.list_api_keys(conn, before=page.before, limit=page.fetch)
    return _credentials(found, page)


async def _revoke(
    request: Request,
    command: str,
    revoke: Callable[[Conn, UUID, str | None], Awaitable[Credential]],
) -> Response:
    actor = await auth.api_key(request, "admin")
    svc = auth.services(request)
    target_id = path_uuid(request, "id")
    body = await read_json(request, wire.Revoke, svc.settings.server.max_body_bytes, optional=True)

    async def once(conn: Conn) -> wire.CredentialOut:
        return _out(await revoke(conn, target_id, body.reason))

    answer = await revoke_once(request, svc, actor, command, target_id, body, once)
    return Response(answer, 200, media_type="application/json")


async def revoke_api_key(request: Request) -> Response:
    return await _revoke(
        request,
        "api_key.revoke",
        lambda conn, key_id, reason: credentials.revoke_api_key(conn, key_id, reason=reason),
    )


async def create_registration_token(request: Request) -> Response:
    actor = await auth.api_key(request, "admin")
    svc = auth.services(request)
    body = await read_json(
        request, wire.CreateRegistrationToken, svc.settings.server.max_body_bytes
    )

    async def create(conn: Conn, token: tokens.Opaque | None) -> tuple[Credential, str]:
        return await credentials.create_manual_token(
            conn,
            workspace_id=body.workspace_id,
            name=body.name,
            ttl=_ttl(body.ttl_seconds),
            token=token,
        )

    created, raw = await create_once(
        request, svc, actor, "registration_token.create", body,
        tokens.Kind.MANUAL_REGISTRATION, create, credentials.manual_token_by_id,
        lambda found: found.id,
    )  # fmt: skip
    return json_response(wire.CreatedCredential(credential=_out(created), token=raw), 201)


async def list_registration_tokens(request: Request) -> Response:
    svc = await auth.admin(request)
    query_only(request, "workspace_id", *PAGE_QUERY)
    workspace = query_uuid(request, "workspace_id")
    page = page_of(request)
    async with svc.pool.acquire() as conn:
        found = await credentials.list_manual_tokens(
            conn, workspace, before=page.before, limit=page.fetch
        )
    return _credentials(found, page)


async def revoke_registration_token(request: Request) -> Response:
    return await _revoke(
        request,
        "registration_token.revoke",
        lambda conn, token_id, reason: credentials.revoke_manual_token(
            conn, token_id, reason=reason
        ),
    )


async def queue_overview(request: Request) -> Response:
    svc = await auth.admin(request)
    async with svc.pool.acquire() as conn:
        depth = await queries.depth(conn)
        workspaces = await executions.workspaces_with_jobs(conn)
        counts = await queries.workspace_counts(conn, workspaces)
    return json_response(
        wire.QueueOut(
            pending=depth.pending,
            running=depth.running,
            workspaces=[
                wire.WorkspaceQueue(
                    workspace_id=c.workspace_id,
                    queued=c.queued,
                    running=c.running,
                    labels=[
                        wire.LabelQueue(
                            labels=list(group.labels),
                            queued=group.queued,
                            running=group.running,
                            oldest_queued_at=group.oldest_queued_at,
                        )
                        for group in c.labels
                    ],
                )
                for c in counts
            ],
        )
    )


ACTIVE_WINDOW_SECONDS = 60  # as the reference's RUNNER_ACTIVE_WINDOW_SECONDS


async def active_runners(request: Request) -> Response:
    svc = await auth.admin(request)
    workspace = query_uuid(request, "workspace_id")
    window = query_integer(
        request, "window_seconds", low=1, high=86_400, default=ACTIVE_WINDOW_SECONDS
    )
    async with svc.pool.acquire() as conn:
        found = await queries.active_runners(conn, workspace, timedelta(seconds=window))
    return json_response(
        wire.ActiveRunners(
            items=[
                wire.ActiveRunnerOut(
                    runner_session_id=runner.runner_session_id,
                    workspace_id=runner.workspace_id,
                    mode=runner.kind,
                    labels=list(runner.labels),
                    last_seen_at=runner.last_seen_at,
                    running=runner.running,
                )
                for runner in found
            ]
        )
    )


def _choice(request: Request, name: str, allowed: tuple[str, ...]) -> str | None:
    raw = query_value(request, name)
    if raw is not None and raw not in allowed:
        raise InvalidInput(f"query {name} must be one of {', '.join(allowed)}", field=name)
    return raw


def _instance(
    row: fleet.InstanceRow, now: datetime, threshold: timedelta
) -> wire.RunnerInstanceOut:
    return wire.RunnerInstanceOut(
        id=row.id,
        provisioner=wire.InstanceProvisioner(
            id=row.provisioner_id,
            scope=row.provisioner_scope,  # type: ignore[arg-type]
            name=row.provisioner_name,
        ),
        workspace_id=row.workspace_id,
        provider_runner_id=row.provider_runner_id,
        provider_kind=row.provider_kind,
        launch_kind=row.launch_kind,  # type: ignore[arg-type]
        template_key=row.template_key,
        labels=list(row.labels),
        state=row.state.value,
        lifecycle_state=views.lifecycle_state(row.facts),
        enrollment_state=views.enrollment_state(row.facts),
        reconciliation_status=views.reconciliation_status(row.facts, now=now, threshold=threshold),
        reason=row.reason,
        created_at=row.created_at,
        updated_at=row.updated_at,
        reported_at=row.reported_at,
        assigned_at=row.assigned_at,
        first_claimed_at=row.first_claimed_at,
        closed_at=row.closed_at,
    )


_STATES = tuple(state.value for state in RunnerState)
_INSTANCE_QUERY = ("state", "assignment", "label", "provisioner_id", "workspace_id", *PAGE_QUERY)


async def runner_instances(request: Request) -> Response:
    """Every provisioner's runner instances, newest first, one page at a time."""
    svc = await auth.admin(request)
    query_only(request, *_INSTANCE_QUERY)
    state = _choice(request, "state", _STATES)
    assignment = _choice(request, "assignment", ("assigned", "unassigned"))
    label = query_value(request, "label")
    if label is not None:
        if (problem := label_error(label)) is not None:
            raise InvalidInput(f"query label: {problem}", field="label")
        label = label.lower()
    page = page_of(request)
    where = fleet.InstanceFilter(
        state=None if state is None else RunnerState(state),
        assigned=None if assignment is None else assignment == "assigned",
        label=label,
        provisioner_id=query_uuid(request, "provisioner_id"),
        workspace_id=query_uuid(request, "workspace_id"),
    )
    async with svc.pool.acquire() as conn:
        rows, now = await fleet.list_instances(conn, where, before=page.before, limit=page.fetch)
    shown, next_cursor = cut(rows, page, lambda row: (row.created_at, row.id))
    threshold = timedelta(seconds=svc.settings.provisioners.stale_runner_threshold_seconds)
    return json_response(
        wire.RunnerInstanceList(
            items=[_instance(row, now, threshold) for row in shown], next_cursor=next_cursor
        )
    )


async def active_runner_instances(request: Request) -> Response:
    """A workspace's active-state instances the server updated recently (spec P-87)."""
    svc = await auth.admin(request)
    query_only(request, "workspace_id")
    workspace = query_uuid(request, "workspace_id")
    if workspace is None:
        raise InvalidInput("query workspace_id is required", field="workspace_id")
    knobs = svc.settings.provisioners
    window = timedelta(seconds=knobs.runner_active_window_seconds)
    async with svc.pool.acquire() as conn:
        rows, now = await fleet.active_instances(conn, workspace, window)
    threshold = timedelta(seconds=knobs.stale_runner_threshold_seconds)
    return json_response(
        wire.ActiveRunnerInstances(items=[_instance(row, now, threshold) for row in rows])
    )


async def runner_instance_counts(request: Request) -> Response:
    svc = await auth.admin(request)
    query_only(request)
    async with svc.pool.acquire() as conn:
        counts = await fleet.counts_by_state(conn)
    return json_response(
        wire.RunnerInstanceCounts(
            states=[wire.StateCount(state=s, count=counts[s]) for s in _STATES if s in counts]
        )
    )


async def reservations(request: Request) -> Response:
    """Unexpired reservations per workspace, label set and kind."""
    svc = await auth.admin(request)
    query_only(request, "workspace_id")
    workspace = query_uuid(request, "workspace_id")
    async with svc.pool.acquire() as conn:
        found = await fleet.live_reservations(conn, workspace)
    return json_response(
        wire.ReservationList(
            items=[
                wire.ReservationGroup(
                    workspace_id=group.workspace_id,
                    labels=list(group.labels),
                    kind=group.kind,  # type: ignore[arg-type]
                    reservations=group.reservations,
                    units=group.units,
                    next_expiry=group.next_expiry,
                )
                for group in found
            ]
        )
    )


routes = [
    Route("/v1/admin/runners", active_runners, methods=["GET"]),
    Route("/v1/admin/runner-instances", runner_instances, methods=["GET"]),
    Route("/v1/admin/runner-instances/active", active_runner_instances, methods=["GET"]),
    Route("/v1/admin/runner-instances/counts", runner_instance_counts, methods=["GET"]),
    Route("/v1/admin/reservations", reservations, methods=["GET"]),
    Route("/v1/admin/api-keys", create_api_key, methods=["POST"]),
    Route("/v1/admin/api-keys", list_api_keys, methods=["GET"]),
    Route("/v1/admin/api-keys/{id}/revoke", revoke_api_key, methods=["POST"]),
    Route("/v1/admin/registration-tokens", create_registration_token, methods=["POST"]),
    Route("/v1/admin/registration-tokens", list_registration_tokens, methods=["GET"]),
    Route("/v1/admin/registration-tokens/{id}/revoke", revoke_registration_token, methods=["POST"]),
    Route("/v1/admin/queue", queue_overview, methods=["GET"]),
]
