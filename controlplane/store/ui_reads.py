"""Reads the operator pages need that no admin route already makes: one execution's timeline from
the event feed, and its payload while it is pending or running (a tombstone keeps none).

Reads only, one statement each, no locks beyond a snapshot's.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

from controlplane.store.pool import Conn
from controlplane.store.records import json_value


@dataclass(frozen=True, slots=True)
class Moment:
    event_type: str
    created_at: datetime
    payload: dict[str, Any]


async def timeline(
    conn: Conn, workspace_id: UUID, job_execution_id: UUID, limit: int
) -> list[Moment]:
    """The execution's events, oldest first, at most `limit`. The feed has no index by
    execution (one would cost every claim and completion a write), so this walks the workspace's
    index and filters: a page view pays it, the hot path does not."""
    rows = await conn.fetch(
        """
        SELECT event_type, created_at, payload::text AS payload
        FROM events
        WHERE workspace_id = $1 AND job_execution_id = $2
        ORDER BY xid, seq
        LIMIT $3
        """,
        workspace_id,
        job_execution_id,
        limit,
    )
    return [
        Moment(row["event_type"], row["created_at"], json_value(row["payload"])) for row in rows
    ]


async def payload(conn: Conn, job_execution_id: UUID) -> dict[str, Any] | None:
    """The payload of a pending or running execution; None once it ended (or never existed)."""
    raw = await conn.fetchval(
        """
        SELECT payload::text FROM pending_jobs WHERE job_execution_id = $1
        UNION ALL
        SELECT payload::text FROM running_jobs WHERE job_execution_id = $1
        LIMIT 1
        """,
        job_execution_id,
    )
    found = json_value(raw)
    return found if isinstance(found, dict) else None


@dataclass(frozen=True, slots=True)
class QueueSample:
    workspace_id: UUID
    pending: int
    pickup_seconds: float | None  # median queued-to-started of leases started in the window


async def queue_sample(
    conn: Conn, window: timedelta, limit: int
) -> tuple[datetime, list[QueueSample]]:
    """The database's now, and per workspace (most pending first, at most `limit`): how many jobs
    are pending, and the median pickup latency of the leases started within `window` that are
    still running (a lease that ended already is gone from running_jobs, so very short jobs are
    not counted)."""
    rows = await conn.fetch(
        """
        WITH p AS (
            SELECT workspace_id, count(*) AS pending FROM pending_jobs GROUP BY workspace_id
        ), r AS (
            SELECT workspace_id,
                   percentile_cont(0.5) WITHIN GROUP (
                       ORDER BY extract(epoch FROM started_at - queued_at)) AS pickup
            FROM running_jobs
            WHERE started_at > now() - $1::interval
            GROUP BY workspace_id
        )
        SELECT now() AS at, coalesce(p.workspace_id, r.workspace_id) AS workspace_id,
               coalesce(p.pending, 0) AS pending, r.pickup
        FROM p FULL JOIN r ON p.workspace_id = r.workspace_id
        ORDER BY pending DESC, workspace_id
        LIMIT $2
        """,
        window,
        limit,
    )
    at = rows[0]["at"] if rows else await conn.fetchval("SELECT now()")
    return at, [
        QueueSample(
            row["workspace_id"],
            row["pending"],
            None if row["pickup"] is None else max(0.0, float(row["pickup"])),
        )
        for row in rows
    ]
