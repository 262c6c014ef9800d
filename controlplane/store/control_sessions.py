"""The provisioned runner's control session (spec 4.3-4.5): the bootstrap exchange that opens
it, its lookup and heartbeat, and enrollment, which promotes the instance's intended
reservation to its assignment.

Locks follow the global order of `store/reservations.py`. Below the runner row, every
transaction here writes in one order: the runner row, then its tokens and control sessions. So
heartbeat, enrollment and activation meet first on the runner row and cannot deadlock on the
control session rows. Token and session expiries are computed on the database clock, like
reservation expiry.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any
from uuid import UUID

import asyncpg

from controlplane.domain import tokens
from controlplane.domain.control_sessions import ControlSession, Enrollment, Exchanged
from controlplane.domain.labels import LabelSet
from controlplane.domain.runner_instances import (
    Cause,
    IllegalTransition,
    ProvisionedRunner,
    RunnerState,
    transition,
)
from controlplane.errors import (
    BootstrapTokenInvalid,
    Conflict,
    ControlSessionInvalid,
    ReservationExpired,
    ReservationNotFound,
    RunnerNotAssignable,
)
from controlplane.store.activations import issue_locked
from controlplane.store.pool import Conn
from controlplane.store.records import found_by_digest, json_text
from controlplane.store.reservations import lock_assignments, lock_reservations, lock_runners
from controlplane.store.runner_instances import assign_locked

# The logger keeps the name it had before the split: operators filter on it.
log = logging.getLogger("controlplane.runner_instances")

# The assignment failures enrollment swallows (spec 4.5 step 6): the runner stays enrolled.
PROMOTION_FAILURES = (ReservationNotFound, ReservationExpired, RunnerNotAssignable)


# ---------------------------------------------------------------- control sessions (4.3, 4.4)


async def exchange_bootstrap(conn: Conn, raw_token: str, control_ttl: timedelta) -> Exchanged:
    """Consume a bootstrap token and open the instance's control session (spec 4.3).

    Locks: the bootstrap token row (its conditional UPDATE: of two concurrent exchanges one
    consumes, the other finds it consumed), then inserts the session. Raises
    `BootstrapTokenInvalid` for an unknown, consumed, revoked or expired token.
    """
    try:
        digest = tokens.parse_opaque(raw_token, tokens.Kind.BOOTSTRAP)
    except tokens.TokenError as error:
        raise BootstrapTokenInvalid() from error
    session = tokens.new_opaque(tokens.Kind.CONTROL_SESSION)
    async with conn.transaction():
        consumed = await conn.fetchrow(
            """
            UPDATE runner_bootstrap_tokens SET consumed_at = now()
             WHERE token_sha256 = $1 AND consumed_at IS NULL AND revoked_at IS NULL
               AND expires_at > now()
            RETURNING runner_instance_id, provisioner_id
            """,
            digest,
        )
        if consumed is None:
            raise BootstrapTokenInvalid()
        expires_at = await conn.fetchval(
            """
            INSERT INTO runner_control_sessions (runner_instance_id, provisioner_id, token_sha256,
                display_prefix, expires_at)
            VALUES ($1, $2, $3, $4, now() + $5::interval)
            RETURNING expires_at
            """,
            consumed["runner_instance_id"],
            consumed["provisioner_id"],
            session.sha256,
            session.display_prefix,
            control_ttl,
        )
    return Exchanged(consumed["runner_instance_id"], session.raw, expires_at)


async def control_session_by_digest(conn: Conn, sha256: str) -> ControlSession | None:
    """The open, unexpired control session with this token digest whose provisioner token is
    not revoked (or no longer exists; provisioner expiry is not checked, as in spec 4.4)."""
    return await found_by_digest(
        conn,
        _control_session,
        """
        SELECT cs.id, cs.token_sha256, cs.runner_instance_id, cs.provisioner_id, cs.expires_at,
               p.scope
          FROM runner_control_sessions cs
          LEFT JOIN provisioner_tokens p ON p.id = cs.provisioner_id
         WHERE cs.token_sha256 = $1 AND cs.closed_at IS NULL AND cs.expires_at > now()
           AND (p.id IS NULL OR p.revoked_at IS NULL)
        """,
        sha256,
    )


def _control_session(row: asyncpg.Record) -> ControlSession:
    return ControlSession(
        row["id"], row["runner_instance_id"], row["provisioner_id"], row["scope"], row["expires_at"]
    )


async def heartbeat(conn: Conn, session: ControlSession) -> None:
    """Liveness: bump the instance's `reported_at`/`updated_at` (never its state) and the open
    control session's `last_seen_at`. Locks: the runner row, then the session row (the order
    activation and enrollment use)."""
    async with conn.transaction():
        await conn.execute(
            "UPDATE runner_instances SET reported_at = now(), updated_at = now() WHERE id = $1",
            session.runner_instance_id,
        )
        await _touch_control_sessions(conn, session.runner_instance_id)


async def _touch_control_sessions(conn: Conn, runner_instance_id: UUID) -> None:
    await conn.execute(
        "UPDATE runner_control_sessions SET last_seen_at = now()"
        " WHERE runner_instance_id = $1 AND closed_at IS NULL",
        runner_instance_id,
    )


# ----------------------------------------------------------------------- enrollment (4.5)


async def enroll(
    conn: Conn,
    session: ControlSession,
    *,
    labels: LabelSet,
    capabilities: dict[str, Any] | None,
    provider_kind: str,
    protocol_version: str,
    activation_ttl: timedelta,
) -> Enrollment:
    """The booted runner declares itself (spec 4.5). `labels` are canonical and already
    sanitised for the provisioner's scope. The instance moves to `running` (a finished or
    stopping one is `ControlSessionInvalid`, 409); its metadata is written only while it has no
    committed assignment. When it was created for a reservation, the reservation is promoted to
    its assignment and an activation token issued, in a savepoint: a failed promotion rolls
    back only the savepoint and the runner stays enrolled, keeping its intended reservation.

    Locks: the assignment lock of its intended reservation, that reservation row FOR UPDATE,
    then the runner row, then the control session rows: the global order, taken before the
    savepoint so the promotion (which locks the same rows again) adds no new lock.
    The intended reservation is only ever cleared after creation, so reading it before locking
    can only over-lock.
    """
    runner_id, provisioner_id = session.runner_instance_id, session.provisioner_id
    async with conn.transaction():
        intended = await conn.fetchrow(
            "SELECT intended_reservation_id FROM runner_instances"
            " WHERE id = $1 AND provisioner_id = $2",
            runner_id,
            provisioner_id,
        )
        if intended is None:
            raise ControlSessionInvalid("the control session's runner instance is gone")
        reservation_id: UUID | None = intended["intended_reservation_id"]
        if reservation_id is not None:
            await lock_assignments(conn, provisioner_id, [reservation_id])
            await lock_reservations(conn, [reservation_id], provisioner_id=provisioner_id)
        (runner,) = await lock_runners(conn, [runner_id])
        try:
            transition(runner.state, RunnerState.RUNNING, Cause.ENROLLMENT)
        except IllegalTransition as error:
            raise ControlSessionInvalid(
                f"a {runner.state.value} runner instance cannot enroll", state=runner.state.value
            ) from error
        await conn.execute(
            """
            UPDATE runner_instances
               SET labels = CASE WHEN assigned_at IS NULL THEN $2 ELSE labels END,
                   capabilities = CASE WHEN assigned_at IS NULL THEN $3::jsonb
                                       ELSE capabilities END,
                   provider_kind = CASE WHEN assigned_at IS NULL THEN $4 ELSE provider_kind END,
                   protocol_version = CASE WHEN assigned_at IS NULL THEN $5
                                           ELSE protocol_version END,
                   state = $6,
                   started_at = COALESCE(started_at, now()),
                   reported_at = now(), updated_at = now()
             WHERE id = $1
            """,
            runner_id,
            list(labels),
            None if capabilities is None else json_text(capabilities),
            provider_kind,
            protocol_version,
            RunnerState.RUNNING.value,
        )
        await _touch_control_sessions(conn, runner_id)
        if runner.intended_reservation_id is None:
            return Enrollment(None)
        return await _promote(conn, runner, runner.intended_reservation_id, activation_ttl)


async def _promote(
    conn: Conn, runner: ProvisionedRunner, reservation_id: UUID, activation_ttl: timedelta
) -> Enrollment:
    try:
        async with conn.transaction():
            await assign_locked(conn, runner.provisioner_id, reservation_id, [runner.id])
            token, reason = await issue_locked(conn, runner.id, activation_ttl)
    except PROMOTION_FAILURES as error:
        reason = error.reason if isinstance(error, RunnerNotAssignable) else error.code
        log.debug(
            "runner.promotion_failed",
            extra={"runner_instance_id": str(runner.id), "reason": reason},
        )
        return Enrollment(None, promotion_failure=reason)
    except (asyncpg.PostgresError, Conflict) as error:
        log.error(
            "runner.promotion_error",
            exc_info=error,
            extra={"runner_instance_id": str(runner.id)},
        )
        return Enrollment(None, promotion_failure="unexpected")
    return Enrollment(token, not_issued=reason)
