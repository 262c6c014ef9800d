"""Parked runners' liveness, stamped for many sessions in one statement (`touch_sessions`)."""

from __future__ import annotations

from datetime import timedelta
from uuid import UUID

from controlplane.store import claiming
from controlplane.store.pool import Conn
from tests.factories import holding, manual_session

THROTTLE = timedelta(seconds=10)


async def _age(conn: Conn, session: UUID, seconds: int) -> None:
    await conn.execute(
        "UPDATE runner_sessions SET updated_at = now() - $2::interval WHERE id = $1",
        session,
        timedelta(seconds=seconds),
    )


async def _stamped(conn: Conn, session: UUID) -> bool:
    fresh: bool = await conn.fetchval(
        "SELECT updated_at > now() - interval '5 seconds' FROM runner_sessions WHERE id = $1",
        session,
    )
    return fresh


async def test_due_sessions_are_stamped_recent_and_foreign_ones_are_not(
    conn: Conn, workspace: UUID
) -> None:
    due, recent = await manual_session(conn, workspace), await manual_session(conn, workspace)
    await _age(conn, due.runner_session_id, 60)
    await _age(conn, recent.runner_session_id, 6)
    ids = [due.runner_session_id, recent.runner_session_id]
    await claiming.touch_sessions(conn, workspace, ids, THROTTLE)
    assert await _stamped(conn, due.runner_session_id)
    # Within its throttle window: left alone (6 s old is not "fresh" by the 5 s check).
    assert not await _stamped(conn, recent.runner_session_id)
    other = await manual_session(conn, workspace)
    await _age(conn, other.runner_session_id, 60)
    await claiming.touch_sessions(conn, UUID(int=0), [other.runner_session_id], THROTTLE)
    assert not await _stamped(conn, other.runner_session_id)  # not of that workspace


async def test_a_session_row_held_elsewhere_is_skipped_not_waited_for(
    conn: Conn, database_url: str, workspace: UUID
) -> None:
    held, free = await manual_session(conn, workspace), await manual_session(conn, workspace)
    for session in (held, free):
        await _age(conn, session.runner_session_id, 60)
    lock = "SELECT 1 FROM runner_sessions WHERE id = $1 FOR UPDATE"
    async with holding(database_url, lock, held.runner_session_id):
        await conn.execute("SET lock_timeout = '1s'")  # a wait would fail the statement
        await claiming.touch_sessions(
            conn, workspace, [held.runner_session_id, free.runner_session_id], THROTTLE
        )
    assert await _stamped(conn, free.runner_session_id)
    assert not await _stamped(conn, held.runner_session_id)
