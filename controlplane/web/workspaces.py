"""A workspace's own administration, under `/v1/workspaces/{workspace_id}/...`: its manual
registration tokens and provisioner tokens (create, list, revoke) and its active runners.

Taken by a workspace admin key of that workspace (`cp_wak_`) or by an installation admin key;
either passes its role (an observer only reads). A workspace admin key of another workspace is
403 `forbidden`: the path names the workspace, so refusing it tells the caller nothing it did not
send. A token of another workspace (or an installation provisioner token) addressed through this
workspace's path is 404 `not-found`, as an unknown id is: its existence never shows.

The bodies and their limits are the admin routes' (web/admin.py, web/provisioners.py) without
the workspace, and a create is remembered under the same command and fingerprint as the admin
create of the same workspace, so an Idempotency-Key replays alike through either route.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any
from uuid import UUID

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from controlplane.domain.credentials import Credential
from controlplane.errors import NotFound
from controlplane.store import capabilities, credentials, provisioners, queries
from controlplane.store.pool import Conn
from controlplane.web import admin
from controlplane.web.edge import read_json
from controlplane.web.endpoints import bound
from controlplane.web.fleet import runners_out
from controlplane.web.idempotency import revoke_once
from controlplane.web.operations import (
    ADM,
    PAGE_NOTE,
    REVOKE_NOTE,
    WAK,
    Op,
    create,
    operation,
    revoke,
)
from controlplane.web.paging import page_of
from controlplane.web.provisioners import issue_token, token_out, token_page
from controlplane.web.queries import decode
from controlplane.wire import admin as wire
from controlplane.wire import provisioners as provisioner_wire
from controlplane.wire.queries import (
    PageQuery,
    WorkspaceProvisionerTokenQuery,
    WorkspaceRunnersQuery,
)

Deps = admin.Deps  # settings, pool, authenticator, and the signing key a replay derives with

_SCOPE = "forbidden admin-key-read-only"  # another workspace's key; an observer's change
_NOT_YOURS = " A token of another workspace (or of installation scope) is 404, as an unknown id is."


def _workspace(op: Op) -> Op:
    """A workspace route: its workspace admin key, or an installation admin key."""
    return replace(op, auth=WAK, alternative_auth=(ADM,), errors=f"{_SCOPE} {op.errors}".strip())


def _op(summary: str, answer: type, errors: str = "", **more: Any) -> Op:
    return _workspace(Op(summary, answer=answer, errors=errors, **more))


def _create(summary: str, answer: type) -> Op:
    return _workspace(create(summary, wire.CreateWorkspaceToken, answer))


def _revoke(summary: str, answer: type) -> Op:
    return _workspace(revoke(summary, wire.Revoke, answer, REVOKE_NOTE + _NOT_YOURS))


async def _caller(svc: Deps, request: Request) -> tuple[Credential, UUID]:
    """The key allowed to act on the workspace the path names, and that workspace."""
    return await svc.auth.workspace_admin(request, "workspace_id")


# Manual registration tokens --------------------------------------------------------------------


@operation(_create("Create a manual registration token of this workspace", wire.CreatedCredential))
async def create_registration_token(svc: Deps, request: Request) -> Response:
    actor, workspace_id = await _caller(svc, request)
    body = await read_json(request, wire.CreateWorkspaceToken, svc.settings.server.max_body_bytes)
    same = wire.CreateRegistrationToken(workspace_id, body.name, body.ttl_seconds)
    return await admin.issue_registration_token(svc, request, actor, same)


@operation(
    _op(
        "This workspace's usable manual registration tokens, newest first, a page at a time",
        wire.CredentialList,
        "invalid-cursor",
        query=PageQuery,
        notes=PAGE_NOTE + " Revoked and expired tokens are left out.",
    )
)
async def list_registration_tokens(svc: Deps, request: Request) -> Response:
    _, workspace_id = await _caller(svc, request)
    query = decode(request, PageQuery, svc.settings)
    page = page_of(query.limit, query.cursor)
    async with svc.pool.acquire() as conn:
        found = await credentials.list_manual_tokens(
            conn, workspace_id, before=page.before, limit=page.fetch, usable_only=True
        )
    return admin.credential_page(found, page)


@operation(_revoke("Revoke a manual registration token of this workspace", wire.CredentialOut))
async def revoke_registration_token(svc: Deps, request: Request) -> Response:
    actor, workspace_id = await _caller(svc, request)

    async def revoked(conn: Conn, token_id: UUID, reason: str | None) -> wire.CredentialOut:
        found = await credentials.revoke_manual_token(conn, token_id, workspace_id, reason=reason)
        return admin.credential_out(found)

    return await revoke_once(request, svc, actor, "registration_token.revoke", revoked)


# Provisioner tokens ------------------------------------------------------------------------------


@operation(
    _create(
        "Create a provisioner token of this workspace (workspace scope)",
        provisioner_wire.CreatedProvisionerToken,
    )
)
async def create_provisioner_token(svc: Deps, request: Request) -> Response:
    actor, workspace_id = await _caller(svc, request)
    body = await read_json(request, wire.CreateWorkspaceToken, svc.settings.server.max_body_bytes)
    same = provisioner_wire.CreateProvisionerToken(body.name, workspace_id, body.ttl_seconds)
    return await issue_token(svc, request, actor, same)


@operation(
    _op(
        "This workspace's provisioner tokens, newest first, a page at a time",
        provisioner_wire.ProvisionerTokenList,
        "invalid-cursor",
        query=WorkspaceProvisionerTokenQuery,
        notes=PAGE_NOTE + " `active=true`: the workspace's active provisioners (seen within "
        "120 s, not revoked, not expired), paged the same way.",
    )
)
async def list_provisioner_tokens(svc: Deps, request: Request) -> Response:
    _, workspace_id = await _caller(svc, request)
    query = decode(request, WorkspaceProvisionerTokenQuery, svc.settings)
    return await token_page(svc, workspace_id, query)


@operation(
    _revoke(
        "Revoke a provisioner token of this workspace; the first revocation cascades",
        provisioner_wire.ProvisionerTokenOut,
    )
)
async def revoke_provisioner_token(svc: Deps, request: Request) -> Response:
    """As the admin revoke (store/provisioners.py cascades the first one), for this workspace's
    tokens only."""
    actor, workspace_id = await _caller(svc, request)

    async def revoked(
        conn: Conn, token_id: UUID, reason: str | None
    ) -> provisioner_wire.ProvisionerTokenOut:
        # A token's workspace never changes, so checking it before the revoke's locks is safe.
        found = await provisioners.by_id(conn, token_id)
        if found is None or found.workspace_id != workspace_id:
            raise NotFound("no such provisioner token", id=str(token_id))
        return token_out(await provisioners.revoke(conn, token_id, reason=reason))

    return await revoke_once(request, svc, actor, "provisioner_token.revoke", revoked)


# Runners -----------------------------------------------------------------------------------------


@operation(
    _op("This workspace's runners seen recently, with their leases and effective tool "
        "capabilities", wire.ActiveRunners,
        query=WorkspaceRunnersQuery)
)  # fmt: skip
async def active_runners(svc: Deps, request: Request) -> Response:
    _, workspace_id = await _caller(svc, request)
    window = decode(request, WorkspaceRunnersQuery, svc.settings).window_seconds
    async with svc.pool.acquire() as conn:
        found = await queries.active_runners(conn, workspace_id, timedelta(seconds=window))
        reports = await capabilities.session_reports(conn, [r.runner_session_id for r in found])
    return runners_out(found, reports, svc.settings)


def routes(svc: Deps | None) -> list[BaseRoute]:
    base = "/v1/workspaces/{workspace_id}"
    tokens = (
        ("registration-tokens", create_registration_token, list_registration_tokens,
         revoke_registration_token),
        ("provisioner-tokens", create_provisioner_token, list_provisioner_tokens,
         revoke_provisioner_token),
    )  # fmt: skip
    found: list[BaseRoute] = []
    for family, creates, lists, revokes in tokens:
        found += [
            Route(f"{base}/{family}", bound(creates, svc), methods=["POST"]),
            Route(f"{base}/{family}", bound(lists, svc), methods=["GET"]),
            Route(f"{base}/{family}/{{id}}/revoke", bound(revokes, svc), methods=["POST"]),
        ]
    return [*found, Route(f"{base}/runners", bound(active_runners, svc), methods=["GET"])]
