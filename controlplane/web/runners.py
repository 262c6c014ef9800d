"""Runner routes: register (manual, activation or ephemeral token), long-poll for a job,
heartbeat (held for cancel), complete."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import anyio
import asyncpg
import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from controlplane import metrics
from controlplane.actors.cancels import CancelBoard
from controlplane.actors.dispatch import Dispatcher
from controlplane.actors.feed import FeedWatch
from controlplane.actors.waiters import Waiter, WaiterState
from controlplane.domain import tokens
from controlplane.domain.jobs import ClaimedJob, Outcome, SessionClaims
from controlplane.domain.labels import LabelSet, canonicalise, provisioned_labels, strip_reserved
from controlplane.domain.output import tail_of_text
from controlplane.errors import (
    LeaseJobMismatch,
    RateLimitUnavailable,
    RegistrationRateLimited,
    RunnerLabelsReserved,
    RunnerPaused,
    ShuttingDown,
)
from controlplane.settings import Settings
from controlplane.store import activations, claiming, executions, leases, lifecycle, sessions
from controlplane.store import ephemeral as ephemeral_store
from controlplane.store.ordering import KnownOrderings
from controlplane.store.pool import borrow
from controlplane.web import auth
from controlplane.web.edge import hold, json_response, path_uuid, read_json, reject_duplicate_tools
from controlplane.web.endpoints import bound
from controlplane.web.operations import ERT, JL, KNOBS, MRT, RAT, RS, Op, operation
from controlplane.web.queries import decode
from controlplane.web.runner_control import observe_lifecycle
from controlplane.wire.common import Capabilities
from controlplane.wire.queries import HeartbeatQuery, JobRequestQuery
from controlplane.wire.runners import (
    PAUSED_HEADER,
    CompleteRequest,
    CompleteResponse,
    HeartbeatRequest,
    HeartbeatResponse,
    JobResponse,
    RegisterRequest,
    RegisterResponse,
)

log = logging.getLogger("controlplane.runners")


@dataclass(frozen=True, slots=True)
class Deps:
    settings: Settings
    pool: asyncpg.Pool
    auth: auth.Authenticator
    dispatcher: Dispatcher  # parks job requests
    cancels: CancelBoard  # wakes held heartbeats
    # Told after this replica's own claims and completions, which do not NOTIFY (see
    # store/events.py): held event-feed reads may have something new (actors/feed.py).
    feed: FeedWatch
    closing: anyio.Event  # set at shutdown: a released heartbeat answers without a re-read
    reserved_labels: LabelSet
    orderings: KnownOrderings  # which claim statement a workspace takes (store/ordering.py)

    @property
    def liveness_throttle(self) -> timedelta:
        return timedelta(seconds=self.settings.runners.liveness_throttle_seconds)


_P = KNOBS.provisioners
_LEASE = "lease-job-mismatch running-job-execution-not-found"
_NO_JOB = {
    "description": "No job within `wait` (Retry-After: 0), shutting down (Retry-After: 1), or "
    f"the runner session is paused ({PAUSED_HEADER}: runner, Retry-After: "
    "runners.paused_retry_seconds, default "
    f"{KNOBS.runners.paused_retry_seconds})",
    "headers": {
        "Retry-After": {"schema": {"type": "string"}, "description": "seconds"},
        PAUSED_HEADER: {
            "schema": {"type": "string", "enum": ["runner"]},
            "description": "present only on the paused answer",
        },
    },
}


@operation(
    Op(
        "Register a runner session (manual, or a provisioned runner's activation or ephemeral "
        "token)",
        MRT,
        RegisterRequest,
        RegisterResponse,
        "runner-labels-reserved registration-token-consumed rate-limited "
        "runners-rate-limit-unavailable",
        alternative_auth=(RAT, ERT),
        notes="Labels are canonicalised (trimmed, lower-cased, deduplicated, "
        "sorted); labels in runners.reserved_labels are dropped, except for an activation or "
        "ephemeral token of an installation provisioner. A manual token gives an uncapped `manual` "
        "session; an activation token (one use) gives an `activation` session with `max_claims` 1 "
        "and closes the runner's control session; an ephemeral token (one use) gives an "
        "`ephemeral` session with `max_claims` 1, linked to the provisioner's runner of that "
        "provider id. Ephemeral attempts are counted per token after the body is validated: "
        "beyond provisioners.ephemeral_register_rate_limit (default "
        f"{_P.ephemeral_register_rate_limit}) per "
        "provisioners.ephemeral_register_rate_window_seconds "
        f"(default {_P.ephemeral_register_rate_window_seconds}) they get 429; a used token still "
        "counts, then gets 409. A 429 or 503 leaves the token unused.",
    )
)
async def register(svc: Deps, request: Request) -> Response:
    kind = auth.bearer_kind(request)
    if kind is tokens.Kind.ACTIVATION:
        return await _register_activation(svc, request)
    if kind is tokens.Kind.EPHEMERAL_REGISTRATION:
        return await _register_ephemeral(svc, request)
    token = await svc.auth.manual_registration(request)
    body = await read_json(request, RegisterRequest, svc.settings.server.max_body_bytes)
    reject_duplicate_tools(body.capabilities)
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
    return _registered(svc, claims, "manual", {"runner_session_id": str(session.id)})


def _registered(
    svc: Deps,
    claims: SessionClaims,
    mode: Literal["manual", "ephemeral", "activation"],
    ids: Mapping[str, object],
) -> Response:
    """A new session's token and polling knobs, logged as `runner.registered` with `ids`."""
    log.info("runner.registered", extra={**ids, "mode": mode})
    return json_response(
        RegisterResponse(
            session_token=svc.auth.mint_session(claims),
            session_id=claims.runner_session_id,
            mode=mode,
            max_claims=claims.max_claims,
            labels=list(claims.labels),
            heartbeat_interval_seconds=svc.settings.runners.heartbeat_interval_seconds,
            long_poll_max_seconds=svc.settings.runners.long_poll_max_seconds,
        )
    )


async def _register_activation(svc: Deps, request: Request) -> Response:
    """A provisioned runner trades its activation token for a one-claim session (spec 4.7).
    Reserved labels are kept for an installation provisioner's runner, stripped otherwise."""
    grant = await svc.auth.activation(request)
    body = await read_json(request, RegisterRequest, svc.settings.server.max_body_bytes)
    reject_duplicate_tools(body.capabilities)
    labels = provisioned_labels(body.labels, grant.provisioner_scope, svc.reserved_labels)
    async with svc.pool.acquire() as conn:
        session = await activations.consume_activation(
            conn,
            grant,
            labels=labels,
            capabilities=None if body.capabilities is None else body.capabilities.as_json(),
        )
    await observe_lifecycle(
        svc.pool,
        lambda conn: lifecycle.assignment_to_activation(conn, grant.runner_instance_id),
        metrics.assignment_to_activation,
    )
    claims = SessionClaims(session.id, session.workspace_id, labels, session.max_claims)
    ids = {
        "runner_session_id": str(session.id),
        "runner_instance_id": str(grant.runner_instance_id),
    }
    return _registered(svc, claims, "activation", ids)


async def _register_ephemeral(svc: Deps, request: Request) -> Response:
    """A provisioner-minted ephemeral token for a one-claim session (spec 4.15, jobs 3.14).
    Order: token, body, then the attempt is counted against the token's rate limit (so a bad
    body spends no budget, a used token does), then the token is consumed. A 429 or 503 from
    the limiter leaves the token unconsumed. Reserved labels are kept for an installation
    provisioner's token, stripped otherwise."""
    grant = await svc.auth.ephemeral_registration(request)
    body = await read_json(request, RegisterRequest, svc.settings.server.max_body_bytes)
    reject_duplicate_tools(body.capabilities)
    knobs = svc.settings.provisioners
    ids = {"token_id": str(grant.token_id), "provisioner_id": str(grant.provisioner_id)}
    checks = metrics.rate_limit_checks
    try:
        async with svc.pool.acquire() as conn:
            await ephemeral_store.count_attempt(
                conn,
                grant.token_id,
                limit=knobs.ephemeral_register_rate_limit,
                window=timedelta(seconds=knobs.ephemeral_register_rate_window_seconds),
            )
    except RegistrationRateLimited as error:
        checks.labels("ephemeral-register", "blocked").inc()
        log.warning(
            "runner.register_rate_limited",
            extra={**ids, "retry_after_seconds": error.retry_after_seconds},
        )
        raise
    except RateLimitUnavailable as error:
        checks.labels("ephemeral-register", "unavailable").inc()
        log.error(
            "runner.register_rate_limit_unavailable",
            extra={**ids, "error": type(error.__cause__).__name__},
        )
        raise
    checks.labels("ephemeral-register", "allowed").inc()
    labels = provisioned_labels(body.labels, grant.provisioner_scope, svc.reserved_labels)
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
    linked = [str(i) for i in consumed.linked_runner_ids]
    return _registered(
        svc,
        claims,
        "ephemeral",
        {**ids, "runner_session_id": str(session.id), "runner_instance_ids": linked},
    )


def _job_response(svc: Deps, session: SessionClaims, job: ClaimedJob) -> Response:
    lease = auth.Lease(job.identity, session.runner_session_id)
    return json_response(
        JobResponse(
            job_execution_id=job.identity.job_execution_id,
            job_id=job.identity.job_id,
            workflow_run_id=job.identity.workflow_run_id,
            workflow_run_attempt_id=job.identity.workflow_run_attempt_id,
            required_labels=list(job.required_labels),
            payload=job.payload,
            lease_token=svc.auth.mint_lease(lease),
            heartbeat_interval_seconds=svc.settings.runners.heartbeat_interval_seconds,
            output_tail_bytes=svc.settings.runners.output_tail_bytes,
        )
    )


def _nothing() -> Response:
    return Response(status_code=204, headers={"Retry-After": "0"})


def _paused(svc: Deps) -> Response:
    """The "paused" answer: no job; ask again after runners.paused_retry_seconds."""
    metrics.paused_answers.inc()
    retry = str(svc.settings.runners.paused_retry_seconds)
    return Response(status_code=204, headers={"Retry-After": retry, PAUSED_HEADER: "runner"})


@operation(
    Op(
        "Long-poll for a job",
        RS,
        None,
        JobResponse,
        "runner-session-exhausted unavailable",
        JobRequestQuery,
        also={"204": _NO_JOB},
        notes="No request body is read. Claims the oldest compatible "
        "pending job of the session's workspace; a claim whose client went away is put back. "
        "A paused workspace hands out nothing (the request waits); a paused runner session's "
        "request is answered 204 with `Controlplane-Paused: runner` at once, and a parked one "
        "as soon as the pause commits on any replica (docs/policies.md).",
    )
)
async def request_job(svc: Deps, request: Request) -> Response:
    """Hold the request until a job is claimed for this runner, or `wait` seconds pass (204)."""
    started = anyio.current_time()
    response = await _request_job(svc, request)
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


async def _request_job(svc: Deps, request: Request) -> Response:
    session = await svc.auth.runner_session(request)
    limit = svc.settings.runners.long_poll_max_seconds
    asked = decode(request, JobRequestQuery, svc.settings).wait
    wait = limit if asked is None else asked
    if wait == 0:
        if svc.dispatcher.paused.holds(session.runner_session_id):
            return _paused(svc)
        async with borrow(svc.pool) as conn:
            job = await claiming.claim(
                conn, session, liveness_throttle=svc.liveness_throttle, orderings=svc.orderings
            )
        if job is None:
            return _nothing()
        svc.feed.poke()
        return _job_response(svc, session, job)
    waiter = Waiter(session)
    svc.dispatcher.park(waiter)
    disconnected = await _park(request, waiter, wait)
    if waiter.abandon():
        # Nothing was delivered, and from now on nothing will be.
        if isinstance(waiter.error, ShuttingDown):
            return Response(status_code=204, headers={"Retry-After": "1"})
        if isinstance(waiter.error, RunnerPaused):
            return _paused(svc)
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
    svc.feed.poke()  # its `job.claimed` event is committed
    return _job_response(svc, session, job)


async def _lease_for(svc: Deps, request: Request) -> auth.Lease:
    lease = await svc.auth.job_lease(request)
    if path_uuid(request, "job_execution_id") != lease.identity.job_execution_id:
        raise LeaseJobMismatch()
    return lease


@operation(
    Op(
        "Refresh the lease; with wait, hold until cancelled",
        JL,
        HeartbeatRequest,
        HeartbeatResponse,
        _LEASE,
        HeartbeatQuery,
        optional_body=True,
        notes="An empty or `null` body is `{}`. "
        "`capabilities` omitted keeps the stored report, `null` clears it, an object replaces it. "
        "`cancel` is true once the orchestrator cancelled or the lease's run deadline (its start "
        "plus the job's `timeout_seconds`) passed; a heartbeat held across that deadline is "
        "answered at it.",
    )
)
async def heartbeat(svc: Deps, request: Request) -> Response:
    """Refresh the lease. With `wait`, hold the answer until a cancel arrives or `wait` passes."""
    lease = await _lease_for(svc, request)
    body = await read_json(
        request, HeartbeatRequest, svc.settings.server.max_body_bytes, optional=True
    )
    wait = decode(request, HeartbeatQuery, svc.settings).wait
    capabilities = body.capabilities
    if isinstance(capabilities, Capabilities):
        reject_duplicate_tools(capabilities)
    execution, session_id = lease.identity.job_execution_id, lease.runner_session_id
    with svc.cancels.watch(execution) as cancelled:
        async with svc.pool.acquire() as conn:
            if capabilities is msgspec.UNSET:
                result = await leases.heartbeat(conn, execution, session_id)
            else:
                as_json = None if capabilities is None else capabilities.as_json()
                result = await leases.heartbeat(conn, execution, session_id, as_json)
        cancel = result.must_stop
        if not cancel and wait > 0:
            # The run deadline never moves: a hold that reaches it answers cancel itself, with
            # no re-read (`timeout_in` is measured by the database's clock, at the heartbeat).
            until_deadline = result.timeout_in
            if until_deadline is not None and until_deadline < wait:
                left = await hold(request, cancelled, until_deadline)
                cancel = not (left or cancelled.is_set() or svc.closing.is_set())
            else:
                await hold(request, cancelled, wait)
            if cancelled.is_set() and not svc.closing.is_set():
                async with svc.pool.acquire() as conn:
                    cancel = await executions.cancel_requested(conn, execution, session_id)
    renewed = auth.Lease(result.identity, session_id)
    return json_response(HeartbeatResponse(cancel=cancel, lease_token=svc.auth.mint_lease(renewed)))


def _kept_tail(reported: str | None, limit: int) -> str | None:
    """What the server keeps of a reported output tail: its last `limit` bytes, never a split
    character or a NUL (which PostgreSQL text cannot hold)."""
    if reported is None or limit == 0:
        return None
    return tail_of_text(reported, limit)


@operation(
    Op(
        "Report the outcome; the lease is removed",
        JL,
        CompleteRequest,
        CompleteResponse,
        _LEASE,
        notes="`recorded` is false when the execution "
        "had already ended (the orchestrator ended it first); the lease is removed either way.",
    )
)
async def complete(svc: Deps, request: Request) -> Response:
    lease = await _lease_for(svc, request)
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
        svc.feed.poke()  # its `job.completed` event is committed
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


def routes(svc: Deps | None) -> list[BaseRoute]:
    return [
        Route("/v1/runners/register", bound(register, svc), methods=["POST"]),
        Route("/v1/runners/jobs/request", bound(request_job, svc), methods=["POST"]),
        Route(
            "/v1/runners/jobs/{job_execution_id}/heartbeat",
            bound(heartbeat, svc),
            methods=["POST"],
        ),
        Route(
            "/v1/runners/jobs/{job_execution_id}/complete", bound(complete, svc), methods=["POST"]
        ),
    ]
