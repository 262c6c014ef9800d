"""The queue side of job executions: enqueue and put-back (claims are store/claiming.py).

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
from uuid import UUID

from controlplane.domain.jobs import (
    EnqueueResult,
    EventType,
    NewJob,
)
from controlplane.domain.labels import LabelSet, canonicalise
from controlplane.errors import EmptyRequiredLabels
from controlplane.store import events, locks
from controlplane.store.pool import Conn
from controlplane.store.records import CARRIED_COLUMNS, IDENTITY_COLUMNS, identity, json_text

ENQUEUED_CHANNEL = "cp_enqueued"


def enqueued_payload(workspace_id: UUID, labels: LabelSet) -> str:
    """`<workspace>|<label>,<label>`: who to wake, and which waiters could match."""
    return f"{workspace_id}|{','.join(labels)}"


def execution_keys(execution_ids: Sequence[UUID]) -> list[int]:
    """The advisory keys of `execution_ids`' execution locks, each once, in ascending order: the
    order every transaction takes several of them in."""
    return sorted({locks.execution(execution_id) for execution_id in execution_ids})


async def lock_executions(conn: Conn, execution_ids: Sequence[UUID]) -> None:
    """Take the execution locks of `execution_ids`, blocking, in ascending key order."""
    keys = execution_keys(execution_ids)
    if len(keys) == 1:
        await conn.execute("SELECT pg_advisory_xact_lock($1)", keys[0])
    elif keys:
        # unnest returns the array in order, so the locks are taken in ascending key order.
        await conn.execute("SELECT pg_advisory_xact_lock(k) FROM unnest($1::bigint[]) AS k", keys)


async def enqueue(conn: Conn, jobs: Sequence[NewJob]) -> list[EnqueueResult]:
    """Insert pending rows for `jobs`, in one transaction; one result per job, in input order.

    Locks: the execution locks of every job (blocking, ascending key order), then pending-row
    inserts (their trigger then takes the `cp_workspace_demand` keys shared and adds or lowers
    summary rows, sql/0022, sql/0030), then each new concurrency key's row; all in one call of
    `cp_enqueue` (sql/0026), one round trip, in its own transaction (the caller's, if it is in
    one). A concurrent claim of the same execution holds its lock until commit, so we then see
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
    todo = [jobs[first[i]] for i in ids]
    keys = execution_keys(ids)
    # One round trip, its own transaction unless the caller is in one: cp_enqueue (sql/0026)
    # takes the locks, then runs one statement after them (so its snapshot sees whatever the
    # lock holders committed): find running and ended executions, insert the rest, notify per
    # distinct (workspace, labels) of what was inserted.
    row = await conn.fetchrow(
        "SELECT * FROM cp_enqueue($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14,"
        " $15, $16, $17, $18)",
        keys,
        [j.identity.workspace_id for j in todo],
        [j.identity.workflow_run_id for j in todo],
        [j.identity.workflow_run_attempt_id for j in todo],
        [j.identity.job_id for j in todo],
        [j.identity.job_execution_id for j in todo],
        [j.identity.project_id for j in todo],
        [json_text(j.required_labels) for j in todo],
        [json_text(j.payload) for j in todo],
        [j.queued_at for j in todo],
        [enqueued_payload(j.identity.workspace_id, j.required_labels) for j in todo],
        ENQUEUED_CHANNEL,
        [j.priority for j in todo],
        [j.concurrency_key for j in todo],
        [j.concurrency_limit for j in todo],
        [j.timeout_seconds for j in todo],
        [j.queue_timeout_seconds for j in todo],
        [j.retries_on_lost for j in todo],
    )
    assert row is not None
    inserted = set(row["inserted_ids"])
    # A lease and a tombstone can coexist (cancelled while running): ended wins.
    state = dict.fromkeys(row["running_ids"], EnqueueResult.RUNNING)
    state.update(dict.fromkeys(row["ended_ids"], EnqueueResult.ENDED))
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


def requeue_statement(condition: str, *, retry: bool) -> str:
    """One statement returning leases to the queue in their original place: it deletes the
    running rows matching `condition` and inserts their pending rows with the original id and
    `created_at` (queued_at) and every carried column by name (records.CARRIED_COLUMNS). A retry
    is the next attempt, with a fresh queue deadline; a put-back of an undelivered claim keeps
    both. Returns each moved lease's identity, labels, attempt (the one that ended), session,
    start and provisioned link.

    Locks: the running rows (delete), then the new pending rows (insert); the caller holds the
    execution locks first."""
    again = {
        "attempt": "attempt + 1",
        "expires_at": "now() + queue_timeout_seconds * interval '1 second'",
    }
    carried = ", ".join(
        again.get(column, column) if retry else column for column in CARRIED_COLUMNS.split(", ")
    )
    return f"""
    WITH moved AS (
        DELETE FROM running_jobs WHERE {condition}
        RETURNING pending_id, {IDENTITY_COLUMNS}, {CARRIED_COLUMNS}, queued_at, runner_session_id,
                  started_at, provisioner_id, provider_runner_id
    ), back AS (
        INSERT INTO pending_jobs (id, {IDENTITY_COLUMNS}, {CARRIED_COLUMNS}, created_at)
        SELECT pending_id, {IDENTITY_COLUMNS}, {carried}, queued_at FROM moved
    )
    SELECT {IDENTITY_COLUMNS}, required_labels, attempt, runner_session_id, started_at,
           provisioner_id, provider_runner_id
    FROM moved
    """  # noqa: S608 -- interpolates constants and the callers' literal conditions only


_PUT_BACK = requeue_statement(
    "job_execution_id = $1 AND runner_session_id = $2"
    " AND first_heartbeat_at IS NULL AND cancellation_requested_at IS NULL",
    retry=False,
)


async def put_back(conn: Conn, job_execution_id: UUID, runner_session_id: UUID) -> bool:
    """Return an undelivered claim to its original queue position. False when it cannot be.

    Only a lease that has never heartbeated (the runner never saw it) and is still held by the
    session is put back. The pending row gets its original id and created_at, so FIFO order is as
    if it had never been claimed, and every carried column (`requeue_statement`); a capped
    session gets its claim back.

    Locks: execution lock (blocking) -> running row (delete) -> pending insert -> session row.
    """
    async with conn.transaction():
        await lock_executions(conn, [job_execution_id])
        row = await conn.fetchrow(_PUT_BACK, job_execution_id, runner_session_id)
        if row is None:
            return False
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
