"""Read-only views of the queue: depth, per-workspace counts, active leases, lease state.

None of these take locks; each is one statement, so each is a consistent snapshot (the reference
ran its two counts as independent queries).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from uuid import UUID

from controlplane.domain.jobs import JobIdentity
from controlplane.store.pool import Conn
from controlplane.store.records import IDENTITY_COLUMNS, identity


@dataclass(frozen=True, slots=True)
class QueueDepth:
    pending: int
    running: int


@dataclass(frozen=True, slots=True)
class WorkspaceCounts:
    workspace_id: UUID
    queued: int
    running: int


@dataclass(frozen=True, slots=True)
class ActiveLease:
    identity: JobIdentity
    runner_session_id: UUID
    started_at: datetime
    last_heartbeat_at: datetime
    cancellation_requested: bool


async def depth(conn: Conn) -> QueueDepth:
    row = await conn.fetchrow(
        "SELECT (SELECT count(*) FROM pending_jobs) AS p, (SELECT count(*) FROM running_jobs) AS r"
    )
    assert row is not None
    return QueueDepth(pending=row["p"], running=row["r"])


async def workspace_counts(conn: Conn, workspace_ids: Sequence[UUID]) -> list[WorkspaceCounts]:
    """One entry per requested workspace, in input order, zero where there are no rows."""
    rows = await conn.fetch(
        """
        SELECT w.id,
               (SELECT count(*) FROM pending_jobs p WHERE p.workspace_id = w.id) AS queued,
               (SELECT count(*) FROM running_jobs r WHERE r.workspace_id = w.id) AS running
        FROM unnest($1::uuid[]) WITH ORDINALITY AS w(id, n)
        ORDER BY w.n
        """,
        list(workspace_ids),
    )
    return [WorkspaceCounts(row["id"], row["queued"], row["running"]) for row in rows]


async def active_leases(
    conn: Conn, workspace_id: UUID, window: timedelta, limit: int = 1000
) -> list[ActiveLease]:
    rows = await conn.fetch(
        f"""
        SELECT {IDENTITY_COLUMNS}, runner_session_id, started_at, last_heartbeat_at,
               cancellation_requested_at
        FROM running_jobs
        WHERE workspace_id = $1 AND last_heartbeat_at > now() - $2::interval
        ORDER BY last_heartbeat_at DESC, id DESC
        LIMIT $3
        """,
        workspace_id,
        window,
        limit,
    )
    return [
        ActiveLease(
            identity=identity(row),
            runner_session_id=row["runner_session_id"],
            started_at=row["started_at"],
            last_heartbeat_at=row["last_heartbeat_at"],
            cancellation_requested=row["cancellation_requested_at"] is not None,
        )
        for row in rows
    ]


async def lease_active(
    conn: Conn,
    job_execution_id: UUID,
    runner_session_id: UUID,
    job_id: UUID | None = None,
) -> bool:
    """True while this session holds a lease on the execution (cancel requested or not)."""
    found = await conn.fetchval(
        """
        SELECT EXISTS (SELECT 1 FROM running_jobs
                       WHERE job_execution_id = $1 AND runner_session_id = $2
                         AND ($3::uuid IS NULL OR job_id = $3))
        """,
        job_execution_id,
        runner_session_id,
        job_id,
    )
    return bool(found)


@dataclass(frozen=True, slots=True)
class ActiveRunner:
    runner_session_id: UUID
    workspace_id: UUID
    kind: str
    labels: tuple[str, ...]
    last_seen_at: datetime
    running: int


async def active_runners(
    conn: Conn, workspace_id: UUID | None, window: timedelta, limit: int = 1000
) -> list[ActiveRunner]:
    """Sessions seen (job request, heartbeat) within `window`, most recent first, with how many
    leases each holds. Liveness stamps are throttled, so `last_seen_at` can lag by that much."""
    rows = await conn.fetch(
        """
        SELECT s.id, s.workspace_id, s.registration_token_kind, s.labels, s.updated_at,
               (SELECT count(*) FROM running_jobs r WHERE r.runner_session_id = s.id) AS running
        FROM runner_sessions s
        WHERE s.updated_at > now() - $2::interval AND ($1::uuid IS NULL OR s.workspace_id = $1)
        ORDER BY s.updated_at DESC, s.id DESC
        LIMIT $3
        """,
        workspace_id,
        window,
        limit,
    )
    return [
        ActiveRunner(
            runner_session_id=row["id"],
            workspace_id=row["workspace_id"],
            kind=row["registration_token_kind"],
            labels=tuple(row["labels"]),
            last_seen_at=row["updated_at"],
            running=row["running"],
        )
        for row in rows
    ]
