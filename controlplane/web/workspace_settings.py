"""Admin routes for one workspace's settings: its queue's ordering (fifo or fair share)."""

from __future__ import annotations

from dataclasses import dataclass

import asyncpg
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from controlplane.settings import Settings
from controlplane.store import ordering
from controlplane.web import auth
from controlplane.web.edge import json_response, path_uuid, read_json
from controlplane.web.endpoints import bound
from controlplane.web.operations import ADM, Op, operation
from controlplane.wire import admin as wire


@dataclass(frozen=True, slots=True)
class Deps:
    settings: Settings
    pool: asyncpg.Pool
    auth: auth.Authenticator


@operation(
    Op(
        "Set a workspace's settings (idempotent)",
        ADM,
        wire.WorkspaceSettingsIn,
        wire.WorkspaceSettingsOut,
        notes="`ordering`: `fifo` (the default: priority, then age) or `fair` (the project "
        "with the fewest running executions first, then priority, then age). A change writes "
        "one `workspace.settings_changed` event to the feed, naming the admin key; setting "
        "what is already set writes none. Claims on every replica use it from their next "
        "statement.",
    )
)
async def put_settings(svc: Deps, request: Request) -> Response:
    actor = await svc.auth.admin(request)
    workspace_id = path_uuid(request, "workspace_id")
    body = await read_json(request, wire.WorkspaceSettingsIn, svc.settings.server.max_body_bytes)
    async with svc.pool.acquire() as conn:
        changed = await ordering.set_workspace_ordering(
            conn, workspace_id, ordering.Ordering(body.ordering), actor_id=actor.id
        )
    out = wire.WorkspaceSettingsOut(
        workspace_id=workspace_id, ordering=body.ordering, changed=changed
    )
    return json_response(out)


def routes(svc: Deps | None) -> list[BaseRoute]:
    return [
        Route(
            "/v1/admin/workspaces/{workspace_id}/settings",
            bound(put_settings, svc),
            methods=["PUT"],
        ),
    ]
