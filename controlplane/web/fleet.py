"""Admin views of runners and the provisioned fleet (admin API key): runners seen recently, runner
instances, live reservations. Admin keys are installation-wide, so the fleet views list every
provisioner's instances, of either scope."""

from __future__ import annotations

from datetime import datetime, timedelta

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from controlplane.domain import fleet as views
from controlplane.domain.labels import MAX_LABEL_LENGTH, label_error
from controlplane.domain.runner_instances import RunnerState
from controlplane.errors import InvalidInput
from controlplane.store import fleet, queries
from controlplane.web import auth
from controlplane.web.edge import (
    json_response,
    query_integer,
    query_only,
    query_uuid,
    query_value,
)
from controlplane.web.operations import (
    ADM,
    KNOBS,
    PAGE,
    UUID_SCHEMA,
    WORKSPACE_FILTER,
    Op,
    Param,
    operation,
)
from controlplane.web.paging import PAGE_QUERY, cut, page_of
from controlplane.wire import admin as wire
from controlplane.wire.common import LABEL_PATTERN

_P = KNOBS.provisioners


ACTIVE_WINDOW_SECONDS = 60  # as the reference's RUNNER_ACTIVE_WINDOW_SECONDS


@operation(
    Op(
        "Runners seen recently, with their leases",
        ADM,
        None,
        wire.ActiveRunners,
        query=(
            WORKSPACE_FILTER,
            Param(
                "window_seconds",
                {"type": "integer", "minimum": 1, "maximum": 86400, "default": 60},
                "Seen within this many seconds.",
            ),
        ),
    )
)
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


def _choice(request: Request, name: str, allowed: tuple[str, ...]) -> str | None:
    raw = query_value(request, name)
    if raw is not None and raw not in allowed:
        raise InvalidInput(f"query {name} must be one of {', '.join(allowed)}", field=name)
    return raw


def _instance(
    row: fleet.InstanceRow, now: datetime, threshold: timedelta
) -> wire.RunnerInstanceOut:
    return wire.RunnerInstanceOut(
        id=row.id,
        provisioner=wire.InstanceProvisioner(
            id=row.provisioner_id,
            scope=row.provisioner_scope,  # type: ignore[arg-type]
            name=row.provisioner_name,
        ),
        workspace_id=row.workspace_id,
        provider_runner_id=row.provider_runner_id,
        provider_kind=row.provider_kind,
        launch_kind=row.launch_kind,  # type: ignore[arg-type]
        template_key=row.template_key,
        labels=list(row.labels),
        state=row.state.value,
        lifecycle_state=views.lifecycle_state(row.facts),
        enrollment_state=views.enrollment_state(row.facts),
        reconciliation_status=views.reconciliation_status(row.facts, now=now, threshold=threshold),
        reason=row.reason,
        created_at=row.created_at,
        updated_at=row.updated_at,
        reported_at=row.reported_at,
        assigned_at=row.assigned_at,
        first_claimed_at=row.first_claimed_at,
        closed_at=row.closed_at,
    )


_STATES = tuple(state.value for state in RunnerState)
_INSTANCE_QUERY = ("state", "assignment", "label", "provisioner_id", "workspace_id", *PAGE_QUERY)


@operation(
    Op(
        "List runner instances of every provisioner, newest first, a page at a time",
        ADM,
        None,
        wire.RunnerInstanceList,
        "invalid-cursor",
        query=(
            Param(
                "state",
                {"type": "string", "enum": list(_STATES)},
                "Only instances in this state.",
            ),
            Param(
                "assignment",
                {"type": "string", "enum": ["assigned", "unassigned"]},
                "assigned: instances with a workspace; unassigned: without one.",
            ),
            Param(
                "label",
                {
                    "type": "string",
                    "minLength": 1,
                    "maxLength": MAX_LABEL_LENGTH,
                    "pattern": LABEL_PATTERN,
                },
                "Only instances with this label (matched canonicalised).",
            ),
            Param("provisioner_id", UUID_SCHEMA, "Only this provisioner's instances."),
            WORKSPACE_FILTER,
            *PAGE,
        ),
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
async def runner_instances(request: Request) -> Response:
    """Every provisioner's runner instances, newest first, one page at a time."""
    svc = await auth.admin(request)
    query_only(request, *_INSTANCE_QUERY)
    state = _choice(request, "state", _STATES)
    assignment = _choice(request, "assignment", ("assigned", "unassigned"))
    label = query_value(request, "label")
    if label is not None:
        if (problem := label_error(label)) is not None:
            raise InvalidInput(f"query label: {problem}", field="label")
        label = label.lower()
    page = page_of(request)
    where = fleet.InstanceFilter(
        state=None if state is None else RunnerState(state),
        assigned=None if assignment is None else assignment == "assigned",
        label=label,
        provisioner_id=query_uuid(request, "provisioner_id"),
        workspace_id=query_uuid(request, "workspace_id"),
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
        query=(Param("workspace_id", UUID_SCHEMA, "The workspace.", required=True),),
        notes="Instances in starting, running or stopping "
        "whose row the server updated within provisioners.runner_active_window_seconds (default "
        f"{_P.runner_active_window_seconds}); server time, never a reported one.",
    )
)
async def active_runner_instances(request: Request) -> Response:
    """A workspace's active-state instances the server updated recently (spec P-87)."""
    svc = await auth.admin(request)
    query_only(request, "workspace_id")
    workspace = query_uuid(request, "workspace_id")
    if workspace is None:
        raise InvalidInput("query workspace_id is required", field="workspace_id")
    knobs = svc.settings.provisioners
    window = timedelta(seconds=knobs.runner_active_window_seconds)
    async with svc.pool.acquire() as conn:
        rows, now = await fleet.active_instances(conn, workspace, window)
    threshold = timedelta(seconds=knobs.stale_runner_threshold_seconds)
    return json_response(
        wire.ActiveRunnerInstances(items=[_instance(row, now, threshold) for row in rows])
    )


@operation(Op("Runner instances per state", ADM, None, wire.RunnerInstanceCounts))
async def runner_instance_counts(request: Request) -> Response:
    svc = await auth.admin(request)
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
        query=(Param("workspace_id", UUID_SCHEMA, "Only this workspace's reservations."),),
    )
)
async def reservations(request: Request) -> Response:
    """Unexpired reservations per workspace, label set and kind."""
    svc = await auth.admin(request)
    query_only(request, "workspace_id")
    workspace = query_uuid(request, "workspace_id")
    async with svc.pool.acquire() as conn:
        found = await fleet.live_reservations(conn, workspace)
    return json_response(
        wire.ReservationList(
            items=[
                wire.ReservationGroup(
                    workspace_id=group.workspace_id,
                    labels=list(group.labels),
                    kind=group.kind,  # type: ignore[arg-type]
                    reservations=group.reservations,
                    units=group.units,
                    next_expiry=group.next_expiry,
                )
                for group in found
            ]
        )
    )


routes = [
    Route("/v1/admin/runners", active_runners, methods=["GET"]),
    Route("/v1/admin/runner-instances", runner_instances, methods=["GET"]),
    Route("/v1/admin/runner-instances/active", active_runner_instances, methods=["GET"]),
    Route("/v1/admin/runner-instances/counts", runner_instance_counts, methods=["GET"]),
    Route("/v1/admin/reservations", reservations, methods=["GET"]),
]
