"""The lease side of job executions: heartbeat, complete, reconcile, the reaper, cancel-session.

Lock order is the one in store/queue.py. Who may touch an existing running row:

* heartbeat updates exactly one running row, then the session row. It takes no execution lock;
  it never waits on anything a running-row holder waits for (no one holding a session row waits
  on a running row), so it closes no cycle;
* every other writer of an existing running row (complete, reconcile, cancel-session, put-back,
  the reaper) holds that execution's advisory lock first. The blocking ones take their locks
  before any row; the reaper only try-locks, so it never waits on an execution lock at all. Two
  of them can therefore never both hold rows the other waits for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from uuid import UUID

import asyncpg

from controlplane.domain.jobs import (
    EndedLease,
    EventType,
    HeartbeatResult,
    JobIdentity,
    Outcome,
    ReconcileResult,
    StaleRule,
)
from controlplane.errors import RunningJobExecutionNotFound
from controlplane.store import events, locks, retries
from controlplane.store.pool import Conn
from controlplane.store.queue import lock_executions, requeue_statement
from controlplane.store.records import IDENTITY_COLUMNS, identity, json_text, json_value

# The stale predicate, as in domain.jobs.StaleRule ($1 = grace, $2 = threshold).
_STALE = """(
    (first_heartbeat_at IS NULL AND last_heartbeat_at <= started_at
        AND started_at < now() - $1::interval)
    OR ((first_heartbeat_at IS NOT NULL OR last_heartbeat_at > started_at)
        AND last_heartbeat_at < now() - $2::interval)
)"""

# Stale leases that go back to the queue ($1 grace, $2 threshold, $3 the picked lease ids).
_RETRY = requeue_statement(f"id = ANY($3::uuid[]) AND {_STALE} AND {retries.RETRYABLE}", retry=True)

# Reconcile and cancel-session notify this channel with the execution id, delivered at commit,
# so a heartbeat held on any replica learns of the cancel at once.
CANCEL_CHANNEL = "cp_cancel"

_NO_CAPABILITIES = object()

# One autocommitted statement, one round trip. $1 execution, $2 session, $3 whether to store
# capabilities, $4 the capabilities (NULL clears them). No index of running_jobs holds a column
# it sets, so its update is HOT (sql/0031; tests/store/test_heartbeat.py keeps it so). The
# session update's WHERE depends on `beat`, so the running row is updated (and locked) before the
# session row is touched, and the session row is not touched at all when there is no lease.
# RETURNING old (PostgreSQL 18) gives the capabilities as they were under the row lock.
_HEARTBEAT = f"""
WITH beat AS (
    UPDATE running_jobs
    SET first_heartbeat_at = COALESCE(first_heartbeat_at, now()), last_heartbeat_at = now()
    WHERE job_execution_id = $1 AND runner_session_id = $2
    RETURNING {IDENTITY_COLUMNS}, cancellation_requested_at,
              EXTRACT(epoch FROM started_at + timeout_seconds * interval '1 second' - now())::float8
                  AS timeout_in
), touched AS (
    UPDATE runner_sessions
    SET updated_at = now(),
        tool_capabilities = CASE WHEN $3 THEN $4::jsonb ELSE tool_capabilities END,
        tool_capabilities_reported_at = CASE
            WHEN NOT $3 THEN tool_capabilities_reported_at
            WHEN $4::jsonb IS NULL THEN NULL
            ELSE now() END
    WHERE id = $2 AND EXISTS (SELECT 1 FROM beat)
    RETURNING old.tool_capabilities::text AS previous
)
SELECT beat.*, touched.previous FROM beat LEFT JOIN touched ON true
"""  # noqa: S608 -- interpolates constants only: IDENTITY_COLUMNS


async def heartbeat(
    conn: Conn,
    job_execution_id: UUID,
    runner_session_id: UUID,
    capabilities: Any = _NO_CAPABILITIES,
) -> HeartbeatResult:
    """Refresh the lease held by this session; report whether cancellation was requested and how
    far its run deadline is (by the database's clock). The deadline never moves.

    Unlike the reference, omitting `capabilities` keeps the stored report (it only ages); an
    explicit None clears it. Raises RunningJobExecutionNotFound, changing nothing, when the
    session holds no lease on the execution.

    Locks: the running row (UPDATE), then the session row (UPDATE), in one statement.
    """
    setting = capabilities is not _NO_CAPABILITIES
    row = await conn.fetchrow(
        _HEARTBEAT,
        job_execution_id,
        runner_session_id,
        setting,
        json_text(capabilities) if setting and capabilities is not None else None,
    )
    if row is None:
        raise RunningJobExecutionNotFound()
    previous = json_value(row["previous"])
    current = capabilities if setting else previous
    return HeartbeatResult(
        identity=identity(row),
        cancellation_requested=row["cancellation_requested_at"] is not None,
        previous_capabilities=previous,
        current_capabilities=current,
        timeout_in=row["timeout_in"],
    )


async def end_executions(
    conn: Conn,
    jobs: Sequence[JobIdentity],
    outcome: Outcome,
    ended_by: str,
    event_type: EventType,
    extra: dict[str, Any],
) -> set[UUID]:
    """Write tombstones; for the executions that had none, write the one terminal event."""
    if not jobs:
        return set()
    rows = await conn.fetch(
        """
        INSERT INTO ended_executions (job_execution_id, workspace_id, job_id, outcome, ended_by)
        SELECT ex, ws, job, $4, $5 FROM unnest($1::uuid[], $2::uuid[], $3::uuid[]) AS t(ex, ws, job)
        ON CONFLICT (job_execution_id) DO NOTHING
        RETURNING job_execution_id
        """,
        [job.job_execution_id for job in jobs],
        [job.workspace_id for job in jobs],
        [job.job_id for job in jobs],
        str(outcome),
        ended_by,
    )
    fresh = {row["job_execution_id"] for row in rows}
    await events.write(
        conn,
        [
            (event_type, job, events.identity_payload(job, outcome=str(outcome), **extra))
            for job in jobs
            if job.job_execution_id in fresh
        ],
    )
    return fresh


def ended_lease(row: asyncpg.Record, fresh: set[UUID]) -> EndedLease:
    return EndedLease(
        identity=identity(row),
        provisioner_id=row["provisioner_id"],
        provider_runner_id=row["provider_runner_id"],
        cancellation_requested=row["cancellation_requested_at"] is not None,
        newly_ended=row["job_execution_id"] in fresh,
    )


async def complete(
    conn: Conn,
    job_execution_id: UUID,
    runner_session_id: UUID,
    outcome: Outcome,
    exit_code: int | None = None,
    output_tail: str | None = None,
) -> EndedLease:
    """The runner finished: remove its lease at once and record the outcome.

    The tombstone (with the exit code and output tail, when given) and the `job.completed` event
    are written only if the execution had not ended already (an orchestrator cancel comes first
    and keeps its record).

    Locks: execution lock (blocking) -> pending row (orphan sweep) -> running row (delete) ->
    tombstone -> events; one transaction, each step a statement of its own (so each sees what
    the previous lock holder committed).
    """
    if outcome == Outcome.EXPIRED:
        raise ValueError("a runner cannot complete with 'expired'")
    # cp_complete (sql/0010_job_results.sql) runs these steps in this order: one round trip.
    try:
        row = await conn.fetchrow(
            "SELECT * FROM cp_complete($1, $2, $3, $4, $5, $6)",
            locks.execution(job_execution_id),
            job_execution_id,
            runner_session_id,
            str(outcome),
            exit_code,
            output_tail,
        )
    except asyncpg.NoDataFoundError as error:
        raise RunningJobExecutionNotFound() from error
    assert row is not None
    return ended_lease(row, {job_execution_id} if row["newly_ended"] else set())


async def reconcile(
    conn: Conn, job_execution_id: UUID, status: Outcome, reason: str | None = None
) -> ReconcileResult:
    """The orchestrator says the execution is over (cancelled, or done elsewhere).

    A pending row is deleted; a running lease is asked to stop (the first request time is kept)
    and stays until its runner completes or the reaper takes it. Either way a tombstone is
    written, also for an execution we have never seen, so an enqueue replay arriving late can
    never bring it back. The `job.cancelled` event is written once per execution, also for one
    we never had (then without workspace and run ids).

    Locks: execution lock (blocking) -> pending row (delete) -> running row (update) ->
    tombstone -> events. Same order as claim for the two rows; claim only try-locks the
    execution, so no deadlock. A claim that already holds the lock commits first and its lease
    is then born cancelled.
    """
    if status == Outcome.EXPIRED:
        raise ValueError("the orchestrator cannot end an execution as 'expired'")
    async with conn.transaction():
        await lock_executions(conn, [job_execution_id])
        pending = await conn.fetchrow(
            f"DELETE FROM pending_jobs WHERE job_execution_id = $1 RETURNING {IDENTITY_COLUMNS}",  # noqa: S608 -- interpolates constants only: IDENTITY_COLUMNS
            job_execution_id,
        )
        running = await conn.fetchrow(
            f"""
            UPDATE running_jobs
            SET cancellation_requested_at = COALESCE(cancellation_requested_at, now())
            WHERE job_execution_id = $1
            RETURNING {IDENTITY_COLUMNS}
            """,  # noqa: S608 -- interpolates constants only: IDENTITY_COLUMNS
            job_execution_id,
        )
        known = running or pending
        if running is not None:
            await conn.execute("SELECT pg_notify($1, $2)", CANCEL_CHANNEL, str(job_execution_id))
        if known is not None:
            extra: dict[str, Any] = {"reason": reason, "was": "running" if running else "pending"}
            fresh = await end_executions(
                conn, [identity(known)], status, "orchestrator", EventType.CANCELLED, extra
            )
        else:
            inserted = await conn.fetchval(
                """
                INSERT INTO ended_executions (job_execution_id, outcome, ended_by)
                VALUES ($1, $2, 'orchestrator') ON CONFLICT DO NOTHING RETURNING true
                """,
                job_execution_id,
                str(status),
            )
            fresh = {job_execution_id} if inserted else set()
            if inserted:
                # Never seen here: the event carries only what we know, so the feed still holds
                # exactly one terminal event for every tombstone.
                await events.write_unknown(
                    conn,
                    EventType.CANCELLED,
                    job_execution_id,
                    {"outcome": str(status), "reason": reason, "was": "unknown"},
                )
    return ReconcileResult(
        was_pending=pending is not None,
        was_running=running is not None,
        newly_ended=job_execution_id in fresh,
    )


async def lock_and_sweep(
    conn: Conn, candidates: str, args: Sequence[object], limit: int
) -> list[asyncpg.Record]:
    """The leader's first two steps on leases, in the caller's transaction: of the running rows
    `candidates` selects (`id, job_execution_id`, in the order to take them; its parameters
    `args`), keep the first `limit` whose execution lock we get by trying, and delete pending
    orphans of those executions. The candidates are materialised first and the try-lock applied
    while reading them in order, so only what we keep (and the busy ones we skip) is locked.

    Locks: execution try-locks -> pending rows; never a running row, so nothing held here is
    waited for by a claim holding a pending row."""
    picked = await conn.fetch(
        f"""
        WITH due AS MATERIALIZED ({candidates})
        SELECT id, job_execution_id FROM due
        WHERE pg_try_advisory_xact_lock({locks.sql_key(locks.EXECUTION, "job_execution_id")})
        LIMIT ${len(args) + 1}
        """,  # noqa: S608 -- interpolates the callers' constant queries and locks.sql_key
        *args,
        limit,
    )
    if picked:
        await conn.execute(
            "DELETE FROM pending_jobs WHERE job_execution_id = ANY($1::uuid[])",
            [row["job_execution_id"] for row in picked],
        )
    return list(picked)


async def reap(conn: Conn, rule: StaleRule, *, limit: int = 100) -> list[EndedLease]:
    """Expire stale leases: at most `limit` per call, oldest-stale first; each exactly once.

    1. Scan the stale rows ordered by their stale instant, then id, and try-lock each one's
       execution, stopping after `limit` successes. The candidates are materialised first and the
       try-lock applied while reading them in order, so we lock only what we keep plus the busy
       ones we skip (the reference could lock rows past its limit). Rows whose lock is held
       (being completed, reconciled, reaped by another replica) are skipped for this tick.
    2. Sweep pending orphans of those executions, before touching any running row, so we never
       hold a running row while waiting for a pending row a claim holds.
    3. Move the leases whose job asked for retries and has some left back to the queue as their
       next attempt (store/retries.py), re-checking staleness; they come back marked `retried`.
    4. Delete the other running rows, re-checking staleness: a heartbeat that committed
       meanwhile (or that we waited for) keeps its row.
    5. Tombstone and one `job.lease_expired` event for executions not already ended.

    Locks: execution try-locks -> pending rows -> running rows (retried: then their new pending
    rows and attempt rows) -> tombstones -> events.

    The scan of step 1 reads running_jobs whole (one row per running job): no index serves it,
    so that a heartbeat stays a HOT update (sql/0031; 2.9 ms at 20,000 running rows).
    """
    async with conn.transaction():
        picked = await lock_and_sweep(
            conn,
            f"""
            SELECT id, job_execution_id
            FROM running_jobs
            WHERE {_STALE}
            ORDER BY CASE WHEN first_heartbeat_at IS NULL AND last_heartbeat_at <= started_at
                          THEN started_at ELSE last_heartbeat_at END, id
            """,  # noqa: S608 -- interpolates constants only: _STALE
            [rule.grace, rule.threshold],
            limit,
        )
        if not picked:
            return []
        moved = await conn.fetch(_RETRY, rule.grace, rule.threshold, [row["id"] for row in picked])
        retried = await retries.record(conn, moved)
        deleted = await conn.fetch(
            f"""
            DELETE FROM running_jobs WHERE id = ANY($3::uuid[]) AND {_STALE}
            RETURNING {IDENTITY_COLUMNS}, provisioner_id, provider_runner_id,
                      cancellation_requested_at
            """,  # noqa: S608 -- interpolates constants only: _STALE, IDENTITY_COLUMNS
            rule.grace,
            rule.threshold,
            [row["id"] for row in picked],
        )
        fresh = await end_executions(
            conn,
            [identity(row) for row in deleted],
            Outcome.EXPIRED,
            "reaper",
            EventType.LEASE_EXPIRED,
            {},
        )
    return [ended_lease(row, fresh) for row in deleted] + retried


async def cancel_session_jobs(conn: Conn, runner_session_id: UUID) -> list[UUID]:
    """Ask every lease of a session to stop (its runner is going away). Returns the executions.

    This is a request, not an end: each lease ends when its runner completes or when it expires.
    Locks: execution locks of the session's leases (blocking, ascending key order) -> running rows.
    """
    async with conn.transaction():
        ids = [
            row["job_execution_id"]
            for row in await conn.fetch(
                "SELECT job_execution_id FROM running_jobs WHERE runner_session_id = $1",
                runner_session_id,
            )
        ]
        if not ids:
            return []
        await lock_executions(conn, ids)
        rows = await conn.fetch(
            f"""
            UPDATE running_jobs
            SET cancellation_requested_at = COALESCE(cancellation_requested_at, now())
            WHERE runner_session_id = $1 AND job_execution_id = ANY($2::uuid[])
              AND cancellation_requested_at IS NULL
            RETURNING {IDENTITY_COLUMNS}
            """,  # noqa: S608 -- interpolates constants only: IDENTITY_COLUMNS
            runner_session_id,
            ids,
        )
        await events.write(
            conn,
            [
                (EventType.CANCEL_REQUESTED, identity(row), events.identity_payload(identity(row)))
                for row in rows
            ],
        )
        await conn.execute(
            "SELECT pg_notify($1, ex) FROM unnest($2::text[]) AS ex",
            CANCEL_CHANNEL,
            [str(row["job_execution_id"]) for row in rows],
        )
    return [row["job_execution_id"] for row in rows]
