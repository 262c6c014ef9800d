"""Installation-scope eligibility (admin key): which workspaces an installation provisioner may
serve, read and set per provisioner token (domain/eligibility.py). A change applies from the
provisioner's next allocation round, without reconnecting it (store/eligibility.py): the
provisioner actors on this replica are woken at once, those on other replicas run theirs within
`provisioners.demand_safety_tick_seconds`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

import asyncpg
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from controlplane.domain.eligibility import Eligibility, Mode, eligibility_problem
from controlplane.errors import InvalidInput, NotFound
from controlplane.settings import Settings
from controlplane.store import eligibility, provisioners
from controlplane.web import auth
from controlplane.web.edge import json_response, path_uuid, read_json
from controlplane.web.endpoints import bound
from controlplane.web.operations import ADM, KNOBS, Op, operation
from controlplane.wire import provisioners as wire

log = logging.getLogger("controlplane.admin")


@dataclass(frozen=True, slots=True)
class Deps:
    settings: Settings  # the longest list
    pool: asyncpg.Pool
    auth: auth.Authenticator
    wake: Callable[[], None]  # this replica's provisioner actors: a round at once


_NOTES = (
    "`all` (the default): every workspace; `allow`: only `workspace_ids`; `deny`: every workspace "
    "but `workspace_ids` (at most provisioners.eligibility_max_workspaces, default "
    f"{KNOBS.provisioners.eligibility_max_workspaces}, none twice). The provisioner's allocation "
    "walk visits only the workspaces it admits, so it gets no grant for another and none of its "
    "idle runners is bound to another; a change applies from its next round (at the latest one "
    "and a half provisioners.demand_safety_tick_seconds later) without reconnecting. Grants "
    "already made stay until used or expired. A workspace-scope token is 409 `conflict`."
)


def _out(provisioner_id: UUID, rule: Eligibility, updated_at: datetime | None) -> Response:
    return json_response(
        wire.EligibilityOut(
            provisioner_id=provisioner_id,
            mode=rule.mode.value,
            workspace_ids=sorted(rule.workspaces),
            updated_at=updated_at,
        )
    )


@operation(
    Op("Which workspaces an installation provisioner may serve", ADM, None, wire.EligibilityOut,
       "not-found", notes=_NOTES)
)  # fmt: skip
async def show(svc: Deps, request: Request) -> Response:
    await svc.auth.admin(request)
    provisioner_id = path_uuid(request, "id")
    async with svc.pool.acquire() as conn:
        if await provisioners.by_id(conn, provisioner_id) is None:
            raise NotFound("no such provisioner token", id=str(provisioner_id))
        rule, updated_at = await eligibility.read(conn, provisioner_id)
    return _out(provisioner_id, rule, updated_at)


@operation(
    Op("Set which workspaces an installation provisioner may serve", ADM, wire.SetEligibility,
       wire.EligibilityOut, "not-found conflict", notes=_NOTES)
)  # fmt: skip
async def replace(svc: Deps, request: Request) -> Response:
    actor = await svc.auth.admin(request)
    provisioner_id = path_uuid(request, "id")
    body = await read_json(request, wire.SetEligibility, svc.settings.server.max_body_bytes)
    limit = svc.settings.provisioners.eligibility_max_workspaces
    if problem := eligibility_problem(Mode(body.mode), body.workspace_ids, limit=limit):
        raise InvalidInput(problem, field="workspace_ids")
    wanted = Eligibility(Mode(body.mode), frozenset(body.workspace_ids))
    async with svc.pool.acquire() as conn:
        rule, updated_at = await eligibility.replace(conn, provisioner_id, wanted)
    svc.wake()
    log.info(
        "admin.eligibility_set",
        extra={
            "provisioner_id": str(provisioner_id),
            "actor_id": str(actor.id),
            "mode": rule.mode.value,
            "workspaces": len(rule.workspaces),
        },
    )
    return _out(provisioner_id, rule, updated_at)


def routes(svc: Deps | None) -> list[BaseRoute]:
    path = "/v1/admin/provisioner-tokens/{id}/eligibility"
    return [
        Route(path, bound(show, svc), methods=["GET"]),
        Route(path, bound(replace, svc), methods=["PUT"]),
    ]
