"""Runner instances of a provisioner: batch creation with bootstrap tokens (spec 4.1), the
provider identity (4.2) and assignment to a launch reservation (4.6).

Locks follow the global order of `store/reservations.py`: assignment advisory locks (sorted, one
statement) -> reservation rows FOR UPDATE (id order) -> runner rows FOR UPDATE (id order, one
statement each) -> writes. The decisions (how many entries of a batch a reservation still has
room for, which runners an assignment may take) are `domain.assignment`'s; this module reads
their inputs under those locks and writes what they decide.

Every write that gives a runner an assignment calls `notify_assigned` (delivered at commit) so
its parked assignment long-poll wakes at once. The boot path that follows creation is in
`store/control_sessions.py` (exchange, heartbeat, enrollment) and `store/activations.py`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from datetime import datetime, timedelta
from uuid import UUID

import asyncpg

from controlplane.domain import tokens
from controlplane.domain.assignment import (
    Batch,
    CreatedInstance,
    accept_batch,
    check_assignment,
    committed_to,
)
from controlplane.domain.demand import Reservation
from controlplane.domain.runner_instances import (
    TERMINAL_STATES,
    Cause,
    LaunchKind,
    RunnerState,
    transition,
)
from controlplane.errors import ProviderRunnerIdTaken
from controlplane.store.pool import Conn
from controlplane.store.reservations import (
    db_now,
    lock_assignments,
    lock_reservations,
    lock_runners,
    notify_assigned,
)

_TERMINAL = sorted(TERMINAL_STATES)

# ---------------------------------------------------------------------------------- batch (4.1)


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
    async with conn.transaction():
        found: dict[UUID, Reservation] = {}
        used: Counter[UUID] = Counter()
        now: datetime | None = None
        if wanted:
            await lock_assignments(conn, provisioner_id, wanted)
            found = {
                r.id: r
                for r in await lock_reservations(conn, wanted, provisioner_id=provisioner_id)
            }
            now = await db_now(conn)
            used = await _units_used(conn, provisioner_id, list(wanted))
        kept, failures = accept_batch(entries, reservations=found, used=used, now=now)
        if not kept:
            return Batch((), failures)
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
            [entry.template_key for entry in kept],
            [entry.reservation_id for entry in kept],
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
        CreatedInstance(runner_id, token.raw, entry.request_index)
        for runner_id, token, entry in zip(ids, minted, kept, strict=True)
    )
    return Batch(created, failures)


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
        await assign_locked(conn, provisioner_id, reservation_id, runner_instance_ids)
    return list(runner_instance_ids)


async def assign_locked(
    conn: Conn, provisioner_id: UUID, reservation_id: UUID, runner_ids: Sequence[UUID]
) -> None:
    """The assignment, with the assignment lock already held: lock the reservation row, then
    the runner rows in id order; `domain.assignment.check_assignment` decides (a replay of a
    committed assignment is decided before the reservation is looked at)."""
    found = await lock_reservations(conn, [reservation_id], provisioner_id=provisioner_id)
    runners = {
        r.id: r for r in await lock_runners(conn, runner_ids) if r.provisioner_id == provisioner_id
    }
    requested = sorted(set(runner_ids))
    committed = committed_to(reservation_id, runners)
    if len(committed) == len(requested):
        await _write_assignment(conn, [r.id for r in committed], None)
        return
    new = check_assignment(
        reservation_id=reservation_id,
        reservation=found[0] if found else None,
        requested=requested,
        runners=runners,
        committed=committed,
        used_by_others=(await _units_used(conn, provisioner_id, [reservation_id], requested))[
            reservation_id
        ],
        now=await db_now(conn),
    )
    await _write_assignment(conn, [r.id for r in committed], None)
    await _write_assignment(conn, [r.id for r in new], found[0])


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
