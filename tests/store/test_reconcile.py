"""Terminal reconciliation (J-54 .. J-60) and cancel-session, against real rows."""

from __future__ import annotations

import json
from uuid import UUID, uuid4

import anyio
import asyncpg
import pytest

from controlplane.domain.jobs import (
    ClaimedJob,
    EnqueueResult,
    Outcome,
    ReconcileResult,
    SessionClaims,
)
from controlplane.store import claiming, leases, queue
from controlplane.store.pool import Conn
from tests.factories import event_types, holding, manual_session, new_job, wait_until_blocked


async def claimed_job(
    conn: Conn, workspace: UUID, *, job_id: UUID | None = None
) -> tuple[SessionClaims, ClaimedJob]:
    session = await manual_session(conn, workspace)
    await queue.enqueue(conn, [new_job(workspace, job_id=job_id)])
    job = await claiming.claim(conn, session)
    assert job is not None
    return session, job


async def tombstone(conn: Conn, execution_id: UUID) -> asyncpg.Record | None:
    return await conn.fetchrow(
        "SELECT * FROM ended_executions WHERE job_execution_id = $1", execution_id
    )


async def count(conn: Conn, table: str, execution_id: UUID) -> int:
    assert table in {"pending_jobs", "running_jobs"}
    found: int = await conn.fetchval(
        f"SELECT count(*) FROM {table} WHERE job_execution_id = $1",  # noqa: S608 -- table is one of two names (asserted above)
        execution_id,
    )
    return found


async def test_j54_reconciling_a_pending_execution_deletes_its_row(
    conn: Conn, workspace: UUID
) -> None:
    job = new_job(workspace)
    execution = job.identity.job_execution_id
    await queue.enqueue(conn, [job])

    result = await leases.reconcile(conn, execution, Outcome.CANCELLED, "user")

    assert (result.was_pending, result.was_running, result.newly_ended) == (True, False, True)
    assert await count(conn, "pending_jobs", execution) == 0
    ended = await tombstone(conn, execution)
    assert ended is not None
    assert (ended["outcome"], ended["ended_by"]) == ("cancelled", "orchestrator")
    assert ended["workspace_id"] == workspace
    assert await event_types(conn, execution) == ["job.cancelled"]


async def test_j55_reconciling_a_running_execution_requests_cancel_and_keeps_row(
    conn: Conn, workspace: UUID
) -> None:
    _, job = await claimed_job(conn, workspace)
    execution = job.identity.job_execution_id

    result = await leases.reconcile(conn, execution, Outcome.SUCCEEDED)

    assert (result.was_pending, result.was_running, result.newly_ended) == (False, True, True)
    row = await conn.fetchrow(
        "SELECT cancellation_requested_at FROM running_jobs WHERE job_execution_id = $1",
        execution,
    )
    assert row is not None
    assert row["cancellation_requested_at"] is not None
    ended = await tombstone(conn, execution)
    assert ended is not None
    assert ended["outcome"] == "succeeded"
    payload = await conn.fetchval(
        "SELECT payload::text FROM events WHERE job_execution_id = $1 AND event_type = $2",
        execution,
        "job.cancelled",
    )
    assert json.loads(payload)["was"] == "running"
    assert json.loads(payload)["outcome"] == "succeeded"
    assert await event_types(conn, execution) == ["job.claimed", "job.cancelled"]


async def test_j56_second_reconcile_keeps_the_first_cancellation_time(
    conn: Conn, workspace: UUID
) -> None:
    _, job = await claimed_job(conn, workspace)
    execution = job.identity.job_execution_id
    await leases.reconcile(conn, execution, Outcome.CANCELLED)
    # Make the first request clearly older than anything the second could write.
    first = await conn.fetchval(
        """
        UPDATE running_jobs SET cancellation_requested_at = now() - interval '1 minute'
        WHERE job_execution_id = $1 RETURNING cancellation_requested_at
        """,
        execution,
    )

    again = await leases.reconcile(conn, execution, Outcome.FAILED)

    assert again.was_running is True
    assert again.newly_ended is False
    assert (
        await conn.fetchval(
            "SELECT cancellation_requested_at FROM running_jobs WHERE job_execution_id = $1",
            execution,
        )
        == first
    )
    ended = await tombstone(conn, execution)
    assert ended is not None
    assert ended["outcome"] == "cancelled"
    assert await event_types(conn, execution) == ["job.claimed", "job.cancelled"]


async def test_j57_reconciling_an_unknown_execution_leaves_a_tombstone_and_one_event(
    conn: Conn,
) -> None:
    """Differs from the spec (a no-op): a tombstone, so a late enqueue cannot revive it, and its
    one terminal event, carrying only the execution id."""
    execution = uuid4()

    result = await leases.reconcile(conn, execution, Outcome.CANCELLED)

    assert (result.was_pending, result.was_running, result.newly_ended) == (False, False, True)
    ended = await tombstone(conn, execution)
    assert ended is not None
    assert (ended["outcome"], ended["ended_by"], ended["workspace_id"]) == (
        "cancelled",
        "orchestrator",
        None,
    )
    rows = await conn.fetch("SELECT event_type, workspace_id, payload::text FROM events")
    assert [(row["event_type"], row["workspace_id"]) for row in rows] == [("job.cancelled", None)]
    assert json.loads(rows[0]["payload"]) == {
        "job_execution_id": str(execution),
        "outcome": "cancelled",
        "reason": None,
        "was": "unknown",
    }
    assert await count(conn, "pending_jobs", execution) == 0
    assert await count(conn, "running_jobs", execution) == 0

    again = await leases.reconcile(conn, execution, Outcome.CANCELLED)
    assert again.newly_ended is False
    assert await conn.fetchval("SELECT count(*) FROM events") == 1


async def test_j58_reconcile_leaves_a_pending_sibling_of_the_same_job(
    conn: Conn, workspace: UUID
) -> None:
    job_id = uuid4()
    target, sibling = new_job(workspace, job_id=job_id), new_job(workspace, job_id=job_id)
    await queue.enqueue(conn, [target, sibling])

    await leases.reconcile(conn, target.identity.job_execution_id, Outcome.CANCELLED)

    assert await count(conn, "pending_jobs", target.identity.job_execution_id) == 0
    assert await count(conn, "pending_jobs", sibling.identity.job_execution_id) == 1
    assert await tombstone(conn, sibling.identity.job_execution_id) is None
    assert await event_types(conn, sibling.identity.job_execution_id) == []


async def test_j59_reconcile_leaves_a_running_sibling_of_the_same_job_uncancelled(
    conn: Conn, workspace: UUID
) -> None:
    job_id = uuid4()
    _, target = await claimed_job(conn, workspace, job_id=job_id)
    _, sibling = await claimed_job(conn, workspace, job_id=job_id)
    assert target.identity.job_id == sibling.identity.job_id

    await leases.reconcile(conn, target.identity.job_execution_id, Outcome.CANCELLED)

    rows = {
        row["job_execution_id"]: row["cancellation_requested_at"]
        for row in await conn.fetch(
            "SELECT job_execution_id, cancellation_requested_at FROM running_jobs"
        )
    }
    assert rows[target.identity.job_execution_id] is not None
    assert rows[sibling.identity.job_execution_id] is None
    assert await tombstone(conn, sibling.identity.job_execution_id) is None


async def test_j60_reconcile_waits_for_an_uncommitted_claim_and_cancels_its_lease(
    conn: Conn, pool: asyncpg.Pool, observer: asyncpg.Connection, database_url: str, workspace: UUID
) -> None:
    session = await manual_session(conn, workspace)
    job = new_job(workspace)
    execution = job.identity.job_execution_id
    await queue.enqueue(conn, [job])
    claims: list[ClaimedJob | None] = []
    results: list[ReconcileResult] = []

    async with pool.acquire() as claimer, pool.acquire() as reconciler:
        claimer_pid: int = await claimer.fetchval("SELECT pg_backend_pid()")
        reconciler_pid: int = await reconciler.fetchval("SELECT pg_backend_pid()")

        async def run_claim() -> None:
            claims.append(await claiming.claim(claimer, session))

        async def run_reconcile() -> None:
            results.append(await leases.reconcile(reconciler, execution, Outcome.CANCELLED))

        with anyio.fail_after(10):
            # With its session row held, the claim stops at the lease's foreign-key check: it
            # has moved the row and holds the execution lock, but has not committed.
            async with (
                anyio.create_task_group() as tasks,
                holding(
                    database_url,
                    "SELECT 1 FROM runner_sessions WHERE id = $1 FOR UPDATE",
                    session.runner_session_id,
                ),
            ):
                tasks.start_soon(run_claim)
                await wait_until_blocked(observer, claimer_pid)
                assert await count(observer, "running_jobs", execution) == 0
                tasks.start_soon(run_reconcile)
                await wait_until_blocked(observer, reconciler_pid)
                waits_on = await observer.fetchval(
                    "SELECT locktype FROM pg_locks WHERE pid = $1 AND NOT granted",
                    reconciler_pid,
                )
                assert waits_on == "advisory"

    assert claims[0] is not None
    assert claims[0].identity == job.identity
    assert results[0].was_running is True
    assert results[0].was_pending is False
    assert await count(conn, "pending_jobs", execution) == 0
    cancelled_at = await conn.fetchval(
        "SELECT cancellation_requested_at FROM running_jobs WHERE job_execution_id = $1",
        execution,
    )
    assert cancelled_at is not None
    assert await event_types(conn, execution) == ["job.claimed", "job.cancelled"]
    beat = await leases.heartbeat(conn, execution, session.runner_session_id)
    assert beat.cancellation_requested is True


async def test_reconcile_refuses_expired_as_an_orchestrator_outcome(
    conn: Conn, workspace: UUID
) -> None:
    job = new_job(workspace)
    await queue.enqueue(conn, [job])

    with pytest.raises(ValueError, match="expired"):
        await leases.reconcile(conn, job.identity.job_execution_id, Outcome.EXPIRED)

    assert await count(conn, "pending_jobs", job.identity.job_execution_id) == 1
    assert await tombstone(conn, job.identity.job_execution_id) is None


async def test_reconcile_of_an_unknown_execution_blocks_a_later_enqueue(
    conn: Conn, workspace: UUID
) -> None:
    """Closes spec gap 16: a terminated fact ahead of its queued fact still wins."""
    job = new_job(workspace)
    await leases.reconcile(conn, job.identity.job_execution_id, Outcome.CANCELLED)

    assert await queue.enqueue(conn, [job]) == [EnqueueResult.ENDED]
    assert await count(conn, "pending_jobs", job.identity.job_execution_id) == 0


async def test_cancel_session_jobs_requests_cancel_of_that_sessions_leases_once(
    conn: Conn, workspace: UUID
) -> None:
    session, first = await claimed_job(conn, workspace)
    await queue.enqueue(conn, [new_job(workspace)])
    second = await claiming.claim(conn, session)
    assert second is not None
    _, other = await claimed_job(conn, workspace)

    asked = await leases.cancel_session_jobs(conn, session.runner_session_id)

    mine = {first.identity.job_execution_id, second.identity.job_execution_id}
    assert set(asked) == mine
    rows = {
        row["job_execution_id"]: row["cancellation_requested_at"]
        for row in await conn.fetch(
            "SELECT job_execution_id, cancellation_requested_at FROM running_jobs"
        )
    }
    assert all(rows[execution] is not None for execution in mine)
    assert rows[other.identity.job_execution_id] is None
    for execution in mine:
        assert await event_types(conn, execution) == ["job.claimed", "job.cancel_requested"]
        assert await tombstone(conn, execution) is None

    assert await leases.cancel_session_jobs(conn, session.runner_session_id) == []
    assert await conn.fetchval(
        "SELECT count(*) FROM events WHERE event_type = 'job.cancel_requested'"
    ) == len(mine)
