"""Reservation cleanup (spec 4.11): deleting reservations, by id (launch grants a provisioner
never received) or by expiry (maintenance), and unbinding their unactivated runners.

This is the one path that reverses the global lock order of `store/reservations.py` (runner
rows before reservation rows); `_delete` says why it cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from uuid import UUID

from controlplane.store.pool import Conn
from controlplane.store.reservations import db_now, lock_reservations, lock_runners


async def delete_reservations(conn: Conn, ids: Collection[UUID]) -> int:
    """Delete these reservations (launch grants a provisioner never received, or any other),
    unbinding their unactivated runners (spec 4.11). Returns the rows deleted. Locks: see
    `_delete`."""
    async with conn.transaction():
        return await _delete(conn, sorted(set(ids)), expired_only=False)


async def delete_expired_reservations(conn: Conn, limit: int = 1000) -> int:
    """Delete up to `limit` expired reservations, oldest expiry first (maintenance). Locks: see
    `_delete`."""
    async with conn.transaction():
        rows = await conn.fetch(
            "SELECT id FROM reservations WHERE expires_at < now() ORDER BY expires_at, id LIMIT $1",
            limit,
        )
        return await _delete(conn, [r["id"] for r in rows], expired_only=True)


async def _delete(conn: Conn, ids: Sequence[UUID], *, expired_only: bool) -> int:
    """Locks: the affected runner rows one at a time in ascending id, then the reservation rows
    FOR UPDATE in id order; no advisory lock.

    This reverses the global order (runner rows before reservation rows). It cannot deadlock
    with allocation: allocation locks reservation rows only of live reservations of its own
    provisioner, and runner rows in the same ascending id order one at a time, so the two meet
    on runner rows in one order, and only cleanup then waits on a reservation row. With an
    assignment (reservation row, then runner rows) it meets only on live reservations, which
    maintenance does not delete; a disconnect deletes grants nobody has assigned against yet.
    """
    if not ids:
        return 0
    affected = await conn.fetch(
        """
        SELECT id FROM runner_instances
         WHERE (reservation_id = ANY($1::uuid[]) AND runner_session_id IS NULL
                AND reservation_released_at IS NULL)
            OR intended_reservation_id = ANY($1::uuid[])
         ORDER BY id
        """,
        list(ids),
    )
    runner_ids = [r.id for r in await lock_runners(conn, [r["id"] for r in affected])]
    locked = await lock_reservations(conn, ids)
    if expired_only:
        now = await db_now(conn)
        locked = [r for r in locked if r.expires_at < now]
    if not locked:
        return 0
    reservation_ids = [r.id for r in locked]
    unbind = """
        FROM runner_instances ri
       WHERE ri.id = ANY($1::uuid[]) AND ri.reservation_id = ANY($2::uuid[])
         AND ri.runner_session_id IS NULL AND ri.reservation_released_at IS NULL
    """
    await conn.execute(
        f"""
        UPDATE runner_activation_tokens SET revoked_at = now()
         WHERE consumed_at IS NULL AND revoked_at IS NULL
           AND runner_instance_id IN (SELECT ri.id {unbind})
        """,  # noqa: S608 -- interpolates constants only: unbind
        runner_ids,
        reservation_ids,
    )
    await conn.execute(
        f"""
        UPDATE runner_instances SET workspace_id = NULL, reservation_id = NULL, assigned_at = NULL,
                                    updated_at = now()
         WHERE id IN (SELECT ri.id {unbind})
        """,  # noqa: S608 -- interpolates constants only: unbind
        runner_ids,
        reservation_ids,
    )
    await conn.execute(
        """
        UPDATE runner_instances SET intended_reservation_id = NULL, updated_at = now()
         WHERE id = ANY($1::uuid[]) AND intended_reservation_id = ANY($2::uuid[])
        """,
        runner_ids,
        reservation_ids,
    )
    status = await conn.execute(
        "DELETE FROM reservations WHERE id = ANY($1::uuid[])", reservation_ids
    )
    return int(status.split()[-1])
