"""Point reads about one job execution, for the orchestrator's state route and held heartbeats."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

from controlplane.store.pool import Conn


@dataclass(frozen=True, slots=True)
class ExecutionState:
    job_execution_id: UUID
    state: str  # 'pending', 'running' or 'ended'
    workspace_id: UUID | None
    outcome: str | None = None
    ended_by: str | None = None
    runner_session_id: UUID | None = None
    cancel_requested: bool = False
    exit_code: int | None = None  # as its runner reported it, when it ended so
    output_tail: str | None = None
    required_labels: tuple[str, ...] = ()  # while pending: what a runner must offer
    attempt: int | None = None  # while pending or running: 1, or n + 1 after n retries
    lost_attempts: tuple[LostAttempt, ...] = ()  # earlier attempts, lost with their runner


@dataclass(frozen=True, slots=True)
class LostAttempt:
    """An attempt that did not end its execution: its lease was lost and it was retried."""

    attempt: int
    outcome: str
    runner_session_id: UUID
    started_at: datetime
    ended_at: datetime


async def state(conn: Conn, job_execution_id: UUID) -> ExecutionState | None:
    """Where the execution is now; a lease still draining after a cancel reports 'ended'."""
    row = await conn.fetchrow(
        """
        SELECT e.workspace_id AS ended_ws, e.outcome, e.ended_by, e.exit_code, e.output_tail,
               r.workspace_id AS running_ws, r.runner_session_id,
               r.cancellation_requested_at IS NOT NULL AS cancel_requested,
               p.workspace_id AS pending_ws, p.required_labels,
               coalesce(r.attempt, p.attempt) AS attempt,
               ARRAY(SELECT ROW(a.attempt, a.outcome, a.runner_session_id, a.started_at,
                                a.ended_at)
                     FROM execution_attempts a WHERE a.job_execution_id = x.id
                     ORDER BY a.attempt) AS lost
        FROM (SELECT $1::uuid AS id) AS x
        LEFT JOIN ended_executions e ON e.job_execution_id = x.id
        LEFT JOIN running_jobs r ON r.job_execution_id = x.id
        LEFT JOIN pending_jobs p ON p.job_execution_id = x.id
        """,
        job_execution_id,
    )
    assert row is not None
    if row["outcome"] is not None:  # ended; a lease may still be draining after a cancel
        where, workspace_id = "ended", row["ended_ws"] or row["running_ws"]
    elif row["running_ws"] is not None:
        where, workspace_id = "running", row["running_ws"]
    elif row["pending_ws"] is not None:
        where, workspace_id = "pending", row["pending_ws"]
    else:
        return None
    # The columns of the tables it is not in are null (a pending execution has no lease, so no
    # runner and no cancel; a running one no outcome), so one answer serves the three.
    return ExecutionState(
        job_execution_id,
        where,
        workspace_id,
        outcome=row["outcome"],
        ended_by=row["ended_by"],
        runner_session_id=row["runner_session_id"],
        cancel_requested=bool(row["cancel_requested"]),
        exit_code=row["exit_code"],
        output_tail=row["output_tail"],
        required_labels=tuple(row["required_labels"]) if where == "pending" else (),
        attempt=None if where == "ended" else row["attempt"],
        lost_attempts=tuple(LostAttempt(*attempt) for attempt in row["lost"]),
    )


async def cancel_requested(conn: Conn, job_execution_id: UUID, runner_session_id: UUID) -> bool:
    """True when the lease is asked to stop, is past its run deadline, or is gone (the runner
    must stop either way)."""
    found = await conn.fetchval(
        """
        SELECT cancellation_requested_at IS NOT NULL
               OR coalesce(started_at + timeout_seconds * interval '1 second' <= now(), false)
        FROM running_jobs
        WHERE job_execution_id = $1 AND runner_session_id = $2
        """,
        job_execution_id,
        runner_session_id,
    )
    return found is None or bool(found)


async def workspaces_with_jobs(conn: Conn) -> list[UUID]:
    rows = await conn.fetch(
        "SELECT workspace_id FROM pending_jobs UNION SELECT workspace_id FROM running_jobs"
    )
    return [row["workspace_id"] for row in rows]
