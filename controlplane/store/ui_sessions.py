"""Operator pages' browser sessions (sql/0021_ui_sessions.sql): signed in with an admin key,
kept as the SHA-256 of a random secret the browser holds in a cookie; the one-time sign-in links
`controlplane dev` prints; and the audit entries every page action writes to the event feed.

A session lives only as long as its admin key: the lookup returns the key with it, and the caller
applies the key's refusals (revoked, expired) on every request, so revoking the key signs its
sessions out at once.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from uuid import UUID

from controlplane.domain.credentials import Credential
from controlplane.store import credentials
from controlplane.store.events import EVENTS_CHANNEL
from controlplane.store.pool import Conn
from controlplane.store.records import json_text, row_by_digest

# 32 random bytes, URL-safe base64 without padding: what the cookie and the link carry.
_SECRET_BYTES = 32
AUDIT_PREFIX = "ui."


def new_secret() -> tuple[str, str]:
    """A fresh secret and the SHA-256 hex that is all the database keeps of it."""
    raw = secrets.token_urlsafe(_SECRET_BYTES)
    return raw, digest(raw)


def digest(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class SignedIn:
    """A live browser session and the admin key it was signed in with (refusals not yet
    applied: the caller checks the key at its own `now`)."""

    session_id: UUID
    key: Credential


async def create(conn: Conn, api_key_id: UUID, ttl: timedelta) -> str:
    """A new session for the admin key; returns the secret for the cookie. First deletes the
    key's sessions that ended a day ago or more (so a key's rows stay few without a maintenance
    job). Locks: those rows (delete), then the key row's share lock the insert's foreign key
    takes."""
    await conn.execute(
        """
        DELETE FROM ui_sessions
        WHERE api_key_id = $1
          AND (expires_at < now() - interval '1 day' OR signed_out_at < now() - interval '1 day')
        """,
        api_key_id,
    )
    return await _insert_secret(conn, "ui_sessions", api_key_id, ttl)


async def _insert_secret(conn: Conn, table: str, api_key_id: UUID, ttl: timedelta) -> str:
    """A new row of `table` (a session or a link) for the key, lasting `ttl`; its secret."""
    raw, sha256 = new_secret()
    await conn.execute(
        f"""
        INSERT INTO {table} (api_key_id, token_sha256, expires_at)
        VALUES ($1, $2, now() + $3::interval)
        """,  # noqa: S608 -- interpolates constants only: ui_sessions or ui_sign_in_links
        api_key_id,
        sha256,
        ttl,
    )
    return raw


async def by_secret(conn: Conn, raw: str) -> SignedIn | None:
    """The unexpired, not signed-out session of the cookie's secret, with its key. One
    statement: every page view makes this check first."""
    row = await row_by_digest(
        conn,
        f"""
        SELECT s.id AS session_id, s.token_sha256, k.*
        FROM ui_sessions s
        CROSS JOIN LATERAL (SELECT {credentials.API_KEY_COLUMNS} FROM api_keys a
                            WHERE a.id = s.api_key_id) AS k
        WHERE s.token_sha256 = $1 AND s.signed_out_at IS NULL AND s.expires_at > now()
        """,  # noqa: S608 -- interpolates constants only: API_KEY_COLUMNS
        digest(raw),
    )
    if row is None:
        return None
    key = credentials.api_key(row)
    if key.kind != "admin":
        return None
    return SignedIn(session_id=row["session_id"], key=key)


async def sign_out(conn: Conn, session_id: UUID) -> None:
    await conn.execute(
        "UPDATE ui_sessions SET signed_out_at = now() WHERE id = $1 AND signed_out_at IS NULL",
        session_id,
    )


async def create_link(conn: Conn, api_key_id: UUID, ttl: timedelta) -> str:
    """A one-time sign-in link's secret for the admin key, usable once within `ttl`."""
    return await _insert_secret(conn, "ui_sign_in_links", api_key_id, ttl)


async def use_link(conn: Conn, raw: str) -> UUID | None:
    """Spend a sign-in link: the admin key it signs in, or None when it is unknown, used or
    expired. Locks: the link's row (the UPDATE), alone; two browsers presenting the same link
    queue on it, and the second finds it used."""
    row = await conn.fetchrow(
        """
        UPDATE ui_sign_in_links SET used_at = now()
        WHERE token_sha256 = $1 AND used_at IS NULL AND expires_at > now()
        RETURNING api_key_id
        """,
        digest(raw),
    )
    return None if row is None else row["api_key_id"]


async def audit(
    conn: Conn,
    action: str,
    key: Credential,
    *,
    workspace_id: UUID | None = None,
    job_execution_id: UUID | None = None,
    details: dict[str, Any] | None = None,
) -> None:
    """Write `ui.<action>` to the event feed: who (the admin key's id and name) did what. No
    secret goes in: callers pass ids and names only. Wakes held feed reads like any event."""
    payload = {"api_key_id": str(key.id), "api_key_name": key.name, **(details or {})}
    await conn.execute(
        """
        INSERT INTO events (event_type, workspace_id, job_execution_id, payload)
        SELECT $1, $2, $3, $4::jsonb FROM (SELECT pg_notify($5, '')) AS wake
        """,
        AUDIT_PREFIX + action,
        workspace_id,
        job_execution_id,
        json_text(payload),
        EVENTS_CHANNEL,
    )
