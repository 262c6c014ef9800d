"""Provisioner routes: identity (provisioner token), and token administration (admin key)."""

from __future__ import annotations

from datetime import timedelta
from uuid import UUID

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from controlplane.domain.credential_rules import Family, NewCredential, lifetime
from controlplane.domain.credentials import Credential
from controlplane.domain.fields import by_name
from controlplane.domain.provisioners import Provisioner
from controlplane.store import credentials, provisioners
from controlplane.store.pool import Conn
from controlplane.web import admin
from controlplane.web.edge import json_response, read_json
from controlplane.web.endpoints import bound
from controlplane.web.idempotency import create_once, revoke_once
from controlplane.web.operations import (
    PAGE_NOTE,
    PT,
    REVOKE_NOTE,
    Op,
    create,
    listing,
    operation,
    revoke,
)
from controlplane.web.paging import cut, page_of
from controlplane.web.queries import decode
from controlplane.wire import admin as admin_wire
from controlplane.wire import provisioners as wire
from controlplane.wire.queries import ProvisionerTokenPageQuery
from controlplane.wire.queries import WorkspaceProvisionerTokenQuery as WorkspaceTokenQuery

# A provisioner seen this recently (and not revoked or expired) is active, as in the reference.
ACTIVE_WITHIN = timedelta(seconds=120)


# What the other admin routes need: the provisioner tokens are administered alike.
Deps = admin.Deps


def token_out(found: Provisioner) -> wire.ProvisionerTokenOut:
    return by_name(wire.ProvisionerTokenOut, found)


@operation(
    Op(
        "The calling provisioner's identity",
        PT,
        None,
        wire.ProvisionerIdentity,
        "provisioner-token-revoked provisioner-token-expired",
    )
)
async def me(svc: Deps, request: Request) -> Response:
    found = await svc.auth.provisioner(request)
    return json_response(
        wire.ProvisionerIdentity(
            id=found.id,
            scope=found.scope,  # type: ignore[arg-type]
            workspace_id=msgspec.UNSET if found.workspace_id is None else found.workspace_id,
        )
    )


@operation(
    create(
        "Create a provisioner token (workspace_id omitted: installation scope)",
        wire.CreateProvisionerToken,
        wire.CreatedProvisionerToken,
    )
)
async def create_token(svc: Deps, request: Request) -> Response:
    actor = await svc.auth.admin(request)
    body = await read_json(request, wire.CreateProvisionerToken, svc.settings.server.max_body_bytes)
    return await issue_token(svc, request, actor, body)


async def issue_token(
    svc: Deps, request: Request, actor: Credential, body: wire.CreateProvisionerToken
) -> Response:
    """Issue the provisioner token `body` asks for, once per Idempotency-Key, and answer it
    (201): this admin route's answer, and a workspace's own with its workspace filled in, so
    that both routes remember one request alike."""
    new = NewCredential(
        Family.PROVISIONER, body.name, body.workspace_id, lifetime(body.ttl_seconds)
    )
    created, raw = await create_once(
        request, svc, actor, "provisioner_token.create", body, new,
        credentials.issue_provisioner, provisioners.by_id,
    )  # fmt: skip
    return json_response(
        wire.CreatedProvisionerToken(provisioner=token_out(created), token=raw), 201
    )


@operation(
    listing(
        "List provisioner tokens, newest first, a page at a time",
        wire.ProvisionerTokenList,
        ProvisionerTokenPageQuery,
        PAGE_NOTE + " `active` pages the same way.",
    )
)
async def list_tokens(svc: Deps, request: Request) -> Response:
    await svc.auth.admin(request)
    query = decode(request, ProvisionerTokenPageQuery, svc.settings)
    return await token_page(svc, query.workspace_id, query)


async def token_page(
    svc: Deps, workspace_id: UUID | None, query: ProvisionerTokenPageQuery | WorkspaceTokenQuery
) -> Response:
    """One page of provisioner tokens (of one workspace, or all), only the active ones when the
    query asks: the admin list's answer, and a workspace's own."""
    seen_within = ACTIVE_WITHIN if query.active == "true" else None
    page = page_of(query.limit, query.cursor)
    async with svc.pool.acquire() as conn:
        found = await provisioners.list_all(
            conn, workspace_id, seen_within=seen_within, before=page.before, limit=page.fetch
        )
    shown, next_cursor = cut(found, page, lambda item: (item.created_at, item.id))
    items = [token_out(item) for item in shown]
    return json_response(wire.ProvisionerTokenList(items=items, next_cursor=next_cursor))


@operation(
    revoke(
        "Revoke a provisioner token of either scope (idempotent); the first revocation cascades",
        admin_wire.Revoke,
        wire.ProvisionerTokenOut,
        REVOKE_NOTE
        + " Any provisioner token of either scope: admin keys are installation-wide. The first "
        "revocation revokes the provisioner's boot-path credentials and unused runner sessions, "
        "closes its control sessions and terminates its instances without a runner session; it "
        "runs once.",
    )
)
async def revoke_token(svc: Deps, request: Request) -> Response:
    """Any provisioner token, of either scope: admin keys are installation-wide, so there is no
    workspace token this route must refuse (the reference's 404 for one, S-70, does not apply).
    The first revocation cascades (store/provisioners.py); a replay with the same
    Idempotency-Key answers the first answer without calling the store."""
    actor = await svc.auth.admin(request)

    async def revoked(conn: Conn, token_id: UUID, reason: str | None) -> wire.ProvisionerTokenOut:
        return token_out(await provisioners.revoke(conn, token_id, reason=reason))

    return await revoke_once(request, svc, actor, "provisioner_token.revoke", revoked)


def routes(svc: Deps | None) -> list[BaseRoute]:
    return [
        Route("/v1/provisioners/me", bound(me, svc), methods=["GET"]),
        Route("/v1/admin/provisioner-tokens", bound(create_token, svc), methods=["POST"]),
        Route("/v1/admin/provisioner-tokens", bound(list_tokens, svc), methods=["GET"]),
        Route(
            "/v1/admin/provisioner-tokens/{id}/revoke", bound(revoke_token, svc), methods=["POST"]
        ),
    ]
