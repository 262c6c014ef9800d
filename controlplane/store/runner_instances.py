"""Runner instances and the provisioned runner's boot path (spec 4.1-4.7, 4.14).

A provisioner creates instances with one-use bootstrap tokens (`create_batch`); the booted
machine trades its bootstrap token for a control session (`exchange_bootstrap`), attaches its
provider identity, enrolls, heartbeats, and long-polls for an assignment; once assigned it gets
an activation token (`issue_activation_token`), which `/v1/runners/register` trades for a
one-claim `activation` runner session (`consume_activation`). Its first claim gives its
reservation unit back (`release_on_first_claim`).

Locks follow the global order of `store/reservations.py`: assignment advisory locks (sorted, one
statement) -> reservation rows FOR UPDATE (id order) -> runner rows FOR UPDATE (id order, one
statement each) -> writes. Below the runner row, every transaction here writes in one order:
the runner row, then its tokens and control sessions. So heartbeat, enrollment and activation
meet first on the runner row and cannot deadlock on the control session rows.

Token and session expiries are computed on the database clock, like reservation expiry.
Every write that gives a runner an assignment calls `notify_assigned` (delivered at commit) so
its parked assignment long-poll wakes at once.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

import asyncpg

from controlplane.domain import tokens
from controlplane.domain.demand import Reservation, ReservationKind
from controlplane.domain.labels import LabelSet, matches
from controlplane.domain.runner_instances import (
    TERMINAL_STATES,
    Cause,
    IllegalTransition,
    LaunchKind,
    ProvisionedRunner,
    RunnerState,
    transition,
)
from controlplane.errors import Conflict, NotFound, Unauthorized
from controlplane.store import sessions
from controlplane.store.pool import Conn
from controlplane.store.records import json_text
from controlplane.store.reservations import (
    db_now,
    lock_assignments,
    lock_reservations,
    lock_runners,
    notify_assigned,
    release_units,
)

log = logging.getLogger("controlplane.runner_instances")

_TERMINAL = sorted(TERMINAL_STATES)


class BootstrapTokenInvalid(Unauthorized):
    """the bootstrap token is unknown, used, revoked or expired"""

    code = "runner-bootstrap-token-invalid"

    def __init__(self) -> None:
        super().__init__(
            "the bootstrap token is unknown, used, revoked or expired",
            code="runner-bootstrap-token-invalid",
        )


class ControlSessionInvalid(Conflict):
    """the runner instance is gone, finished or stopping"""

    code = "runner-control-session-invalid"


class ProviderRunnerIdTaken(Conflict):
    """another instance of the provisioner has that provider id"""

    code = "provider-runner-id-taken"


class ReservationNotFound(NotFound):
    """No launch reservation of this provisioner with that id (bound ones included)."""

    code = "reservation-not-found"


class ReservationExpired(Conflict):
    code = "reservation-expired"


class RunnerNotAssignable(Conflict):
    """`reason` is one of: runner-not-found, already-assigned, already-released,
    capacity-exhausted, runner-not-running, provider-identity-missing,
    control-session-not-active, labels-mismatch."""

    code = "runner-instance-not-assignable"

    def __init__(self, reason: str, runner_instance_ids: Sequence[UUID] = ()) -> None:
        super().__init__(
            f"runner instances cannot be assigned: {reason}",
            reason=reason,
            runner_instance_ids=[str(i) for i in runner_instance_ids],
        )
        self.reason = reason


# The assignment failures enrollment swallows (spec 4.5 step 6): the runner stays enrolled.
PROMOTION_FAILURES = (ReservationNotFound, ReservationExpired, RunnerNotAssignable)


# ---------------------------------------------------------------------------------- batch (4.1)


@dataclass(frozen=True, slots=True)
class CreatedInstance:
    runner_instance_id: UUID
    bootstrap_token: str  # raw, returned once; only its SHA-256 is stored
    request_index: int


@dataclass(frozen=True, slots=True)
class Batch:
    instances: tuple[CreatedInstance, ...]
    # reason (reservation-not-found, reservation-kind-mismatch, reservation-expired,
    # capacity-exhausted) -> units refused for it
    capacity_failures: dict[str, int]

    @property
    def reservation_unavailable(self) -> bool:
        return bool(self.capacity_failures)


async def _units_used(
    conn: Conn, provisioner_id: UUID, reservation_ids: Sequence[UUID], exclude: Sequence[UUID] = ()
) -> Counter[UUID]:
    """used(R) of spec 2.7 for each R: live, unreleased runners of P assigned to or created for
    R, not counting `exclude`. The caller holds the assignment locks of every R."""
    rows = await conn.fetch(
        """
        SELECT r.id, count(DISTINCT ri.id) AS used
          FROM unnest($2::uuid[]) AS r(id)
          JOIN runner_instances ri
            ON ri.provisioner_id = $1
           AND (ri.reservation_id = r.id OR ri.intended_reservation_id = r.id)
           AND ri.reservation_released_at IS NULL
           AND ri.state <> ALL($3::text[])
           AND NOT (ri.id = ANY($4::uuid[]))
         GROUP BY r.id
        """,
        provisioner_id,
        list(reservation_ids),
        _TERMINAL,
        list(exclude),
    )
    return Counter({row["id"]: row["used"] for row in rows})


async def create_batch(
    conn: Conn,
    provisioner_id: UUID,
    *,
    provider_kind: str | None,
    entries: Sequence[tuple[str | None, UUID | None]],
    bootstrap_ttl: timedelta,
) -> Batch:
    """Create one `starting` instance and one bootstrap token per accepted (template_key,
    reservation_id) entry. Entries without a reservation are warm and always accepted; entries
    of reservation R are accepted, in request order, up to pending(R). Reservation problems are
    never errors: they are counted in `capacity_failures`.

    Locks: the assignment locks of every named reservation (one sorted statement), then those
    reservation rows FOR UPDATE in id order; no runner row (it only inserts). Counting used(R)
    under the assignment lock is what keeps two batches, an assignment or a release from
    handing out the same unit twice.
    """
    wanted = Counter(r for _, r in entries if r is not None)
    failures: Counter[str] = Counter()
    accepted: dict[UUID, int] = {}
    async with conn.transaction():
        if wanted:
            await lock_assignments(conn, provisioner_id, wanted)
            found = {
                r.id: r
                for r in await lock_reservations(conn, wanted, provisioner_id=provisioner_id)
            }
            now = await db_now(conn)
            used = await _units_used(conn, provisioner_id, list(wanted))
            for reservation_id, requested in wanted.items():
                reservation = found.get(reservation_id)
                if reservation is None:
                    failures["reservation-not-found"] += requested
                elif reservation.kind is not ReservationKind.LAUNCH:
                    failures["reservation-kind-mismatch"] += requested
                elif not reservation.is_live(now):
                    failures["reservation-expired"] += requested
                else:
                    pending = max(0, reservation.count - used[reservation_id])
                    accepted[reservation_id] = min(requested, pending)
                    if requested > pending:
                        failures["capacity-exhausted"] += requested - pending
        kept: list[tuple[int, str | None, UUID | None]] = []
        for index, (template_key, entry_reservation) in enumerate(entries):
            if entry_reservation is not None:
                if accepted.get(entry_reservation, 0) <= 0:
                    continue
                accepted[entry_reservation] -= 1
            kept.append((index, template_key, entry_reservation))
        if not kept:
            return Batch((), dict(failures))
        rows = await conn.fetch(
            """
            WITH src AS MATERIALIZED (
                SELECT uuidv7() AS id, t.template_key, t.reservation_id, t.n
                  FROM unnest($2::text[], $3::uuid[]) WITH ORDINALITY AS t(template_key,
                                                                           reservation_id, n)
            ), inserted AS (
                INSERT INTO runner_instances (id, provisioner_id, provider_kind, template_key,
                    intended_reservation_id, launch_kind, state, labels, reported_at)
                SELECT id, $1, $4, template_key, reservation_id,
                       CASE WHEN reservation_id IS NULL THEN $5 ELSE $6 END, $7, '{}', now()
                  FROM src
                RETURNING id
            )
            SELECT src.id FROM src JOIN inserted USING (id) ORDER BY src.n
            """,
            provisioner_id,
            [key for _, key, _ in kept],
            [reservation for _, _, reservation in kept],
            provider_kind,
            LaunchKind.WARM.value,
            LaunchKind.DEMAND.value,
            transition(None, RunnerState.STARTING, Cause.CREATE).value,
        )
        ids = [row["id"] for row in rows]
        minted = [tokens.new_opaque(tokens.Kind.BOOTSTRAP) for _ in ids]
        await conn.execute(
            """
            INSERT INTO runner_bootstrap_tokens (runner_instance_id, provisioner_id, token_sha256,
                display_prefix, expires_at)
            SELECT t.id, $1, t.sha, t.prefix, now() + $5::interval
              FROM unnest($2::uuid[], $3::text[], $4::text[]) AS t(id, sha, prefix)
            """,
            provisioner_id,
            ids,
            [token.sha256 for token in minted],
            [token.display_prefix for token in minted],
            bootstrap_ttl,
        )
    created = tuple(
        CreatedInstance(runner_id, token.raw, index)
        for runner_id, token, (index, _, _) in zip(ids, minted, kept, strict=True)
    )
    return Batch(created, dict(failures))


# ------------------------------------------------------------------------- provider identity


async def attach_provider_runner(
    conn: Conn, provisioner_id: UUID, runner_instance_id: UUID, provider_runner_id: str
) -> bool:
    """Set the provider identity once (spec 4.2): only on the provisioner's own, unfinished
    instance that has none yet. False when nothing changed (a second attach, another
    provisioner's or a finished instance). An identity another instance of the provisioner
    already has is `ProviderRunnerIdTaken`.

    Locks: the runner row, through its UPDATE (in a savepoint, so the unique violation leaves
    a caller's transaction usable).
    """
    try:
        async with conn.transaction():
            attached = await conn.fetchval(
                """
                UPDATE runner_instances SET provider_runner_id = $3, updated_at = now()
                 WHERE id = $2 AND provisioner_id = $1 AND provider_runner_id IS NULL
                   AND state <> ALL($4::text[])
                RETURNING id
                """,
                provisioner_id,
                runner_instance_id,
                provider_runner_id,
                _TERMINAL,
            )
    except asyncpg.UniqueViolationError as error:
        raise ProviderRunnerIdTaken(
            "another runner instance of this provisioner has that provider runner id",
            provider_runner_id=provider_runner_id,
        ) from error
    return attached is not None


# ---------------------------------------------------------------- control sessions (4.3, 4.4)


@dataclass(frozen=True, slots=True)
class ControlSession:
    """An authenticated, live control session, with its provisioner's scope."""

    id: UUID
    runner_instance_id: UUID
    provisioner_id: UUID
    provisioner_scope: str | None  # None: the provisioner token row is gone
    expires_at: datetime


@dataclass(frozen=True, slots=True)
class Exchanged:
    runner_instance_id: UUID
    control_session_token: str
    expires_at: datetime


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
    row = await conn.fetchrow(
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
    if row is None or not tokens.same_digest(row["token_sha256"], sha256):
        return None
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


@dataclass(frozen=True, slots=True)
class Enrollment:
    activation_token: str | None
    # Why the intended reservation was not promoted (an assignment rejection reason, or
    # `unexpected`), or why no token was issued after a promotion; None when neither applies.
    promotion_failure: str | None = None
    not_issued: str | None = None


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
            await _assign_locked(conn, runner.provisioner_id, reservation_id, [runner.id])
            token, reason = await _issue_locked(conn, runner.id, activation_ttl)
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


# ----------------------------------------------------------------------- assignment (4.6)


async def assign(
    conn: Conn, provisioner_id: UUID, reservation_id: UUID, runner_instance_ids: Sequence[UUID]
) -> list[UUID]:
    """Assign the provisioner's runners to its launch reservation (spec 4.6); returns the ids
    in request order. Replaying a committed assignment succeeds without reading the reservation
    (after it was deleted, or for a bound one), so concurrent identical calls both succeed.
    Raises `ReservationNotFound` (404), `ReservationExpired` (409) or `RunnerNotAssignable`
    (409, with its `reason`).

    Locks: the assignment lock (P, R), the reservation row FOR UPDATE, then the runner rows
    FOR UPDATE in id order. (The reference locks runner rows before the reservation row; we
    keep the global order instead.)
    """
    async with conn.transaction():
        await lock_assignments(conn, provisioner_id, [reservation_id])
        await _assign_locked(conn, provisioner_id, reservation_id, runner_instance_ids)
    return list(runner_instance_ids)


async def _assign_locked(
    conn: Conn, provisioner_id: UUID, reservation_id: UUID, runner_ids: Sequence[UUID]
) -> None:
    """The assignment, with the assignment lock already held."""
    found = await lock_reservations(conn, [reservation_id], provisioner_id=provisioner_id)
    runners = {
        r.id: r for r in await lock_runners(conn, runner_ids) if r.provisioner_id == provisioner_id
    }
    requested = sorted(set(runner_ids))
    committed = [
        r
        for r in runners.values()
        if r.reservation_id == reservation_id and r.assigned_at and r.workspace_id
    ]
    if len(committed) == len(requested):
        await _write_assignment(conn, [r.id for r in committed], None)
        return
    reservation = found[0] if found else None
    if reservation is None or reservation.kind is not ReservationKind.LAUNCH:
        raise ReservationNotFound("no such launch reservation", reservation_id=str(reservation_id))
    if not reservation.is_live(await db_now(conn)):
        raise ReservationExpired("the reservation expired", reservation_id=str(reservation_id))
    if missing := [i for i in requested if i not in runners]:
        raise RunnerNotAssignable("runner-not-found", missing)
    if taken := [i for i in requested if runners[i].reservation_id not in (None, reservation_id)]:
        raise RunnerNotAssignable("already-assigned", taken)
    committed_ids = {r.id for r in committed}
    new = [runners[i] for i in requested if i not in committed_ids]
    if released := [r.id for r in new if r.released]:
        raise RunnerNotAssignable("already-released", released)
    others = await _units_used(conn, provisioner_id, [reservation_id], exclude=requested)
    charged = len(new) + sum(1 for r in committed if r.holds_unit_of(reservation_id))
    if others[reservation_id] + charged > reservation.count:
        raise RunnerNotAssignable("capacity-exhausted", [r.id for r in new])
    for reason, failing in (
        ("runner-not-running", [r.id for r in new if r.state is not RunnerState.RUNNING]),
        ("provider-identity-missing", [r.id for r in new if r.provider_runner_id is None]),
        (
            "control-session-not-active",
            [r.id for r in new if r.control_session_expires_at is None],
        ),
        ("labels-mismatch", [r.id for r in new if not matches(reservation.labels, r.labels)]),
    ):
        if failing:
            raise RunnerNotAssignable(reason, failing)
    await _write_assignment(conn, [r.id for r in committed], None)
    await _write_assignment(conn, [r.id for r in new], reservation)


async def _write_assignment(
    conn: Conn, runner_ids: Sequence[UUID], reservation: Reservation | None
) -> None:
    """With a reservation: assign; without: only clear the intended id of committed ones."""
    if not runner_ids:
        return
    if reservation is None:
        await conn.execute(
            "UPDATE runner_instances SET intended_reservation_id = NULL, updated_at = now()"
            " WHERE id = ANY($1::uuid[]) AND intended_reservation_id IS NOT NULL",
            list(runner_ids),
        )
    else:
        await conn.execute(
            """
            UPDATE runner_instances
               SET workspace_id = $2, reservation_id = $3, intended_reservation_id = NULL,
                   assigned_at = now(), updated_at = now()
             WHERE id = ANY($1::uuid[])
            """,
            list(runner_ids),
            reservation.workspace_id,
            reservation.id,
        )
    await notify_assigned(conn, runner_ids)


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
        return await _issue_locked(conn, runner_instance_id, ttl)


async def _issue_locked(
    conn: Conn, runner_instance_id: UUID, ttl: timedelta
) -> tuple[str | None, str | None]:
    locked = await lock_runners(conn, [runner_instance_id])
    if not locked:
        return None, "runner-not-found"
    runner = locked[0]
    if runner.workspace_id is None:
        return None, "missing-workspace"
    if runner.runner_session_id is not None:
        return None, "existing-session"
    if runner.state is not RunnerState.RUNNING:
        return None, "not-running"
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


@dataclass(frozen=True, slots=True)
class ActivationGrant:
    """A usable activation token, with what registration needs to know of its runner."""

    token_id: UUID
    runner_instance_id: UUID
    provisioner_id: UUID
    provisioner_scope: str | None
    workspace_id: UUID


async def activation_by_digest(conn: Conn, sha256: str) -> ActivationGrant | None:
    """The activation token with this digest if it is unconsumed, unrevoked and unexpired, its
    provisioner is not revoked (or gone), and its runner is assigned and not activated."""
    row = await conn.fetchrow(
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
    if row is None or not tokens.same_digest(row["token_sha256"], sha256):
        return None
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
        if (
            runner is None
            or runner.workspace_id is None
            or runner.provider_runner_id is None
            or runner.runner_session_id is not None
        ):
            raise Unauthorized()
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
            workspace_id=runner.workspace_id,
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
