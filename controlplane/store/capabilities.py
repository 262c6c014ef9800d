"""Reading back what runners reported and hold: a session's tool-capability report and a
lease's state (spec jobs 3.9, the reference's `getLeaseState`; a workspace's job counts, 3.10,
are `queries.workspace_counts`). Plain reads: no lock, no write; each answers the database's
`now()` beside the report, so freshness is judged on the clock that stamped it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from controlplane.store.pool import Conn


@dataclass(frozen=True, slots=True)
class Report:
    """A session's stored tool-capability report (None: none stored) and the time it is read."""

    capabilities: dict[str, Any] | None
    reported_at: datetime | None
    now: datetime


@dataclass(frozen=True, slots=True)
class LeaseState:
    """`active`: a running row exists for that execution and that session (and that job, when
    one was named); cancellation is not considered. The rest is known only when active."""

    active: bool
    workspace_id: UUID | None = None
    report: Report | None = None


def _report(row: Any) -> Report:
    raw = row["tool_capabilities"]
    return Report(
        None if raw is None else json.loads(raw), row["tool_capabilities_reported_at"], row["now"]
    )


async def lease_state(
    conn: Conn, job_execution_id: UUID, runner_session_id: UUID, job_id: UUID | None = None
) -> LeaseState:
    row = await conn.fetchrow(
        """
        SELECT r.workspace_id, s.tool_capabilities::text AS tool_capabilities,
               s.tool_capabilities_reported_at, now() AS now
          FROM running_jobs r JOIN runner_sessions s ON s.id = r.runner_session_id
         WHERE r.job_execution_id = $1 AND r.runner_session_id = $2
           AND ($3::uuid IS NULL OR r.job_id = $3)
        """,
        job_execution_id,
        runner_session_id,
        job_id,
    )
    if row is None:
        return LeaseState(False)
    return LeaseState(True, row["workspace_id"], _report(row))


async def session_reports(conn: Conn, runner_session_ids: Sequence[UUID]) -> dict[UUID, Report]:
    """The stored reports of these sessions (sessions that are gone are left out)."""
    rows = await conn.fetch(
        """
        SELECT id, tool_capabilities::text AS tool_capabilities, tool_capabilities_reported_at,
               now() AS now
          FROM runner_sessions WHERE id = ANY($1::uuid[])
        """,
        list(runner_session_ids),
    )
    return {row["id"]: _report(row) for row in rows}
