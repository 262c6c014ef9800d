"""The life of an execution (docs/policies.md Q-40..Q-69): run timeouts and queue expiry against
real PostgreSQL, with the races forced by holding a lock or a row from a second connection."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from uuid import UUID

import anyio
import asyncpg
import pytest

from controlplane.domain.jobs import (
    ClaimedJob,
    EndedLease,
    EnqueueResult,
    JobIdentity,
    Outcome,
    SessionClaims,
)
from controlplane.errors import RunningJobExecutionNotFound
from controlplane.store import claiming, deadlines, executions, leases, locks, queue
from controlplane.store.pool import Conn
from tests.factories import (
    event_types,
    holding,
    holding_lock,
    manual_session,
    new_job,
    wait_until_blocked,
)

GRACE = timedelta(seconds=60)
TERMINAL = (
    "job.completed",
    "job.cancelled",
    "job.lease_expired",
    "job.timed_out",
    "job.queue_expired",
)


async def leased(
    conn: Conn, session: SessionClaims, *, run_timeout: int | None = 3600
) -> ClaimedJob:
    job = dataclasses.replace(new_job(session.workspace_id), timeout_seconds=run_timeout)
    assert await queue.enqueue(conn, [job]) == [EnqueueResult.ENQUEUED]
    claimed = await claiming.claim(conn, session)
    assert claimed is not None
    return claimed


async def started_ago(conn: Conn, execution: UUID, seconds: float) -> None:
    """Move the lease's start (and so its run deadline) `seconds` into the past."""
    await conn.execute(
        """
        UPDATE running_jobs
        SET started_at = now() - make_interval(secs => $2),
            last_heartbeat_at = now(), first_heartbeat_at = now()
        WHERE job_execution_id = $1
        """,
        execution,
        seconds,
    )


async def expire_in_queue(conn: Conn, execution: UUID) -> None:
    await conn.execute(
        "UPDATE pending_jobs SET expires_at = now() - interval '1 second'"
        " WHERE job_execution_id = $1",
        execution,
    )


async def terminal_events(conn: Conn, execution: UUID) -> list[str]:
    return [kind for kind in await event_types(conn, execution) if kind in TERMINAL]


async def tombstone(conn: Conn, execution: UUID) -> str | None:
    outcome: str | None = await conn.fetchval(
        "SELECT outcome FROM ended_executions WHERE job_execution_id = $1", execution
    )
    return outcome


async def rows_of(conn: Conn, table: str, execution: UUID) -> int:
    count: int = await conn.fetchval(
        f"SELECT count(*) FROM {table} WHERE job_execution_id = $1",  # noqa: S608 -- test tables
        execution,
    )
    return count


# Run timeout -----------------------------------------------------------------------------------


async def test_q41_the_run_deadline_is_fixed_at_the_start_and_heartbeats_never_move_it(
    conn: Conn, workspace: UUID
) -> None:
    session = await manual_session(conn, workspace)
    job = await leased(conn, session, run_timeout=600)
    execution = job.identity.job_execution_id

    first = await leases.heartbeat(conn, execution, session.runner_session_id)
    assert first.timeout_in is not None and 590 < first.timeout_in <= 600
    assert not first.must_stop
    await started_ago(conn, execution, 300)
    second = await leases.heartbeat(conn, execution, session.runner_session_id)
    assert second.timeout_in is not None and 290 < second.timeout_in <= 300
    await started_ago(conn, execution, 601)
    late = await leases.heartbeat(conn, execution, session.runner_session_id)
    assert late.timeout_in is not None and late.timeout_in < 0
    assert late.must_stop and not late.cancellation_requested
    assert await executions.cancel_requested(conn, execution, session.runner_session_id)
    # Beating changed nothing: the deadline is still past, and the lease is still there.
    again = await leases.heartbeat(conn, execution, session.runner_session_id)
    assert again.must_stop
    assert await rows_of(conn, "running_jobs", execution) == 1


async def test_q43_a_lease_past_its_deadline_and_grace_ends_timed_out_with_one_event(
    conn: Conn, workspace: UUID
) -> None:
    session = await manual_session(conn, workspace)
    job = await leased(conn, session, run_timeout=600)
    execution = job.identity.job_execution_id
    await started_ago(conn, execution, 600 + 61)

    ended = await deadlines.time_out(conn, GRACE)

    assert [lease.identity.job_execution_id for lease in ended] == [execution]
    assert ended[0].newly_ended
    assert await tombstone(conn, execution) == "timed_out"
    assert await terminal_events(conn, execution) == ["job.timed_out"]
    payload = await conn.fetchval(
        "SELECT payload->>'outcome' FROM events WHERE event_type = 'job.timed_out'"
    )
    assert payload == "timed_out"
    assert await deadlines.time_out(conn, GRACE) == []
    with pytest.raises(RunningJobExecutionNotFound):
        await leases.complete(conn, execution, session.runner_session_id, Outcome.CANCELLED)
    assert await terminal_events(conn, execution) == ["job.timed_out"]
    assert await queue.enqueue(conn, [new_job(workspace, execution_id=execution)]) == [
        EnqueueResult.ENDED
    ]


async def test_q44_a_lease_within_its_grace_is_kept_and_completes_with_its_own_outcome(
    conn: Conn, workspace: UUID
) -> None:
    session = await manual_session(conn, workspace)
    job = await leased(conn, session, run_timeout=600)
    execution = job.identity.job_execution_id
    await started_ago(conn, execution, 600 + 30)

    assert await deadlines.time_out(conn, GRACE) == []
    assert (await leases.heartbeat(conn, execution, session.runner_session_id)).must_stop
    ended = await leases.complete(conn, execution, session.runner_session_id, Outcome.CANCELLED)

    assert ended.newly_ended
    assert await tombstone(conn, execution) == "cancelled"
    assert await terminal_events(conn, execution) == ["job.completed"]


async def test_q45_a_completion_committing_first_wins_over_the_timeout(
    conn: Conn,
    pool: asyncpg.Pool,
    observer: asyncpg.Connection,
    database_url: str,
    workspace: UUID,
) -> None:
    session = await manual_session(conn, workspace)
    job = await leased(conn, session, run_timeout=600)
    execution = job.identity.job_execution_id
    await started_ago(conn, execution, 600 + 61)
    completed: list[EndedLease] = []

    async with pool.acquire() as runner, pool.acquire() as leader:
        runner_pid: int = await runner.fetchval("SELECT pg_backend_pid()")

        async def run_complete() -> None:
            completed.append(
                await leases.complete(runner, execution, session.runner_session_id, Outcome.FAILED)
            )

        with anyio.fail_after(10):
            # The completion waits for the execution lock a second connection holds; the
            # leader's try-lock fails meanwhile, so it leaves the lease to the completion.
            async with (
                anyio.create_task_group() as tasks,
                holding_lock(database_url, locks.execution(execution)),
            ):
                tasks.start_soon(run_complete)
                await wait_until_blocked(observer, runner_pid)
                assert await deadlines.time_out(leader, GRACE) == []
        assert await deadlines.time_out(leader, GRACE) == []

    assert completed[0].newly_ended
    assert await tombstone(conn, execution) == "failed"
    assert await terminal_events(conn, execution) == ["job.completed"]


async def test_q45_a_timeout_committing_first_wins_over_the_completion(
    conn: Conn,
    pool: asyncpg.Pool,
    observer: asyncpg.Connection,
    database_url: str,
    workspace: UUID,
) -> None:
    session = await manual_session(conn, workspace)
    job = await leased(conn, session, run_timeout=600)
    execution = job.identity.job_execution_id
    await started_ago(conn, execution, 600 + 61)
    timed: list[list[EndedLease]] = []
    refused: list[Exception] = []

    async with pool.acquire() as runner, pool.acquire() as leader:
        runner_pid: int = await runner.fetchval("SELECT pg_backend_pid()")
        leader_pid: int = await leader.fetchval("SELECT pg_backend_pid()")

        async def run_timeout() -> None:
            timed.append(await deadlines.time_out(leader, GRACE))

        async def run_complete() -> None:
            try:
                await leases.complete(runner, execution, session.runner_session_id, Outcome.FAILED)
            except RunningJobExecutionNotFound as error:
                refused.append(error)

        with anyio.fail_after(10):
            # The leader holds the execution lock and waits for the lease row a second
            # connection holds; the completion then waits for the leader's execution lock.
            async with (
                anyio.create_task_group() as tasks,
                holding(
                    database_url,
                    "SELECT 1 FROM running_jobs WHERE job_execution_id = $1 FOR UPDATE",
                    execution,
                ),
            ):
                tasks.start_soon(run_timeout)
                await wait_until_blocked(observer, leader_pid)
                tasks.start_soon(run_complete)
                await wait_until_blocked(observer, runner_pid)

    assert [[lease.identity.job_execution_id for lease in tick] for tick in timed] == [[execution]]
    assert len(refused) == 1
    assert await tombstone(conn, execution) == "timed_out"
    assert await terminal_events(conn, execution) == ["job.timed_out"]


async def test_q46_a_lease_without_a_run_timeout_never_times_out(
    conn: Conn, workspace: UUID
) -> None:
    session = await manual_session(conn, workspace)
    job = await leased(conn, session, run_timeout=None)
    execution = job.identity.job_execution_id
    await started_ago(conn, execution, 400 * 86_400)

    beat = await leases.heartbeat(conn, execution, session.runner_session_id)
    assert beat.timeout_in is None and not beat.must_stop
    assert not await executions.cancel_requested(conn, execution, session.runner_session_id)
    assert await deadlines.time_out(conn, GRACE) == []
    assert await rows_of(conn, "running_jobs", execution) == 1


async def test_q47_a_timed_out_lease_cancelled_earlier_gets_no_second_terminal_event(
    conn: Conn, workspace: UUID
) -> None:
    session = await manual_session(conn, workspace)
    job = await leased(conn, session, run_timeout=600)
    execution = job.identity.job_execution_id
    await leases.reconcile(conn, execution, Outcome.CANCELLED)
    await started_ago(conn, execution, 600 + 61)

    ended = await deadlines.time_out(conn, GRACE)

    assert [lease.newly_ended for lease in ended] == [False]
    assert await rows_of(conn, "running_jobs", execution) == 0
    assert await tombstone(conn, execution) == "cancelled"
    assert await terminal_events(conn, execution) == ["job.cancelled"]


# Queue expiry ----------------------------------------------------------------------------------


async def test_q50_a_pending_job_past_its_queue_deadline_is_removed_with_one_event(
    conn: Conn, workspace: UUID
) -> None:
    job = dataclasses.replace(new_job(workspace), queue_timeout_seconds=3600)
    other = dataclasses.replace(new_job(workspace), queue_timeout_seconds=3600)
    await queue.enqueue(conn, [job, other])
    execution = job.identity.job_execution_id
    deadline = await conn.fetchval(
        "SELECT expires_at - enqueued_at FROM pending_jobs WHERE job_execution_id = $1", execution
    )
    assert deadline == timedelta(hours=1)
    await expire_in_queue(conn, execution)

    expired = await deadlines.expire_queued(conn)

    assert [found.job_execution_id for found in expired] == [execution]
    assert await rows_of(conn, "pending_jobs", execution) == 0
    assert await rows_of(conn, "pending_jobs", other.identity.job_execution_id) == 1
    assert await tombstone(conn, execution) == "queue_expired"
    assert await terminal_events(conn, execution) == ["job.queue_expired"]
    assert await deadlines.expire_queued(conn) == []
    assert await queue.enqueue(conn, [job]) == [EnqueueResult.ENDED]


async def test_q51_a_claim_never_hands_out_an_expired_job_even_before_the_leader_runs(
    conn: Conn, workspace: UUID
) -> None:
    stale, fresh, third = (
        dataclasses.replace(new_job(workspace), queue_timeout_seconds=60) for _ in range(3)
    )
    await queue.enqueue(conn, [stale, fresh, third])
    await expire_in_queue(conn, stale.identity.job_execution_id)
    session = await manual_session(conn, workspace)
    batch = [await manual_session(conn, workspace) for _ in range(2)]

    claimed = await claiming.claim(conn, session)
    assert claimed is not None
    assert claimed.identity.job_execution_id == fresh.identity.job_execution_id
    served = await claiming.claim_batch(
        conn, workspace, session.labels, [s.runner_session_id for s in batch]
    )
    assert [job.identity.job_execution_id for job in served.values()] == [
        third.identity.job_execution_id
    ]
    assert await rows_of(conn, "pending_jobs", stale.identity.job_execution_id) == 1
    assert await event_types(conn, stale.identity.job_execution_id) == []


async def test_q52_a_claim_steps_over_a_job_the_expiry_holds(
    conn: Conn,
    pool: asyncpg.Pool,
    observer: asyncpg.Connection,
    database_url: str,
    workspace: UUID,
) -> None:
    job = dataclasses.replace(new_job(workspace), queue_timeout_seconds=60)
    await queue.enqueue(conn, [job])
    execution = job.identity.job_execution_id
    await expire_in_queue(conn, execution)
    session = await manual_session(conn, workspace)
    expired: list[list[JobIdentity]] = []

    async with pool.acquire() as leader, pool.acquire() as claimer:
        leader_pid: int = await leader.fetchval("SELECT pg_backend_pid()")

        async def run_expiry() -> None:
            expired.append(await deadlines.expire_queued(leader))

        with anyio.fail_after(10):
            # An uncommitted tombstone for the execution makes the expiry's own tombstone wait:
            # the expiry then holds the pending row and the execution lock.
            async with (
                anyio.create_task_group() as tasks,
                holding(
                    database_url,
                    "INSERT INTO ended_executions (job_execution_id, outcome, ended_by)"
                    " VALUES ($1, 'cancelled', 'orchestrator')",
                    execution,
                ) as holder,
            ):
                tasks.start_soon(run_expiry)
                await wait_until_blocked(observer, leader_pid)
                assert await claiming.claim(claimer, session) is None
                await holder.execute("ROLLBACK; BEGIN")

    assert [[found.job_execution_id for found in tick] for tick in expired] == [[execution]]
    assert await rows_of(conn, "running_jobs", execution) == 0
    assert await tombstone(conn, execution) == "queue_expired"
    assert await terminal_events(conn, execution) == ["job.queue_expired"]


async def test_q52_the_expiry_skips_a_job_a_claim_took_before_its_deadline(
    conn: Conn, pool: asyncpg.Pool, workspace: UUID
) -> None:
    job = dataclasses.replace(new_job(workspace), queue_timeout_seconds=60)
    await queue.enqueue(conn, [job])
    execution = job.identity.job_execution_id
    session = await manual_session(conn, workspace)
    claims: list[ClaimedJob | None] = []

    async with pool.acquire() as claimer, pool.acquire() as leader:
        with anyio.fail_after(10):
            async with claimer.transaction():
                # The claim's transaction starts (its now() is fixed) before the deadline, which
                # is then moved to just after that instant: the claim still takes the job.
                await claimer.execute("SELECT now()")
                await conn.execute(
                    "UPDATE pending_jobs SET expires_at = clock_timestamp()"
                    " WHERE job_execution_id = $1",
                    execution,
                )
                claims.append(await claiming.claim(claimer, session))
                # Past the deadline by the leader's clock, but the row is the claim's.
                assert await deadlines.expire_queued(leader) == []

    assert claims[0] is not None and claims[0].identity.job_execution_id == execution
    assert await rows_of(conn, "running_jobs", execution) == 1
    assert await tombstone(conn, execution) is None
    assert await terminal_events(conn, execution) == []
    assert await deadlines.expire_queued(conn) == []


async def test_q53_an_expired_orphan_row_is_swept_without_a_tombstone(
    conn: Conn, workspace: UUID
) -> None:
    session = await manual_session(conn, workspace)
    job = await leased(conn, session)
    execution = job.identity.job_execution_id
    await conn.execute(
        """
        INSERT INTO pending_jobs (workspace_id, workflow_run_id, workflow_run_attempt_id, job_id,
            job_execution_id, project_id, required_labels, payload, created_at, expires_at)
        SELECT workspace_id, workflow_run_id, workflow_run_attempt_id, job_id, job_execution_id,
               project_id, required_labels, payload, queued_at, now() - interval '1 second'
        FROM running_jobs WHERE job_execution_id = $1
        """,
        execution,
    )

    assert await deadlines.expire_queued(conn) == []

    assert await rows_of(conn, "pending_jobs", execution) == 0
    assert await rows_of(conn, "running_jobs", execution) == 1
    assert await tombstone(conn, execution) is None
    assert await terminal_events(conn, execution) == []
