"""The batched last-seen stamp of a replica's pinged control sessions
(`provisioner_sessions.stamp_seen`) against PostgreSQL: one statement stamps every session still
holding its generation and a valid token, leaves out a stale generation and a revoked token, and
skips a row another transaction holds rather than wait for it."""

from __future__ import annotations

import uuid
from uuid import UUID

import anyio

from controlplane.domain.provisioners import Fence
from controlplane.store import provisioner_sessions, provisioners
from controlplane.store.pool import Conn
from tests import provisioning as rows
from tests.factories import holding


async def _session(conn: Conn) -> tuple[UUID, int]:
    made = await rows.provisioner(conn, uuid.uuid4())
    generation = await provisioner_sessions.take_over(conn, made.id, uuid.uuid4())
    assert generation is not None
    await conn.execute(
        "UPDATE provisioner_sessions SET last_seen_at = now() - interval '1 hour'"
        " WHERE provisioner_id = $1",
        made.id,
    )
    return made.id, generation


async def _fresh(conn: Conn, provisioner_id: UUID) -> bool:
    fresh = await conn.fetchval(
        "SELECT last_seen_at > now() - interval '1 minute' FROM provisioner_sessions"
        " WHERE provisioner_id = $1",
        provisioner_id,
    )
    assert isinstance(fresh, bool)
    return fresh


async def test_one_statement_stamps_the_current_sessions_only(conn: Conn) -> None:
    live, stale, revoked = await _session(conn), await _session(conn), await _session(conn)
    await conn.execute(
        "UPDATE provisioner_sessions SET generation = generation + 1 WHERE provisioner_id = $1",
        stale[0],
    )
    await provisioners.revoke(conn, revoked[0])
    assert await provisioner_sessions.stamp_seen(conn, [live, stale, revoked]) == {live}
    assert [await _fresh(conn, p) for p, _ in (live, stale, revoked)] == [True, False, False]
    # Left out: fenced alone, they tell why.
    assert await provisioner_sessions.fence(conn, *stale) is Fence.SUPERSEDED
    assert await provisioner_sessions.fence(conn, *revoked) is Fence.REVOKED
    assert await provisioner_sessions.stamp_seen(conn, []) == set()


async def test_a_row_held_by_a_session_write_is_skipped_not_waited_for(
    conn: Conn, database_url: str
) -> None:
    held, free = await _session(conn), await _session(conn)
    # A session's write holds its fencing row FOR SHARE until it commits (hold_fence).
    async with holding(
        database_url,
        "SELECT 1 FROM provisioner_sessions WHERE provisioner_id = $1 FOR SHARE",
        held[0],
    ):
        with anyio.fail_after(5):
            assert await provisioner_sessions.stamp_seen(conn, [held, free]) == {free}
    # Once the write committed, the session is still current: fenced alone, it is stamped.
    assert await provisioner_sessions.fence(conn, *held) is Fence.CURRENT
    assert await _fresh(conn, held[0])
