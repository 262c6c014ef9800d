"""Runner completion (ours: the reference had no release) and durable tombstones."""

from __future__ import annotations

import enum
import json
from datetime import timedelta
from uuid import UUID, uuid4

import asyncpg
import pytest

from controlplane.domain.jobs import (
    EndedLease,
    EnqueueResult,
    Outcome,
    StaleRule,
)
from controlplane.errors import RunningJobExecutionNotFound
from controlplane.store import claiming, executions, leases, queue
from controlplane.store.pool import Conn
from tests.factories import claimed_job, event_types, manual_session, new_job


async def tombstone(conn: Conn, execution_id: UUID) -> asyncpg.Record | None:
    return await conn.fetchrow(
        "SELECT outcome, ended_by, workspace_id, job_id FROM ended_executions"
        " WHERE job_execution_id = $1",
        execution_id,
    )


async def rows_of(conn: Conn, execution_id: UUID) -> tuple[int, int]:
    row = await conn.fetchrow(
        """
        SELECT (SELECT count(*) FROM pending_jobs WHERE job_execution_id = $1) AS pending,
               (SELECT count(*) FROM running_jobs WHERE job_execution_id = $1) AS running
        """,
        execution_id,
    )
    assert row is not None
    return (row["pending"], row["running"])


async def test_complete_removes_the_lease_and_records_the_outcome(
    conn: Conn, workspace: UUID
) -> None:
    """Ours: the reference had no completion; the lease lived until the reaper took it."""
    session = await manual_session(conn, workspace)
    job = await claimed_job(conn, session)
    execution = job.identity.job_execution_id

    ended = await leases.complete(
        conn, execution, session.runner_session_id, Outcome.FAILED, exit_code=3
    )

    assert ended == EndedLease(
        identity=job.identity,
        provisioner_id=None,
        provider_runner_id=None,
        cancellation_requested=False,
        newly_ended=True,
    )
    assert await rows_of(conn, execution) == (0, 0)
    stone = await tombstone(conn, execution)
    assert stone is not None
    assert dict(stone) == {
        "outcome": "failed",
        "ended_by": "runner",
        "workspace_id": workspace,
        "job_id": job.identity.job_id,
    }
    assert await event_types(conn, execution) == ["job.claimed", "job.completed"]
    payload = await conn.fetchval(
        "SELECT payload::text FROM events WHERE event_type = 'job.completed'"
    )
    assert json.loads(payload)["outcome"] == "failed"
    assert json.loads(payload)["ended_by"] == "runner"
    assert json.loads(payload)["exit_code"] == 3


async def test_complete_by_another_session_is_not_found_and_changes_nothing(
    conn: Conn, workspace: UUID
) -> None:
    """Ours: completion checks the lease's session like a heartbeat does."""
    owner = await manual_session(conn, workspace)
    intruder = await manual_session(conn, workspace)
    job = await claimed_job(conn, owner)
    execution = job.identity.job_execution_id
    before = await conn.fetchrow(
        "SELECT * FROM running_jobs WHERE job_execution_id = $1", execution
    )

    with pytest.raises(RunningJobExecutionNotFound):
        await leases.complete(conn, execution, intruder.runner_session_id, Outcome.SUCCEEDED)

    after = await conn.fetchrow("SELECT * FROM running_jobs WHERE job_execution_id = $1", execution)
    assert after == before
    assert await tombstone(conn, execution) is None
    assert await event_types(conn, execution) == ["job.claimed"]


async def test_complete_of_an_unknown_lease_is_not_found_and_writes_nothing(
    conn: Conn, workspace: UUID
) -> None:
    """Ours: completion of a lease we do not hold leaves no tombstone behind."""
    session = await manual_session(conn, workspace)
    execution = uuid4()

    with pytest.raises(RunningJobExecutionNotFound):
        await leases.complete(conn, execution, session.runner_session_id, Outcome.SUCCEEDED)

    assert await tombstone(conn, execution) is None
    assert await conn.fetchval("SELECT count(*) FROM events") == 0


async def test_complete_with_an_orphan_pending_row_keeps_it_when_refused(
    conn: Conn, workspace: UUID
) -> None:
    """Ours: a refused completion rolls back its orphan sweep too."""
    owner = await manual_session(conn, workspace)
    intruder = await manual_session(conn, workspace)
    job = await claimed_job(conn, owner)
    execution = job.identity.job_execution_id
    await conn.execute(
        """
        INSERT INTO pending_jobs (workspace_id, workflow_run_id, workflow_run_attempt_id, job_id,
            job_execution_id, project_id, required_labels, created_at)
        SELECT workspace_id, workflow_run_id, workflow_run_attempt_id, job_id, job_execution_id,
               project_id, required_labels, queued_at
        FROM running_jobs WHERE job_execution_id = $1
        """,
        execution,
    )

    with pytest.raises(RunningJobExecutionNotFound):
        await leases.complete(conn, execution, intruder.runner_session_id, Outcome.SUCCEEDED)
    assert await rows_of(conn, execution) == (1, 1)

    await leases.complete(conn, execution, owner.runner_session_id, Outcome.SUCCEEDED)
    assert await rows_of(conn, execution) == (0, 0)


async def test_complete_after_reconcile_writes_no_second_terminal_event(
    conn: Conn, workspace: UUID
) -> None:
    """Ours: the orchestrator's cancel came first and keeps the one terminal record."""
    session = await manual_session(conn, workspace)
    job = await claimed_job(conn, session)
    execution = job.identity.job_execution_id
    await leases.reconcile(conn, execution, Outcome.CANCELLED)

    ended = await leases.complete(conn, execution, session.runner_session_id, Outcome.SUCCEEDED)

    assert ended.newly_ended is False
    assert ended.cancellation_requested is True
    assert await rows_of(conn, execution) == (0, 0)
    stone = await tombstone(conn, execution)
    assert stone is not None
    assert (stone["outcome"], stone["ended_by"]) == ("cancelled", "orchestrator")
    assert await event_types(conn, execution) == ["job.claimed", "job.cancelled"]


async def test_complete_twice_is_not_found_the_second_time(conn: Conn, workspace: UUID) -> None:
    session = await manual_session(conn, workspace)
    job = await claimed_job(conn, session)
    execution = job.identity.job_execution_id
    await leases.complete(conn, execution, session.runner_session_id, Outcome.SUCCEEDED)

    with pytest.raises(RunningJobExecutionNotFound):
        await leases.complete(conn, execution, session.runner_session_id, Outcome.FAILED)

    stone = await tombstone(conn, execution)
    assert stone is not None
    assert stone["outcome"] == "succeeded"
    assert await event_types(conn, execution) == ["job.claimed", "job.completed"]


async def test_complete_refuses_expired_as_a_runner_outcome(conn: Conn, workspace: UUID) -> None:
    session = await manual_session(conn, workspace)
    job = await claimed_job(conn, session)

    with pytest.raises(ValueError, match="expired"):
        await leases.complete(
            conn, job.identity.job_execution_id, session.runner_session_id, Outcome.EXPIRED
        )

    assert await rows_of(conn, job.identity.job_execution_id) == (0, 1)


class Ending(enum.Enum):
    CLAIMED = "claimed"
    COMPLETED = "completed"
    CANCELLED_PENDING = "cancelled while pending"
    CANCELLED_RUNNING = "cancelled while running"
    EXPIRED = "expired"


@pytest.mark.parametrize(
    ("ending", "expected"),
    [
        (Ending.CLAIMED, EnqueueResult.RUNNING),
        (Ending.COMPLETED, EnqueueResult.ENDED),
        (Ending.CANCELLED_PENDING, EnqueueResult.ENDED),
        (Ending.CANCELLED_RUNNING, EnqueueResult.ENDED),
        (Ending.EXPIRED, EnqueueResult.ENDED),
    ],
    ids=lambda value: value.value if isinstance(value, Ending) else None,
)
async def test_enqueue_replay_never_recreates_the_execution_after_the_outbox_is_pruned(
    conn: Conn, workspace: UUID, ending: Ending, expected: EnqueueResult
) -> None:
    """Ours: tombstones live in their own table, so pruning the event feed cannot revive a job."""
    session = await manual_session(conn, workspace)
    job = new_job(workspace)
    execution = job.identity.job_execution_id
    await queue.enqueue(conn, [job])
    if ending is Ending.CANCELLED_PENDING:
        await leases.reconcile(conn, execution, Outcome.CANCELLED)
    else:
        assert await claiming.claim(conn, session) is not None
    if ending is Ending.COMPLETED:
        await leases.complete(conn, execution, session.runner_session_id, Outcome.SUCCEEDED)
    elif ending is Ending.CANCELLED_RUNNING:
        await leases.reconcile(conn, execution, Outcome.CANCELLED)
    elif ending is Ending.EXPIRED:
        await conn.execute(
            "UPDATE running_jobs SET started_at = now() - interval '10 minutes',"
            " last_heartbeat_at = now() - interval '10 minutes' WHERE job_execution_id = $1",
            execution,
        )
        rule = StaleRule(threshold=timedelta(seconds=180), grace=timedelta(seconds=60))
        assert len(await leases.reap(conn, rule)) == 1
    running_before = await conn.fetch(
        "SELECT * FROM running_jobs WHERE job_execution_id = $1", execution
    )
    await conn.execute("DELETE FROM events")

    replayed = await queue.enqueue(conn, [job, new_job(workspace, execution_id=execution)])

    assert replayed == [expected, expected]
    assert (await rows_of(conn, execution))[0] == 0
    assert (
        await conn.fetch("SELECT * FROM running_jobs WHERE job_execution_id = $1", execution)
        == running_before
    )
    assert await claiming.claim(conn, session) is None


async def test_the_exit_code_and_output_tail_are_kept_with_the_tombstone_and_the_event(
    conn: Conn, workspace: UUID
) -> None:
    session = await manual_session(conn, workspace)
    job = await claimed_job(conn, session)
    execution = job.identity.job_execution_id
    tail = "building…\nerror: 1 test failed\n"

    await leases.complete(
        conn, execution, session.runner_session_id, Outcome.FAILED, exit_code=3, output_tail=tail
    )

    kept = await conn.fetchrow(
        "SELECT exit_code, output_tail FROM ended_executions WHERE job_execution_id = $1",
        execution,
    )
    assert kept is not None and (kept["exit_code"], kept["output_tail"]) == (3, tail)
    payload = json.loads(
        await conn.fetchval("SELECT payload::text FROM events WHERE event_type = 'job.completed'")
    )
    assert (payload["exit_code"], payload["output_tail"]) == (3, tail)
    state = await executions.state(conn, execution)
    assert state is not None
    assert (state.state, state.outcome, state.exit_code, state.output_tail) == (
        "ended",
        "failed",
        3,
        tail,
    )
