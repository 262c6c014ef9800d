"""The pages that read: overview, jobs, one job, runners, provisioners, credentials. Each reads
through the store's read models (the admin API's; the overview its own one statement,
store/overview.py, which answers what the admin API's reads would), and renders; none writes."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from uuid import UUID

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from controlplane.domain.credential_rules import Family
from controlplane.domain.labels import label_error
from controlplane.domain.waiting import Waiting, why_waiting
from controlplane.store import (
    credentials,
    fleet,
    job_views,
    pauses,
    provisioners,
    queries,
    ui_reads,
)
from controlplane.store.overview import overview as overview_read
from controlplane.web.jobs import TAKER_WINDOW
from controlplane.web.ui.render import masked, page
from controlplane.web.ui.sessions import Deps, signed_in

# Runners seen within this long are listed; those seen within TAKER_WINDOW count as live.
RUNNERS_SHOWN = timedelta(hours=1)
TIMELINE_LIMIT = 200


@dataclass(frozen=True, slots=True)
class QueueRow:
    workspace_id: UUID
    labels: tuple[str, ...]
    pending: int
    oldest: datetime | None
    running: int
    live_runners: int
    busy_runners: int
    templates: int
    waiting: Waiting | None  # None when nothing of this label set waits
    paused: bool = False  # its workspace is paused: nothing is handed out


async def overview(svc: Deps, request: Request) -> Response:
    who = await signed_in(svc, request)
    async with svc.pool.acquire() as conn:
        read = await overview_read(conn, TAKER_WINDOW, svc.settings.pages.list_limit)
    counts, paused = read.workspaces, read.paused
    drawn = svc.history.drawn()
    by_group = {(g.workspace_id, g.required_labels): g for g in read.groups}
    rows = []
    for space in counts:
        for labels in space.labels:
            group = by_group.get((space.workspace_id, labels.labels))
            rows.append(
                QueueRow(
                    workspace_id=space.workspace_id,
                    labels=labels.labels,
                    pending=labels.queued,
                    oldest=labels.oldest_queued_at,
                    running=labels.running,
                    live_runners=0 if group is None else group.takers.live_runners,
                    busy_runners=0 if group is None else group.takers.busy_runners,
                    templates=0 if group is None else group.takers.templates,
                    waiting=None
                    if group is None
                    else why_waiting(group.required_labels, group.takers),
                    paused=space.workspace_id in paused,
                )
            )
    rows.sort(key=lambda row: (not (row.waiting and row.waiting.stuck), -row.pending))
    return page(
        request,
        "overview.html",
        who,
        {
            "rows": rows,
            "workspaces": [(space.workspace_id, space.workspace_id in paused) for space in counts],
            "depth": read.depth,
            "runners": read.live_runners,
            "plots": drawn.charts,
            "plots_drawn_at": drawn.at,
            "sample_seconds": svc.settings.pages.plot_sample_seconds,
            "live": True,
        },
    )


def _uuid(raw: str | None, field: str) -> UUID | None:
    if not raw:
        return None
    try:
        return UUID(raw)
    except ValueError as error:
        raise HTTPException(400, f"{field} must be a UUID") from error


def _label_filter(raw: str | None) -> list[str] | None:
    if not raw:
        return None
    labels = [label.strip().lower() for label in raw.split(",") if label.strip()]
    for label in labels:
        if problem := label_error(label):
            raise HTTPException(400, f"labels: {problem}")
    return labels or None


async def jobs(svc: Deps, request: Request) -> Response:
    who = await signed_in(svc, request)
    params = request.query_params
    text = params.get("text", "").strip()
    if text:  # an id pasted in the search box goes straight to its job
        found = _uuid(text, "text")
        return RedirectResponse(f"/ui/jobs/{found}", status_code=303)
    status = params.get("status") or None
    if status is not None and status not in job_views.STATUSES:
        raise HTTPException(400, f"status must be one of {', '.join(job_views.STATUSES)}")
    workspace = _uuid(params.get("workspace"), "workspace")
    labels = _label_filter(params.get("labels"))
    async with svc.pool.acquire() as conn:
        rows = await job_views.list_jobs(
            conn,
            workspace_id=workspace,
            status=status,
            labels=labels,
            before=None,
            limit=svc.settings.pages.list_limit,
        )
    return page(
        request,
        "jobs.html",
        who,
        {
            "rows": rows,
            "statuses": job_views.STATUSES,
            "filters": {
                "workspace": "" if workspace is None else str(workspace),
                "status": status or "",
                "labels": ",".join(labels or []),
            },
            "live": True,
        },
    )


async def job(svc: Deps, request: Request) -> Response:
    who = await signed_in(svc, request)
    execution = _uuid(request.path_params["job_execution_id"], "job execution id")
    assert execution is not None
    async with svc.pool.acquire() as conn:
        view = await job_views.one_job(conn, execution)
        if view is None:
            raise HTTPException(404, "no such job execution")
        waiting = takers = None
        if view.status == "pending" and view.workspace_id and view.required_labels:
            takers = await job_views.takers(
                conn, view.workspace_id, view.required_labels, TAKER_WINDOW
            )
            waiting = why_waiting(view.required_labels, takers)
        moments = (
            []
            if view.workspace_id is None
            else await ui_reads.timeline(conn, view.workspace_id, execution, TIMELINE_LIMIT)
        )
        payload = await ui_reads.payload(conn, execution)
    return page(
        request,
        "job.html",
        who,
        {
            "job": view,
            "waiting": waiting,
            "takers": takers,
            "moments": moments,
            "payload": None if payload is None else masked(payload),
            "live": True,
        },
    )


async def runners(svc: Deps, request: Request) -> Response:
    who = await signed_in(svc, request)
    async with svc.pool.acquire() as conn:
        rows = await queries.active_runners(
            conn, None, RUNNERS_SHOWN, svc.settings.pages.list_limit
        )
        _, paused = await pauses.paused_among(conn, [], [r.runner_session_id for r in rows])
        now = await conn.fetchval("SELECT now()")
    return page(
        request,
        "runners.html",
        who,
        {
            "rows": rows,
            "paused": paused,
            "live_after": now - TAKER_WINDOW,
            "now": now,
            "live": True,
        },
    )


async def provisioner_page(svc: Deps, request: Request) -> Response:
    who = await signed_in(svc, request)
    async with svc.pool.acquire() as conn:
        rows = await provisioners.list_all(conn, limit=svc.settings.pages.list_limit)
        states = await fleet.counts_by_state(conn)
        reservations = await fleet.live_reservations(conn, None)
    return page(
        request,
        "provisioners.html",
        who,
        {"rows": rows, "states": states, "reservations": reservations, "live": True},
    )


async def credential_page(svc: Deps, request: Request) -> Response:
    who = await signed_in(svc, request)
    async with svc.pool.acquire() as conn:
        listed = {family: await credentials.listed(conn, family) for family in Family}
    limit = svc.settings.pages.list_limit
    return page(
        request,
        "credentials.html",
        who,
        {
            "families": list(Family),
            "listed": {family: rows[:limit] for family, rows in listed.items()},
            "created": None,
        },
    )
