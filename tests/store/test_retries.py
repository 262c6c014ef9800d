"""Retry on a lost runner (docs/policies.md Q-60..Q-66), against real PostgreSQL: the reaper's
lease-expiry path puts a lost lease back in its place, and the races are forced by locks."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from uuid import UUID

import anyio
import asyncpg

from controlplane import metrics
from controlplane.actors.maintenance.deadlines import Deadlines, PoolDeadlineStore
from controlplane.actors.maintenance.reaper import LeaseReaper, PoolReaperStore
from controlplane.domain.jobs import (
    ClaimedJob,
    EndedLease,
    Outcome,
    ReconcileResult,
    SessionClaims,
    StaleRule,
)
from controlplane.store import claiming, executions, leases, queue, retention
from controlplane.store.pool import Conn
from tests.factories import event_types, holding, manual_session, new_job, wait_until_blocked

RULE = StaleRule(threshold=timedelta(seconds=180), grace=timedelta(seconds=60))


async def claim_of(conn: Conn, session: SessionClaims) -> ClaimedJob:
    claimed = await claiming.claim(conn, session)
    assert claimed is not None
    return claimed


async def enqueue_retrying(
    conn: Conn, workspace: UUID, retries: int, *, run_timeout: int | None = 3600
) -> UUID:
    job = dataclasses.replace(
        new_job(workspace),
        retries_on_lost=retries,
        timeout_seconds=run_timeout,
        queue_timeout_seconds=600,
    )
    await queue.enqueue(conn, [job])
    return job.identity.job_execution_id


async def go_silent(conn: Conn, execution: UUID, seconds: float = 600) -> None:
    """The runner heartbeated once and vanished `seconds` ago."""
    await conn.execute(
        """
        UPDATE running_jobs
        SET started_at = now() - make_interval(secs => $2 + 60),
            first_heartbeat_at = now() - make_interval(secs => $2 + 30),
            last_heartbeat_at = now() - make_interval(secs => $2)
        WHERE job_execution_id = $1
        """,
        execution,
        seconds,
    )


async def pending_row(conn: Conn, execution: UUID) -> asyncpg.Record | None:
    row: asyncpg.Record | None = await conn.fetchrow(
        "SELECT * FROM pending_jobs WHERE job_execution_id = $1", execution
    )
    return row


async def terminal_events(conn: Conn, execution: UUID) -> list[str]:
    return [
        kind
        for kind in await event_types(conn, execution)
        if kind
        in ("job.completed", "job.cancelled", "job.lease_expired", "job.timed_out",
            "job.queue_expired")
    ]  # fmt: skip


async def test_q60_a_lost_lease_with_retries_left_goes_back_to_its_place_as_the_next_attempt(
    conn: Conn, workspace: UUID
) -> None:
    execution = await enqueue_retrying(conn, workspace, 1)
    before = await pending_row(conn, execution)
    assert before is not None and before["attempt"] == 1
    session = await manual_session(conn, workspace)
    await claim_of(conn, session)
    younger = new_job(workspace)
    await queue.enqueue(conn, [younger])
    await go_silent(conn, execution)

    reaped = await leases.reap(conn, RULE)

    assert [(lease.identity.job_execution_id, lease.retried) for lease in reaped] == [
        (execution, True)
    ]
    after = await pending_row(conn, execution)
    assert after is not None
    assert (after["id"], after["created_at"]) == (before["id"], before["created_at"])
    assert after["attempt"] == 2
    assert await conn.fetchval("SELECT count(*) FROM running_jobs") == 0
    assert await conn.fetchval("SELECT count(*) FROM ended_executions") == 0
    assert await event_types(conn, execution) == ["job.claimed", "job.retried"]
    payload = await conn.fetchval(
        "SELECT payload::text FROM events WHERE event_type = 'job.retried'"
    )
    assert '"attempt": 2' in payload and '"outcome": "lost"' in payload
    # In its original place: the next claim takes it before the younger job.
    again = await claim_of(conn, await manual_session(conn, workspace))
    assert again.identity.job_execution_id == execution


async def test_q61_the_lost_attempt_is_kept_and_read_with_the_execution(
    conn: Conn, workspace: UUID
) -> None:
    execution = await enqueue_retrying(conn, workspace, 2)
    session = await manual_session(conn, workspace)
    await claim_of(conn, session)
    await go_silent(conn, execution)
    await leases.reap(conn, RULE)

    pending = await executions.state(conn, execution)
    assert pending is not None and pending.state == "pending" and pending.attempt == 2
    assert [(a.attempt, a.outcome, a.runner_session_id) for a in pending.lost_attempts] == [
        (1, "lost", session.runner_session_id)
    ]
    second = await manual_session(conn, workspace)
    await claim_of(conn, second)
    running = await executions.state(conn, execution)
    assert running is not None and running.state == "running" and running.attempt == 2
    await leases.complete(conn, execution, second.runner_session_id, Outcome.SUCCEEDED)
    ended = await executions.state(conn, execution)
    assert ended is not None and ended.outcome == "succeeded"
    assert [a.attempt for a in ended.lost_attempts] == [1]
    assert await terminal_events(conn, execution) == ["job.completed"]


async def test_q62_a_lost_lease_without_retries_left_expires_with_one_event(
    conn: Conn, workspace: UUID
) -> None:
    execution = await enqueue_retrying(conn, workspace, 1)
    for attempt in (1, 2):
        await claim_of(conn, await manual_session(conn, workspace))
        await go_silent(conn, execution)
        reaped = await leases.reap(conn, RULE)
        assert [lease.retried for lease in reaped] == [attempt == 1]

    assert await pending_row(conn, execution) is None
    assert await conn.fetchval("SELECT count(*) FROM running_jobs") == 0
    assert (
        await conn.fetchval(
            "SELECT outcome FROM ended_executions WHERE job_execution_id = $1", execution
        )
        == "expired"
    )
    assert await event_types(conn, execution) == [
        "job.claimed",
        "job.retried",
        "job.claimed",
        "job.lease_expired",
    ]


async def test_q63_a_lost_lease_is_not_retried_after_a_cancel_request_or_its_deadline(
    conn: Conn, workspace: UUID
) -> None:
    cancelled = await enqueue_retrying(conn, workspace, 3)
    session = await manual_session(conn, workspace)
    await claim_of(conn, session)
    await leases.cancel_session_jobs(conn, session.runner_session_id)
    late = await enqueue_retrying(conn, workspace, 3, run_timeout=60)
    await claim_of(conn, await manual_session(conn, workspace))
    await go_silent(conn, cancelled)
    await go_silent(conn, late)  # started 660 s ago: past its 60 s run deadline

    reaped = await leases.reap(conn, RULE)

    assert sorted((lease.identity.job_execution_id, lease.retried) for lease in reaped) == sorted(
        [(cancelled, False), (late, False)]
    )
    assert await conn.fetchval("SELECT count(*) FROM pending_jobs") == 0
    for execution in (cancelled, late):
        assert await terminal_events(conn, execution) == ["job.lease_expired"]


async def test_q64_a_cancel_racing_a_retry_waits_then_ends_the_requeued_job_once(
    conn: Conn,
    pool: asyncpg.Pool,
    observer: asyncpg.Connection,
    database_url: str,
    workspace: UUID,
) -> None:
    execution = await enqueue_retrying(conn, workspace, 2)
    session = await manual_session(conn, workspace)
    await claim_of(conn, session)
    await go_silent(conn, execution)
    reaped: list[list[EndedLease]] = []
    cancels: list[ReconcileResult] = []

    async with pool.acquire() as leader, pool.acquire() as orchestrator:
        leader_pid: int = await leader.fetchval("SELECT pg_backend_pid()")
        orchestrator_pid: int = await orchestrator.fetchval("SELECT pg_backend_pid()")

        async def run_reap() -> None:
            reaped.append(await leases.reap(leader, RULE))

        async def run_cancel() -> None:
            cancels.append(await leases.reconcile(orchestrator, execution, Outcome.CANCELLED))

        with anyio.fail_after(10):
            # The reaper holds the execution lock and waits for the lease row a second
            # connection holds; the cancel then waits for the reaper's execution lock.
            async with (
                anyio.create_task_group() as tasks,
                holding(
                    database_url,
                    "SELECT 1 FROM running_jobs WHERE job_execution_id = $1 FOR UPDATE",
                    execution,
                ),
            ):
                tasks.start_soon(run_reap)
                await wait_until_blocked(observer, leader_pid)
                tasks.start_soon(run_cancel)
                await wait_until_blocked(observer, orchestrator_pid)

    assert [[lease.retried for lease in tick] for tick in reaped] == [[True]]
    assert cancels == [ReconcileResult(was_pending=True, was_running=False, newly_ended=True)]
    assert await pending_row(conn, execution) is None
    assert await conn.fetchval("SELECT count(*) FROM running_jobs") == 0
    assert await event_types(conn, execution) == ["job.claimed", "job.retried", "job.cancelled"]
    assert await claiming.claim(conn, await manual_session(conn, workspace)) is None


async def test_q64_a_retry_after_a_committed_cancel_does_not_happen(
    conn: Conn, workspace: UUID
) -> None:
    execution = await enqueue_retrying(conn, workspace, 2)
    session = await manual_session(conn, workspace)
    await claim_of(conn, session)
    await leases.reconcile(conn, execution, Outcome.CANCELLED)
    await go_silent(conn, execution)

    reaped = await leases.reap(conn, RULE)

    assert [(lease.retried, lease.newly_ended) for lease in reaped] == [(False, False)]
    assert await pending_row(conn, execution) is None
    assert await terminal_events(conn, execution) == ["job.cancelled"]


async def test_q65_a_retried_execution_keeps_its_policies_and_gets_a_fresh_queue_deadline(
    conn: Conn, workspace: UUID
) -> None:
    execution = await enqueue_retrying(conn, workspace, 2, run_timeout=900)
    await conn.execute(
        "UPDATE pending_jobs SET expires_at = now() + interval '5 seconds'"
        " WHERE job_execution_id = $1",
        execution,
    )
    session = await manual_session(conn, workspace)
    await claim_of(conn, session)
    await go_silent(conn, execution, 200)

    await leases.reap(conn, RULE)

    row = await pending_row(conn, execution)
    assert row is not None
    assert (row["timeout_seconds"], row["queue_timeout_seconds"], row["retries_on_lost"]) == (
        900,
        600,
        2,
    )
    fresh = await conn.fetchval("SELECT $1::timestamptz - now()", row["expires_at"])
    assert timedelta(seconds=590) < fresh <= timedelta(seconds=600)
    claimed = await claim_of(conn, await manual_session(conn, workspace))
    assert claimed.identity.job_execution_id == execution
    lease = await conn.fetchrow(
        "SELECT attempt, timeout_seconds, retries_on_lost FROM running_jobs"
        " WHERE job_execution_id = $1",
        execution,
    )
    assert lease is not None and tuple(lease) == (2, 900, 2)


def _count(counter: object) -> float:
    value: float = metrics.REGISTRY.get_sample_value(str(counter)) or 0.0
    return value


async def test_q66_the_leader_counts_timeouts_queue_expiries_and_retries(
    conn: Conn, pool: asyncpg.Pool, workspace: UUID
) -> None:
    retried = await enqueue_retrying(conn, workspace, 1)
    await claim_of(conn, await manual_session(conn, workspace))
    await go_silent(conn, retried)
    timing = await enqueue_retrying(conn, workspace, 0, run_timeout=60)
    await claim_of(conn, await manual_session(conn, workspace))
    await conn.execute(
        "UPDATE running_jobs SET started_at = now() - interval '10 minutes'"
        " WHERE job_execution_id = $1",
        timing,
    )
    waiting = await enqueue_retrying(conn, workspace, 0)
    await conn.execute(
        "UPDATE pending_jobs SET expires_at = now() - interval '1 second'"
        " WHERE job_execution_id = $1",
        waiting,
    )
    names = (
        "controlplane_jobs_retried_total",
        "controlplane_jobs_timed_out_total",
        "controlplane_jobs_queue_expired_total",
        "controlplane_leases_expired_total",
    )
    before = [_count(name) for name in names]

    await LeaseReaper(PoolReaperStore(pool), rule=RULE, interval=1, limit=10).run_once()
    assert await Deadlines(
        PoolDeadlineStore(pool), grace=timedelta(seconds=60), interval=1, limit=10
    ).run_once() == (1, 1)

    assert [_count(name) - was for name, was in zip(names, before, strict=True)] == [1, 1, 1, 0]


async def test_lost_attempts_are_pruned_with_their_tombstone(conn: Conn, workspace: UUID) -> None:
    execution = await enqueue_retrying(conn, workspace, 1)
    session = await manual_session(conn, workspace)
    await claim_of(conn, session)
    await go_silent(conn, execution)
    await leases.reap(conn, RULE)
    await claim_of(conn, await manual_session(conn, workspace))
    await leases.reconcile(conn, execution, Outcome.CANCELLED)
    kept = await enqueue_retrying(conn, workspace, 1)
    await conn.execute(
        "INSERT INTO execution_attempts (job_execution_id, attempt, workspace_id,"
        " runner_session_id, started_at, ended_at, outcome)"
        " VALUES ($1, 1, $2, $3, now(), now() - interval '100 days', 'lost')",
        kept,
        workspace,
        session.runner_session_id,
    )
    await conn.execute(
        "UPDATE ended_executions SET ended_at = now() - interval '100 days'"
        " WHERE job_execution_id = $1",
        execution,
    )
    await conn.execute("DELETE FROM running_jobs WHERE job_execution_id = $1", execution)

    assert await retention.prune_tombstones(conn, timedelta(days=90), 10) == 1

    left = await conn.fetch("SELECT job_execution_id FROM execution_attempts")
    assert [row["job_execution_id"] for row in left] == [kept]
