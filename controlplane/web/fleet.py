"""Admin views of runners and the provisioned fleet (admin API key): runners seen recently, runner
instances, live reservations. Admin keys are installation-wide, so the fleet views list every
provisioner's instances, of either scope."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from uuid import UUID

import asyncpg
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from controlplane.domain import fleet as views
from controlplane.domain.fields import by_name
from controlplane.domain.labels import label_error
from controlplane.domain.runner_instances import RunnerState
from controlplane.errors import InvalidInput
from controlplane.settings import Settings
from controlplane.store import capabilities, fleet, queries
from controlplane.web import auth
from controlplane.web.edge import (
    json_response,
    query_only,
)
from controlplane.web.endpoints import bound
from controlplane.web.operations import (
    ADM,
    KNOBS,
    Op,
    operation,
)
from controlplane.web.paging import cut, page_of
from controlplane.web.queries import decode
from controlplane.web.readback import effective_out
from controlplane.wire import admin as wire
from controlplane.wire.queries import (
    ActiveInstancesQuery,
    ActiveRunnersQuery,
    ReservationsQuery,
    RunnerInstancesQuery,
)

_P = KNOBS.provisioners


@dataclass(frozen=True, slots=True)
class Deps:
    settings: Settings  # query maxima, and the stale threshold of the instance views
    pool: asyncpg.Pool
    auth: auth.Authenticator


@operation(
    Op(
        "Runners seen recently, with their leases and effective tool capabilities",
        ADM,
        None,
        wire.ActiveRunners,
        query=ActiveRunnersQuery,
        notes="`capabilities` counts a report older than "
        "runners.tool_capabilities_stale_after_seconds (default "
        f"{KNOBS.runners.tool_capabilities_stale_after_seconds}) as none.",
    )
)
async def active_runners(svc: Deps, request: Request) -> Response:
    await svc.auth.admin(request)
    query = decode(request, ActiveRunnersQuery, svc.settings)
    workspace, window = query.workspace_id, query.window_seconds
    async with svc.pool.acquire() as conn:
        found = await queries.active_runners(conn, workspace, timedelta(seconds=window))
        reports = await capabilities.session_reports(conn, [r.runner_session_id for r in found])
    return runners_out(found, reports, svc.settings)


def runners_out(
    found: list[queries.ActiveRunner], reports: dict[UUID, capabilities.Report], settings: Settings
) -> Response:
    """The active runners' answer (the admin view's and a workspace's own), each with its
    effective tool capabilities (`reports`, by session)."""
    absent = capabilities.Report(None, None, datetime.now(UTC))  # a session deleted meanwhile
    return json_response(
        wire.ActiveRunners(
            items=[
                by_name(
                    wire.ActiveRunnerOut,
                    runner,
                    mode=runner.kind,
                    capabilities=effective_out(
                        reports.get(runner.runner_session_id, absent), settings
                    ),
                )
                for runner in found
            ]
        )
    )


def _instance(
    row: fleet.InstanceRow, now: datetime, threshold: timedelta
) -> wire.RunnerInstanceOut:
    return by_name(
        wire.RunnerInstanceOut,
        row,
        provisioner=wire.InstanceProvisioner(
            id=row.provisioner_id,
            scope=row.provisioner_scope,  # type: ignore[arg-type]
            name=row.provisioner_name,
        ),
        lifecycle_state=views.lifecycle_state(row.facts),
        enrollment_state=views.enrollment_state(row.facts),
        reconciliation_status=views.reconciliation_status(row.facts, now=now, threshold=threshold),
    )


@operation(
    Op(
        "List runner instances of every provisioner, newest first, a page at a time",
        ADM,
        None,
        wire.RunnerInstanceList,
        "invalid-cursor",
        query=RunnerInstancesQuery,
        notes="Installation-wide: instances of workspace and "
        "installation provisioners alike. Unknown query parameters are 400. Derived per row: "
        "`lifecycle_state` (unassigned, assigned, activated, claimed; an assigned instance in a "
        "terminal state is completed), `enrollment_state` (activated: has a runner session; "
        "enrolled: an open control session; else pending) and `reconciliation_status` (terminal; "
        "unknown: its provisioner was never seen; stale: its last report or its provisioner's "
        "last-seen is older than provisioners.stale_runner_threshold_seconds (default "
        f"{_P.stale_runner_threshold_seconds}); else current).",
    )
)
async def runner_instances(svc: Deps, request: Request) -> Response:
    """Every provisioner's runner instances, newest first, one page at a time."""
    await svc.auth.admin(request)
    query = decode(request, RunnerInstancesQuery, svc.settings)
    label = query.label
    if label is not None:
        if (problem := label_error(label)) is not None:
            raise InvalidInput(f"query label: {problem}", field="label")
        label = label.lower()
    page = page_of(query.limit, query.cursor)
    where = fleet.InstanceFilter(
        state=query.state,
        assigned=None if query.assignment is None else query.assignment == "assigned",
        label=label,
        provisioner_id=query.provisioner_id,
        workspace_id=query.workspace_id,
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


@operation(
    Op(
        "A workspace's active runner instances, updated recently",
        ADM,
        None,
        wire.ActiveRunnerInstances,
        query=ActiveInstancesQuery,
        notes="Instances in starting, running or stopping "
        "whose row the server updated within provisioners.runner_active_window_seconds (default "
        f"{_P.runner_active_window_seconds}); server time, never a reported one.",
    )
)
async def active_runner_instances(svc: Deps, request: Request) -> Response:
    """A workspace's active-state instances the server updated recently (spec P-87)."""
    await svc.auth.admin(request)
    workspace = decode(request, ActiveInstancesQuery, svc.settings).workspace_id
    knobs = svc.settings.provisioners
    window = timedelta(seconds=knobs.runner_active_window_seconds)
    async with svc.pool.acquire() as conn:
        rows, now = await fleet.active_instances(conn, workspace, window)
    threshold = timedelta(seconds=knobs.stale_runner_threshold_seconds)
    return json_response(
        wire.ActiveRunnerInstances(items=[_instance(row, now, threshold) for row in rows])
    )


_STATES = tuple(state.value for state in RunnerState)


@operation(Op("Runner instances per state", ADM, None, wire.RunnerInstanceCounts))
async def runner_instance_counts(svc: Deps, request: Request) -> Response:
    await svc.auth.admin(request)
    query_only(request)
    async with svc.pool.acquire() as conn:
        counts = await fleet.counts_by_state(conn)
    return json_response(
        wire.RunnerInstanceCounts(
            states=[wire.StateCount(state=s, count=counts[s]) for s in _STATES if s in counts]
        )
    )


@operation(
    Op(
        "Live reservations per workspace, labels and kind",
        ADM,
        None,
        wire.ReservationList,
        query=ReservationsQuery,
    )
)
async def reservations(svc: Deps, request: Request) -> Response:
    """Unexpired reservations per workspace, label set and kind."""
    await svc.auth.admin(request)
    workspace = decode(request, ReservationsQuery, svc.settings).workspace_id
    async with svc.pool.acquire() as conn:
        found = await fleet.live_reservations(conn, workspace)
    return json_response(
        wire.ReservationList(items=[by_name(wire.ReservationGroup, group) for group in found])
    )


def routes(svc: Deps | None) -> list[BaseRoute]:
    return [
        Route("/v1/admin/runners", bound(active_runners, svc), methods=["GET"]),
        Route("/v1/admin/runner-instances", bound(runner_instances, svc), methods=["GET"]),
        Route(
            "/v1/admin/runner-instances/active",
            bound(active_runner_instances, svc),
            methods=["GET"],
        ),
        Route(
            "/v1/admin/runner-instances/counts", bound(runner_instance_counts, svc), methods=["GET"]
        ),
        Route("/v1/admin/reservations", bound(reservations, svc), methods=["GET"]),
    ]
