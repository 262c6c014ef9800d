"""The leader's two deadlines (docs/policies.md, "The life of an execution"): leases past their
run timeout and its grace end as `timed_out` (`time_out`), pending executions past their queue
timeout are removed as `queue_expired` (`expire_queued`). Each writes a tombstone and exactly one
terminal event per execution it ends (store/leases.py `end_executions`); the rules are
domain/lifetimes.py's `timed_out` and `queue_expired`.

At the run deadline itself (not its grace) a lease's cancel is requested by the server
(`cancel_at_deadline`, run first by `time_out`): `cancellation_requested_at` is set to the
deadline and `NOTIFY cp_cancel` names the execution, exactly as an orchestrator's cancel does
(store/leases.py `reconcile`). The heartbeat already answers `cancel: true` from the deadline
alone; the stamp is for everything that reads a cancel from the lease row: a provisioned runner's
terminate intent and reconcile answer (sql/0011's `cp_terminate_candidates`, store/reconcile.py),
the release of its unit once its provider reports it gone (store/runner_release.py), and the
job's views. Without it a provisioner kept a timed-out runner running, and after the leader
ended the lease nothing asked it to stop.

None of them ever waits for a lock held by a hot-path transaction:

* `cancel_at_deadline` locks the running rows it stamps `FOR UPDATE SKIP LOCKED` and takes no
  other lock (not the execution lock: a row a completion, a cancel or a heartbeat holds is
  stamped at the next round, or never if that lease ends first). Only a heartbeat or a
  completion may wait for it, for one statement.

* `time_out` is the reaper's shape: execution **try**-locks on the leases it keeps -> pending
  rows (orphan sweep) -> running rows (delete) -> tombstones -> events. A lease whose lock is
  held (its runner completing, the orchestrator cancelling) is skipped until the next round;
  the completion that holds it decides.
* `expire_queued` is the claim's shape: pending rows `FOR UPDATE SKIP LOCKED` -> execution
  **try**-lock -> delete -> tombstones -> events. A row a claim holds is skipped (that claim
  started before the deadline: the claim filters expired rows out, so it wins), and a claim skips
  a row the expiry holds.
"""

from __future__ import annotations

from datetime import timedelta

from controlplane.domain.jobs import EndedLease, EventType, JobIdentity, Outcome
from controlplane.store import leases, locks
from controlplane.store.leases import CANCEL_CHANNEL
from controlplane.store.pool import Conn
from controlplane.store.records import IDENTITY_COLUMNS, identity, qualified

_RUN_DEADLINE = "started_at + timeout_seconds * interval '1 second'"


async def cancel_at_deadline(conn: Conn, *, limit: int = 100) -> int:
    """Request the cancel of up to `limit` leases past their run deadline that have none yet,
    earliest deadline first: `cancellation_requested_at` is the deadline, and one `NOTIFY
    cp_cancel` per execution is delivered at commit. Returns how many it stamped.

    Locks: the running rows, `FOR UPDATE SKIP LOCKED`, in one statement; nothing else.
    """
    return len(
        await conn.fetch(
            f"""
            WITH due AS MATERIALIZED (
                SELECT id FROM running_jobs
                WHERE timeout_seconds IS NOT NULL AND cancellation_requested_at IS NULL
                  AND {_RUN_DEADLINE} <= now()
                ORDER BY {_RUN_DEADLINE}, id
                LIMIT $1
                FOR UPDATE SKIP LOCKED
            ), stamped AS (
                UPDATE running_jobs AS r SET cancellation_requested_at = {_RUN_DEADLINE}
                FROM due WHERE r.id = due.id
                RETURNING r.job_execution_id
            )
            SELECT pg_notify($2, job_execution_id::text) FROM stamped
            """,  # noqa: S608 -- interpolates constants only: _RUN_DEADLINE
            limit,
            CANCEL_CHANNEL,
        )
    )


async def time_out(conn: Conn, grace: timedelta, *, limit: int = 100) -> list[EndedLease]:
    """End up to `limit` leases whose run deadline passed more than `grace` ago, earliest
    deadline first, each with outcome `timed_out` and one `job.timed_out` event (none when the
    execution had ended already, cancelled while its lease drained). First, in a transaction of
    its own, request the cancel of up to `limit` leases past their deadline
    (`cancel_at_deadline`), so a provisioner hears of it within one leader round.

    Locks: execution try-locks -> pending rows (orphan sweep) -> running rows (delete) ->
    tombstones -> events. The deadline never moves, so the delete needs no re-check; a lease
    completed before we took its lock is simply gone.
    """
    await cancel_at_deadline(conn, limit=limit)
    async with conn.transaction():
        picked = await leases.lock_and_sweep(
            conn,
            f"""
            SELECT id, job_execution_id FROM running_jobs
            WHERE timeout_seconds IS NOT NULL AND {_RUN_DEADLINE} + $1::interval <= now()
            ORDER BY {_RUN_DEADLINE}, id
            """,  # noqa: S608 -- interpolates constants only: _RUN_DEADLINE
            [grace],
            limit,
        )
        if not picked:
            return []
        deleted = await conn.fetch(
            f"""
            DELETE FROM running_jobs WHERE id = ANY($1::uuid[])
            RETURNING {IDENTITY_COLUMNS}, provisioner_id, provider_runner_id,
                      cancellation_requested_at
            """,  # noqa: S608 -- interpolates constants only: IDENTITY_COLUMNS
            [row["id"] for row in picked],
        )
        fresh = await leases.end_executions(
            conn,
            [identity(row) for row in deleted],
            Outcome.TIMED_OUT,
            "reaper",
            EventType.TIMED_OUT,
            {},
        )
    return [leases.ended_lease(row, fresh) for row in deleted]


async def expire_queued(conn: Conn, *, limit: int = 100) -> list[JobIdentity]:
    """Remove up to `limit` pending executions past their queue deadline, earliest first, each
    with outcome `queue_expired` and one `job.queue_expired` event; return those it ended. An
    orphan (a pending row whose execution already has a lease) is deleted without either.

    Locks: pending rows `FOR UPDATE SKIP LOCKED` -> execution try-locks -> delete -> tombstones
    -> events; one statement for the rows, so it never waits for a row or a lock.
    """
    async with conn.transaction():
        rows = await conn.fetch(
            f"""
            WITH due AS MATERIALIZED (
                SELECT id, job_execution_id FROM pending_jobs
                WHERE expires_at <= now()
                ORDER BY expires_at, id
                LIMIT $1
                FOR UPDATE SKIP LOCKED
            ), mine AS MATERIALIZED (
                SELECT id FROM due
                WHERE pg_try_advisory_xact_lock(
                    {locks.sql_key(locks.EXECUTION, "job_execution_id")})
            )
            DELETE FROM pending_jobs AS p USING mine WHERE p.id = mine.id
            RETURNING {qualified("p", IDENTITY_COLUMNS)},
                      EXISTS (SELECT 1 FROM running_jobs r
                              WHERE r.job_execution_id = p.job_execution_id) AS orphan
            """,  # noqa: S608 -- interpolates constants only: IDENTITY_COLUMNS, locks.sql_key
            limit,
        )
        expired = [identity(row) for row in rows if not row["orphan"]]
        fresh = await leases.end_executions(
            conn, expired, Outcome.QUEUE_EXPIRED, "reaper", EventType.QUEUE_EXPIRED, {}
        )
    return [job for job in expired if job.job_execution_id in fresh]
