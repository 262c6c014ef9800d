"""Claim (spec jobs.md §3.3, scenarios J-10 .. J-47 at store level) against a real PostgreSQL."""

from __future__ import annotations

import uuid
from contextlib import AbstractAsyncContextManager
from datetime import datetime, timedelta
from uuid import UUID

import anyio
import asyncpg
import pytest

from controlplane.domain.jobs import ClaimedJob, NewJob, Outcome, SessionClaims, StaleRule
from controlplane.errors import RunnerSessionExhausted
from controlplane.store import claiming, leases, locks, queries, queue, sessions
from controlplane.store.pool import Conn
from controlplane.store.records import json_value
from tests.factories import (
    capped_session,
    holding,
    holding_lock,
    manual_session,
    minutes_ago,
    new_job,
    wait_until_blocked,
)

# --- reading rows -----------------------------------------------------------------------------


async def pending_ids(conn: Conn, workspace_id: UUID) -> list[UUID]:
    """Pending executions of the workspace, in FIFO order."""
    rows = await conn.fetch(
        "SELECT job_execution_id FROM pending_jobs WHERE workspace_id = $1 ORDER BY created_at, id",
        workspace_id,
    )
    return [row["job_execution_id"] for row in rows]


async def running_rows(conn: Conn, workspace_id: UUID) -> list[asyncpg.Record]:
    return await conn.fetch(
        "SELECT * FROM running_jobs WHERE workspace_id = $1 ORDER BY started_at, id", workspace_id
    )


async def running_row(conn: Conn, job_execution_id: UUID) -> asyncpg.Record:
    row = await conn.fetchrow(
        "SELECT * FROM running_jobs WHERE job_execution_id = $1", job_execution_id
    )
    assert row is not None
    return row


async def claimed_events(conn: Conn, workspace_id: UUID) -> list[asyncpg.Record]:
    return await conn.fetch(
        """
        SELECT job_execution_id, workspace_id, payload::text AS payload FROM events
        WHERE event_type = 'job.claimed' AND workspace_id = $1 ORDER BY seq
        """,
        workspace_id,
    )


async def claims_used(conn: Conn, session: SessionClaims) -> int:
    used: int = await conn.fetchval(
        "SELECT claims_used FROM runner_sessions WHERE id = $1", session.runner_session_id
    )
    return used


async def session_updated_at(conn: Conn, session: SessionClaims) -> datetime:
    stamp: datetime = await conn.fetchval(
        "SELECT updated_at FROM runner_sessions WHERE id = $1", session.runner_session_id
    )
    return stamp


# --- building state ---------------------------------------------------------------------------


async def enqueue(conn: Conn, *jobs: NewJob) -> None:
    await queue.enqueue(conn, jobs)


async def claim_ok(conn: Conn, session: SessionClaims) -> ClaimedJob:
    claimed = await claiming.claim(conn, session)
    assert claimed is not None
    return claimed


async def make_stale(conn: Conn, job_execution_id: UUID) -> None:
    await conn.execute(
        """
        UPDATE running_jobs SET started_at = now() - interval '10 minutes',
                                last_heartbeat_at = now() - interval '10 minutes'
        WHERE job_execution_id = $1
        """,
        job_execution_id,
    )


async def running_with_orphan(
    conn: Conn,
    workspace_id: UUID,
    *,
    labels: list[str] | None = None,
    orphan_queued_at: datetime | None = None,
) -> NewJob:
    """An execution that is running and also has a pending row again (an orphan).

    Enqueue refuses to create one, so the orphan row is written by hand, as a replay racing a
    lost lock would have left it.
    """
    job = new_job(workspace_id, labels, queued_at=minutes_ago(30))
    holder = await manual_session(conn, workspace_id, ("linux", "macos", "x64"))
    await enqueue(conn, job)
    assert (await claim_ok(conn, holder)).identity == job.identity
    ident = job.identity
    await conn.execute(
        """
        INSERT INTO pending_jobs (workspace_id, workflow_run_id, workflow_run_attempt_id, job_id,
            job_execution_id, project_id, required_labels, created_at)
        VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
        """,
        ident.workspace_id,
        ident.workflow_run_id,
        ident.workflow_run_attempt_id,
        ident.job_id,
        ident.job_execution_id,
        ident.project_id,
        list(job.required_labels),
        orphan_queued_at or job.queued_at,
    )
    return job


async def stale_session(conn: Conn, session: SessionClaims, age: timedelta) -> datetime:
    stamp: datetime = await conn.fetchval(
        "UPDATE runner_sessions SET updated_at = now() - $2::interval WHERE id = $1 "
        "RETURNING updated_at",
        session.runner_session_id,
        age,
    )
    return stamp


def table_locked(
    url: str, table: str, mode: str
) -> AbstractAsyncContextManager[asyncpg.Connection]:
    """Hold a table lock from a second connection until the block ends."""
    return holding(url, f"LOCK TABLE {table} IN {mode} MODE")


def session_row_locked(
    url: str, session_id: UUID
) -> AbstractAsyncContextManager[asyncpg.Connection]:
    """Hold a session row FOR UPDATE: a claim by that session stops at its lease insert (the
    foreign key needs a KEY SHARE lock on the row), holding its pending row and execution lock.
    """
    return holding(url, "SELECT 1 FROM runner_sessions WHERE id = $1 FOR UPDATE", session_id)


def running_table_locked(url: str) -> AbstractAsyncContextManager[asyncpg.Connection]:
    """Hold SHARE on `running_jobs`: a capped claim stops before its claim statement, holding
    the session row it locked first (the claim statement inserts into running_jobs)."""
    return table_locked(url, "running_jobs", "SHARE")


# --- matching and FIFO ------------------------------------------------------------------------


async def test_j10_claim_returns_the_claimed_identifiers(conn: Conn, workspace: UUID) -> None:
    job = new_job(workspace, queued_at=minutes_ago(2), payload={"image": "ubuntu"})
    session = await manual_session(conn, workspace)
    await enqueue(conn, job)

    claimed = await claim_ok(conn, session)

    assert claimed.identity == job.identity  # run, attempt, job, execution, project, workspace
    assert claimed.required_labels == ("linux",)
    assert claimed.payload == {"image": "ubuntu"}
    assert claimed.queued_at == job.queued_at
    assert claimed.started_at > job.queued_at


async def test_j11_claim_moves_the_row_from_pending_to_running(conn: Conn, workspace: UUID) -> None:
    job = new_job(workspace)
    session = await manual_session(conn, workspace)
    await enqueue(conn, job)

    await claim_ok(conn, session)

    assert await pending_ids(conn, workspace) == []
    [row] = await running_rows(conn, workspace)
    ident = job.identity
    assert row["job_execution_id"] == ident.job_execution_id
    assert row["job_id"] == ident.job_id
    assert row["workflow_run_id"] == ident.workflow_run_id
    assert row["workflow_run_attempt_id"] == ident.workflow_run_attempt_id
    assert row["project_id"] == ident.project_id
    assert row["required_labels"] == ["linux"]
    assert row["runner_session_id"] == session.runner_session_id
    assert row["runner_labels"] == ["linux", "x64"]
    assert row["provisioner_id"] is None
    assert row["provider_runner_id"] is None
    assert row["cancellation_requested_at"] is None


async def test_j12_new_lease_has_no_first_heartbeat_and_last_equals_started(
    conn: Conn, workspace: UUID
) -> None:
    job = new_job(workspace)
    session = await manual_session(conn, workspace)
    await enqueue(conn, job)

    claimed = await claim_ok(conn, session)

    row = await running_row(conn, job.identity.job_execution_id)
    assert row["first_heartbeat_at"] is None
    assert row["last_heartbeat_at"] == row["started_at"]
    assert row["started_at"] == claimed.started_at


async def test_j13_claim_writes_one_claimed_event(conn: Conn, workspace: UUID) -> None:
    """Ours: table `events`, type 'job.claimed', snake_case payload with the session id."""
    job = new_job(workspace)
    session = await manual_session(conn, workspace)
    await enqueue(conn, job)

    await claim_ok(conn, session)

    row = await running_row(conn, job.identity.job_execution_id)
    [event] = await claimed_events(conn, workspace)
    assert event["job_execution_id"] == job.identity.job_execution_id
    payload = json_value(event["payload"])
    assert payload == {
        "workflow_run_id": str(job.identity.workflow_run_id),
        "workflow_run_attempt_id": str(job.identity.workflow_run_attempt_id),
        "job_id": str(job.identity.job_id),
        "job_execution_id": str(job.identity.job_execution_id),
        "runner_session_id": str(session.runner_session_id),
        "claimed_at": payload["claimed_at"],
    }
    assert datetime.fromisoformat(payload["claimed_at"]) == row["started_at"]


async def test_j14_empty_queue_claims_nothing_and_writes_no_event(
    conn: Conn, workspace: UUID
) -> None:
    """The queue-time metric part of J-14 is not store-level here."""
    session = await manual_session(conn, workspace)

    assert await claiming.claim(conn, session) is None

    assert await running_rows(conn, workspace) == []
    assert await conn.fetchval("SELECT count(*) FROM events") == 0


async def test_j15_fifo_by_created_at_then_id(conn: Conn, workspace: UUID) -> None:
    session = await manual_session(conn, workspace)
    newer = new_job(workspace, queued_at=minutes_ago(1))
    older = new_job(workspace, queued_at=minutes_ago(2))
    await enqueue(conn, newer)
    await enqueue(conn, older)  # arrives later, queued earlier

    assert (await claim_ok(conn, session)).identity == older.identity
    assert (await claim_ok(conn, session)).identity == newer.identity

    # A tie on created_at goes to the lower id (uuidv7, so the earlier insert), whatever the
    # execution ids say.
    tie = minutes_ago(5)
    first = new_job(workspace, queued_at=tie, execution_id=uuid.UUID(int=2**128 - 1))
    second = new_job(workspace, queued_at=tie, execution_id=uuid.UUID(int=1))
    await enqueue(conn, first)
    await enqueue(conn, second)
    ids = await conn.fetch(
        "SELECT job_execution_id FROM pending_jobs WHERE workspace_id = $1 ORDER BY id", workspace
    )
    assert [r["job_execution_id"] for r in ids] == [
        first.identity.job_execution_id,
        second.identity.job_execution_id,
    ]

    assert (await claim_ok(conn, session)).identity == first.identity
    assert await pending_ids(conn, workspace) == [second.identity.job_execution_id]


async def test_j16_incompatible_head_is_passed_for_the_older_compatible_row(
    conn: Conn, workspace: UUID
) -> None:
    session = await manual_session(conn, workspace)
    macos = new_job(workspace, ["macos"], queued_at=minutes_ago(3))
    older_linux = new_job(workspace, ["linux"], queued_at=minutes_ago(2))
    newer_linux = new_job(workspace, ["linux"], queued_at=minutes_ago(1))
    await enqueue(conn, newer_linux, macos, older_linux)

    assert (await claim_ok(conn, session)).identity == older_linux.identity

    assert await pending_ids(conn, workspace) == [
        macos.identity.job_execution_id,
        newer_linux.identity.job_execution_id,
    ]


async def test_j17_first_compatible_row_in_fifo_order_wins(conn: Conn, workspace: UUID) -> None:
    session = await manual_session(conn, workspace)
    macos = new_job(workspace, ["macos"], queued_at=minutes_ago(3))
    linux = new_job(workspace, ["linux"], queued_at=minutes_ago(2))
    x64 = new_job(workspace, ["x64"], queued_at=minutes_ago(1))
    await enqueue(conn, x64, linux, macos)

    assert (await claim_ok(conn, session)).identity == linux.identity

    assert await pending_ids(conn, workspace) == [
        macos.identity.job_execution_id,
        x64.identity.job_execution_id,
    ]


@pytest.mark.parametrize("required", [["macos"], ["linux", "macos"]])
async def test_j18_only_incompatible_rows_claims_nothing(
    conn: Conn, workspace: UUID, required: list[str]
) -> None:
    session = await manual_session(conn, workspace)
    # Sharing a label is not enough: every required label must be the session's.
    macos = new_job(workspace, required)
    await enqueue(conn, macos)

    assert await claiming.claim(conn, session) is None

    assert await pending_ids(conn, workspace) == [macos.identity.job_execution_id]
    assert await running_rows(conn, workspace) == []


async def test_j19_session_without_labels_claims_nothing(
    conn: Conn, database_url: str, workspace: UUID
) -> None:
    registered = await manual_session(conn, workspace)
    session = SessionClaims(registered.runner_session_id, workspace, (), None)
    job = new_job(workspace, ["linux"])
    await enqueue(conn, job)

    # It does not even look at the queue: a lock on the whole table does not hold it up.
    async with table_locked(database_url, "pending_jobs", "ACCESS EXCLUSIVE"):
        with anyio.fail_after(3):
            assert await claiming.claim(conn, session) is None

    assert await pending_ids(conn, workspace) == [job.identity.job_execution_id]
    assert await running_rows(conn, workspace) == []
    assert await claimed_events(conn, workspace) == []
    # The same row is claimable by that session once it has labels.
    assert (await claim_ok(conn, registered)).identity == job.identity


async def test_j20_strict_subset_of_session_labels_is_claimable(
    conn: Conn, workspace: UUID
) -> None:
    session = await manual_session(conn, workspace, ("gpu", "linux", "x64"))
    job = new_job(workspace, ["linux", "x64"])
    await enqueue(conn, job)

    assert (await claim_ok(conn, session)).identity == job.identity
    assert await pending_ids(conn, workspace) == []


async def test_j21_required_equal_to_session_labels_is_claimable(
    conn: Conn, workspace: UUID
) -> None:
    session = await manual_session(conn, workspace, ("linux", "x64"))
    job = new_job(workspace, ["x64", "LINUX"])
    await enqueue(conn, job)

    assert (await claim_ok(conn, session)).identity == job.identity
    assert (await running_row(conn, job.identity.job_execution_id))["required_labels"] == [
        "linux",
        "x64",
    ]


async def test_j22_many_incompatible_rows_do_not_hide_a_compatible_one(
    conn: Conn, workspace: UUID
) -> None:
    session = await manual_session(conn, workspace)
    gpus = [new_job(workspace, [f"gpu-{n}"], queued_at=minutes_ago(20 - n)) for n in range(8)]
    linux = new_job(workspace, ["linux"], queued_at=minutes_ago(1))
    await enqueue(conn, *gpus, linux)

    assert (await claim_ok(conn, session)).identity == linux.identity

    assert await pending_ids(conn, workspace) == [job.identity.job_execution_id for job in gpus]


async def test_j23_other_workspace_row_is_never_claimed(conn: Conn, workspace: UUID) -> None:
    session = await manual_session(conn, workspace)
    elsewhere = uuid.uuid4()
    job = new_job(elsewhere, ["linux"])
    await enqueue(conn, job)

    assert await claiming.claim(conn, session) is None

    assert await pending_ids(conn, elsewhere) == [job.identity.job_execution_id]
    assert await conn.fetchval("SELECT count(*) FROM running_jobs") == 0


async def test_j24_tool_capabilities_do_not_affect_matching(conn: Conn, workspace: UUID) -> None:
    claims = []
    for capabilities in ({"docker": "27.0"}, {"podman": "5.1", "node": "22"}):
        created = await sessions.create(
            conn,
            workspace_id=workspace,
            registration_token_id=uuid.uuid4(),
            kind="manual",
            labels=("linux", "x64"),
            capabilities=capabilities,
        )
        claims.append(SessionClaims(created.id, workspace, ("linux", "x64"), None))
    jobs = [new_job(workspace, ["linux"], queued_at=minutes_ago(2 - n)) for n in range(2)]
    await enqueue(conn, *jobs)

    first = await claim_ok(conn, claims[0])
    second = await claim_ok(conn, claims[1])

    assert [first.identity, second.identity] == [jobs[0].identity, jobs[1].identity]
    leases_by_session = {
        row["job_execution_id"]: row["runner_session_id"]
        for row in await running_rows(conn, workspace)
    }
    assert leases_by_session == {
        jobs[0].identity.job_execution_id: claims[0].runner_session_id,
        jobs[1].identity.job_execution_id: claims[1].runner_session_id,
    }


async def test_j25_manual_session_claims_two_jobs_in_fifo_order(
    conn: Conn, workspace: UUID
) -> None:
    session = await manual_session(conn, workspace)
    second = new_job(workspace, queued_at=minutes_ago(1))
    first = new_job(workspace, queued_at=minutes_ago(2))
    await enqueue(conn, second, first)

    assert (await claim_ok(conn, session)).identity == first.identity
    assert (await claim_ok(conn, session)).identity == second.identity
    assert await claiming.claim(conn, session) is None

    rows = await running_rows(conn, workspace)
    assert {row["runner_session_id"] for row in rows} == {session.runner_session_id}
    assert len(rows) == 2
    assert await claims_used(conn, session) == 0  # manual sessions are never counted


async def test_j26_concurrent_claims_of_one_row_yield_exactly_one_job(
    pool: asyncpg.Pool, observer: asyncpg.Connection, database_url: str, workspace: UUID
) -> None:
    async with pool.acquire() as first_conn, pool.acquire() as second_conn:
        first = await manual_session(first_conn, workspace)
        second = await manual_session(first_conn, workspace)
        job = new_job(workspace)
        await enqueue(first_conn, job)
        results: list[ClaimedJob | None] = []

        async def first_claim() -> None:
            results.append(await claiming.claim(first_conn, first))

        # The table lock is released on leaving the block, before the task group waits.
        with anyio.fail_after(10):
            async with (
                anyio.create_task_group() as tg,
                session_row_locked(database_url, first.runner_session_id),
            ):
                tg.start_soon(first_claim)
                # The first claim now holds the pending row and waits at its lease insert.
                await wait_until_blocked(observer, first_conn.get_server_pid())
                results.append(await claiming.claim(second_conn, second))

    assert sorted(r is None for r in results) == [False, True]
    assert [r.identity for r in results if r is not None] == [job.identity]
    [row] = await running_rows(observer, workspace)
    assert row["runner_session_id"] == first.runner_session_id
    assert await pending_ids(observer, workspace) == []
    assert len(await claimed_events(observer, workspace)) == 1


async def test_j27_busy_head_is_stepped_over_and_claimed_after_release(
    conn: Conn, database_url: str, workspace: UUID
) -> None:
    """Ours: a head whose execution lock is held is stepped over (the reference returned null)."""
    session = await manual_session(conn, workspace)
    head = new_job(workspace, queued_at=minutes_ago(2))
    next_row = new_job(workspace, queued_at=minutes_ago(1))
    await enqueue(conn, head, next_row)

    async with holding_lock(database_url, locks.execution(head.identity.job_execution_id)):
        assert (await claim_ok(conn, session)).identity == next_row.identity
        assert await pending_ids(conn, workspace) == [head.identity.job_execution_id]

    assert (await claim_ok(conn, session)).identity == head.identity
    assert await pending_ids(conn, workspace) == []
    assert len(await running_rows(conn, workspace)) == 2


async def test_j28_orphan_is_deleted_and_the_claim_returns_nothing(
    conn: Conn, workspace: UUID
) -> None:
    """Ours: the claim deletes the orphan and moves on; with nothing else it returns None."""
    job = await running_with_orphan(conn, workspace)
    before = await running_row(conn, job.identity.job_execution_id)
    session = await manual_session(conn, workspace)
    assert await pending_ids(conn, workspace) == [job.identity.job_execution_id]

    assert await claiming.claim(conn, session) is None

    assert await pending_ids(conn, workspace) == []
    assert await running_row(conn, job.identity.job_execution_id) == before
    assert len(await claimed_events(conn, workspace)) == 1  # only the original claim's

    # With a genuine job behind an orphan head, the same claim drops the orphan and takes it.
    second_orphan = await running_with_orphan(conn, workspace, orphan_queued_at=minutes_ago(9))
    genuine = new_job(workspace, queued_at=minutes_ago(1))
    await enqueue(conn, genuine)
    assert await pending_ids(conn, workspace) == [
        second_orphan.identity.job_execution_id,
        genuine.identity.job_execution_id,
    ]

    assert (await claim_ok(conn, session)).identity == genuine.identity
    assert await pending_ids(conn, workspace) == []


async def test_j29_non_matching_orphan_survives_until_reconciled(
    conn: Conn, workspace: UUID
) -> None:
    """Ours: reconcile also writes a tombstone for the execution."""
    job = await running_with_orphan(conn, workspace, labels=["linux"])
    macos = await manual_session(conn, workspace, ("macos",))

    assert await claiming.claim(conn, macos) is None
    assert await pending_ids(conn, workspace) == [job.identity.job_execution_id]

    result = await leases.reconcile(conn, job.identity.job_execution_id, Outcome.CANCELLED)

    assert result.was_pending
    assert result.was_running
    assert await pending_ids(conn, workspace) == []
    row = await running_row(conn, job.identity.job_execution_id)
    assert row["cancellation_requested_at"] is not None
    assert (
        await conn.fetchval(
            "SELECT outcome FROM ended_executions WHERE job_execution_id = $1",
            job.identity.job_execution_id,
        )
        == "cancelled"
    )


async def test_j30_older_genuine_job_is_claimed_ahead_of_newer_orphan(
    conn: Conn, workspace: UUID
) -> None:
    """Ours: the orphan, left in place by that claim, is deleted by the next one."""
    orphan = await running_with_orphan(conn, workspace, orphan_queued_at=minutes_ago(1))
    genuine = new_job(workspace, queued_at=minutes_ago(5))
    await enqueue(conn, genuine)
    session = await manual_session(conn, workspace)

    assert (await claim_ok(conn, session)).identity == genuine.identity
    assert await pending_ids(conn, workspace) == [orphan.identity.job_execution_id]

    assert await claiming.claim(conn, session) is None
    assert await pending_ids(conn, workspace) == []
    assert (await running_row(conn, orphan.identity.job_execution_id))["runner_session_id"] != (
        session.runner_session_id
    )


# --- liveness and caps ------------------------------------------------------------------------


async def test_j33_empty_poll_still_touches_a_stale_session(conn: Conn, workspace: UUID) -> None:
    session = await manual_session(conn, workspace)
    stale = await stale_session(conn, session, timedelta(minutes=1))

    assert await claiming.claim(conn, session) is None

    assert await session_updated_at(conn, session) - stale > timedelta(seconds=50)


async def test_j34_successful_claim_touches_a_stale_session(conn: Conn, workspace: UUID) -> None:
    session = await manual_session(conn, workspace)
    await enqueue(conn, new_job(workspace))
    stale = await stale_session(conn, session, timedelta(minutes=1))

    await claim_ok(conn, session)

    assert await session_updated_at(conn, session) - stale > timedelta(seconds=50)


async def test_j35_touch_inside_the_throttle_window_changes_nothing(
    conn: Conn, workspace: UUID
) -> None:
    session = await manual_session(conn, workspace)
    await enqueue(conn, new_job(workspace))
    recent = await stale_session(conn, session, timedelta(seconds=5))

    await claim_ok(conn, session)
    assert await claiming.claim(conn, session) is None

    assert await session_updated_at(conn, session) == recent


async def test_j36_capped_session_is_exhausted_after_one_claim(conn: Conn, workspace: UUID) -> None:
    session = await capped_session(conn, workspace, max_claims=1)
    first = new_job(workspace, queued_at=minutes_ago(2))
    second = new_job(workspace, queued_at=minutes_ago(1))
    await enqueue(conn, first, second)

    assert (await claim_ok(conn, session)).identity == first.identity
    assert await claims_used(conn, session) == 1

    with pytest.raises(RunnerSessionExhausted):
        await claiming.claim(conn, session)

    assert await claims_used(conn, session) == 1
    assert await pending_ids(conn, workspace) == [second.identity.job_execution_id]
    assert len(await running_rows(conn, workspace)) == 1


async def test_j38_provisioned_link_is_copied_onto_the_lease(conn: Conn, workspace: UUID) -> None:
    provisioner = uuid.uuid4()
    session = await capped_session(
        conn, workspace, provisioner_id=provisioner, provider_runner_id="i-0abc"
    )
    job = new_job(workspace)
    await enqueue(conn, job)

    await claim_ok(conn, session)

    row = await running_row(conn, job.identity.job_execution_id)
    assert row["provisioner_id"] == provisioner
    assert row["provider_runner_id"] == "i-0abc"


@pytest.mark.parametrize(
    ("provisioner_id", "provider_runner_id"),
    [(uuid.UUID(int=7), None), (None, "i-0abc")],
)
async def test_j39_half_a_provisioned_link_violates_the_check(
    conn: Conn, workspace: UUID, provisioner_id: UUID | None, provider_runner_id: str | None
) -> None:
    session = await manual_session(conn, workspace)
    with pytest.raises(asyncpg.CheckViolationError) as raised:
        await conn.execute(
            """
            INSERT INTO running_jobs (pending_id, workspace_id, workflow_run_id,
                workflow_run_attempt_id, job_id, job_execution_id, project_id, runner_session_id,
                provisioner_id, provider_runner_id, required_labels, runner_labels, payload,
                queued_at)
            VALUES ($1, $2, $1, $1, $1, $1, $1, $3, $4, $5, '{linux}', '{linux}', '{}', now())
            """,
            uuid.uuid4(),
            workspace,
            session.runner_session_id,
            provisioner_id,
            provider_runner_id,
        )
    assert raised.value.constraint_name == "running_jobs_link_ck"
    assert await running_rows(conn, workspace) == []


async def test_j41_revoked_capped_session_is_exhausted(conn: Conn, workspace: UUID) -> None:
    session = await capped_session(conn, workspace)
    job = new_job(workspace)
    await enqueue(conn, job)
    await conn.execute(
        "UPDATE runner_sessions SET revoked_at = now() WHERE id = $1", session.runner_session_id
    )

    with pytest.raises(RunnerSessionExhausted):
        await claiming.claim(conn, session)

    assert await claims_used(conn, session) == 0
    assert await pending_ids(conn, workspace) == [job.identity.job_execution_id]
    assert await running_rows(conn, workspace) == []


async def test_j42_dropping_an_orphan_spends_no_claim(conn: Conn, workspace: UUID) -> None:
    """Ours: the orphan is deleted by the capped claim, which returns None."""
    orphan = await running_with_orphan(conn, workspace)
    session = await capped_session(conn, workspace, max_claims=1)

    assert await claiming.claim(conn, session) is None

    assert await claims_used(conn, session) == 0
    assert await pending_ids(conn, workspace) == []
    assert (await running_row(conn, orphan.identity.job_execution_id))["runner_session_id"] != (
        session.runner_session_id
    )
    # The one claim is still there to spend.
    job = new_job(workspace)
    await enqueue(conn, job)
    assert (await claim_ok(conn, session)).identity == job.identity
    assert await claims_used(conn, session) == 1


async def test_j43_concurrent_claims_by_one_capped_session_claim_once(
    pool: asyncpg.Pool, observer: asyncpg.Connection, database_url: str, workspace: UUID
) -> None:
    async with pool.acquire() as first_conn, pool.acquire() as second_conn:
        session = await capped_session(first_conn, workspace, max_claims=1)
        jobs = [new_job(workspace, queued_at=minutes_ago(2 - n)) for n in range(2)]
        await enqueue(first_conn, *jobs)
        claimed: list[ClaimedJob | None] = []
        exhausted: list[RunnerSessionExhausted] = []

        async def claim(connection: Conn) -> None:
            try:
                claimed.append(await claiming.claim(connection, session))
            except RunnerSessionExhausted as error:
                exhausted.append(error)

        first_pid = first_conn.get_server_pid()
        second_pid = second_conn.get_server_pid()
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg, running_table_locked(database_url):
                tg.start_soon(claim, first_conn)
                # The first claim holds the session row and waits at its claim statement...
                await wait_until_blocked(observer, first_pid)
                tg.start_soon(claim, second_conn)
                # ...and the second waits for that session row, not for our table lock.
                await wait_until_blocked(observer, second_pid)
                blockers = await observer.fetchval("SELECT pg_blocking_pids($1)", second_pid)
                assert blockers == [first_pid]

    assert [c.identity for c in claimed if c is not None] == [jobs[0].identity]
    assert len(claimed) == 1
    assert len(exhausted) == 1
    assert await claims_used(observer, session) == 1
    assert await pending_ids(observer, workspace) == [jobs[1].identity.job_execution_id]
    assert len(await running_rows(observer, workspace)) == 1


# --- lease state ------------------------------------------------------------------------------


async def test_j46_lease_active_only_for_the_claiming_session_and_job(
    conn: Conn, workspace: UUID
) -> None:
    session = await manual_session(conn, workspace)
    other = await manual_session(conn, workspace)
    job = new_job(workspace)
    await enqueue(conn, job)
    execution = job.identity.job_execution_id
    assert not await queries.lease_active(conn, execution, session.runner_session_id)

    await claim_ok(conn, session)

    assert await queries.lease_active(conn, execution, session.runner_session_id)
    assert await queries.lease_active(
        conn, execution, session.runner_session_id, job.identity.job_id
    )
    assert not await queries.lease_active(conn, execution, other.runner_session_id)
    assert not await queries.lease_active(conn, execution, session.runner_session_id, uuid.uuid4())


async def test_j47_lease_stays_active_when_cancel_requested_until_reaped(
    conn: Conn, workspace: UUID
) -> None:
    session = await manual_session(conn, workspace)
    job = new_job(workspace)
    await enqueue(conn, job)
    await claim_ok(conn, session)
    execution = job.identity.job_execution_id

    await leases.reconcile(conn, execution, Outcome.SUCCEEDED)

    assert (await running_row(conn, execution))["cancellation_requested_at"] is not None
    assert await queries.lease_active(
        conn, execution, session.runner_session_id, job.identity.job_id
    )

    await make_stale(conn, execution)
    [reaped] = await leases.reap(conn, StaleRule())

    assert reaped.identity == job.identity
    assert await running_rows(conn, workspace) == []
    assert not await queries.lease_active(conn, execution, session.runner_session_id)
