"""The live control session of each provisioner: a generation that fences stale sessions.

Locks: `take_over` upserts one provisioner_sessions row (its row lock) after reading the token
row without a lock; `fence` updates that one row; `stamp_seen` updates many, skipping any that is
locked. Two hellos for one provisioner serialise on
the row and each gets its own generation. `hold_fence` locks the row FOR SHARE as the first lock
of every write a session makes (advertisement, allocation, instances, reports); a takeover or a
revocation then waits for that write to commit. Revocation locks the token row before this one,
and nothing holding this row's share lock ever waits for a token row lock, so no cycle.
"""

from __future__ import annotations

from collections.abc import Sequence
from uuid import UUID

from controlplane.domain.provisioners import Fence, lost_fence
from controlplane.store.pool import Conn

TAKEOVER_CHANNEL = "cp_provisioner_takeover"


async def take_over(conn: Conn, provisioner_id: UUID, session_id: UUID) -> int | None:
    """Make `session_id` the provisioner's live session: one statement bumps the generation and
    NOTIFYs it (delivered at commit). None when the token was revoked meanwhile."""
    row = await conn.fetchrow(
        """
        WITH bumped AS (
            INSERT INTO provisioner_sessions (provisioner_id, generation, session_id)
            SELECT id, 1, $2 FROM provisioner_tokens WHERE id = $1 AND revoked_at IS NULL
            ON CONFLICT (provisioner_id) DO UPDATE
                SET generation = provisioner_sessions.generation + 1,
                    session_id = EXCLUDED.session_id,
                    connected_at = now(),
                    last_seen_at = now()
            RETURNING generation
        )
        SELECT generation, pg_notify($3, $1::text || ':' || generation) FROM bumped
        """,
        provisioner_id,
        session_id,
        TAKEOVER_CHANNEL,
    )
    return None if row is None else int(row["generation"])


async def fence(conn: Conn, provisioner_id: UUID, generation: int) -> Fence:
    """Stamp the session's last-seen, only if it still holds the current generation and its
    token is still valid. The write and the check are one statement: the fencing pattern."""
    done = await conn.fetchval(
        """
        UPDATE provisioner_sessions AS s SET last_seen_at = now()
        FROM provisioner_tokens AS t
        WHERE s.provisioner_id = $1 AND s.generation = $2 AND t.id = s.provisioner_id
          AND t.revoked_at IS NULL AND (t.expires_at IS NULL OR t.expires_at > now())
        RETURNING true
        """,
        provisioner_id,
        generation,
    )
    if done:
        return Fence.CURRENT
    row = await conn.fetchrow(
        """
        SELECT s.generation, t.revoked_at IS NOT NULL AS revoked,
               t.expires_at IS NOT NULL AND t.expires_at <= now() AS expired
        FROM provisioner_tokens AS t
        LEFT JOIN provisioner_sessions AS s ON s.provisioner_id = t.id
        WHERE t.id = $1
        """,
        provisioner_id,
    )
    if row is None:
        return lost_fence(
            current_generation=None, generation=generation, revoked=None, expired=False
        )
    return lost_fence(
        current_generation=row["generation"],
        generation=generation,
        revoked=row["revoked"],
        expired=row["expired"],
    )


async def stamp_seen(conn: Conn, sessions: Sequence[tuple[UUID, int]]) -> set[tuple[UUID, int]]:
    """Stamp the last-seen of every (provisioner, generation) given that still holds its
    generation and a valid token, in one statement: a replica's pinged sessions, batched
    (actors/control.py). Returns the pairs stamped; a pair left out lost its fence, or its row
    was locked (a takeover, a revocation or a session write in flight): `fence` it alone.

    Locks: the rows it stamps (FOR UPDATE, SKIP LOCKED: it never waits for a row, so it cannot
    wait in a cycle with a takeover, a revocation or another replica's batch)."""
    if not sessions:
        return set()
    rows = await conn.fetch(
        """
        WITH due AS (
            SELECT s.provisioner_id FROM provisioner_sessions AS s
              JOIN unnest($1::uuid[], $2::bigint[]) AS x(provisioner_id, generation)
                ON x.provisioner_id = s.provisioner_id AND x.generation = s.generation
              JOIN provisioner_tokens AS t ON t.id = s.provisioner_id
             WHERE t.revoked_at IS NULL AND (t.expires_at IS NULL OR t.expires_at > now())
               FOR UPDATE OF s SKIP LOCKED
        )
        UPDATE provisioner_sessions AS s SET last_seen_at = now()
          FROM due WHERE s.provisioner_id = due.provisioner_id
        RETURNING s.provisioner_id, s.generation
        """,
        [p for p, _ in sessions],
        [g for _, g in sessions],
    )
    return {(r["provisioner_id"], int(r["generation"])) for r in rows}


async def hold_fence(conn: Conn, provisioner_id: UUID, generation: int) -> Fence:
    """Inside a transaction: lock the fencing row FOR SHARE if `generation` is still current
    and the token still valid, and stamp nothing. The lock is held to commit, so a takeover or
    a revocation (both UPDATE this row) waits for the writes that follow: they commit under the
    generation that checked them, or not at all. This is the first lock of every write made on
    behalf of a control session (before any workspace or reservation lock).
    """
    held = await conn.fetchval(
        """
        SELECT true FROM provisioner_sessions AS s
          JOIN provisioner_tokens AS t ON t.id = s.provisioner_id
         WHERE s.provisioner_id = $1 AND s.generation = $2
           AND t.revoked_at IS NULL AND (t.expires_at IS NULL OR t.expires_at > now())
           FOR SHARE OF s
        """,
        provisioner_id,
        generation,
    )
    if held:
        return Fence.CURRENT
    return await fence(conn, provisioner_id, generation)
