"""Enqueue (spec jobs.md §3.2, scenarios J-01 .. J-09) against a real PostgreSQL."""

from __future__ import annotations

import uuid
from datetime import timedelta
from uuid import UUID

import anyio
import asyncpg
import pytest

from controlplane.domain.jobs import EnqueueResult, NewJob, StaleRule
from controlplane.domain.labels import canonicalise
from controlplane.errors import EmptyRequiredLabels
from controlplane.store import claiming, leases, locks, queue
from controlplane.store.pool import Conn
from tests.factories import holding_lock, manual_session, minutes_ago, new_job, wait_until_blocked


async def pending_rows(conn: Conn, workspace_id: UUID) -> list[asyncpg.Record]:
    return await conn.fetch(
        "SELECT * FROM pending_jobs WHERE workspace_id = $1 ORDER BY created_at, id", workspace_id
    )


async def running_rows(conn: Conn, workspace_id: UUID) -> list[asyncpg.Record]:
    return await conn.fetch(
        "SELECT * FROM running_jobs WHERE workspace_id = $1 ORDER BY started_at, id", workspace_id
    )


async def insert_running(conn: Conn, job: NewJob, runner_session_id: UUID) -> None:
    """A lease written by hand, as a concurrent claim would have committed it."""
    ident = job.identity
    await conn.execute(
        """
        INSERT INTO running_jobs (pending_id, workspace_id, workflow_run_id,
            workflow_run_attempt_id, job_id, job_execution_id, project_id, runner_session_id,
            required_labels, runner_labels, payload, queued_at)
        VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $9, '{}'::jsonb, $10)
        """,
        uuid.uuid4(),
        ident.workspace_id,
        ident.workflow_run_id,
        ident.workflow_run_attempt_id,
        ident.job_id,
        ident.job_execution_id,
        ident.project_id,
        runner_session_id,
        list(job.required_labels),
        job.queued_at,
    )


async def test_j01_enqueue_stores_every_identifier_and_queued_at(
    conn: Conn, workspace: UUID
) -> None:
    job = new_job(workspace, ["linux"], queued_at=minutes_ago(5), payload={"steps": 3})

    assert await queue.enqueue(conn, [job]) == [EnqueueResult.ENQUEUED]

    [row] = await pending_rows(conn, workspace)
    ident = job.identity
    assert row["workspace_id"] == ident.workspace_id
    assert row["workflow_run_id"] == ident.workflow_run_id
    assert row["workflow_run_attempt_id"] == ident.workflow_run_attempt_id
    assert row["job_id"] == ident.job_id
    assert row["job_execution_id"] == ident.job_execution_id
    assert row["project_id"] == ident.project_id
    assert row["required_labels"] == ["linux"]
    assert row["created_at"] == job.queued_at
    # The FIFO key is queued_at, not the insert time (which was about five minutes later).
    assert row["enqueued_at"] - row["created_at"] > timedelta(minutes=4)


async def test_j02_enqueue_canonicalises_required_labels(conn: Conn, workspace: UUID) -> None:
    raw = new_job(workspace)
    job = NewJob(raw.identity, ("Ubuntu22", " ubuntu22 ", "LINUX"), raw.queued_at)

    assert await queue.enqueue(conn, [job]) == [EnqueueResult.ENQUEUED]

    [row] = await pending_rows(conn, workspace)
    assert row["required_labels"] == ["linux", "ubuntu22"]


async def test_j03_enqueue_with_no_labels_raises_and_inserts_nothing(
    conn: Conn, workspace: UUID
) -> None:
    good = new_job(workspace)
    empty = NewJob(new_job(workspace).identity, (), minutes_ago(1))

    with pytest.raises(EmptyRequiredLabels):
        await queue.enqueue(conn, [good, empty])

    # The whole batch is refused, the valid job included.
    assert await pending_rows(conn, workspace) == []


async def test_j04_enqueue_with_labels_canonicalising_to_empty_raises(
    conn: Conn, workspace: UUID
) -> None:
    blank = NewJob(new_job(workspace).identity, (" ", "\t"), minutes_ago(1))

    with pytest.raises(EmptyRequiredLabels):
        await queue.enqueue(conn, [blank])

    assert canonicalise([" ", "\t"]) == ()
    assert await pending_rows(conn, workspace) == []


async def test_j05_enqueue_twice_leaves_one_row_first_write_wins(
    conn: Conn, workspace: UUID
) -> None:
    """Ours: enqueue reports ENQUEUED once and DUPLICATE for every replay."""
    first = new_job(workspace, ["linux"], queued_at=minutes_ago(10))
    replay = NewJob(first.identity, ("macos",), minutes_ago(1))

    # The same execution twice in one batch: the first occurrence is the one inserted.
    assert await queue.enqueue(conn, [first, first]) == [
        EnqueueResult.ENQUEUED,
        EnqueueResult.DUPLICATE,
    ]
    assert await queue.enqueue(conn, [replay]) == [EnqueueResult.DUPLICATE]

    [row] = await pending_rows(conn, workspace)
    assert row["job_execution_id"] == first.identity.job_execution_id
    assert row["required_labels"] == ["linux"]
    assert row["created_at"] == first.queued_at


async def test_j06_enqueue_of_running_execution_is_a_no_op(conn: Conn, workspace: UUID) -> None:
    """Ours: the replay reports RUNNING."""
    job = new_job(workspace)
    session = await manual_session(conn, workspace)
    await queue.enqueue(conn, [job])
    assert await claiming.claim(conn, session) is not None
    [before] = await running_rows(conn, workspace)

    assert await queue.enqueue(conn, [job]) == [EnqueueResult.RUNNING]

    assert await pending_rows(conn, workspace) == []
    assert await running_rows(conn, workspace) == [before]


async def test_j07_enqueue_after_lease_expired_is_a_no_op(conn: Conn, workspace: UUID) -> None:
    """Ours: the tombstone is an ended_executions row and the replay reports ENDED."""
    job = new_job(workspace)
    session = await manual_session(conn, workspace)
    await queue.enqueue(conn, [job])
    assert await claiming.claim(conn, session) is not None
    await conn.execute(
        """
        UPDATE running_jobs SET started_at = now() - interval '10 minutes',
                                last_heartbeat_at = now() - interval '10 minutes'
        WHERE job_execution_id = $1
        """,
        job.identity.job_execution_id,
    )
    [reaped] = await leases.reap(conn, StaleRule())
    assert reaped.identity.job_execution_id == job.identity.job_execution_id
    assert (
        await conn.fetchval(
            "SELECT outcome FROM ended_executions WHERE job_execution_id = $1",
            job.identity.job_execution_id,
        )
        == "expired"
    )

    assert await queue.enqueue(conn, [job]) == [EnqueueResult.ENDED]

    assert await pending_rows(conn, workspace) == []
    assert await running_rows(conn, workspace) == []


async def test_j08_replays_keep_one_row_and_none_after_claim(conn: Conn, workspace: UUID) -> None:
    job = new_job(workspace, queued_at=minutes_ago(3))
    session = await manual_session(conn, workspace)

    assert await queue.enqueue(conn, [job]) == [EnqueueResult.ENQUEUED]
    assert await queue.enqueue(conn, [job]) == [EnqueueResult.DUPLICATE]
    [row] = await pending_rows(conn, workspace)
    assert row["created_at"] == job.queued_at

    claimed = await claiming.claim(conn, session)
    assert claimed is not None
    assert claimed.identity == job.identity

    assert await queue.enqueue(conn, [job]) == [EnqueueResult.RUNNING]
    assert await pending_rows(conn, workspace) == []
    [lease] = await running_rows(conn, workspace)
    assert lease["job_execution_id"] == job.identity.job_execution_id


@pytest.mark.parametrize("committed", ["nothing", "lease", "tombstone"])
async def test_j09_enqueue_waits_for_execution_lock_then_honours_commit(
    conn: Conn,
    observer: asyncpg.Connection,
    database_url: str,
    workspace: UUID,
    committed: str,
) -> None:
    job = new_job(workspace)
    session = await manual_session(conn, workspace)
    results: list[EnqueueResult] = []

    async def enqueue() -> None:
        results.extend(await queue.enqueue(conn, [job]))

    # The holder commits on leaving the block, before the task group waits for the enqueue.
    with anyio.fail_after(10):
        async with (
            anyio.create_task_group() as tg,
            holding_lock(database_url, locks.execution(job.identity.job_execution_id)) as holder,
        ):
            tg.start_soon(enqueue)
            await wait_until_blocked(observer, conn.get_server_pid())
            assert results == []
            assert await pending_rows(observer, workspace) == []
            if committed == "lease":
                await insert_running(holder, job, session.runner_session_id)
            elif committed == "tombstone":
                await holder.execute(
                    """
                    INSERT INTO ended_executions (job_execution_id, outcome, ended_by)
                    VALUES ($1, 'cancelled', 'orchestrator')
                    """,
                    job.identity.job_execution_id,
                )

    expected = {
        "nothing": EnqueueResult.ENQUEUED,
        "lease": EnqueueResult.RUNNING,
        "tombstone": EnqueueResult.ENDED,
    }[committed]
    assert results == [expected]
    pending = await pending_rows(observer, workspace)
    assert len(pending) == (1 if committed == "nothing" else 0)
    assert len(await running_rows(observer, workspace)) == (1 if committed == "lease" else 0)
