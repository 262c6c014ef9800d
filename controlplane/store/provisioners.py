"""Provisioner tokens: create, authenticate, touch last-seen, list, revoke with its cascade.

The token id is the provisioner id. Revocation runs in one transaction: the token row first
(FOR UPDATE via its UPDATE), then its control-session row (generation bumped and NOTIFYed, so
the live session closes at once on any replica), then the provisioner's unused capped sessions,
in id order. Sessions
that already claimed keep working; an unused one gets `runner-session-exhausted` on its claim.
Runner instances, bootstrap tokens and control sessions join this cascade when they exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from uuid import UUID

import asyncpg

from controlplane.domain import tokens
from controlplane.errors import NotFound
from controlplane.store.pool import Conn
from controlplane.store.provisioner_sessions import TAKEOVER_CHANNEL

_COLUMNS = (
    "id, scope, workspace_id, name, display_prefix, created_at, expires_at, revoked_at, "
    "last_seen_at"
)


@dataclass(frozen=True, slots=True)
class Provisioner:
    id: UUID
    scope: str  # 'workspace' or 'installation'
    workspace_id: UUID | None
    name: str
    display_prefix: str
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    last_seen_at: datetime | None


def _provisioner(row: asyncpg.Record) -> Provisioner:
    return Provisioner(**{key: row[key] for key in Provisioner.__slots__})


async def create(
    conn: Conn,
    *,
    name: str,
    workspace_id: UUID | None,
    ttl: timedelta | None = None,
    token: tokens.Opaque | None = None,
) -> tuple[Provisioner, str]:
    """A workspace token when `workspace_id` is given, an installation token otherwise."""
    token = token or tokens.new_opaque(tokens.Kind.PROVISIONER)
    row = await conn.fetchrow(
        f"""
        INSERT INTO provisioner_tokens
            (scope, workspace_id, name, token_sha256, display_prefix, expires_at)
        VALUES (CASE WHEN $1::uuid IS NULL THEN 'installation' ELSE 'workspace' END,
                $1, $2, $3, $4, now() + $5::interval)
        RETURNING {_COLUMNS}
        """,
        workspace_id,
        name,
        token.sha256,
        token.display_prefix,
        ttl,
    )
    assert row is not None
    return _provisioner(row), token.raw


async def by_digest(conn: Conn, sha256: str) -> Provisioner | None:
    row = await conn.fetchrow(
        f"SELECT token_sha256, {_COLUMNS} FROM provisioner_tokens WHERE token_sha256 = $1", sha256
    )
    if row is None or not tokens.same_digest(row["token_sha256"], sha256):
        return None
    return _provisioner(row)


async def by_id(conn: Conn, provisioner_id: UUID) -> Provisioner | None:
    row = await conn.fetchrow(
        f"SELECT {_COLUMNS} FROM provisioner_tokens WHERE id = $1", provisioner_id
    )
    return None if row is None else _provisioner(row)


async def touch(conn: Conn, provisioner_id: UUID, throttle: timedelta) -> None:
    """Stamp last-seen, at most once per throttle window."""
    await conn.execute(
        """
        UPDATE provisioner_tokens SET last_seen_at = now()
        WHERE id = $1 AND (last_seen_at IS NULL OR last_seen_at < now() - $2::interval)
        """,
        provisioner_id,
        throttle,
    )


async def list_all(
    conn: Conn, workspace_id: UUID | None = None, *, seen_within: timedelta | None = None
) -> list[Provisioner]:
    """Newest first. With `seen_within`, only live ones: seen that recently, not revoked, not
    expired (the admin "active provisioners" view)."""
    rows = await conn.fetch(
        f"""
        SELECT {_COLUMNS} FROM provisioner_tokens
        WHERE ($1::uuid IS NULL OR workspace_id = $1)
          AND ($2::interval IS NULL OR (last_seen_at > now() - $2::interval
                                        AND revoked_at IS NULL
                                        AND (expires_at IS NULL OR expires_at > now())))
        ORDER BY created_at DESC, id DESC
        """,
        workspace_id,
        seen_within,
    )
    return [_provisioner(row) for row in rows]


async def revoke(conn: Conn, provisioner_id: UUID) -> Provisioner:
    """Idempotent: a second revoke keeps the first time and changes nothing else."""
    async with conn.transaction():
        row = await conn.fetchrow(
            f"""
            UPDATE provisioner_tokens
            SET revoked_at = COALESCE(revoked_at, now()), updated_at = now()
            WHERE id = $1
            RETURNING {_COLUMNS}
            """,
            provisioner_id,
        )
        if row is None:
            raise NotFound("no such provisioner token", id=str(provisioner_id))
        # Its live control session, on whichever replica, is superseded at once (and finds
        # the token revoked when it asks why).
        await conn.execute(
            """
            WITH bumped AS (
                UPDATE provisioner_sessions SET generation = generation + 1
                WHERE provisioner_id = $1 RETURNING generation
            )
            SELECT pg_notify($2, $1::text || ':' || generation) FROM bumped
            """,
            provisioner_id,
            TAKEOVER_CHANNEL,
        )
        await conn.execute(
            """
            UPDATE runner_sessions SET revoked_at = now()
            WHERE id IN (SELECT id FROM runner_sessions
                         WHERE provisioner_id = $1 AND claims_used = 0 AND revoked_at IS NULL
                         ORDER BY id FOR UPDATE)
            """,
            provisioner_id,
        )
    return _provisioner(row)
