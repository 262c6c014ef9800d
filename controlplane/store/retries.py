"""Retry on a lost runner (docs/policies.md, Q-60..Q-69): a stale lease whose job asked for
`retries_on_lost` goes back to the queue in its original place as the next attempt, instead of
ending as `expired`. The reaper (store/leases.py `reap`) moves the leases, under the execution
try-locks it already holds, with `queue.requeue_statement(..., retry=True)` restricted by
`RETRYABLE`; `record` then writes what the move leaves behind.

Locks (inside the reaper's transaction, after its execution try-locks and orphan sweep): the
running rows (delete) -> their new pending rows (insert; nothing else can insert a pending row
for an execution whose lock we hold) -> attempt rows (insert) -> events.
"""

from __future__ import annotations

from collections.abc import Sequence

import asyncpg

from controlplane.domain.jobs import EndedLease, EventType
from controlplane.store import events
from controlplane.store.pool import Conn
from controlplane.store.queue import ENQUEUED_CHANNEL, enqueued_payload
from controlplane.store.records import identity

# domain.lifetimes.may_retry over a running row: retries left, no cancel asked, not ended (an
# orchestrator's cancel leaves a tombstone beside the draining lease), not past its run deadline.
RETRYABLE = """(
    cancellation_requested_at IS NULL AND attempt <= retries_on_lost
    AND (timeout_seconds IS NULL OR started_at + timeout_seconds * interval '1 second' > now())
    AND NOT EXISTS (SELECT 1 FROM ended_executions e
                    WHERE e.job_execution_id = running_jobs.job_execution_id)
)"""


async def record(conn: Conn, moved: Sequence[asyncpg.Record]) -> list[EndedLease]:
    """For leases `requeue_statement` moved back: keep each lost attempt, write one `job.retried`
    event each (not terminal: the execution goes on), and wake the replicas' dispatchers for
    their labels. Returns them as ended leases marked `retried` (their runners' units are
    released as for any lease that ended with its runner)."""
    if not moved:
        return []
    await conn.execute(
        """
        INSERT INTO execution_attempts
            (job_execution_id, attempt, workspace_id, runner_session_id, started_at, outcome)
        SELECT ex, n, ws, session, started, 'lost'
        FROM unnest($1::uuid[], $2::int[], $3::uuid[], $4::uuid[], $5::timestamptz[])
             AS t(ex, n, ws, session, started)
        ON CONFLICT DO NOTHING
        """,
        [row["job_execution_id"] for row in moved],
        [row["attempt"] for row in moved],
        [row["workspace_id"] for row in moved],
        [row["runner_session_id"] for row in moved],
        [row["started_at"] for row in moved],
    )
    await events.write(
        conn,
        [
            (
                EventType.RETRIED,
                identity(row),
                events.identity_payload(
                    identity(row),
                    attempt=row["attempt"] + 1,
                    previous_attempt={
                        "attempt": row["attempt"],
                        "outcome": "lost",
                        "runner_session_id": str(row["runner_session_id"]),
                    },
                ),
            )
            for row in moved
        ],
    )
    wakes = sorted(
        {enqueued_payload(row["workspace_id"], tuple(row["required_labels"])) for row in moved}
    )
    await conn.execute(
        "SELECT pg_notify($1, wake) FROM unnest($2::text[]) AS wake", ENQUEUED_CHANNEL, wakes
    )
    return [
        EndedLease(
            identity=identity(row),
            provisioner_id=row["provisioner_id"],
            provider_runner_id=row["provider_runner_id"],
            cancellation_requested=False,
            newly_ended=False,
            retried=True,
        )
        for row in moved
    ]
