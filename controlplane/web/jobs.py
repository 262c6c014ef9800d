"""Operators' job routes (admin key): list executions, show one with why it waits, cancel one,
and the pending label sets with who could take them (`controlplane jobs`, `status`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from uuid import UUID

import asyncpg
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from controlplane.actors.feed import FeedWatch
from controlplane.domain.fields import by_name
from controlplane.domain.jobs import Outcome
from controlplane.domain.labels import label_error
from controlplane.domain.waiting import QueuePlace, Takers, Waiting, waiting_reasons, why_waiting
from controlplane.errors import InvalidInput, NotFound
from controlplane.settings import Settings
from controlplane.store import job_views, leases
from controlplane.store.pool import Conn
from controlplane.web import auth
from controlplane.web.edge import json_response, path_uuid, query_only
from controlplane.web.endpoints import bound
from controlplane.web.operations import ADM, Op, operation
from controlplane.web.paging import cut, page_of
from controlplane.web.queries import decode
from controlplane.wire import jobs as wire
from controlplane.wire.queries import JobPageQuery

# A runner or provisioner session seen this recently counts as able to take work, as in the
# admin runner view (`window_seconds` of wire/queries.py's ActiveRunnersQuery).
TAKER_WINDOW = timedelta(seconds=60)
MAX_LABELS = 20


@dataclass(frozen=True, slots=True)
class Deps:
    settings: Settings  # the query limits
    pool: asyncpg.Pool
    auth: auth.Authenticator
    feed: FeedWatch  # told when an operator's cancel adds to the event feed


def _job(view: job_views.JobView) -> wire.JobOut:
    return by_name(wire.JobOut, view)


def waiting_out(
    waiting: Waiting, takers: Takers, place: QueuePlace | None = None
) -> wire.WaitingOut:
    return by_name(
        wire.WaitingOut,
        waiting,
        takers,
        position=None if place is None else place.position,
        reasons=[
            by_name(wire.WaitingReasonOut, reason)
            for reason in waiting_reasons(waiting, takers, place)
        ],
    )


async def why_pending(
    conn: Conn, workspace_id: UUID, labels: Sequence[str], job_execution_id: UUID
) -> wire.WaitingOut | None:
    """Why a pending execution waits: who could take it, where it stands, and every reason
    holding it back (domain/waiting.py); None when it is no longer pending. Two reads."""
    place = await job_views.queue_place(conn, job_execution_id)
    if place is None:
        return None
    takers = await job_views.takers(conn, workspace_id, labels, TAKER_WINDOW)
    return waiting_out(why_waiting(labels, takers), takers, place)


def _labels(raw: str | None) -> list[str] | None:
    if raw is None:
        return None
    labels = [label.strip().lower() for label in raw.split(",")]
    if not raw or len(labels) > MAX_LABELS:
        raise InvalidInput(f"query labels must name 1 to {MAX_LABELS} labels", field="labels")
    for label in labels:
        if problem := label_error(label):
            raise InvalidInput(f"query labels: {problem}", field="labels")
    return labels


@operation(
    Op(
        "List executions, newest change (enqueued, started, ended) first, a page at a time",
        ADM,
        None,
        wire.JobList,
        "invalid-cursor",
        query=JobPageQuery,
    )
)
async def list_jobs(svc: Deps, request: Request) -> Response:
    await svc.auth.admin(request)
    query = decode(request, JobPageQuery, svc.settings)
    page = page_of(query.limit, query.cursor)
    labels = _labels(query.labels)
    async with svc.pool.acquire() as conn:
        rows = await job_views.list_jobs(
            conn,
            workspace_id=query.workspace_id,
            status=query.status,
            labels=labels,
            before=page.before,
            limit=page.fetch,
        )
    shown, next_cursor = cut(rows, page, lambda row: (row.changed_at, row.job_execution_id))
    return json_response(wire.JobList(items=[_job(row) for row in shown], next_cursor=next_cursor))


@operation(
    Op(
        "One execution: its timestamps, outcome, exit code, output tail, and why it waits",
        ADM,
        None,
        wire.JobDetail,
        "not-found",
    )
)
async def show_job(svc: Deps, request: Request) -> Response:
    await svc.auth.admin(request)
    query_only(request)
    execution = path_uuid(request, "job_execution_id")
    async with svc.pool.acquire() as conn:
        view = await job_views.one_job(conn, execution)
        if view is None:
            raise NotFound("no such job execution", job_execution_id=str(execution))
        waiting = None
        if view.status == "pending":
            assert view.workspace_id is not None
            assert view.required_labels is not None
            waiting = await why_pending(
                conn, view.workspace_id, view.required_labels, view.job_execution_id
            )
    return json_response(
        wire.JobDetail(job=_job(view), output_tail=view.output_tail, waiting=waiting)
    )


@operation(
    Op(
        "Cancel an execution as the orchestrator would (idempotent)",
        ADM,
        None,
        wire.JobCancelled,
        "not-found",
    )
)
async def cancel_job(svc: Deps, request: Request) -> Response:
    """An operator ends an execution, as the orchestrator's cancel does: a pending one leaves the
    queue, a running one's runner hears the cancel on its held heartbeat."""
    await svc.auth.admin(request)
    query_only(request)
    execution = path_uuid(request, "job_execution_id")
    async with svc.pool.acquire() as conn:
        if await job_views.one_job(conn, execution) is None:
            raise NotFound("no such job execution", job_execution_id=str(execution))
        result = await leases.reconcile(
            conn, execution, Outcome.CANCELLED, "cancelled by an operator"
        )
    if result.newly_ended:
        svc.feed.poke()
    return json_response(
        wire.JobCancelled(
            was_pending=result.was_pending,
            was_running=result.was_running,
            newly_ended=result.newly_ended,
        )
    )


@operation(
    Op(
        "Pending label sets per workspace, oldest first, with who could take them and whether "
        "they are stuck",
        ADM,
        None,
        wire.PendingGroupList,
    )
)
async def pending_groups(svc: Deps, request: Request) -> Response:
    await svc.auth.admin(request)
    query_only(request)
    async with svc.pool.acquire() as conn:
        groups = await job_views.pending_groups(conn, TAKER_WINDOW)
    return json_response(
        wire.PendingGroupList(
            items=[
                by_name(
                    wire.PendingGroupOut,
                    group,
                    labels=group.required_labels,
                    waiting=waiting_out(
                        why_waiting(group.required_labels, group.takers), group.takers
                    ),
                )
                for group in groups
            ]
        )
    )


def routes(svc: Deps | None) -> list[BaseRoute]:
    return [
        Route("/v1/admin/jobs", bound(list_jobs, svc), methods=["GET"]),
        Route("/v1/admin/jobs/{job_execution_id}", bound(show_job, svc), methods=["GET"]),
        Route("/v1/admin/jobs/{job_execution_id}/cancel", bound(cancel_job, svc), methods=["POST"]),
        Route("/v1/admin/queue/pending", bound(pending_groups, svc), methods=["GET"]),
    ]
