"""Orchestrator routes: enqueue, report an outcome, read an execution, read the event feed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from uuid import UUID

import anyio
import asyncpg
import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from controlplane import metrics
from controlplane.actors.feed import FeedWatch
from controlplane.domain import lifetimes
from controlplane.domain.credentials import Credential
from controlplane.domain.fields import by_name
from controlplane.domain.jobs import JobIdentity, NewJob, Outcome
from controlplane.domain.labels import canonicalise
from controlplane.domain.ordering import check_ordering
from controlplane.errors import InvalidInput, NotFound, PayloadTooLarge
from controlplane.settings import Queue as QueueSettings
from controlplane.settings import Settings
from controlplane.store import events, executions, leases, queue
from controlplane.web import auth, jobs
from controlplane.web.edge import (
    json_response,
    path_uuid,
    read_json,
)
from controlplane.web.endpoints import bound
from controlplane.web.operations import KNOBS, OAK, Op, operation
from controlplane.web.queries import decode
from controlplane.wire import orchestrator as wire
from controlplane.wire.common import whole
from controlplane.wire.queries import EventsQuery


@dataclass(frozen=True, slots=True)
class Deps:
    settings: Settings
    pool: asyncpg.Pool
    auth: auth.Authenticator
    feed: FeedWatch  # wakes held event reads
    closing: anyio.Event  # set at shutdown: a released event read answers without a re-read


# A cursor's parts as PostgreSQL types them: the transaction id is xid8 (unsigned 64-bit), the
# sequence bigint (signed 64-bit). Checked here, so a larger one is 400, not a failed query.
_XID8_MAX = 2**64 - 1
_BIGINT_MAX = 2**63 - 1


def _event_cursor(raw: str | None) -> tuple[int, int]:
    """`after`: absent is the start of the feed; malformed or out of range is 400 (empty is
    refused as it is decoded)."""
    if raw is None:
        return (0, 0)
    try:
        xid, seq = events.parse_cursor(raw)
    except ValueError as error:
        raise InvalidInput(str(error), field="after", code="invalid-cursor") from error
    if xid > _XID8_MAX or seq > _BIGINT_MAX:
        raise InvalidInput(
            f"a cursor's parts are at most {_XID8_MAX}.{_BIGINT_MAX}",
            field="after",
            code="invalid-cursor",
        )
    return (xid, seq)


def _new_job(job: wire.EnqueueJob, queue_knobs: QueueSettings, index: int) -> NewJob:
    max_payload = queue_knobs.max_payload_bytes
    priority = int(job.priority)
    limit = None if job.concurrency_limit is None else int(job.concurrency_limit)
    check_ordering(
        index,
        priority,
        job.concurrency_key,
        limit,
        priority_min=queue_knobs.priority_min,
        priority_max=queue_knobs.priority_max,
        max_limit=queue_knobs.max_concurrency_limit,
    )
    if len(job.payload) > max_payload:
        raise PayloadTooLarge(
            f"jobs[{index}].payload exceeds {max_payload} bytes", index=index, limit=max_payload
        )
    try:
        payload = msgspec.json.decode(job.payload, type=dict[str, object])
    except msgspec.ValidationError as error:
        raise InvalidInput(f"jobs[{index}].payload must be a JSON object", index=index) from error
    return NewJob(
        identity=by_name(JobIdentity, job),
        required_labels=canonicalise(job.required_labels),
        queued_at=job.queued_at,
        payload=payload,
        priority=priority,
        concurrency_key=job.concurrency_key,
        concurrency_limit=limit,
        timeout_seconds=lifetimes.resolve(
            whole(job.timeout_seconds),
            lifetimes.Bounds(queue_knobs.default_timeout_seconds, queue_knobs.max_timeout_seconds),
            field="timeout_seconds",
            index=index,
        ),
        queue_timeout_seconds=lifetimes.resolve(
            whole(job.queue_timeout_seconds),
            lifetimes.Bounds(
                queue_knobs.default_queue_timeout_seconds, queue_knobs.max_queue_timeout_seconds
            ),
            field="queue_timeout_seconds",
            index=index,
        ),
        retries_on_lost=lifetimes.resolve(
            int(job.retries_on_lost),
            lifetimes.Bounds(0, queue_knobs.max_retries_on_lost, minimum=0),
            field="retries_on_lost",
            index=index,
        ),
    )


@operation(
    Op(
        "Enqueue job executions (idempotent)",
        OAK,
        wire.EnqueueRequest,
        wire.EnqueueResponse,
        "forbidden priority-out-of-range concurrency-key-incomplete concurrency-limit-out-of-range",
        notes=f"At most queue.max_batch_size (default {KNOBS.queue.max_batch_size}) jobs; "
        f"a payload is a JSON object of at most queue.max_payload_bytes (default "
        f"{KNOBS.queue.max_payload_bytes}) bytes. One result per job, in order. "
        "`timeout_seconds` is at most queue.max_timeout_seconds (default "
        f"{KNOBS.queue.max_timeout_seconds}; absent: {KNOBS.queue.default_timeout_seconds}), "
        "`queue_timeout_seconds` at most queue.max_queue_timeout_seconds (default "
        f"{KNOBS.queue.max_queue_timeout_seconds}; absent: "
        f"{KNOBS.queue.default_queue_timeout_seconds}), `retries_on_lost` at most "
        f"queue.max_retries_on_lost (default {KNOBS.queue.max_retries_on_lost}); beyond is 400 "
        "`validation-error` naming the field, and nothing of the request is enqueued.",
    )
)
async def enqueue(svc: Deps, request: Request) -> Response:
    key = await svc.auth.orchestrator(request)
    body = await read_json(request, wire.EnqueueRequest, svc.settings.server.max_body_bytes)
    if len(body.jobs) > svc.settings.queue.max_batch_size:
        raise InvalidInput(
            f"at most {svc.settings.queue.max_batch_size} jobs per request", count=len(body.jobs)
        )
    for job in body.jobs:
        auth.require_workspace(key, job.workspace_id)
    jobs = [_new_job(job, svc.settings.queue, index) for index, job in enumerate(body.jobs)]
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
    svc: Deps, key: Credential, execution: UUID
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


@operation(
    Op(
        "End an execution (idempotent)",
        OAK,
        wire.OutcomeRequest,
        wire.OutcomeResponse,
        "not-found",
        notes="An installation-wide key may end an execution "
        "never seen (its tombstone stops a later enqueue); a workspace-scoped key gets 404.",
    )
)
async def report_outcome(svc: Deps, request: Request) -> Response:
    """The orchestrator says the execution is over. A workspace-scoped key can only end
    executions of its workspace that we know; an installation key may end unknown ones too
    (a tombstone then stops a late enqueue from resurrecting it)."""
    key = await svc.auth.orchestrator(request)
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


@operation(Op("Read an execution's state", OAK, None, wire.ExecutionState, "not-found"))
async def execution_state(svc: Deps, request: Request) -> Response:
    key = await svc.auth.orchestrator(request)
    execution = path_uuid(request, "job_execution_id")
    found = await _visible_state(svc, key, execution)
    if found is None or found.state == "unknown":
        raise NotFound("no such job execution", job_execution_id=str(execution))
    waiting = None
    if found.state == "pending" and found.workspace_id is not None:
        async with svc.pool.acquire() as conn:
            waiting = await jobs.why_pending(
                conn, found.workspace_id, found.required_labels, execution
            )
    return json_response(
        by_name(
            wire.ExecutionState,
            found,
            waiting=waiting,
            lost_attempts=[
                by_name(wire.LostAttemptOut, lost, outcome="lost") for lost in found.lost_attempts
            ],
        )
    )


@operation(
    Op(
        "Read the event feed",
        OAK,
        None,
        wire.EventsResponse,
        "invalid-cursor forbidden rate-limited",
        EventsQuery,
        notes="Events after `after`, oldest first; with `wait`, held until one arrives. "
        "A key holds at most events.held_reads_per_key (default "
        f"{KNOBS.events.held_reads_per_key}) reads with `wait` on one replica; more get 429.",
    )
)
async def read_events(svc: Deps, request: Request) -> Response:
    """Events after `after` (a cursor), oldest first; with `wait`, held until some arrive."""
    key = await svc.auth.orchestrator(request)
    query = decode(request, EventsQuery, svc.settings)
    after = _event_cursor(query.after)
    workspace = query.workspace_id
    if workspace is None:
        workspace = key.workspace_id
    else:
        auth.require_workspace(key, workspace)
    limit, wait = query.limit, query.wait
    if wait > 0:
        found = await _held_read(request, svc, key, after, workspace, limit, wait)
    else:
        async with svc.pool.acquire() as conn:
            found = await events.read(conn, after=after, workspace_id=workspace, limit=limit)
    next_cursor = found[-1].cursor if found else f"{after[0]}.{after[1]}"
    return json_response(
        wire.EventsResponse(
            events=[by_name(wire.EventOut, event, type=event.event_type) for event in found],
            next_cursor=next_cursor,
        )
    )


async def _held_read(
    request: Request,
    svc: Deps,
    key: Credential,
    after: tuple[int, int],
    workspace: UUID | None,
    limit: int,
    wait: float,
) -> Sequence[events.Event]:
    """Read, and until something is found, read again only when the replica's feed watcher says
    this workspace's feed may have grown (actors/feed.py): no polling per request. A client
    that leaves frees its place under the per-key cap at once."""
    deadline = anyio.current_time() + wait
    async with svc.feed.hold(key.id, workspace):
        while True:
            woken = svc.feed.wake_for(workspace)
            async with svc.pool.acquire() as conn:
                found = await events.read(conn, after=after, workspace_id=workspace, limit=limit)
            remaining = deadline - anyio.current_time()
            if found or remaining <= 0 or svc.closing.is_set():
                return found
            if await _client_left(request, woken, remaining) or not woken.is_set():
                return found  # the client left, or `wait` passed with nothing new


async def _client_left(request: Request, woken: anyio.Event, seconds: float) -> bool:
    """Wait up to `seconds` for `woken`; True when the client disconnected first. This route
    reads no body, so the only message still to come is `http.disconnect`."""
    left = False
    with anyio.move_on_after(seconds):
        async with anyio.create_task_group() as group:

            async def watch_client() -> None:
                nonlocal left
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                left = True
                group.cancel_scope.cancel()

            group.start_soon(watch_client)
            await woken.wait()
            group.cancel_scope.cancel()
    return left


def routes(svc: Deps | None) -> list[BaseRoute]:
    return [
        Route("/v1/jobs", bound(enqueue, svc), methods=["POST"]),
        Route("/v1/jobs/{job_execution_id}", bound(execution_state, svc), methods=["GET"]),
        Route("/v1/jobs/{job_execution_id}/outcome", bound(report_outcome, svc), methods=["POST"]),
        Route("/v1/events", bound(read_events, svc), methods=["GET"]),
    ]
