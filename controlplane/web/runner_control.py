"""The provisioned runner's boot path: bootstrap exchange, then its control session (enroll,
attach its provider identity, heartbeat, long-poll for an assignment). Spec 4.3-4.7.

Routes with a body or query validate it before authenticating, as the reference's control-plane
routes do (a malformed request without a token is 400, not 401).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from uuid import UUID

import anyio
import asyncpg
from prometheus_client import Histogram
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from controlplane import metrics
from controlplane.actors.assignments import AssignmentBoard
from controlplane.domain.control_sessions import Enrollment
from controlplane.domain.labels import LabelSet, provisioned_labels
from controlplane.errors import BootstrapTokenInvalid
from controlplane.settings import Settings
from controlplane.store import activations, control_sessions, fleet, lifecycle, runner_instances
from controlplane.store.pool import Conn
from controlplane.web import auth
from controlplane.web.edge import hold as hold_until
from controlplane.web.edge import json_response, read_json, reject_duplicate_tools
from controlplane.web.endpoints import bound
from controlplane.web.operations import KNOBS, RCS, Op, operation
from controlplane.web.queries import decode
from controlplane.wire.queries import AssignmentQuery
from controlplane.wire.runner_control import (
    ActivationResponse,
    ControlHeartbeatResponse,
    EnrollmentRequest,
    ExchangeRequest,
    ExchangeResponse,
    ProviderRunnerRequest,
    ProviderRunnerResponse,
)

log = logging.getLogger("controlplane.runner_control")

# A parked assignment poll re-reads the database this often even without a notification.
RECHECK_SECONDS = 1.0
_WAIT_QUERY_HIGH = 2**31 - 1


_P = KNOBS.provisioners


@dataclass(frozen=True, slots=True)
class Deps:
    settings: Settings
    pool: asyncpg.Pool
    auth: auth.Authenticator
    reserved_labels: LabelSet
    assignments: AssignmentBoard  # wakes parked assignment polls; the listener feeds it


@operation(
    Op(
        "Trade a bootstrap token for a control session",
        None,
        ExchangeRequest,
        ExchangeResponse,
        "runner-bootstrap-token-invalid server-error",
        tag="provisioned-runners",
        notes="Unauthenticated; the bootstrap token is the "
        "credential, usable once before provisioners.bootstrap_token_ttl_seconds (default "
        f"{_P.bootstrap_token_ttl_seconds}) pass.",
    )
)
async def exchange(svc: Deps, request: Request) -> Response:
    body = await read_json(request, ExchangeRequest, svc.settings.server.max_body_bytes)
    ttl = timedelta(seconds=svc.settings.provisioners.control_session_ttl_seconds)
    try:
        async with svc.pool.acquire() as conn:
            done = await control_sessions.exchange_bootstrap(conn, body.bootstrap_token, ttl)
    except BootstrapTokenInvalid:
        metrics.bootstrap_exchanges.labels("rejected").inc()
        log.info("runner.bootstrap_exchange", extra={"outcome": "rejected"})
        raise
    metrics.bootstrap_exchanges.labels("accepted").inc()
    await observe_lifecycle(
        svc.pool,
        lambda conn: fleet.since_created(conn, done.runner_instance_id),
        metrics.created_to_control_session,
    )
    log.info(
        "runner.bootstrap_exchange",
        extra={"outcome": "accepted", "runner_instance_id": str(done.runner_instance_id)},
    )
    return json_response(
        ExchangeResponse(
            runner_instance_id=done.runner_instance_id,
            control_session_token=done.control_session_token,
            expires_at=done.expires_at,
        )
    )


async def observe_lifecycle(
    pool: asyncpg.Pool,
    read: Callable[[Conn], Awaitable[fleet.Since | None]],
    histogram: Histogram,
    *extra: str,
) -> None:
    """Observe a lifecycle duration that `read` finds after the step committed; a metric never
    fails the request, so a failed read is only logged."""
    try:
        async with pool.acquire() as conn:
            since = await read(conn)
    except Exception as error:
        log.warning("metrics.lifecycle_read_failed", extra={"error": repr(error)})
        return
    if since is not None:
        provider = metrics.provider_label(since.provider_kind)
        metrics.observe_seconds(histogram, since.seconds, provider, since.launch_kind, *extra)


async def _lag(conn: Conn, runner_id: UUID) -> fleet.Since | None:
    lags = await lifecycle.assignment_lags(conn, [runner_id])
    return lags[0] if lags else None


# Assignment rejections that are promotion failures of the spec's vocabulary keep their name;
# the other rejections of an assignment are `not-assignable` there.
_PROMOTION_REASONS = {
    "reservation-expired",
    "reservation-not-found",
    "already-assigned",
    "unexpected",
}


def _count_enrollment(enrolled: Enrollment) -> None:
    failure = enrolled.promotion_failure
    if failure is not None:
        metrics.promotion_failures.labels(
            failure if failure in _PROMOTION_REASONS else "not-assignable"
        ).inc()
        if failure != "unexpected":
            metrics.assignments_rejected.labels(failure, "enrollment").inc()
    if enrolled.not_issued is not None:
        metrics.activation_not_issued.labels(enrolled.not_issued, "enrollment").inc()


@operation(
    Op(
        "Enroll: declare labels and metadata; may answer an activation token",
        RCS,
        EnrollmentRequest,
        ActivationResponse,
        "runner-labels-reserved runner-control-session-invalid",
        notes="The body is validated before the token. The "
        "instance becomes `running`; labels, capabilities, provider_kind and protocol_version are "
        "stored while it has no assignment. When it was created for a reservation, that "
        "reservation is promoted to its assignment and an activation token returned; otherwise, "
        "or when the promotion fails, `activation_token` is null.",
    )
)
async def enrollment(svc: Deps, request: Request) -> Response:
    body = await read_json(request, EnrollmentRequest, svc.settings.server.max_body_bytes)
    reject_duplicate_tools(body.capabilities)
    session = await svc.auth.control_session(request)
    labels = provisioned_labels(body.labels, session.provisioner_scope, svc.reserved_labels)
    ttl = timedelta(seconds=svc.settings.provisioners.activation_token_ttl_seconds)
    async with svc.pool.acquire() as conn:
        enrolled = await control_sessions.enroll(
            conn,
            session,
            labels=labels,
            capabilities=None if body.capabilities is None else body.capabilities.as_json(),
            provider_kind=body.provider_kind,
            protocol_version=body.protocol_version,
            activation_ttl=ttl,
        )
    _count_enrollment(enrolled)
    if enrolled.activation_token is not None or enrolled.not_issued is not None:
        await observe_lifecycle(  # the promotion committed: an assignment at enrollment
            svc.pool,
            lambda conn: _lag(conn, session.runner_instance_id),
            metrics.control_session_to_assignment,
            "enrollment",
        )
    log.info(
        "runner.enrolled",
        extra={
            "runner_instance_id": str(session.runner_instance_id),
            "activated": enrolled.activation_token is not None,
            "promotion_failure": enrolled.promotion_failure,
            "not_issued": enrolled.not_issued,
        },
    )
    return json_response(ActivationResponse(activation_token=enrolled.activation_token))


@operation(
    Op(
        "Attach the provider identity (once)",
        RCS,
        ProviderRunnerRequest,
        ProviderRunnerResponse,
        "provider-runner-id-taken",
        notes="The body is validated before the token. "
        "`attached` is false when the instance already has an identity or is finished.",
    )
)
async def provider_runner(svc: Deps, request: Request) -> Response:
    body = await read_json(request, ProviderRunnerRequest, svc.settings.server.max_body_bytes)
    session = await svc.auth.control_session(request)
    async with svc.pool.acquire() as conn:
        attached = await runner_instances.attach_provider_runner(
            conn, session.provisioner_id, session.runner_instance_id, body.provider_runner_id
        )
    return json_response(ProviderRunnerResponse(attached=attached))


@operation(Op("Control session liveness", RCS, None, ControlHeartbeatResponse))
async def heartbeat(svc: Deps, request: Request) -> Response:
    session = await svc.auth.control_session(request)
    async with svc.pool.acquire() as conn:
        await control_sessions.heartbeat(conn, session)
    metrics.control_heartbeats.inc()
    return json_response(ControlHeartbeatResponse(ok=True))


def resolve_wait(requested: int | None, cap: int) -> int:
    """Seconds an assignment poll may hold: the request's, within 1..cap (absent: cap)."""
    return max(1, min(cap if requested is None else requested, cap))


async def await_activation(
    read: Callable[[], Awaitable[str | None]],
    park: Callable[[float], Awaitable[bool]],
    *,
    wait: float,
    interval: float,
    clock: Callable[[], float],
) -> str | None:
    """Read until a token comes or `wait` seconds pass. `park(seconds)` waits for a wake-up or
    the timeout and returns True when the client went away. Never reads and never parks past
    the deadline."""
    deadline = clock() + wait
    while True:
        token = await read()
        if token is not None:
            return token
        remaining = deadline - clock()
        if remaining <= 0:
            return None
        if await park(min(interval, remaining)):
            return None
        if clock() >= deadline:
            return None


@operation(
    Op(
        "Long-poll for an assignment; answers an activation token",
        RCS,
        None,
        ActivationResponse,
        query=AssignmentQuery,
        notes="The query is validated before the token; unknown "
        "parameters are 400. Held until the runner is assigned (answers a fresh activation token, "
        "revoking earlier ones) or `wait_seconds` pass (`activation_token` null).",
    )
)
async def assignment(svc: Deps, request: Request) -> Response:
    requested = decode(request, AssignmentQuery, svc.settings).wait_seconds
    cap = svc.settings.provisioners.assignment_poll_max_wait_seconds
    session = await svc.auth.control_session(request)
    ttl = timedelta(seconds=svc.settings.provisioners.activation_token_ttl_seconds)
    runner_id = session.runner_instance_id
    assignments = svc.assignments
    armed: list[anyio.Event] = []

    async def read() -> str | None:
        # Armed before reading: an assignment committed after this read still wakes the park.
        with assignments.watch(runner_id) as event:
            armed[:] = [event]
            async with svc.pool.acquire() as conn:
                # A fresh token when there is an assignment; the reason when none is issued.
                if not await activations.has_pending_assignment(conn, runner_id):
                    return None
                token, reason = await activations.issue_activation_token(conn, runner_id, ttl)
        if reason is not None:
            metrics.activation_not_issued.labels(reason, "poll").inc()
            log.debug(
                "runner.activation_not_issued",
                extra={"runner_instance_id": str(runner_id), "reason": reason},
            )
        return token

    async def park(seconds: float) -> bool:
        with assignments.watch(runner_id) as event:
            if armed and armed[0].is_set():
                return False
            return await hold_until(request, event, seconds)

    token = await await_activation(
        read,
        park,
        wait=resolve_wait(requested, cap),
        interval=RECHECK_SECONDS,
        clock=anyio.current_time,
    )
    return json_response(ActivationResponse(activation_token=token))


def routes(svc: Deps | None) -> list[BaseRoute]:
    return [
        Route("/v1/runner-enrollment/exchange", bound(exchange, svc), methods=["POST"]),
        Route("/v1/runner-control/enrollment", bound(enrollment, svc), methods=["POST"]),
        Route("/v1/runner-control/provider-runner", bound(provider_runner, svc), methods=["POST"]),
        Route("/v1/runner-control/heartbeat", bound(heartbeat, svc), methods=["POST"]),
        Route("/v1/runner-control/assignment", bound(assignment, svc), methods=["GET"]),
    ]
