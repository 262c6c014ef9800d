"""Runner routes: register (manual, activation or ephemeral token), long-poll for a job,
heartbeat (held for cancel), complete."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from datetime import timedelta

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from controlplane import metrics
from controlplane.actors.dispatch import Waiter, WaiterState
from controlplane.domain import tokens
from controlplane.domain.jobs import ClaimedJob, Outcome, SessionClaims
from controlplane.domain.labels import LabelSet, canonicalise, strip_reserved
from controlplane.domain.output import tail_of_text
from controlplane.errors import (
    InvalidInput,
    LeaseJobMismatch,
    RunnerLabelsReserved,
    ShuttingDown,
)
from controlplane.store import activations, executions, leases, queue, sessions
from controlplane.store import ephemeral as ephemeral_store
from controlplane.store.pool import borrow
from controlplane.web import auth
from controlplane.web.edge import hold, json_response, path_uuid, query_number, read_json
from controlplane.web.services import Services
from controlplane.wire.common import Capabilities
from controlplane.wire.runners import (
    CompleteRequest,
    CompleteResponse,
    HeartbeatRequest,
    HeartbeatResponse,
    JobResponse,
    RegisterRequest,
    RegisterResponse,
)

log = logging.getLogger("controlplane.runners")


def _check_capabilities(capabilities: Capabilities | None) -> None:
    if capabilities is not None and (duplicates := capabilities.duplicate_tools()):
        raise InvalidInput("capabilities list a tool twice", duplicates=duplicates)


async def register(request: Request) -> Response:
    kind = auth.bearer_kind(request)
    if kind is tokens.Kind.ACTIVATION:
        return await _register_activation(request)
    if kind is tokens.Kind.EPHEMERAL_REGISTRATION:
        return await _register_ephemeral(request)
    svc = auth.services(request)
    token = await auth.manual_registration(request)
    body = await read_json(request, RegisterRequest, svc.settings.server.max_body_bytes)
    _check_capabilities(body.capabilities)
    supplied = canonicalise(body.labels)
    labels = strip_reserved(supplied, svc.reserved_labels)
    if not labels:
        raise RunnerLabelsReserved(
            "every supplied label is reserved for provisioned runners", labels=list(supplied)
        )
    assert token.workspace_id is not None
    async with svc.pool.acquire() as conn:
        session = await sessions.create(
            conn,
            workspace_id=token.workspace_id,
            registration_token_id=token.id,
            kind="manual",
            labels=labels,
            capabilities=None if body.capabilities is None else body.capabilities.as_json(),
        )
    claims = SessionClaims(session.id, session.workspace_id, labels, None)
    log.info("runner.registered", extra={"runner_session_id": str(session.id), "mode": "manual"})
    return json_response(
        RegisterResponse(
            session_token=auth.mint_session(svc, claims, svc.clock()),
            session_id=session.id,
            mode="manual",
            max_claims=None,
            labels=list(labels),
            heartbeat_interval_seconds=svc.settings.runners.heartbeat_interval_seconds,
            long_poll_max_seconds=svc.settings.runners.long_poll_max_seconds,
        )
    )


async def _register_activation(request: Request) -> Response:
    """A provisioned runner trades its activation token for a one-claim session (spec 4.7).
    Reserved labels are kept for an installation provisioner's runner, stripped otherwise."""
    svc = auth.services(request)
    grant = await auth.activation(request)
    body = await read_json(request, RegisterRequest, svc.settings.server.max_body_bytes)
    _check_capabilities(body.capabilities)
    labels = _provisioned_labels(body.labels, grant.provisioner_scope, svc.reserved_labels)
    async with svc.pool.acquire() as conn:
        session = await activations.consume_activation(
            conn,
            grant,
            labels=labels,
            capabilities=None if body.capabilities is None else body.capabilities.as_json(),
        )
    claims = SessionClaims(session.id, session.workspace_id, labels, session.max_claims)
    log.info(
        "runner.registered",
        extra={
            "runner_session_id": str(session.id),
            "runner_instance_id": str(grant.runner_instance_id),
            "mode": "activation",
        },
    )
    return json_response(
        RegisterResponse(
            session_token=auth.mint_session(svc, claims, svc.clock()),
            session_id=session.id,
            mode="activation",
            max_claims=session.max_claims,
            labels=list(labels),
            heartbeat_interval_seconds=svc.settings.runners.heartbeat_interval_seconds,
            long_poll_max_seconds=svc.settings.runners.long_poll_max_seconds,
        )
    )


async def _register_ephemeral(request: Request) -> Response:
    """A provisioner-minted ephemeral token for a one-claim session (spec 4.15, jobs 3.14).
    Order: token, body, then the attempt is counted against the token's rate limit (so a bad
    body spends no budget, a used token does), then the token is consumed. A 429 or 503 from
    the limiter leaves the token unconsumed. Reserved labels are kept for an installation
    provisioner's token, stripped otherwise."""
    svc = auth.services(request)
    grant = await auth.ephemeral_registration(request)
    body = await read_json(request, RegisterRequest, svc.settings.server.max_body_bytes)
    _check_capabilities(body.capabilities)
    knobs = svc.settings.provisioners
    ids = {"token_id": str(grant.token_id), "provisioner_id": str(grant.provisioner_id)}
    try:
        async with svc.pool.acquire() as conn:
            await ephemeral_store.count_attempt(
                conn,
                grant.token_id,
                limit=knobs.ephemeral_register_rate_limit,
                window=timedelta(seconds=knobs.ephemeral_register_rate_window_seconds),
            )
    except ephemeral_store.RegistrationRateLimited as error:
        log.warning(
            "runner.register_rate_limited",
            extra={**ids, "retry_after_seconds": error.retry_after_seconds},
        )
        raise
    except ephemeral_store.RateLimitUnavailable as error:
        log.error(
            "runner.register_rate_limit_unavailable",
            extra={**ids, "error": type(error.__cause__).__name__},
        )
        raise
    labels = _provisioned_labels(body.labels, grant.provisioner_scope, svc.reserved_labels)
    async with svc.pool.acquire() as conn:
        consumed = await ephemeral_store.consume(
            conn,
            grant.token_id,
            grant.workspace_id,
            labels=labels,
            capabilities=None if body.capabilities is None else body.capabilities.as_json(),
        )
    session = consumed.session
    claims = SessionClaims(session.id, session.workspace_id, labels, session.max_claims)
    log.info(
        "runner.registered",
        extra={
            **ids,
            "runner_session_id": str(session.id),
            "runner_instance_ids": [str(i) for i in consumed.linked_runner_ids],
            "mode": "ephemeral",
        },
    )
    return json_response(
        RegisterResponse(
            session_token=auth.mint_session(svc, claims, svc.clock()),
            session_id=session.id,
            mode="ephemeral",
            max_claims=session.max_claims,
            labels=list(labels),
            heartbeat_interval_seconds=svc.settings.runners.heartbeat_interval_seconds,
            long_poll_max_seconds=svc.settings.runners.long_poll_max_seconds,
        )
    )


def _job_response(svc: Services, session: SessionClaims, job: ClaimedJob) -> Response:
    lease = auth.Lease(job.identity, session.runner_session_id)
    return json_response(
        JobResponse(
            job_execution_id=job.identity.job_execution_id,
            job_id=job.identity.job_id,
            workflow_run_id=job.identity.workflow_run_id,
            workflow_run_attempt_id=job.identity.workflow_run_attempt_id,
            required_labels=list(job.required_labels),
            payload=job.payload,
            lease_token=auth.mint_lease(svc, lease, svc.clock()),
            heartbeat_interval_seconds=svc.settings.runners.heartbeat_interval_seconds,
            output_tail_bytes=svc.settings.runners.output_tail_bytes,
        )
    )


def _provisioned_labels(
    declared: Sequence[str], provisioner_scope: str | None, reserved: LabelSet
) -> LabelSet:
    """A provisioned runner's labels: canonical, and without the reserved ones unless its
    provisioner has installation scope. All reserved: `runner-labels-reserved`."""
    supplied = canonicalise(declared)
    labels = supplied
    if provisioner_scope != "installation":
        labels = strip_reserved(supplied, reserved)
    if not labels:
        raise RunnerLabelsReserved(
            "every supplied label is reserved for installation provisioners",
            labels=list(supplied),
        )
    return labels


def _nothing() -> Response:
    return Response(status_code=204, headers={"Retry-After": "0"})


async def request_job(request: Request) -> Response:
    """Hold the request until a job is claimed for this runner, or `wait` seconds pass (204)."""
    started = anyio.current_time()
    response = await _request_job(request)
    outcome = "claimed" if response.status_code == 200 else "empty"
    metrics.claims.labels(outcome).inc()
    metrics.dispatch_latency.labels(outcome).observe(anyio.current_time() - started)
    return response


async def _park(request: Request, waiter: Waiter, seconds: float) -> bool:
    """Wait up to `seconds` for the waiter's answer, watching for the client to disconnect;
    True when it did. One task per parked request: the answer cancels the wait on the
    request's next message (this route reads no body, so only `http.disconnect` comes)."""
    with anyio.move_on_after(seconds) as scope:
        waiter.on_answer = scope.cancel
        if waiter.state is not WaiterState.WAITING:
            return False  # answered before the wait was armed (no await since the check)
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return True
    return False


async def _request_job(request: Request) -> Response:
    svc = auth.services(request)
    session = await auth.runner_session(request)
    limit = svc.settings.runners.long_poll_max_seconds
    wait = query_number(request, "wait", low=0, high=limit, default=limit)
    if wait == 0:
        async with borrow(svc.pool) as conn:
            job = await queue.claim(conn, session, liveness_throttle=svc.liveness_throttle)
        if job is None:
            return _nothing()
        svc.signal_events()
        return _job_response(svc, session, job)
    waiter = Waiter(session)
    svc.dispatcher.park(waiter)
    disconnected = await _park(request, waiter, wait)
    if waiter.abandon():
        # Nothing was delivered, and from now on nothing will be.
        if isinstance(waiter.error, ShuttingDown):
            return Response(status_code=204, headers={"Retry-After": "1"})
        if waiter.state is WaiterState.FAILED and waiter.error is not None:
            raise waiter.error
        return _nothing()
    job = waiter.job
    assert job is not None
    # A disconnect in the same step as the delivery is not seen by _park(); look once more.
    if disconnected or await request.is_disconnected():
        await svc.dispatcher.put_back(job, session.runner_session_id)
        log.info(
            "dispatch.put_back",
            extra={"job_execution_id": str(job.identity.job_execution_id), "why": "disconnected"},
        )
        return _nothing()
    svc.signal_events()  # its `job.claimed` event is committed
    return _job_response(svc, session, job)


async def _lease_for(request: Request) -> auth.Lease:
    lease = await auth.job_lease(request)
    if path_uuid(request, "job_execution_id") != lease.identity.job_execution_id:
        raise LeaseJobMismatch()
    return lease


async def heartbeat(request: Request) -> Response:
    """Refresh the lease. With `wait`, hold the answer until a cancel arrives or `wait` passes."""
    svc = auth.services(request)
    lease = await _lease_for(request)
    body = await read_json(
        request, HeartbeatRequest, svc.settings.server.max_body_bytes, optional=True
    )
    wait = query_number(
        request, "wait", low=0, high=svc.settings.runners.cancel_wait_max_seconds, default=0
    )
    capabilities = body.capabilities
    if isinstance(capabilities, Capabilities):
        _check_capabilities(capabilities)
    execution, session_id = lease.identity.job_execution_id, lease.runner_session_id
    with svc.cancels.watch(execution) as cancelled:
        async with svc.pool.acquire() as conn:
            if capabilities is msgspec.UNSET:
                result = await leases.heartbeat(conn, execution, session_id)
            else:
                as_json = None if capabilities is None else capabilities.as_json()
                result = await leases.heartbeat(conn, execution, session_id, as_json)
        cancel = result.cancellation_requested
        if not cancel and wait > 0:
            await hold(request, cancelled, wait)
            if cancelled.is_set() and not svc.closing:
                async with svc.pool.acquire() as conn:
                    cancel = await executions.cancel_requested(conn, execution, session_id)
    renewed = auth.Lease(result.identity, session_id)
    return json_response(
        HeartbeatResponse(cancel=cancel, lease_token=auth.mint_lease(svc, renewed, svc.clock()))
    )


def _kept_tail(reported: str | None, limit: int) -> str | None:
    """What the server keeps of a reported output tail: its last `limit` bytes, never a split
    character or a NUL (which PostgreSQL text cannot hold)."""
    if reported is None or limit == 0:
        return None
    return tail_of_text(reported, limit)


async def complete(request: Request) -> Response:
    svc = auth.services(request)
    lease = await _lease_for(request)
    body = await read_json(request, CompleteRequest, svc.settings.server.max_body_bytes)
    async with svc.pool.acquire() as conn:
        ended = await leases.complete(
            conn,
            lease.identity.job_execution_id,
            lease.runner_session_id,
            Outcome(body.outcome),
            body.exit_status,
            _kept_tail(body.output_tail, svc.settings.runners.output_tail_bytes),
        )
    if ended.newly_ended:
        svc.signal_events()  # its `job.completed` event is committed
    metrics.completed.labels(body.outcome).inc()
    if log.isEnabledFor(logging.INFO):  # spares a random request id per job when not logged
        log.info(
            "runner.completed",
            extra={
                "job_execution_id": str(lease.identity.job_execution_id),
                "outcome": body.outcome,
                "request_id": request.headers.get("x-request-id", str(uuid.uuid4())),
            },
        )
    return json_response(CompleteResponse(recorded=ended.newly_ended))


routes = [
    Route("/v1/runners/register", register, methods=["POST"]),
    Route("/v1/runners/jobs/request", request_job, methods=["POST"]),
    Route("/v1/runners/jobs/{job_execution_id}/heartbeat", heartbeat, methods=["POST"]),
    Route("/v1/runners/jobs/{job_execution_id}/complete", complete, methods=["POST"]),
]
