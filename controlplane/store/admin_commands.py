"""Idempotent admin commands: what an (actor, Idempotency-Key) pair already did.

A create remembers the SHA-256 of the token it derived (a replay re-derives the token and checks
it against this); a revoke remembers the JSON it answered (a replay answers it again). Exactly one
of the two is set.

Locks: the advisory lock `cp_admin_command:<actor>:<key>` (transaction, blocking), taken first,
before the lookup, and held through the command and the record, so two concurrent requests with
the same key run one after the other and the second replays the first. Nothing else takes this
key, and nothing that holds one of the locks a command takes next (a provisioner revoke's, see
store/provisioners.py) waits for it, so taking it first cannot deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass
from uuid import UUID

from controlplane.store import locks
from controlplane.store.pool import Conn


@dataclass(frozen=True, slots=True)
class Remembered:
    command: str
    request_sha256: str
    target_id: UUID
    token_sha256: str | None = None  # a create's
    answer: str | None = None  # a revoke's: the JSON body it answered


async def lock_and_find(conn: Conn, actor_id: UUID, key_sha256: str) -> Remembered | None:
    """Inside the caller's transaction."""
    await conn.execute(
        "SELECT pg_advisory_xact_lock($1)", locks.key(locks.ADMIN_COMMAND, actor_id, key_sha256)
    )
    row = await conn.fetchrow(
        """
        SELECT command, request_sha256, target_id, token_sha256, answer FROM admin_commands
        WHERE actor_id = $1 AND key_sha256 = $2
        """,
        actor_id,
        key_sha256,
    )
    if row is None:
        return None
    return Remembered(
        row["command"], row["request_sha256"], row["target_id"], row["token_sha256"], row["answer"]
    )


async def remember(
    conn: Conn,
    actor_id: UUID,
    key_sha256: str,
    done: Remembered,
) -> None:
    await conn.execute(
        """
        INSERT INTO admin_commands
            (actor_id, key_sha256, command, request_sha256, target_id, token_sha256, answer)
        VALUES ($1, $2, $3, $4, $5, $6, $7)
        """,
        actor_id,
        key_sha256,
        done.command,
        done.request_sha256,
        done.target_id,
        done.token_sha256,
        done.answer,
    )
