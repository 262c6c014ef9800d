"""Authentication at the edge. A token's kind prefix is checked before any lookup, so a
credential of one kind never reaches another kind's table; workspace scope is checked after.

Every opaque credential goes through one ladder (`Authenticator.present`): parse the token as its
kind (else `unauthorized`), find it by digest (unknown: `unauthorized`), then the kind's own
refusals (domain/credential_rules.py for keys and tokens an operator issues; the lookup's own
conditions for the boot path's tokens). Signed runner tokens are verified with the key ring.

Admin keys of either kind then pass their role (`credential_rules.may_change`): an observer
only reads. A workspace admin key is good for its own workspace's routes alone: on another
workspace's, or on an installation (`/v1/admin/...`) route, it is 403 `forbidden` once it has
been found valid (an invalid one is 401 like any other).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Generic, TypeVar
from uuid import UUID

import asyncpg
from starlette.requests import HTTPConnection, Request

from controlplane.domain import credential_rules as rules
from controlplane.domain import tokens
from controlplane.domain.control_sessions import ActivationGrant, ControlSession
from controlplane.domain.credentials import Credential
from controlplane.domain.jobs import JobIdentity, SessionClaims
from controlplane.domain.provisioners import Provisioner
from controlplane.errors import Forbidden, ReadOnlyKey, Unauthorized
from controlplane.settings import Settings
from controlplane.store import (
    activations,
    control_sessions,
    credentials,
    ephemeral,
    provisioners,
)
from controlplane.store.credentials import KeyRing
from controlplane.store.pool import Conn
from controlplane.web.edge import bearer, path_uuid

log = logging.getLogger("controlplane.auth")

T = TypeVar("T")


def utc_now() -> datetime:
    return datetime.now(UTC)


def _accepted(_found: object, _now: datetime) -> None:
    """Found is enough: the lookup itself refused what this kind refuses."""


@dataclass(frozen=True, slots=True)
class Check(Generic[T]):
    """One kind of opaque credential: its token kind, how it is found by digest, and how a found
    one is still refused at `now` (raises)."""

    kind: tokens.Kind
    find: Callable[[Conn, str], Awaitable[T | None]]
    refuse: Callable[[T, datetime], None] = _accepted


def _ephemeral_refusal(found: ephemeral.Presented, _now: datetime) -> None:
    """Expired (`expires_at` <= now, by the database's clock) is `registration-token-expired`;
    its provisioner revoked or gone is a plain `unauthorized`. A consumed token passes: it spends
    rate-limit budget, then registration answers 409."""
    if found.expired:
        raise ephemeral.RegistrationTokenExpired()
    if found.provisioner_revoked or found.provisioner_scope is None:
        raise Unauthorized()


async def _orchestrator_key(conn: Conn, sha256: str) -> Credential | None:
    return await credentials.api_key_by_digest(conn, rules.Family.ORCHESTRATOR, sha256)


async def _admin_key(conn: Conn, sha256: str) -> Credential | None:
    return await credentials.api_key_by_digest(conn, rules.Family.ADMIN, sha256)


async def _workspace_admin_key(conn: Conn, sha256: str) -> Credential | None:
    return await credentials.api_key_by_digest(conn, rules.Family.WORKSPACE_ADMIN, sha256)


ORCHESTRATOR_KEY = Check(tokens.Kind.ORCHESTRATOR_KEY, _orchestrator_key, rules.API_KEY.check)
ADMIN_KEY = Check(tokens.Kind.ADMIN_KEY, _admin_key, rules.API_KEY.check)
WORKSPACE_ADMIN_KEY = Check(
    tokens.Kind.WORKSPACE_ADMIN_KEY, _workspace_admin_key, rules.API_KEY.check
)
MANUAL_REGISTRATION = Check(
    tokens.Kind.MANUAL_REGISTRATION,
    credentials.manual_token_by_digest,
    rules.REGISTRATION_TOKEN.check,
)
PROVISIONER = Check(tokens.Kind.PROVISIONER, provisioners.by_digest, rules.PROVISIONER_TOKEN.check)
# Open, unexpired, its provisioner not revoked: the lookup refuses anything else.
CONTROL_SESSION = Check(tokens.Kind.CONTROL_SESSION, control_sessions.control_session_by_digest)
# Unconsumed, unrevoked, unexpired, its provisioner not revoked, its runner assigned and not yet
# activated: the lookup refuses anything else, each as a plain `unauthorized`.
ACTIVATION = Check(tokens.Kind.ACTIVATION, activations.activation_by_digest)
EPHEMERAL_REGISTRATION = Check(
    tokens.Kind.EPHEMERAL_REGISTRATION, ephemeral.presented, _ephemeral_refusal
)


def require_workspace(credential: Credential, workspace_id: UUID) -> None:
    if credential.workspace_id is not None and credential.workspace_id != workspace_id:
        raise Forbidden("this key is scoped to another workspace", workspace_id=str(workspace_id))


def _role_allows(key: Credential, request: HTTPConnection) -> Credential:
    method = request.scope.get("method", "GET")
    if not rules.may_change(key.role, method):
        raise ReadOnlyKey()
    return key


def bearer_kind(request: HTTPConnection) -> tokens.Kind | None:
    """The kind a well-formed bearer token claims to be, or None (routes taking several kinds
    dispatch on it; each kind's check then runs in full)."""
    try:
        return tokens.kind_of(bearer(request))
    except Unauthorized:
        return None


@dataclass(frozen=True, slots=True)
class Lease:
    identity: JobIdentity
    runner_session_id: UUID


class Authenticator:
    """What a request presents, checked; and the runner tokens this replica signs."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        keys: KeyRing,
        settings: Settings,
        clock: Callable[[], datetime] = utc_now,
    ) -> None:
        self._pool = pool
        self._keys = keys
        self._clock = clock
        self._last_seen_throttle = timedelta(
            seconds=settings.provisioners.last_seen_throttle_seconds
        )
        self._session_ttl = timedelta(seconds=settings.runners.session_token_ttl_seconds)
        self._lease_ttl = timedelta(seconds=settings.runners.lease_token_ttl_seconds)

    @asynccontextmanager
    async def _presented(
        self, request: HTTPConnection, check: Check[T]
    ) -> AsyncIterator[tuple[Conn, T]]:
        """The ladder every opaque credential climbs; yields it found and not refused, with the
        connection it was found on."""
        try:
            digest = tokens.parse_opaque(bearer(request), check.kind)
        except tokens.TokenError as error:
            raise Unauthorized() from error
        async with self._pool.acquire() as conn:
            found = await check.find(conn, digest)
            if found is None:
                raise Unauthorized()
            check.refuse(found, self._clock())
            yield conn, found

    async def present(self, request: HTTPConnection, check: Check[T]) -> T:
        """The bearer credential of `check`'s kind, or Unauthorized with that kind's code."""
        async with self._presented(request, check) as (_conn, found):
            return found

    async def orchestrator(self, request: HTTPConnection) -> Credential:
        return await self.present(request, ORCHESTRATOR_KEY)

    async def admin(self, request: HTTPConnection) -> Credential:
        """An installation admin key whose role allows this request. A valid workspace admin
        key is refused with 403: installation routes are not its."""
        if bearer_kind(request) is tokens.Kind.WORKSPACE_ADMIN_KEY:
            await self.present(request, WORKSPACE_ADMIN_KEY)
            raise Forbidden("a workspace admin key may use only its workspace's routes")
        return _role_allows(await self.present(request, ADMIN_KEY), request)

    async def workspace_admin(self, request: Request, path_param: str) -> tuple[Credential, UUID]:
        """The workspace the path parameter names and a key allowed to act on it: a workspace
        admin key of that workspace (of another one: 403 `forbidden`), or an installation admin
        key; either with a role that allows this request. The token is checked before the path
        (not a UUID: 400), as on every route."""
        if bearer_kind(request) is tokens.Kind.ADMIN_KEY:
            found = await self.present(request, ADMIN_KEY)
            return _role_allows(found, request), path_uuid(request, path_param)
        found = await self.present(request, WORKSPACE_ADMIN_KEY)
        workspace_id = path_uuid(request, path_param)
        if found.workspace_id != workspace_id:
            raise Forbidden(
                "this key administers another workspace", workspace_id=str(workspace_id)
            )
        return _role_allows(found, request), workspace_id

    async def manual_registration(self, request: HTTPConnection) -> Credential:
        return await self.present(request, MANUAL_REGISTRATION)

    async def control_session(self, request: HTTPConnection) -> ControlSession:
        return await self.present(request, CONTROL_SESSION)

    async def activation(self, request: HTTPConnection) -> ActivationGrant:
        return await self.present(request, ACTIVATION)

    async def ephemeral_registration(self, request: HTTPConnection) -> ephemeral.Presented:
        return await self.present(request, EPHEMERAL_REGISTRATION)

    async def provisioner(self, request: HTTPConnection) -> Provisioner:
        """A provisioner token (of an HTTP request or a WebSocket upgrade). Last-seen is
        stamped, throttled; a failing stamp does not fail the request."""
        async with self._presented(request, PROVISIONER) as (conn, found):
            try:
                await provisioners.touch(conn, found.id, self._last_seen_throttle)
            except Exception as error:
                log.warning(
                    "provisioner.last_seen_failed",
                    extra={"provisioner_id": str(found.id), "error": type(error).__name__},
                )
        return found

    # Signed runner tokens ----------------------------------------------------------------------

    def mint_session(self, session: SessionClaims) -> str:
        claims = {
            "sid": str(session.runner_session_id),
            "ws": str(session.workspace_id),
            "labels": list(session.labels),
            "max": session.max_claims,
        }
        expires_at = self._clock() + self._session_ttl
        return tokens.sign(tokens.Kind.RUNNER_SESSION, claims, self._keys.current, expires_at)

    def mint_lease(self, lease: Lease) -> str:
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
        expires_at = self._clock() + self._lease_ttl
        return tokens.sign(tokens.Kind.JOB_LEASE, claims, self._keys.current, expires_at)

    async def _verified(self, request: HTTPConnection, kind: tokens.Kind) -> dict[str, Any]:
        token = bearer(request)
        try:
            return tokens.verify(token, kind, await self._keys.keys_for(token), self._clock())
        except tokens.TokenError as error:
            raise Unauthorized() from error

    async def runner_session(self, request: HTTPConnection) -> SessionClaims:
        claims = await self._verified(request, tokens.Kind.RUNNER_SESSION)
        try:
            return SessionClaims(
                runner_session_id=UUID(claims["sid"]),
                workspace_id=UUID(claims["ws"]),
                labels=tuple(claims["labels"]),
                max_claims=claims["max"],
            )
        except (KeyError, TypeError, ValueError) as error:  # signed by us, yet malformed
            raise Unauthorized() from error

    async def job_lease(self, request: HTTPConnection) -> Lease:
        claims = await self._verified(request, tokens.Kind.JOB_LEASE)
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
