"""Authentication at the edge. A token's kind prefix is checked before any lookup, so a
credential of one kind never reaches another kind's table; workspace scope is checked after."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from starlette.requests import HTTPConnection, Request

from controlplane.domain import tokens
from controlplane.domain.control_sessions import ActivationGrant, ControlSession
from controlplane.domain.credentials import Credential
from controlplane.domain.jobs import JobIdentity, SessionClaims
from controlplane.domain.provisioners import Provisioner
from controlplane.errors import Forbidden, Unauthorized
from controlplane.store import activations, control_sessions, credentials, ephemeral, provisioners
from controlplane.web.edge import bearer
from controlplane.web.services import Services

log = logging.getLogger("controlplane.auth")

_API_KINDS = {"orchestrator": tokens.Kind.ORCHESTRATOR_KEY, "admin": tokens.Kind.ADMIN_KEY}


def services(request: HTTPConnection) -> Services:
    found: Services = request.app.state.services
    return found


async def api_key(request: Request, kind: str) -> Credential:
    svc = services(request)
    token = bearer(request)
    try:
        digest = tokens.parse_opaque(token, _API_KINDS[kind])
    except tokens.TokenError as error:
        raise Unauthorized() from error
    async with svc.pool.acquire() as conn:
        found = await credentials.api_key_by_digest(conn, kind, digest)
    now = svc.clock()
    if found is None:
        raise Unauthorized()
    if found.revoked_at is not None:
        raise Unauthorized("the API key was revoked", code="api-key-revoked")
    if found.expires_at is not None and found.expires_at <= now:
        raise Unauthorized("the API key expired", code="api-key-expired")
    return found


async def admin(request: Request) -> Services:
    """Authenticate an admin key; the admin routes need nothing else from it."""
    await api_key(request, "admin")
    return services(request)


def require_workspace(credential: Credential, workspace_id: UUID) -> None:
    if credential.workspace_id is not None and credential.workspace_id != workspace_id:
        raise Forbidden("this key is scoped to another workspace", workspace_id=str(workspace_id))


async def manual_registration(request: Request) -> Credential:
    svc = services(request)
    try:
        digest = tokens.parse_opaque(bearer(request), tokens.Kind.MANUAL_REGISTRATION)
    except tokens.TokenError as error:
        raise Unauthorized() from error
    async with svc.pool.acquire() as conn:
        found = await credentials.manual_token_by_digest(conn, digest)
    if found is None:
        raise Unauthorized()
    # Expiry is reported before revocation, as the reference does.
    if found.expires_at is not None and found.expires_at <= svc.clock():
        raise Unauthorized("the registration token expired", code="registration-token-expired")
    if found.revoked_at is not None:
        raise Unauthorized(
            "the registration token was revoked", code="manual-registration-token-revoked"
        )
    return found


async def provisioner(request: HTTPConnection) -> Provisioner:
    """A provisioner token: revocation is reported before expiry, as the reference does; a
    token expiring at this very instant is expired. Last-seen is stamped, throttled; a failing
    stamp does not fail the request."""
    svc = services(request)
    try:
        digest = tokens.parse_opaque(bearer(request), tokens.Kind.PROVISIONER)
    except tokens.TokenError as error:
        raise Unauthorized() from error
    async with svc.pool.acquire() as conn:
        found = await provisioners.by_digest(conn, digest)
        if found is None:
            raise Unauthorized()
        if found.revoked_at is not None:
            raise Unauthorized(
                "the provisioner token was revoked", code="provisioner-token-revoked"
            )
        if found.expires_at is not None and found.expires_at <= svc.clock():
            raise Unauthorized("the provisioner token expired", code="provisioner-token-expired")
        throttle = timedelta(seconds=svc.settings.provisioners.last_seen_throttle_seconds)
        try:
            await provisioners.touch(conn, found.id, throttle)
        except Exception as error:
            log.warning(
                "provisioner.last_seen_failed",
                extra={"provisioner_id": str(found.id), "error": type(error).__name__},
            )
    return found


def bearer_kind(request: HTTPConnection) -> tokens.Kind | None:
    """The kind a well-formed bearer token claims to be, or None (routes taking several kinds
    dispatch on it; each kind's check then runs in full)."""
    try:
        return tokens.kind_of(bearer(request))
    except Unauthorized:
        return None


async def control_session(request: HTTPConnection) -> ControlSession:
    """A provisioned runner's control session: open, unexpired, its provisioner not revoked."""
    svc = services(request)
    try:
        digest = tokens.parse_opaque(bearer(request), tokens.Kind.CONTROL_SESSION)
    except tokens.TokenError as error:
        raise Unauthorized() from error
    async with svc.pool.acquire() as conn:
        found = await control_sessions.control_session_by_digest(conn, digest)
    if found is None:
        raise Unauthorized()
    return found


async def activation(request: HTTPConnection) -> ActivationGrant:
    """An activation token: unconsumed, unrevoked, unexpired, its provisioner not revoked, its
    runner assigned and not yet activated. Every refusal is a plain `unauthorized`."""
    svc = services(request)
    try:
        digest = tokens.parse_opaque(bearer(request), tokens.Kind.ACTIVATION)
    except tokens.TokenError as error:
        raise Unauthorized() from error
    async with svc.pool.acquire() as conn:
        found = await activations.activation_by_digest(conn, digest)
    if found is None:
        raise Unauthorized()
    return found


async def ephemeral_registration(request: HTTPConnection) -> ephemeral.Presented:
    """An ephemeral registration token: unknown, or its provisioner revoked, is `unauthorized`;
    expired (`expires_at` <= now, database clock) is `registration-token-expired`. A consumed
    token passes: it spends rate-limit budget, then registration answers 409."""
    svc = services(request)
    try:
        digest = tokens.parse_opaque(bearer(request), tokens.Kind.EPHEMERAL_REGISTRATION)
    except tokens.TokenError as error:
        raise Unauthorized() from error
    async with svc.pool.acquire() as conn:
        found = await ephemeral.presented(conn, digest)
    if found is None:
        raise Unauthorized()
    if found.expired:
        raise ephemeral.RegistrationTokenExpired()
    if found.provisioner_revoked or found.provisioner_scope is None:
        raise Unauthorized()
    return found


def mint_session(svc: Services, session: SessionClaims, now: datetime) -> str:
    ttl = timedelta(seconds=svc.settings.runners.session_token_ttl_seconds)
    claims = {
        "sid": str(session.runner_session_id),
        "ws": str(session.workspace_id),
        "labels": list(session.labels),
        "max": session.max_claims,
    }
    return tokens.sign(tokens.Kind.RUNNER_SESSION, claims, svc.keys.current, now + ttl)


async def _verified(request: Request, kind: tokens.Kind) -> dict[str, Any]:
    svc = services(request)
    token = bearer(request)
    try:
        return tokens.verify(token, kind, await svc.keys.keys_for(token), svc.clock())
    except tokens.TokenError as error:
        raise Unauthorized() from error


async def runner_session(request: Request) -> SessionClaims:
    claims = await _verified(request, tokens.Kind.RUNNER_SESSION)
    try:
        return SessionClaims(
            runner_session_id=UUID(claims["sid"]),
            workspace_id=UUID(claims["ws"]),
            labels=tuple(claims["labels"]),
            max_claims=claims["max"],
        )
    except (KeyError, TypeError, ValueError) as error:  # signed by us, yet malformed
        raise Unauthorized() from error


@dataclass(frozen=True, slots=True)
class Lease:
    identity: JobIdentity
    runner_session_id: UUID


def mint_lease(svc: Services, lease: Lease, now: datetime) -> str:
    ttl = timedelta(seconds=svc.settings.runners.lease_token_ttl_seconds)
    job = lease.identity
    claims = {
        "ex": str(job.job_execution_id),
        "job": str(job.job_id),
        "run": str(job.workflow_run_id),
        "att": str(job.workflow_run_attempt_id),
        "prj": str(job.project_id),
        "ws": str(job.workspace_id),
        "sid": str(lease.runner_session_id),
    }
    return tokens.sign(tokens.Kind.JOB_LEASE, claims, svc.keys.current, now + ttl)


async def job_lease(request: Request) -> Lease:
    claims = await _verified(request, tokens.Kind.JOB_LEASE)
    try:
        return Lease(
            identity=JobIdentity(
                workspace_id=UUID(claims["ws"]),
                workflow_run_id=UUID(claims["run"]),
                workflow_run_attempt_id=UUID(claims["att"]),
                job_id=UUID(claims["job"]),
                job_execution_id=UUID(claims["ex"]),
                project_id=UUID(claims["prj"]),
            ),
            runner_session_id=UUID(claims["sid"]),
        )
    except (KeyError, TypeError, ValueError) as error:  # signed by us, yet malformed
        raise Unauthorized() from error
