"""Ephemeral registration tokens (spec provisioning 1.9, 4.15; jobs 3.14; surface 2.5, 3).

A provisioner mints one-use `cp_ert_` tokens for its provider runners over its control session
(`mint`); `POST /v1/runners/register` trades one for a one-claim `ephemeral` runner session
(`consume`), after counting the attempt against the token's rate limit (`count_attempt`). Reports
credit a runner's latest ephemeral session (`consumed_sessions`); maintenance deletes old tokens
(`prune_ephemeral_tokens`).

Locks follow the global order of `store/reservations.py` (fence row -> workspace lock ->
assignment locks -> reservation rows -> runner rows -> writes). The one lock of its own,
`locks.ephemeral_mint(W, P, provider runner id)`, is taken by `mint` alone, last (after the
assignment lock of a batch's reservation), and nothing but inserts follows it: no transaction
holding one ever waits for a lock another kind of transaction holds, so it adds no cycle.

The limiter row is a separate table, so a limiter check never waits for a consumption (or the
reverse), and `count_attempt` runs in its own short transaction under a 250 ms lock and
statement timeout: the limiter fails closed (`RateLimitUnavailable`, 503) rather than holding a
registration behind a stuck row. Token expiry and the limiter window use the database clock.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

import asyncpg

from controlplane.domain import tokens
from controlplane.domain.labels import LabelSet
from controlplane.errors import (
    EphemeralTokenActive,
    InvalidInput,
    RateLimitUnavailable,
    RegistrationRateLimited,
    RegistrationTokenConsumed,
    RegistrationTokenWorkspaceMismatch,
    ReservationCapacityExhausted,
    ReservationExpired,
    ReservationNotFound,
    Unauthorized,
)

# web/auth.py raises it for an expired token it presented here.
from controlplane.errors import RegistrationTokenExpired as RegistrationTokenExpired
from controlplane.store import locks, sessions
from controlplane.store.pool import Conn
from controlplane.store.records import found_by_digest, from_row
from controlplane.store.reservations import lock_assignments, lock_workspace

log = logging.getLogger("controlplane.ephemeral")

BATCH_MAX = 500  # spec REGISTRATION_TOKEN_BATCH_MAX
RATE_LIMIT_TIMEOUT_MS = 250  # spec RUNNERS_RATE_LIMIT_TIMEOUT_MS
GC_BATCH = 1000  # spec RUNNER_EPHEMERAL_TOKEN_GC_BATCH_SIZE


# ---------------------------------------------------------------------------------------- mint


@dataclass(frozen=True, slots=True)
class MintedToken:
    id: UUID
    provider_runner_id: str
    token: str  # raw, returned once; only its SHA-256 is stored
    expires_at: datetime


async def mint(
    conn: Conn,
    *,
    provisioner_id: UUID,
    workspace_id: UUID | None,
    provider_runner_ids: Sequence[str],
    ttl: timedelta,
    reservation_id: UUID | None = None,
) -> list[MintedToken]:
    """One token per provider runner id, all or none; in request order.

    Without `reservation_id` (the single mint of spec 4.15, for each id) the tokens are for
    `workspace_id`, which is then required. With it (the batch mint): the reservation must be a
    live launch reservation of this provisioner (and of `workspace_id` when given), whose
    workspace the tokens are for; the batch may not hold more ids than its count, nor may the
    tokens already minted for it (any status) plus the batch. Either way the whole request is
    refused when any id already has an active (unconsumed, unexpired) token in that workspace.

    Locks, inside the caller's transaction when there is one (the control session's fence row
    first): the batch's assignment lock (P, R), which serialises two batches counting the same
    reservation's tokens; then the ephemeral-mint keys of every id (one sorted statement);
    then inserts.
    """
    ids = list(provider_runner_ids)
    if not ids or len(ids) > BATCH_MAX:
        raise InvalidInput(f"mint between 1 and {BATCH_MAX} tokens at a time", count=len(ids))
    if len(set(ids)) != len(ids):
        raise InvalidInput("provider_runner_ids must be unique")
    async with conn.transaction():
        if reservation_id is not None:
            workspace_id = await _check_reservation(
                conn, provisioner_id, reservation_id, workspace_id, len(ids)
            )
        elif workspace_id is None:
            raise InvalidInput("an installation provisioner must name the reservation_id")
        keys = sorted({locks.ephemeral_mint(workspace_id, provisioner_id, i) for i in ids})
        await conn.execute(
            "SELECT pg_advisory_xact_lock(k) FROM unnest($1::bigint[]) WITH ORDINALITY AS t(k, n)"
            " ORDER BY n",
            keys,
        )
        active = await conn.fetch(
            """
            SELECT DISTINCT provider_runner_id FROM ephemeral_registration_tokens
             WHERE workspace_id = $1 AND provisioner_id = $2 AND provider_runner_id = ANY($3)
               AND consumed_at IS NULL AND expires_at > now()
             ORDER BY provider_runner_id
            """,
            workspace_id,
            provisioner_id,
            ids,
        )
        if active:
            taken = [row["provider_runner_id"] for row in active]
            raise EphemeralTokenActive(
                "a provider runner already has an active ephemeral token",
                provider_runner_ids=taken,
            )
        minted = {i: tokens.new_opaque(tokens.Kind.EPHEMERAL_REGISTRATION) for i in ids}
        rows = await conn.fetch(
            """
            INSERT INTO ephemeral_registration_tokens (workspace_id, provisioner_id,
                reservation_id, provider_runner_id, token_sha256, display_prefix, expires_at)
            SELECT $1, $2, $3, t.pid, t.sha, t.prefix, now() + $7::interval
              FROM unnest($4::text[], $5::text[], $6::text[]) AS t(pid, sha, prefix)
            RETURNING id, provider_runner_id, expires_at
            """,
            workspace_id,
            provisioner_id,
            reservation_id,
            ids,
            [minted[i].sha256 for i in ids],
            [minted[i].display_prefix for i in ids],
            ttl,
        )
    by_id = {row["provider_runner_id"]: row for row in rows}
    return [MintedToken(by_id[i]["id"], i, minted[i].raw, by_id[i]["expires_at"]) for i in ids]


async def mint_one(
    conn: Conn, *, provisioner_id: UUID, workspace_id: UUID, provider_runner_id: str, ttl: timedelta
) -> MintedToken:
    """The single mint: `mint` of one id, without a reservation (same locks)."""
    [token] = await mint(
        conn,
        provisioner_id=provisioner_id,
        workspace_id=workspace_id,
        provider_runner_ids=[provider_runner_id],
        ttl=ttl,
    )
    return token


async def _check_reservation(
    conn: Conn, provisioner_id: UUID, reservation_id: UUID, workspace_id: UUID | None, wanted: int
) -> UUID:
    """Take the reservation's assignment lock and check a batch of `wanted` fits in it; its
    workspace. A plain read of the row is enough under that lock: every change of its count
    holds it too, and an expiry is judged on the database clock here."""
    await lock_assignments(conn, provisioner_id, [reservation_id])
    row = await conn.fetchrow(
        """
        SELECT r.workspace_id, r.kind, r.count, r.expires_at > now() AS live,
               (SELECT count(*) FROM ephemeral_registration_tokens t
                 WHERE t.reservation_id = r.id) AS minted
          FROM reservations r
         WHERE r.id = $1 AND r.provisioner_id = $2
        """,
        reservation_id,
        provisioner_id,
    )
    if (
        row is None
        or row["kind"] != "launch"
        or (workspace_id is not None and row["workspace_id"] != workspace_id)
    ):
        raise ReservationNotFound("no launch reservation of yours with that id")
    if not row["live"]:
        raise ReservationExpired("the reservation expired")
    if row["minted"] + wanted > row["count"]:
        raise ReservationCapacityExhausted(
            "the reservation has fewer units than the tokens minted for it would be",
            count=row["count"],
            minted=row["minted"],
            requested=wanted,
        )
    found: UUID = row["workspace_id"]
    return found


# ------------------------------------------------------------------------------- registration


@dataclass(frozen=True, slots=True)
class Presented:
    """A token found by its digest, with what registration needs to know; not yet checked."""

    token_id: UUID
    workspace_id: UUID
    provisioner_id: UUID
    provisioner_scope: str | None  # None: the provisioner token is gone
    provider_runner_id: str
    expired: bool
    provisioner_revoked: bool


async def presented(conn: Conn, sha256: str) -> Presented | None:
    """The token with this digest, whatever its state (one indexed read, no lock)."""
    return await found_by_digest(
        conn,
        _presented,
        """
        SELECT t.id AS token_id, t.token_sha256, t.workspace_id, t.provisioner_id,
               t.provider_runner_id, t.expires_at <= now() AS expired,
               p.scope AS provisioner_scope, p.revoked_at IS NOT NULL AS revoked
          FROM ephemeral_registration_tokens t
          LEFT JOIN provisioner_tokens p ON p.id = t.provisioner_id
         WHERE t.token_sha256 = $1
        """,
        sha256,
    )


def _presented(row: asyncpg.Record) -> Presented:
    return from_row(Presented, row, provisioner_revoked=bool(row["revoked"]))


async def count_attempt(
    conn: Conn,
    token_id: UUID,
    *,
    limit: int,
    window: timedelta,
    timeout_ms: int = RATE_LIMIT_TIMEOUT_MS,
) -> int:
    """Count one registration attempt with the token; its number within the window. Raises
    `RegistrationRateLimited` past `limit` (the attempt still counts) and `RateLimitUnavailable`
    when the limiter row stays locked, or the statement runs, past `timeout_ms`, or the store
    fails: the limiter fails closed.

    The window starts at the token's first attempt and lasts `window`; the first attempt after
    it starts the next one. Locks: the token's limiter row (the upsert), in its own transaction;
    the foreign key takes a KEY SHARE lock on the token row, which a consumption's UPDATE does
    not conflict with.
    """
    try:
        async with conn.transaction():
            await conn.execute(
                "SELECT set_config('lock_timeout', $1, true),"
                " set_config('statement_timeout', $1, true)",
                f"{timeout_ms}ms",
            )
            row = await conn.fetchrow(
                """
                INSERT INTO ephemeral_registration_attempts AS a (token_id, window_start, attempts)
                VALUES ($1, now(), 1)
                ON CONFLICT (token_id) DO UPDATE SET
                    window_start = CASE WHEN a.window_start + $2::interval <= now()
                                        THEN now() ELSE a.window_start END,
                    attempts = CASE WHEN a.window_start + $2::interval <= now()
                                    THEN 1 ELSE a.attempts + 1 END
                RETURNING attempts, greatest(1, ceil(extract(epoch FROM
                          a.window_start + $2::interval - now())))::int AS retry_after
                """,
                token_id,
                window,
            )
    except asyncpg.ForeignKeyViolationError as error:
        raise Unauthorized() from error  # the token was collected since it was presented
    except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError) as error:
        # The lock or statement timeout (55P03, 57014) or any other failure: fail closed.
        raise RateLimitUnavailable() from error
    assert row is not None
    attempts: int = row["attempts"]
    if attempts > limit:
        raise RegistrationRateLimited(row["retry_after"])
    return attempts


@dataclass(frozen=True, slots=True)
class Consumed:
    session: sessions.Session
    provisioner_id: UUID
    provider_runner_id: str
    linked_runner_ids: tuple[UUID, ...]


async def consume(
    conn: Conn,
    token_id: UUID,
    workspace_id: UUID,
    *,
    labels: LabelSet,
    capabilities: dict[str, Any] | None = None,
) -> Consumed:
    """Trade the token for a one-claim `ephemeral` runner session of `workspace_id` linked to
    the token's provisioner and provider runner; stamp the token consumed with that session and
    link the provisioner's unreleased runner instance with that provider id in the workspace.
    `labels` are canonical and already sanitised for the provisioner's scope. Any refusal rolls
    everything back, so the token stays unconsumed.

    Refusals: gone -> `Unauthorized`; another workspace -> `RegistrationTokenWorkspaceMismatch`;
    used -> `RegistrationTokenConsumed`; expired -> `RegistrationTokenExpired`; its provisioner
    revoked -> `Unauthorized`.

    Locks: the workspace lock (as the spec: it serialises with that workspace's allocation,
    reports and a workspace provisioner's revocation), then the token row (the conditional
    UPDATE; of two registrations racing with one token, the second waits here and finds it
    consumed), then the session insert, then the runner row (the UPDATE, by its unique
    provider identity).
    """
    async with conn.transaction():
        await lock_workspace(conn, workspace_id)
        row = await conn.fetchrow(
            """
            UPDATE ephemeral_registration_tokens SET consumed_at = now()
             WHERE id = $1 AND workspace_id = $2 AND consumed_at IS NULL AND expires_at > now()
            RETURNING provisioner_id, provider_runner_id
            """,
            token_id,
            workspace_id,
        )
        if row is None:
            await _refuse(conn, token_id, workspace_id)
        assert row is not None
        provisioner_id: UUID = row["provisioner_id"]
        provider_runner_id: str = row["provider_runner_id"]
        revoked = await conn.fetchval(
            "SELECT revoked_at IS NOT NULL FROM provisioner_tokens WHERE id = $1", provisioner_id
        )
        if revoked is not False:
            raise Unauthorized()
        session = await sessions.create(
            conn,
            workspace_id=workspace_id,
            registration_token_id=token_id,
            kind="ephemeral",
            labels=labels,
            capabilities=capabilities,
            max_claims=1,
            provisioner_id=provisioner_id,
            provider_runner_id=provider_runner_id,
        )
        await conn.execute(
            "UPDATE ephemeral_registration_tokens SET consumed_session_id = $2 WHERE id = $1",
            token_id,
            session.id,
        )
        linked = await conn.fetch(
            """
            UPDATE runner_instances SET runner_session_id = $4, updated_at = now()
             WHERE workspace_id = $1 AND provisioner_id = $2 AND provider_runner_id = $3
               AND reservation_released_at IS NULL
            RETURNING id
            """,
            workspace_id,
            provisioner_id,
            provider_runner_id,
            session.id,
        )
    return Consumed(session, provisioner_id, provider_runner_id, tuple(row["id"] for row in linked))


async def _refuse(conn: Conn, token_id: UUID, workspace_id: UUID) -> None:
    """Why the conditional consumption matched nothing (the caller holds the workspace lock)."""
    row = await conn.fetchrow(
        """
        SELECT workspace_id, provisioner_id, consumed_at IS NOT NULL AS consumed
          FROM ephemeral_registration_tokens WHERE id = $1
        """,
        token_id,
    )
    if row is None:
        raise Unauthorized()
    if row["workspace_id"] != workspace_id:
        raise RegistrationTokenWorkspaceMismatch(
            "the token belongs to another workspace", token_id=str(token_id)
        )
    if row["consumed"]:
        log.warning(
            "ephemeral.token_reused",
            extra={"token_id": str(token_id), "provisioner_id": str(row["provisioner_id"])},
        )
        raise RegistrationTokenConsumed()
    raise RegistrationTokenExpired()


# ---------------------------------------------------------------------------- reports and GC


async def consumed_sessions(
    conn: Conn, workspace_id: UUID, provisioner_id: UUID, provider_runner_ids: Sequence[str]
) -> dict[str, UUID]:
    """For each provider runner id of (W, P), the session of its most recently consumed token
    (spec 4.8 step 3). A plain read: no lock."""
    rows = await conn.fetch(
        """
        SELECT DISTINCT ON (provider_runner_id) provider_runner_id, consumed_session_id
          FROM ephemeral_registration_tokens
         WHERE workspace_id = $1 AND provisioner_id = $2 AND provider_runner_id = ANY($3)
           AND consumed_session_id IS NOT NULL
         ORDER BY provider_runner_id, consumed_at DESC, id DESC
        """,
        workspace_id,
        provisioner_id,
        list(provider_runner_ids),
    )
    return {row["provider_runner_id"]: row["consumed_session_id"] for row in rows}


async def prune_ephemeral_tokens(conn: Conn, older_than: timedelta, limit: int = GC_BATCH) -> int:
    """Delete up to `limit` tokens consumed, or expired, more than `older_than` ago (oldest
    first), with their limiter rows; return how many. An active token is never deleted.

    Locks: the chosen token rows FOR UPDATE SKIP LOCKED (a token being consumed, or counted by
    the limiter, right now is left for the next run), then their limiter rows (the cascade).
    """
    deleted: int = await conn.fetchval(
        """
        WITH doomed AS (
            SELECT id FROM ephemeral_registration_tokens
             WHERE coalesce(consumed_at, expires_at) < now() - $1::interval
             ORDER BY coalesce(consumed_at, expires_at), id
             LIMIT $2
               FOR UPDATE SKIP LOCKED
        ), gone AS (
            DELETE FROM ephemeral_registration_tokens
             WHERE id IN (SELECT id FROM doomed) RETURNING 1
        )
        SELECT count(*) FROM gone
        """,
        older_than,
        limit,
    )
    return deleted
