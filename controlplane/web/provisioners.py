"""Provisioner routes: identity (provisioner token), and token administration (admin key)."""

from __future__ import annotations

from datetime import timedelta

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from controlplane.domain import tokens
from controlplane.domain.provisioners import Provisioner
from controlplane.errors import InvalidInput
from controlplane.store import provisioners
from controlplane.store.pool import Conn
from controlplane.web import auth
from controlplane.web.edge import json_response, path_uuid, query_only, query_uuid, read_json
from controlplane.web.idempotency import create_once, revoke_once
from controlplane.web.paging import PAGE_QUERY, cut, page_of
from controlplane.wire import admin as admin_wire
from controlplane.wire import provisioners as wire

# A provisioner seen this recently (and not revoked or expired) is active, as in the reference.
ACTIVE_WITHIN = timedelta(seconds=120)


def _out(found: Provisioner) -> wire.ProvisionerTokenOut:
    return wire.ProvisionerTokenOut(
        id=found.id,
        scope=found.scope,  # type: ignore[arg-type]
        workspace_id=found.workspace_id,
        name=found.name,
        display_prefix=found.display_prefix,
        created_at=found.created_at,
        expires_at=found.expires_at,
        revoked_at=found.revoked_at,
        revocation_reason=found.revocation_reason,
        last_seen_at=found.last_seen_at,
    )


async def me(request: Request) -> Response:
    found = await auth.provisioner(request)
    return json_response(
        wire.ProvisionerIdentity(
            id=found.id,
            scope=found.scope,  # type: ignore[arg-type]
            workspace_id=msgspec.UNSET if found.workspace_id is None else found.workspace_id,
        )
    )


async def create_token(request: Request) -> Response:
    actor = await auth.api_key(request, "admin")
    svc = auth.services(request)
    body = await read_json(request, wire.CreateProvisionerToken, svc.settings.server.max_body_bytes)
    ttl = None if body.ttl_seconds is None else timedelta(seconds=body.ttl_seconds)

    async def create(conn: Conn, token: tokens.Opaque | None) -> tuple[Provisioner, str]:
        return await provisioners.create(
            conn, name=body.name, workspace_id=body.workspace_id, ttl=ttl, token=token
        )

    created, raw = await create_once(
        request, svc, actor, "provisioner_token.create", body, tokens.Kind.PROVISIONER,
        create, provisioners.by_id, lambda found: found.id,
    )  # fmt: skip
    return json_response(wire.CreatedProvisionerToken(provisioner=_out(created), token=raw), 201)


async def list_tokens(request: Request) -> Response:
    svc = await auth.admin(request)
    query_only(request, "workspace_id", "active", *PAGE_QUERY)
    workspace = query_uuid(request, "workspace_id")
    active = request.query_params.get("active")
    if active not in (None, "true", "false"):
        raise InvalidInput("query active must be true or false", field="active")
    seen_within = ACTIVE_WITHIN if active == "true" else None
    page = page_of(request)
    async with svc.pool.acquire() as conn:
        found = await provisioners.list_all(
            conn, workspace, seen_within=seen_within, before=page.before, limit=page.fetch
        )
    shown, next_cursor = cut(found, page, lambda item: (item.created_at, item.id))
    return json_response(
        wire.ProvisionerTokenList(items=[_out(item) for item in shown], next_cursor=next_cursor)
    )


async def revoke_token(request: Request) -> Response:
    """Any provisioner token, of either scope: admin keys are installation-wide, so there is no
    workspace token this route must refuse (the reference's 404 for one, S-70, does not apply).
    The first revocation cascades (store/provisioners.py); a replay with the same
    Idempotency-Key answers the first answer without calling the store."""
    actor = await auth.api_key(request, "admin")
    svc = auth.services(request)
    token_id = path_uuid(request, "id")
    body = await read_json(
        request, admin_wire.Revoke, svc.settings.server.max_body_bytes, optional=True
    )

    async def revoke(conn: Conn) -> wire.ProvisionerTokenOut:
        return _out(await provisioners.revoke(conn, token_id, reason=body.reason))

    answer = await revoke_once(
        request, svc, actor, "provisioner_token.revoke", token_id, body, revoke
    )
    return Response(answer, 200, media_type="application/json")


routes = [
    Route("/v1/provisioners/me", me, methods=["GET"]),
    Route("/v1/admin/provisioner-tokens", create_token, methods=["POST"]),
    Route("/v1/admin/provisioner-tokens", list_tokens, methods=["GET"]),
    Route("/v1/admin/provisioner-tokens/{id}/revoke", revoke_token, methods=["POST"]),
]
