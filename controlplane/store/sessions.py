"""Runner sessions: creation, and garbage collection of old ones.

Creation of ephemeral and activation sessions (token consumption, provisioner links) lives with
the provisioning store; this module only writes the session row itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

import asyncpg

from controlplane.domain.labels import LabelSet
from controlplane.store.pool import Conn
from controlplane.store.records import json_text

_GC_ATTEMPTS = 3


@dataclass(frozen=True, slots=True)
class Session:
    id: UUID
    workspace_id: UUID
    kind: str
    labels: LabelSet
    max_claims: int | None
    created_at: datetime


async def create(
    conn: Conn,
    *,
    workspace_id: UUID,
    registration_token_id: UUID,
    kind: str,
    labels: LabelSet,
    capabilities: dict[str, Any] | None = None,
    max_claims: int | None = None,
    runner_instance_id: UUID | None = None,
    provisioner_id: UUID | None = None,
    provider_runner_id: str | None = None,
) -> Session:
    """Insert one session row. The table's CHECK constraints enforce kind/cap/link agreement."""
    row = await conn.fetchrow(
        """
        INSERT INTO runner_sessions (workspace_id, registration_token_id, registration_token_kind,
            labels, tool_capabilities, tool_capabilities_reported_at, max_claims,
            runner_instance_id, provisioner_id, provider_runner_id)
        VALUES ($1, $2, $3, $4, $5::jsonb, CASE WHEN $5 IS NULL THEN NULL ELSE now() END, $6,
                $7, $8, $9)
        RETURNING id, created_at
        """,
        workspace_id,
        registration_token_id,
        kind,
        list(labels),
        None if capabilities is None else json_text(capabilities),
        max_claims,
        runner_instance_id,
        provisioner_id,
        provider_runner_id,
    )
    assert row is not None
    return Session(row["id"], workspace_id, kind, labels, max_claims, row["created_at"])


async def collect_garbage(
    conn: Conn,
    *,
    manual_retention: timedelta,
    capped_retention: timedelta,
    limit: int = 1000,
) -> int:
    """Delete old sessions no lease refers to, oldest first; return how many.

    Age counts from creation. Locks: the chosen session rows, FOR UPDATE SKIP LOCKED, so a
    session a claim is inserting a lease for right now (the foreign key holds a KEY SHARE lock on
    it) is skipped rather than waited for. A claim that commits between our snapshot and our
    delete still makes the foreign key fail; that statement is retried, and the retry no longer
    picks the session.
    """
    for attempt in range(_GC_ATTEMPTS):
        try:
            async with conn.transaction():
                deleted: int = await conn.fetchval(
                    """
                    WITH doomed AS (
                        SELECT s.id FROM runner_sessions s
                        WHERE s.created_at < now() - CASE WHEN s.registration_token_kind = 'manual'
                                                     THEN $1::interval ELSE $2::interval END
                          AND NOT EXISTS (SELECT 1 FROM running_jobs r
                                          WHERE r.runner_session_id = s.id)
                        ORDER BY s.created_at, s.id
                        LIMIT $3
                        FOR UPDATE SKIP LOCKED
                    ), gone AS (
                        DELETE FROM runner_sessions WHERE id IN (SELECT id FROM doomed) RETURNING 1
                    )
                    SELECT count(*) FROM gone
                    """,
                    manual_retention,
                    capped_retention,
                    limit,
                )
                return deleted
        except asyncpg.ForeignKeyViolationError:
            if attempt == _GC_ATTEMPTS - 1:
                raise
    return 0
