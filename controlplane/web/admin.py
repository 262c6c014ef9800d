"""Admin routes (admin API key): API keys, manual registration tokens and the queue. The views of
runners and the provisioned fleet are web/fleet.py's."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from uuid import UUID

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from controlplane.domain import tokens
from controlplane.store import credentials, executions, queries
from controlplane.store.credentials import Credential
from controlplane.store.pool import Conn
from controlplane.web import auth
from controlplane.web.edge import (
    json_response,
    path_uuid,
    read_json,
)
from controlplane.web.idempotency import create_once, revoke_once
from controlplane.web.operations import (
    ADM,
    KNOBS,
    PAGE_NOTE,
    Op,
    create,
    operation,
    revoke,
)
from controlplane.web.paging import Page, cut, page_of
from controlplane.web.queries import decode
from controlplane.wire import admin as wire
from controlplane.wire.queries import PageQuery, TokenPageQuery

_P = KNOBS.provisioners


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


@operation(create("Create an API key", wire.CreateApiKey, wire.CreatedCredential))
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


@operation(
    Op(
        "List API keys, newest first, a page at a time",
        ADM,
        None,
        wire.CredentialList,
        "invalid-cursor",
        PageQuery,
        notes=PAGE_NOTE,
    )
)
async def list_api_keys(request: Request) -> Response:
    svc = await auth.admin(request)
    query = decode(request, PageQuery, svc.settings)
    page = page_of(query.limit, query.cursor)
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


@operation(revoke("Revoke an API key (idempotent)", wire.Revoke, wire.CredentialOut))
async def revoke_api_key(request: Request) -> Response:
    return await _revoke(
        request,
        "api_key.revoke",
        lambda conn, key_id, reason: credentials.revoke_api_key(conn, key_id, reason=reason),
    )


@operation(
    create(
        "Create a manual registration token", wire.CreateRegistrationToken, wire.CreatedCredential
    )
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


@operation(
    Op(
        "List manual registration tokens, newest first, a page at a time",
        ADM,
        None,
        wire.CredentialList,
        "invalid-cursor",
        TokenPageQuery,
        notes=PAGE_NOTE,
    )
)
async def list_registration_tokens(request: Request) -> Response:
    svc = await auth.admin(request)
    query = decode(request, TokenPageQuery, svc.settings)
    workspace = query.workspace_id
    page = page_of(query.limit, query.cursor)
    async with svc.pool.acquire() as conn:
        found = await credentials.list_manual_tokens(
            conn, workspace, before=page.before, limit=page.fetch
        )
    return _credentials(found, page)


@operation(
    revoke("Revoke a manual registration token (idempotent)", wire.Revoke, wire.CredentialOut)
)
async def revoke_registration_token(request: Request) -> Response:
    return await _revoke(
        request,
        "registration_token.revoke",
        lambda conn, token_id, reason: credentials.revoke_manual_token(
            conn, token_id, reason=reason
        ),
    )


@operation(Op("Queue depth, per workspace", ADM, None, wire.QueueOut))
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


routes = [
    Route("/v1/admin/api-keys", create_api_key, methods=["POST"]),
    Route("/v1/admin/api-keys", list_api_keys, methods=["GET"]),
    Route("/v1/admin/api-keys/{id}/revoke", revoke_api_key, methods=["POST"]),
    Route("/v1/admin/registration-tokens", create_registration_token, methods=["POST"]),
    Route("/v1/admin/registration-tokens", list_registration_tokens, methods=["GET"]),
    Route("/v1/admin/registration-tokens/{id}/revoke", revoke_registration_token, methods=["POST"]),
    Route("/v1/admin/queue", queue_overview, methods=["GET"]),
]
