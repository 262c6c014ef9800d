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
from controlplane.store.records import IDENTITY_COLUMNS, from_row, identity


@dataclass(frozen=True, slots=True)
class QueueDepth:
    pending: int
    running: int
    paused_workspaces: int = 0
    paused_runners: int = 0


@dataclass(frozen=True, slots=True)
class LabelCounts:
    labels: tuple[str, ...]
    queued: int
    running: int
    oldest_queued_at: datetime | None  # None when none of this label set is queued


@dataclass(frozen=True, slots=True)
class WorkspaceCounts:
    workspace_id: UUID
    queued: int
    running: int
    labels: tuple[LabelCounts, ...] = ()


@dataclass(frozen=True, slots=True)
class ActiveLease:
    identity: JobIdentity
    runner_session_id: UUID
    started_at: datetime
    last_heartbeat_at: datetime
    cancellation_requested: bool


async def depth(conn: Conn) -> QueueDepth:
    row = await conn.fetchrow(
        """
        SELECT (SELECT count(*) FROM pending_jobs) AS p, (SELECT count(*) FROM running_jobs) AS r,
               (SELECT count(*) FROM paused_workspaces) AS pw,
               (SELECT count(*) FROM paused_runners) AS pr
        """
    )
    assert row is not None
    return QueueDepth(row["p"], row["r"], row["pw"], row["pr"])


async def workspace_counts(conn: Conn, workspace_ids: Sequence[UUID]) -> list[WorkspaceCounts]:
    """One entry per requested workspace, in input order, zero where there are no rows, with
    its queued and running jobs per required label set (most queued first). One statement, so
    the per-workspace totals and the per-label rows agree."""
    rows = await conn.fetch(
        """
        WITH per_labels AS (
            SELECT workspace_id, required_labels, sum(q)::int AS queued, sum(r)::int AS running,
                   min(oldest) AS oldest
              FROM (SELECT workspace_id, required_labels, count(*) AS q, 0 AS r,
                           min(created_at) AS oldest
                      FROM pending_jobs WHERE workspace_id = ANY($1::uuid[])
                     GROUP BY workspace_id, required_labels
                    UNION ALL
                    SELECT workspace_id, required_labels, 0, count(*), NULL
                      FROM running_jobs WHERE workspace_id = ANY($1::uuid[])
                     GROUP BY workspace_id, required_labels) AS t
             GROUP BY workspace_id, required_labels
        )
        SELECT w.id, w.n, p.required_labels, p.queued, p.running, p.oldest
          FROM unnest($1::uuid[]) WITH ORDINALITY AS w(id, n)
          LEFT JOIN per_labels p ON p.workspace_id = w.id
         ORDER BY w.n, p.queued DESC, p.running DESC, p.required_labels
        """,
        list(workspace_ids),
    )
    grouped: dict[UUID, list[LabelCounts]] = {w: [] for w in workspace_ids}
    for row in rows:
        if row["required_labels"] is not None:
            grouped[row["id"]].append(
                LabelCounts(
                    tuple(row["required_labels"]), row["queued"], row["running"], row["oldest"]
                )
            )
    return [
        WorkspaceCounts(
            w,
            sum(c.queued for c in grouped[w]),
            sum(c.running for c in grouped[w]),
            tuple(grouped[w]),
        )
        for w in workspace_ids
    ]


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
        """,  # noqa: S608 -- interpolates constants only: IDENTITY_COLUMNS
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
        SELECT s.id AS runner_session_id, s.workspace_id, s.registration_token_kind AS kind,
               s.labels, s.updated_at AS last_seen_at,
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
    return [from_row(ActiveRunner, row, labels=tuple(row["labels"])) for row in rows]
