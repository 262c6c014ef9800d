"""The queue side of job executions: enqueue, claim and put-back.

Lock order (the whole store follows one order; see also store/leases.py):

    session row  ->  execution advisory lock  ->  pending row  ->  running row
                 ->  tombstone  ->  session row update  ->  events

with two deliberate exceptions that cannot wait, and so cannot close a cycle:

* claim takes the pending row (FOR UPDATE SKIP LOCKED) before the execution lock, but only
  *tries* the execution lock and never waits for it;
* the reaper only *tries* execution locks.

Every transaction that waits for an execution lock (enqueue, reconcile, complete, put-back,
cancel-session) takes it before touching any row, and takes several in ascending key order.

NOTIFY: enqueue and put-back notify channel `cp_enqueued` with the workspace id and the job's
labels, once per distinct pair per transaction; PostgreSQL delivers it at commit, so a woken
waiter always finds the row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import timedelta
from uuid import UUID

from controlplane.domain.jobs import (
    ClaimedJob,
    EnqueueResult,
    EventType,
    NewJob,
    SessionClaims,
)
from controlplane.domain.labels import LabelSet, canonicalise
from controlplane.errors import EmptyRequiredLabels, RunnerSessionExhausted
from controlplane.store import events, locks
from controlplane.store.pool import Conn
from controlplane.store.records import IDENTITY_COLUMNS, identity, json_text, json_value

ENQUEUED_CHANNEL = "cp_enqueued"

# How many busy FIFO heads a claim steps over before it gives up for this attempt. A head is busy
# when another transaction holds its execution lock (an enqueue replay, a reconcile, the reaper).
MAX_BUSY_HEADS = 16

_EXECUTION_TRY_LOCK = (
    f"pg_try_advisory_xact_lock({locks.sql_key(locks.EXECUTION, 'p.job_execution_id')})"
)


def enqueued_payload(workspace_id: UUID, labels: LabelSet) -> str:
    """`<workspace>|<label>,<label>`: who to wake, and which waiters could match."""
    return f"{workspace_id}|{','.join(labels)}"


async def lock_executions(conn: Conn, execution_ids: Sequence[UUID]) -> None:
    """Take the execution locks of `execution_ids`, blocking, in ascending key order."""
    keys = sorted({locks.execution(execution_id) for execution_id in execution_ids})
    if len(keys) == 1:
        await conn.execute("SELECT pg_advisory_xact_lock($1)", keys[0])
    elif keys:
        # unnest returns the array in order, so the locks are taken in ascending key order.
        await conn.execute("SELECT pg_advisory_xact_lock(k) FROM unnest($1::bigint[]) AS k", keys)


async def enqueue(conn: Conn, jobs: Sequence[NewJob]) -> list[EnqueueResult]:
    """Insert pending rows for `jobs`, in one transaction; one result per job, in input order.

    Locks: the execution locks of every job (blocking, ascending key order), then pending-row
    inserts. A concurrent claim of the same execution holds its lock until commit, so we then see
    its running row; a concurrent reaper, reconcile or complete likewise leaves a tombstone that we
    see. Idempotent: a replay while pending changes nothing (the first write wins).
    """
    # Canonical labels are the caller's duty, but a non-canonical set stored here could never
    # match a session (whose labels are canonical): canonicalise again, it is idempotent.
    jobs = [replace(job, required_labels=canonicalise(job.required_labels)) for job in jobs]
    if any(not job.required_labels for job in jobs):
        raise EmptyRequiredLabels("required labels are empty after canonicalisation")
    first: dict[UUID, int] = {}  # execution -> index of its first occurrence in `jobs`
    for index, job in enumerate(jobs):
        first.setdefault(job.identity.job_execution_id, index)
    ids = list(first)
    async with conn.transaction():
        await lock_executions(conn, ids)
        blocked = await conn.fetch(
            """
            SELECT job_execution_id, 'running' AS state FROM running_jobs
            WHERE job_execution_id = ANY($1::uuid[])
            UNION ALL
            SELECT job_execution_id, 'ended' FROM ended_executions
            WHERE job_execution_id = ANY($1::uuid[])
            """,
            ids,
        )
        state: dict[UUID, EnqueueResult] = {}
        for row in blocked:
            # A lease and a tombstone can coexist (cancelled while running): ended wins.
            if state.get(row["job_execution_id"]) != EnqueueResult.ENDED:
                state[row["job_execution_id"]] = EnqueueResult(row["state"])
        todo = [jobs[first[i]] for i in ids if i not in state]
        inserted: set[UUID] = set()
        if todo:
            rows = await conn.fetch(
                """
                INSERT INTO pending_jobs (workspace_id, workflow_run_id, workflow_run_attempt_id,
                    job_id, job_execution_id, project_id, required_labels, payload, created_at)
                SELECT ws, run, attempt, job, ex, project,
                       ARRAY(SELECT jsonb_array_elements_text(labels::jsonb)), body::jsonb, queued
                FROM unnest($1::uuid[], $2::uuid[], $3::uuid[], $4::uuid[], $5::uuid[],
                            $6::uuid[], $7::text[], $8::text[], $9::timestamptz[])
                     AS t(ws, run, attempt, job, ex, project, labels, body, queued)
                ON CONFLICT (job_execution_id) DO NOTHING
                RETURNING job_execution_id, workspace_id
                """,
                [j.identity.workspace_id for j in todo],
                [j.identity.workflow_run_id for j in todo],
                [j.identity.workflow_run_attempt_id for j in todo],
                [j.identity.job_id for j in todo],
                [j.identity.job_execution_id for j in todo],
                [j.identity.project_id for j in todo],
                [json_text(j.required_labels) for j in todo],
                [json_text(j.payload) for j in todo],
                [j.queued_at for j in todo],
            )
            inserted = {row["job_execution_id"] for row in rows}
            labels_of = {j.identity.job_execution_id: j.required_labels for j in todo}
            wakes = sorted(
                {
                    enqueued_payload(row["workspace_id"], labels_of[row["job_execution_id"]])
                    for row in rows
                }
            )
            if wakes:
                await conn.execute(
                    "SELECT pg_notify($1, w) FROM unnest($2::text[]) AS w", ENQUEUED_CHANNEL, wakes
                )
    results = []
    for index, job in enumerate(jobs):
        execution_id = job.identity.job_execution_id
        if execution_id in state:
            results.append(state[execution_id])
        elif execution_id in inserted and first[execution_id] == index:
            results.append(EnqueueResult.ENQUEUED)
        else:
            results.append(EnqueueResult.DUPLICATE)
    return results


async def touch_session(conn: Conn, session: SessionClaims, throttle: timedelta) -> None:
    """Liveness: stamp `updated_at`, at most once per throttle window (autocommit)."""
    await conn.execute(
        """
        UPDATE runner_sessions SET updated_at = now()
        WHERE id = $1 AND workspace_id = $2 AND updated_at < now() - $3::interval
        """,
        session.runner_session_id,
        session.workspace_id,
        throttle,
    )


async def claim(
    conn: Conn,
    session: SessionClaims,
    *,
    liveness_throttle: timedelta = timedelta(seconds=10),
) -> ClaimedJob | None:
    """Claim the oldest compatible pending execution for `session`, or return None.

    Locks, in order: the session row FOR UPDATE (capped sessions only; serialises claims by one
    session so the cap holds), then per candidate: the pending row FOR UPDATE SKIP LOCKED (a row
    another claim holds is skipped), then a *try* of its execution lock. When the try fails the
    head is busy (enqueue, reconcile, complete or reaper hold it): we step to the next compatible
    row, unlike the reference, which returned nothing. We never wait on an execution lock while
    holding a pending row, so no cycle with the transactions that wait for it (they take the
    execution lock first, then the pending row).

    An orphan (a pending row whose execution already has a lease) is deleted and stepped over;
    it spends no claim and writes no event.
    """
    await touch_session(conn, session, liveness_throttle)
    if not session.labels:
        return None
    async with conn.transaction():
        if session.max_claims is not None:
            row = await conn.fetchrow(
                """
                SELECT max_claims, claims_used, revoked_at, provisioner_id, provider_runner_id
                FROM runner_sessions WHERE id = $1 FOR UPDATE
                """,
                session.runner_session_id,
            )
            if (
                row is None
                or row["revoked_at"] is not None
                or row["max_claims"] is None
                or row["claims_used"] >= row["max_claims"]
            ):
                raise RunnerSessionExhausted()
            provisioner_id, provider_runner_id = row["provisioner_id"], row["provider_runner_id"]
        else:
            provisioner_id, provider_runner_id = None, None
        stepped_over: list[UUID] = []
        while len(stepped_over) <= MAX_BUSY_HEADS:
            candidate = await conn.fetchrow(
                f"""
                SELECT p.id, {_EXECUTION_TRY_LOCK} AS locked
                FROM (SELECT id, job_execution_id FROM pending_jobs
                      WHERE workspace_id = $1 AND required_labels <@ $2::text[]
                        AND NOT (id = ANY($3::uuid[]))
                      ORDER BY created_at, id
                      LIMIT 1
                      FOR UPDATE SKIP LOCKED) AS p
                """,
                session.workspace_id,
                list(session.labels),
                stepped_over,
            )
            if candidate is None:
                return None
            if not candidate["locked"]:
                stepped_over.append(candidate["id"])
                continue
            claimed = await conn.fetchrow(
                f"""
                WITH taken AS (
                    DELETE FROM pending_jobs WHERE id = $1
                    RETURNING id, {IDENTITY_COLUMNS}, required_labels, payload, created_at
                )
                INSERT INTO running_jobs (pending_id, {IDENTITY_COLUMNS}, runner_session_id,
                    provisioner_id, provider_runner_id, required_labels, runner_labels, payload,
                    queued_at)
                SELECT id, {IDENTITY_COLUMNS}, $2, $3, $4, required_labels, $5::text[], payload,
                       created_at
                FROM taken
                ON CONFLICT (job_execution_id) DO NOTHING
                RETURNING {IDENTITY_COLUMNS}, required_labels, payload::text AS payload,
                          queued_at, started_at
                """,
                candidate["id"],
                session.runner_session_id,
                provisioner_id,
                provider_runner_id,
                list(session.labels),
            )
            if claimed is None:
                stepped_over.append(candidate["id"])  # an orphan, now deleted
                continue
            job = ClaimedJob(
                identity=identity(claimed),
                required_labels=tuple(claimed["required_labels"]),
                payload=json_value(claimed["payload"]),
                queued_at=claimed["queued_at"],
                started_at=claimed["started_at"],
            )
            if session.max_claims is not None:
                await conn.execute(
                    """
                    UPDATE runner_sessions SET claims_used = claims_used + 1, updated_at = now()
                    WHERE id = $1
                    """,
                    session.runner_session_id,
                )
            await events.write(
                conn,
                [
                    (
                        EventType.CLAIMED,
                        job.identity,
                        events.identity_payload(
                            job.identity,
                            runner_session_id=str(session.runner_session_id),
                            claimed_at=job.started_at.isoformat(),
                        ),
                    )
                ],
            )
            return job
    return None


async def put_back(conn: Conn, job_execution_id: UUID, runner_session_id: UUID) -> bool:
    """Return an undelivered claim to its original queue position. False when it cannot be.

    Only a lease that has never heartbeated (the runner never saw it) and is still held by the
    session is put back. The pending row gets its original id and created_at, so FIFO order is as
    if it had never been claimed; a capped session gets its claim back.

    Locks: execution lock (blocking) -> running row (delete) -> pending insert -> session row.
    """
    async with conn.transaction():
        await lock_executions(conn, [job_execution_id])
        row = await conn.fetchrow(
            f"""
            DELETE FROM running_jobs
            WHERE job_execution_id = $1 AND runner_session_id = $2
              AND first_heartbeat_at IS NULL AND cancellation_requested_at IS NULL
            RETURNING pending_id, {IDENTITY_COLUMNS}, required_labels, payload::text AS payload,
                      queued_at
            """,
            job_execution_id,
            runner_session_id,
        )
        if row is None:
            return False
        await conn.execute(
            f"""
            INSERT INTO pending_jobs (id, {IDENTITY_COLUMNS}, required_labels, payload, created_at)
            VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9::jsonb, $10)
            """,
            row["pending_id"],
            row["workspace_id"],
            row["workflow_run_id"],
            row["workflow_run_attempt_id"],
            row["job_id"],
            row["job_execution_id"],
            row["project_id"],
            row["required_labels"],
            row["payload"],
            row["queued_at"],
        )
        await conn.execute(
            """
            UPDATE runner_sessions SET claims_used = claims_used - 1
            WHERE id = $1 AND max_claims IS NOT NULL AND claims_used > 0
            """,
            runner_session_id,
        )
        job = identity(row)
        await events.write(conn, [(EventType.REQUEUED, job, events.identity_payload(job))])
        await conn.execute(
            "SELECT pg_notify($1, $2)",
            ENQUEUED_CHANNEL,
            enqueued_payload(job.workspace_id, tuple(row["required_labels"])),
        )
    return True
