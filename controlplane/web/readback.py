"""What the orchestrator reads back about work in flight (orchestrator API key): whether an
execution is leased to a given runner session, with that session's effective tool capabilities
(spec jobs 3.9 and 5.6), and the job counts of workspaces by state and required label set
(3.10). Effective capabilities are also what the admin runner view shows (web/fleet.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import asyncpg
import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from controlplane.domain.capabilities import ABSENT, effective_capabilities
from controlplane.errors import InvalidInput
from controlplane.settings import Settings
from controlplane.store import capabilities, queries
from controlplane.web import auth
from controlplane.web.edge import json_response, path_uuid, read_json
from controlplane.web.endpoints import bound
from controlplane.web.operations import KNOBS, OAK, Op, operation
from controlplane.web.queries import decode
from controlplane.wire import admin as admin_wire
from controlplane.wire import orchestrator as wire
from controlplane.wire.common import Capabilities, EffectiveCapabilities
from controlplane.wire.queries import LeaseQuery

_STALE = KNOBS.runners.tool_capabilities_stale_after_seconds


@dataclass(frozen=True, slots=True)
class Deps:
    settings: Settings
    pool: asyncpg.Pool
    auth: auth.Authenticator


def effective_out(report: capabilities.Report, settings: Settings) -> EffectiveCapabilities:
    """A stored report as it counts now. A stored report this version cannot read (written by
    an earlier schema) counts as absent, like a stale one."""
    window = timedelta(seconds=settings.runners.tool_capabilities_stale_after_seconds)
    found = effective_capabilities(
        report.capabilities, report.reported_at, now=report.now, stale_after=window
    )
    try:
        decoded = msgspec.convert(found.capabilities, Capabilities)
    except msgspec.ValidationError:
        return EffectiveCapabilities(
            capabilities=msgspec.convert(ABSENT, Capabilities),
            report_fresh=False,
            reported_at=found.reported_at,
        )
    return EffectiveCapabilities(
        capabilities=decoded, report_fresh=found.fresh, reported_at=found.reported_at
    )


@operation(
    Op(
        "Whether an execution is leased to a runner session, with its capabilities",
        OAK,
        None,
        wire.LeaseState,
        query=LeaseQuery,
        notes="`active` is true exactly while the execution is running on that session (and "
        "is that job, when `job_id` is given), a cancel requested or not. While active, "
        "`capabilities` are the session's effective tool capabilities: a report older than "
        f"runners.tool_capabilities_stale_after_seconds (default {_STALE}) counts as none. A "
        "workspace-scoped key sees only its workspace's leases.",
    )
)
async def lease_state(svc: Deps, request: Request) -> Response:
    key = await svc.auth.orchestrator(request)
    execution = path_uuid(request, "job_execution_id")
    query = decode(request, LeaseQuery, svc.settings)
    async with svc.pool.acquire() as conn:
        found = await capabilities.lease_state(
            conn, execution, query.runner_session_id, query.job_id
        )
    visible = key.workspace_id is None or found.workspace_id == key.workspace_id
    if not found.active or found.report is None or not visible:
        return json_response(wire.LeaseState(active=False, capabilities=None))
    return json_response(
        wire.LeaseState(active=True, capabilities=effective_out(found.report, svc.settings))
    )


@operation(
    Op(
        "Job counts of workspaces, by state and required label set",
        OAK,
        wire.JobCountsRequest,
        wire.JobCountsResponse,
        "forbidden",
        notes="A read, posted for its list of 1 to 100 distinct workspace ids. One entry per "
        "id, in the order given, zeros for a workspace without jobs, with its counts per "
        "required label set (most queued first); `running` counts every lease, a cancel "
        "requested or not. A workspace-scoped key may ask for its workspace only (403 "
        "otherwise).",
    )
)
async def job_counts(svc: Deps, request: Request) -> Response:
    key = await svc.auth.orchestrator(request)
    body = await read_json(request, wire.JobCountsRequest, svc.settings.server.max_body_bytes)
    if len(set(body.workspace_ids)) != len(body.workspace_ids):
        raise InvalidInput("workspace_ids must be distinct", field="workspace_ids")
    for workspace_id in body.workspace_ids:
        auth.require_workspace(key, workspace_id)
    async with svc.pool.acquire() as conn:
        counts = await queries.workspace_counts(conn, body.workspace_ids)
    return json_response(wire.JobCountsResponse(counts=[queue_out(c) for c in counts]))


def queue_out(counts: queries.WorkspaceCounts) -> admin_wire.WorkspaceQueue:
    """A workspace's job counts as the orchestrator and admin APIs both answer them."""
    return admin_wire.WorkspaceQueue(
        workspace_id=counts.workspace_id,
        queued=counts.queued,
        running=counts.running,
        labels=[
            admin_wire.LabelQueue(
                labels=list(group.labels),
                queued=group.queued,
                running=group.running,
                oldest_queued_at=group.oldest_queued_at,
            )
            for group in counts.labels
        ],
    )


def routes(svc: Deps | None) -> list[BaseRoute]:
    return [
        Route("/v1/jobs/{job_execution_id}/lease", bound(lease_state, svc), methods=["GET"]),
        Route("/v1/job-counts", bound(job_counts, svc), methods=["POST"]),
    ]
