"""Activation of a provisioned runner (spec 4.7, 4.14): the activation token an assigned runner
gets, its trade for a one-claim `activation` runner session at `/v1/runners/register`, and the
first claim, which gives the runner's reservation unit back.

Locks follow the global order of `store/reservations.py`: the runner row, then its token rows,
then its control session rows (the order `store/control_sessions.py` uses too); the first claim
takes the assignment locks and the reservation row before the runner row.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any
from uuid import UUID

import asyncpg

from controlplane.domain import tokens
from controlplane.domain.control_sessions import ActivationGrant, activation_refusal, may_activate
from controlplane.domain.labels import LabelSet
from controlplane.domain.runner_instances import RunnerState
from controlplane.errors import Unauthorized
from controlplane.store import sessions
from controlplane.store.pool import Conn
from controlplane.store.records import found_by_digest
from controlplane.store.reservations import (
    lock_assignments,
    lock_reservations,
    lock_runners,
    release_units,
)

# ------------------------------------------------------------------------ activation (4.7)


async def issue_activation_token(
    conn: Conn, runner_instance_id: UUID, ttl: timedelta
) -> tuple[str | None, str | None]:
    """A fresh activation token for an assigned, running, unactivated runner, revoking every
    earlier unconsumed one: `(raw token, None)`, or `(None, reason)` with reason
    `runner-not-found`, `missing-workspace`, `existing-session` or `not-running`.

    Locks: the runner row FOR UPDATE (it serialises issuers, and orders issue before or after
    an activation), then its token rows.
    """
    async with conn.transaction():
        return await issue_locked(conn, runner_instance_id, ttl)


async def issue_locked(
    conn: Conn, runner_instance_id: UUID, ttl: timedelta
) -> tuple[str | None, str | None]:
    """`issue_activation_token` inside the caller's transaction (enrollment's promotion)."""
    locked = await lock_runners(conn, [runner_instance_id])
    if reason := activation_refusal(locked[0] if locked else None):
        return None, reason
    token = tokens.new_opaque(tokens.Kind.ACTIVATION)
    await conn.execute(
        "UPDATE runner_activation_tokens SET revoked_at = now()"
        " WHERE runner_instance_id = $1 AND consumed_at IS NULL AND revoked_at IS NULL",
        runner_instance_id,
    )
    await conn.execute(
        """
        INSERT INTO runner_activation_tokens (runner_instance_id, token_sha256, display_prefix,
            expires_at)
        VALUES ($1, $2, $3, now() + $4::interval)
        """,
        runner_instance_id,
        token.sha256,
        token.display_prefix,
        ttl,
    )
    return token.raw, None


async def has_pending_assignment(conn: Conn, runner_instance_id: UUID) -> bool:
    """Whether the runner is assigned, running and not activated (the assignment poll's cheap,
    lock-free read before it issues a token)."""
    found = await conn.fetchval(
        """
        SELECT true FROM runner_instances
         WHERE id = $1 AND workspace_id IS NOT NULL AND runner_session_id IS NULL AND state = $2
        """,
        runner_instance_id,
        RunnerState.RUNNING.value,
    )
    return bool(found)


async def activation_by_digest(conn: Conn, sha256: str) -> ActivationGrant | None:
    """The activation token with this digest if it is unconsumed, unrevoked and unexpired, its
    provisioner is not revoked (or gone), and its runner is assigned and not activated."""
    return await found_by_digest(
        conn,
        _grant,
        """
        SELECT t.id, t.token_sha256, t.runner_instance_id, ri.provisioner_id, ri.workspace_id,
               p.scope
          FROM runner_activation_tokens t
          JOIN runner_instances ri ON ri.id = t.runner_instance_id
          LEFT JOIN provisioner_tokens p ON p.id = ri.provisioner_id
         WHERE t.token_sha256 = $1 AND t.consumed_at IS NULL AND t.revoked_at IS NULL
           AND t.expires_at > now() AND (p.id IS NULL OR p.revoked_at IS NULL)
           AND ri.runner_session_id IS NULL AND ri.workspace_id IS NOT NULL
        """,
        sha256,
    )


def _grant(row: asyncpg.Record) -> ActivationGrant:
    return ActivationGrant(
        row["id"], row["runner_instance_id"], row["provisioner_id"], row["scope"],
        row["workspace_id"],
    )  # fmt: skip


async def consume_activation(
    conn: Conn,
    grant: ActivationGrant,
    *,
    labels: LabelSet,
    capabilities: dict[str, Any] | None,
) -> sessions.Session:
    """Trade the activation token for a one-claim `activation` runner session (spec 4.7):
    link it to the runner, consume the token, close the runner's control sessions
    (`activated`). `labels` are canonical and sanitised for the provisioner's scope.

    Locks: the runner row FOR UPDATE, then the token row (its conditional UPDATE), then the
    control session rows. Of two registrations racing with one token, the second waits on the
    runner row and then finds the session: `Unauthorized` (401), never a second session.
    """
    async with conn.transaction():
        locked = await lock_runners(conn, [grant.runner_instance_id])
        runner = locked[0] if locked else None
        if runner is None or not may_activate(runner):
            raise Unauthorized()
        workspace_id = runner.workspace_id
        assert workspace_id is not None  # may_activate checked it
        consumed = await conn.fetchval(
            """
            UPDATE runner_activation_tokens SET consumed_at = now()
             WHERE id = $1 AND consumed_at IS NULL AND revoked_at IS NULL AND expires_at > now()
            RETURNING id
            """,
            grant.token_id,
        )
        if consumed is None:
            raise Unauthorized()
        session = await sessions.create(
            conn,
            workspace_id=workspace_id,
            registration_token_id=grant.token_id,
            kind="activation",
            labels=labels,
            capabilities=capabilities,
            max_claims=1,
            runner_instance_id=runner.id,
            provisioner_id=runner.provisioner_id,
            provider_runner_id=runner.provider_runner_id,
        )
        await conn.execute(
            "UPDATE runner_activation_tokens SET consumed_session_id = $2 WHERE id = $1",
            grant.token_id,
            session.id,
        )
        await conn.execute(
            "UPDATE runner_instances SET runner_session_id = $2, updated_at = now() WHERE id = $1",
            runner.id,
            session.id,
        )
        await conn.execute(
            """
            UPDATE runner_control_sessions SET closed_at = now(), close_reason = 'activated'
             WHERE runner_instance_id = $1 AND closed_at IS NULL
            """,
            runner.id,
        )
    return session


# ------------------------------------------------------------------- first claim (4.14)


async def lock_first_claim(conn: Conn, runner_session_id: UUID) -> None:
    """Before a capped claim locks its session row: if the session is a provisioned runner's
    that has not claimed yet, take the assignment locks of its reservations (the first lock
    `release_on_first_claim` needs), so the claim's locks follow the global order. One indexed
    read for every capped claim; nothing for a runner that already claimed."""
    row = await conn.fetchrow(
        """
        SELECT provisioner_id, reservation_id, intended_reservation_id FROM runner_instances
         WHERE runner_session_id = $1 AND first_claimed_at IS NULL
        """,
        runner_session_id,
    )
    if row is not None:
        await lock_assignments(
            conn, row["provisioner_id"], [row["intended_reservation_id"], row["reservation_id"]]
        )


async def release_on_first_claim(conn: Conn, runner_session_id: UUID) -> int:
    """On the first claim by a runner's activation session: stamp `first_claimed_at`, clear the
    intended reservation, mark the unit released and give one unit of `intended ?? reservation`
    back if that reservation is still live. Later claims change nothing. Returns units released.

    Call it inside the claim's transaction, after the lease is written. Locks: the assignment
    locks of the runner's reservation ids, that reservation row FOR UPDATE, then the runner row
    (re-checked: a concurrent first claim or release found it first). The claim took these
    assignment locks before its session row (`lock_first_claim`); taking them again here is a
    no-op unless the runner's links moved in between, which the re-check handles.
    """
    row = await conn.fetchrow(
        """
        SELECT id, provisioner_id, reservation_id, intended_reservation_id FROM runner_instances
         WHERE runner_session_id = $1 AND first_claimed_at IS NULL
        """,
        runner_session_id,
    )
    if row is None:
        return 0
    provisioner_id = row["provisioner_id"]
    target: UUID | None = row["intended_reservation_id"] or row["reservation_id"]
    async with conn.transaction():
        await lock_assignments(
            conn, provisioner_id, [row["intended_reservation_id"], row["reservation_id"]]
        )
        found = await lock_reservations(
            conn, [] if target is None else [target], provisioner_id=provisioner_id
        )
        locked = await lock_runners(conn, [row["id"]])
        if not locked:
            return 0
        runner = locked[0]
        stamped = await conn.fetchval(
            """
            UPDATE runner_instances
               SET first_claimed_at = now(), intended_reservation_id = NULL,
                   reservation_released_at = COALESCE(reservation_released_at, now()),
                   updated_at = now()
             WHERE id = $1 AND first_claimed_at IS NULL
            RETURNING true
            """,
            runner.id,
        )
        if not stamped or runner.released:
            return 0
        if (
            target is None
            or (runner.intended_reservation_id or runner.reservation_id) != target
            or not found
        ):
            # The runner's reservation changed between the read and the lock (it was rebound):
            # its unit is marked released; the reservation we locked is not the one it held.
            return 0
        return await release_units(conn, found[0].workspace_id, provisioner_id, [target])
