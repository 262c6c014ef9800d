"""Orchestrator routes: enqueue, report an outcome, read an execution, read the event feed."""

from __future__ import annotations

from uuid import UUID

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from controlplane import metrics
from controlplane.domain.jobs import JobIdentity, NewJob, Outcome
from controlplane.domain.labels import canonicalise
from controlplane.domain.waiting import why_waiting
from controlplane.errors import InvalidInput, NotFound, PayloadTooLarge
from controlplane.store import events, executions, job_views, leases, queue
from controlplane.store.credentials import Credential
from controlplane.web import auth, jobs
from controlplane.web.edge import (
    json_response,
    path_uuid,
    query_integer,
    query_number,
    query_uuid,
    read_json,
)
from controlplane.web.services import Services
from controlplane.wire import orchestrator as wire

_EVENT_RECHECK_SECONDS = 0.25


def _new_job(job: wire.EnqueueJob, max_payload: int, index: int) -> NewJob:
    if len(job.payload) > max_payload:
        raise PayloadTooLarge(
            f"jobs[{index}].payload exceeds {max_payload} bytes", index=index, limit=max_payload
        )
    try:
        payload = msgspec.json.decode(job.payload, type=dict[str, object])
    except msgspec.ValidationError as error:
        raise InvalidInput(f"jobs[{index}].payload must be a JSON object", index=index) from error
    return NewJob(
        identity=JobIdentity(
            workspace_id=job.workspace_id,
            workflow_run_id=job.workflow_run_id,
            workflow_run_attempt_id=job.workflow_run_attempt_id,
            job_id=job.job_id,
            job_execution_id=job.job_execution_id,
            project_id=job.project_id,
        ),
        required_labels=canonicalise(job.required_labels),
        queued_at=job.queued_at,
        payload=payload,
    )


async def enqueue(request: Request) -> Response:
    svc = auth.services(request)
    key = await auth.api_key(request, "orchestrator")
    body = await read_json(request, wire.EnqueueRequest, svc.settings.server.max_body_bytes)
    if len(body.jobs) > svc.settings.queue.max_batch_size:
        raise InvalidInput(
            f"at most {svc.settings.queue.max_batch_size} jobs per request", count=len(body.jobs)
        )
    for job in body.jobs:
        auth.require_workspace(key, job.workspace_id)
    jobs = [
        _new_job(job, svc.settings.queue.max_payload_bytes, index)
        for index, job in enumerate(body.jobs)
    ]
    async with svc.pool.acquire() as conn:
        results = await queue.enqueue(conn, jobs)
    for result in results:
        metrics.enqueued.labels(result.value).inc()
    return json_response(
        wire.EnqueueResponse(
            results=[
                wire.EnqueueResult(
                    job_execution_id=job.identity.job_execution_id,
                    result=result.value,
                )
                for job, result in zip(jobs, results, strict=True)
            ]
        )
    )


async def _visible_state(
    svc: Services, key: Credential, execution: UUID
) -> executions.ExecutionState | None:
    async with svc.pool.acquire() as conn:
        found = await executions.state(conn, execution)
    if (
        found is not None
        and key.workspace_id is not None
        and found.workspace_id != key.workspace_id
    ):
        return None  # another workspace's execution does not exist for this key
    if found is None and key.workspace_id is not None:
        return None
    return found or executions.ExecutionState(execution, "unknown", None)


async def report_outcome(request: Request) -> Response:
    """The orchestrator says the execution is over. A workspace-scoped key can only end
    executions of its workspace that we know; an installation key may end unknown ones too
    (a tombstone then stops a late enqueue from resurrecting it)."""
    svc = auth.services(request)
    key = await auth.api_key(request, "orchestrator")
    execution = path_uuid(request, "job_execution_id")
    body = await read_json(request, wire.OutcomeRequest, svc.settings.server.max_body_bytes)
    if await _visible_state(svc, key, execution) is None:
        raise NotFound("no such job execution", job_execution_id=str(execution))
    async with svc.pool.acquire() as conn:
        result = await leases.reconcile(conn, execution, Outcome(body.status), body.reason)
    return json_response(
        wire.OutcomeResponse(
            was_pending=result.was_pending,
            was_running=result.was_running,
            newly_ended=result.newly_ended,
        )
    )


async def execution_state(request: Request) -> Response:
    svc = auth.services(request)
    key = await auth.api_key(request, "orchestrator")
    execution = path_uuid(request, "job_execution_id")
    found = await _visible_state(svc, key, execution)
    if found is None or found.state == "unknown":
        raise NotFound("no such job execution", job_execution_id=str(execution))
    waiting = None
    if found.state == "pending" and found.workspace_id is not None:
        async with svc.pool.acquire() as conn:
            takers = await job_views.takers(
                conn, found.workspace_id, found.required_labels, jobs.TAKER_WINDOW
            )
        waiting = jobs.waiting_out(why_waiting(found.required_labels, takers), takers)
    return json_response(
        wire.ExecutionState(
            job_execution_id=found.job_execution_id,
            state=found.state,  # type: ignore[arg-type]
            workspace_id=found.workspace_id,
            outcome=found.outcome,
            ended_by=found.ended_by,
            runner_session_id=found.runner_session_id,
            cancel_requested=found.cancel_requested,
            exit_code=found.exit_code,
            output_tail=found.output_tail,
            waiting=waiting,
        )
    )


async def read_events(request: Request) -> Response:
    """Events after `after` (a cursor), oldest first; with `wait`, held until some arrive."""
    svc = auth.services(request)
    key = await auth.api_key(request, "orchestrator")
    try:
        after = events.parse_cursor(request.query_params.get("after"))
    except ValueError as error:
        raise InvalidInput(str(error), field="after", code="invalid-cursor") from error
    workspace = query_uuid(request, "workspace_id")
    if workspace is None:
        workspace = key.workspace_id
    else:
        auth.require_workspace(key, workspace)
    limit = query_integer(request, "limit", low=1, high=1000, default=100)
    wait = query_number(
        request, "wait", low=0, high=svc.settings.runners.long_poll_max_seconds, default=0
    )
    deadline = anyio.current_time() + wait
    while True:
        changed = svc.events_changed
        async with svc.pool.acquire() as conn:
            found = await events.read(conn, after=after, workspace_id=workspace, limit=limit)
        remaining = deadline - anyio.current_time()
        if found or remaining <= 0 or svc.closing:
            break
        # Woken by NOTIFY; the short re-check covers events hidden behind a transaction that
        # was still open when we read (they become visible when it ends).
        with anyio.move_on_after(min(remaining, _EVENT_RECHECK_SECONDS)):
            await changed.wait()
    next_cursor = found[-1].cursor if found else f"{after[0]}.{after[1]}"
    return json_response(
        wire.EventsResponse(
            events=[
                wire.EventOut(
                    cursor=event.cursor,
                    type=event.event_type,
                    workspace_id=event.workspace_id,
                    job_execution_id=event.job_execution_id,
                    payload=event.payload,
                    created_at=event.created_at,
                )
                for event in found
            ],
            next_cursor=next_cursor,
        )
    )


routes = [
    Route("/v1/jobs", enqueue, methods=["POST"]),
    Route("/v1/jobs/{job_execution_id}", execution_state, methods=["GET"]),
    Route("/v1/jobs/{job_execution_id}/outcome", report_outcome, methods=["POST"]),
    Route("/v1/events", read_events, methods=["GET"]),
]
