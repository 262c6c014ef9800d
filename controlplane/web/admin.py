"""Admin routes (admin API key): API keys (orchestrator, admin and workspace admin keys, with an
admin key's role), manual registration tokens and the queue. The views of runners and the
provisioned fleet are web/fleet.py's; a workspace's own routes are web/workspaces.py's."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

import asyncpg
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from controlplane.domain.credential_rules import Family, NewCredential, lifetime
from controlplane.domain.credentials import Credential, Role
from controlplane.domain.fields import by_name
from controlplane.settings import Settings
from controlplane.store import credentials, executions, queries
from controlplane.store.credentials import KeyRing
from controlplane.store.pool import Conn
from controlplane.web import auth
from controlplane.web.edge import (
    json_response,
    read_json,
)
from controlplane.web.endpoints import bound
from controlplane.web.idempotency import create_once, revoke_once
from controlplane.web.operations import (
    ADM,
    Op,
    create,
    listing,
    operation,
    revoke,
)
from controlplane.web.paging import Page, cut, page_of
from controlplane.web.queries import decode
from controlplane.web.readback import queue_out
from controlplane.wire import admin as wire
from controlplane.wire.queries import PageQuery, TokenPageQuery


@dataclass(frozen=True, slots=True)
class Deps:
    settings: Settings
    pool: asyncpg.Pool
    auth: auth.Authenticator
    keys: KeyRing  # a replayed create derives its token with the current key


def credential_out(credential: Credential) -> wire.CredentialOut:
    return by_name(wire.CredentialOut, credential)


@operation(create("Create an API key", wire.CreateApiKey, wire.CreatedCredential))
async def create_api_key(svc: Deps, request: Request) -> Response:
    actor = await svc.auth.admin(request)
    body = await read_json(request, wire.CreateApiKey, svc.settings.server.max_body_bytes)
    new = NewCredential(
        Family(body.kind),
        body.name,
        body.workspace_id,
        lifetime(body.ttl_seconds),
        Role(body.role),
    )
    created, raw = await create_once(
        request, svc, actor, "api_key.create", body, new, credentials.issue_key,
        credentials.api_key_by_id,
    )  # fmt: skip
    return json_response(wire.CreatedCredential(credential=credential_out(created), token=raw), 201)


def _position(credential: Credential) -> tuple[datetime, UUID]:
    return credential.created_at, credential.id


def credential_page(found: list[Credential], page: Page) -> Response:
    shown, next_cursor = cut(found, page, _position)
    return json_response(
        wire.CredentialList(items=[credential_out(item) for item in shown], next_cursor=next_cursor)
    )


@operation(listing("List API keys, newest first, a page at a time", wire.CredentialList, PageQuery))
async def list_api_keys(svc: Deps, request: Request) -> Response:
    await svc.auth.admin(request)
    query = decode(request, PageQuery, svc.settings)
    page = page_of(query.limit, query.cursor)
    async with svc.pool.acquire() as conn:
        found = await credentials.list_api_keys(conn, before=page.before, limit=page.fetch)
    return credential_page(found, page)


@operation(revoke("Revoke an API key (idempotent)", wire.Revoke, wire.CredentialOut))
async def revoke_api_key(svc: Deps, request: Request) -> Response:
    actor = await svc.auth.admin(request)

    async def revoked(conn: Conn, key_id: UUID, reason: str | None) -> wire.CredentialOut:
        return credential_out(await credentials.revoke_api_key(conn, key_id, reason=reason))

    return await revoke_once(request, svc, actor, "api_key.revoke", revoked)


@operation(
    create(
        "Create a manual registration token", wire.CreateRegistrationToken, wire.CreatedCredential
    )
)
async def create_registration_token(svc: Deps, request: Request) -> Response:
    actor = await svc.auth.admin(request)
    body = await read_json(
        request, wire.CreateRegistrationToken, svc.settings.server.max_body_bytes
    )
    return await issue_registration_token(svc, request, actor, body)


async def issue_registration_token(
    svc: Deps, request: Request, actor: Credential, body: wire.CreateRegistrationToken
) -> Response:
    """Issue the manual registration token `body` asks for, once per Idempotency-Key, and answer
    it (201): this admin route's answer, and a workspace's own with its workspace filled in, so
    that both routes remember one request alike."""
    new = NewCredential(
        Family.REGISTRATION, body.name, body.workspace_id, lifetime(body.ttl_seconds)
    )
    created, raw = await create_once(
        request, svc, actor, "registration_token.create", body, new, credentials.issue_key,
        credentials.manual_token_by_id,
    )  # fmt: skip
    return json_response(wire.CreatedCredential(credential=credential_out(created), token=raw), 201)


@operation(
    listing(
        "List manual registration tokens, newest first, a page at a time",
        wire.CredentialList,
        TokenPageQuery,
    )
)
async def list_registration_tokens(svc: Deps, request: Request) -> Response:
    await svc.auth.admin(request)
    query = decode(request, TokenPageQuery, svc.settings)
    workspace = query.workspace_id
    page = page_of(query.limit, query.cursor)
    async with svc.pool.acquire() as conn:
        found = await credentials.list_manual_tokens(
            conn, workspace, before=page.before, limit=page.fetch
        )
    return credential_page(found, page)


@operation(
    revoke("Revoke a manual registration token (idempotent)", wire.Revoke, wire.CredentialOut)
)
async def revoke_registration_token(svc: Deps, request: Request) -> Response:
    actor = await svc.auth.admin(request)

    async def revoked(conn: Conn, token_id: UUID, reason: str | None) -> wire.CredentialOut:
        return credential_out(await credentials.revoke_manual_token(conn, token_id, reason=reason))

    return await revoke_once(request, svc, actor, "registration_token.revoke", revoked)


@operation(Op("Queue depth, per workspace", ADM, None, wire.QueueOut))
async def queue_overview(svc: Deps, request: Request) -> Response:
    await svc.auth.admin(request)
    async with svc.pool.acquire() as conn:
        depth = await queries.depth(conn)
        workspaces = await executions.workspaces_with_jobs(conn)
        counts = await queries.workspace_counts(conn, workspaces)
    return json_response(
        wire.QueueOut(
            pending=depth.pending,
            running=depth.running,
            workspaces=[queue_out(c) for c in counts],
        )
    )


def routes(svc: Deps | None) -> list[BaseRoute]:
    return [
        Route("/v1/admin/api-keys", bound(create_api_key, svc), methods=["POST"]),
        Route("/v1/admin/api-keys", bound(list_api_keys, svc), methods=["GET"]),
        Route("/v1/admin/api-keys/{id}/revoke", bound(revoke_api_key, svc), methods=["POST"]),
        Route(
            "/v1/admin/registration-tokens",
            bound(create_registration_token, svc),
            methods=["POST"],
        ),
        Route(
            "/v1/admin/registration-tokens",
            bound(list_registration_tokens, svc),
            methods=["GET"],
        ),
        Route(
            "/v1/admin/registration-tokens/{id}/revoke",
            bound(revoke_registration_token, svc),
            methods=["POST"],
        ),
        Route("/v1/admin/queue", bound(queue_overview, svc), methods=["GET"]),
    ]
