"""Admin routes (admin API key): API keys, manual registration tokens, the queue."""

from __future__ import annotations

from datetime import timedelta

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from controlplane.domain import tokens
from controlplane.errors import InvalidInput
from controlplane.store import credentials, executions, queries
from controlplane.store.credentials import Credential
from controlplane.store.pool import Conn
from controlplane.web import auth
from controlplane.web.edge import json_response, path_uuid, query_integer, query_uuid, read_json
from controlplane.web.idempotency import create_once
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
    )


def _ttl(seconds: int | None) -> timedelta | None:
    return None if seconds is None else timedelta(seconds=seconds)


async def create_api_key(request: Request) -> Response:
    actor = await auth.api_key(request, "admin")
    svc = auth.services(request)
    body = await read_json(request, wire.CreateApiKey, svc.settings.server.max_body_bytes)
    if body.kind == "admin" and body.workspace_id is not None:
        raise InvalidInput("admin keys are installation-wide: omit workspace_id")
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


async def list_api_keys(request: Request) -> Response:
    svc = await auth.admin(request)
    async with svc.pool.acquire() as conn:
        found = await credentials.list_api_keys(conn)
    return json_response(wire.CredentialList(items=[_out(item) for item in found]))


async def revoke_api_key(request: Request) -> Response:
    svc = await auth.admin(request)
    key_id = path_uuid(request, "id")
    async with svc.pool.acquire() as conn:
        revoked = await credentials.revoke_api_key(conn, key_id)
    return json_response(_out(revoked))


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
    workspace = query_uuid(request, "workspace_id")
    async with svc.pool.acquire() as conn:
        found = await credentials.list_manual_tokens(conn, workspace)
    return json_response(wire.CredentialList(items=[_out(item) for item in found]))


async def revoke_registration_token(request: Request) -> Response:
    svc = await auth.admin(request)
    token_id = path_uuid(request, "id")
    async with svc.pool.acquire() as conn:
        revoked = await credentials.revoke_manual_token(conn, token_id)
    return json_response(_out(revoked))


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
                wire.WorkspaceQueue(workspace_id=c.workspace_id, queued=c.queued, running=c.running)
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


routes = [
    Route("/v1/admin/runners", active_runners, methods=["GET"]),
    Route("/v1/admin/api-keys", create_api_key, methods=["POST"]),
    Route("/v1/admin/api-keys", list_api_keys, methods=["GET"]),
    Route("/v1/admin/api-keys/{id}/revoke", revoke_api_key, methods=["POST"]),
    Route("/v1/admin/registration-tokens", create_registration_token, methods=["POST"]),
    Route("/v1/admin/registration-tokens", list_registration_tokens, methods=["GET"]),
    Route("/v1/admin/registration-tokens/{id}/revoke", revoke_registration_token, methods=["POST"]),
    Route("/v1/admin/queue", queue_overview, methods=["GET"]),
]
