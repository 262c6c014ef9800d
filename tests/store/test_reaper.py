"""The stuck-lease reaper (J-64, J-66 .. J-83): staleness set by SQL, races forced by locks."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime, timedelta
from uuid import UUID

import anyio
import asyncpg

from controlplane.domain.jobs import (
    ClaimedJob,
    EndedLease,
    EnqueueResult,
    Outcome,
    SessionClaims,
    StaleRule,
)
from controlplane.store import claiming, leases, locks, queue
from controlplane.store.pool import Conn
from tests.factories import (
    claimed_job,
    event_types,
    holding,
    holding_lock,
    manual_session,
    new_job,
    wait_until_blocked,
)

RULE = StaleRule(threshold=timedelta(seconds=180), grace=timedelta(seconds=60))


async def set_lease_times(
    conn: Conn,
    execution_id: UUID,
    *,
    started: float,
    last: float,
    first: float | None = None,
) -> None:
    """Place the lease's timestamps the given number of seconds in the past."""
    await conn.execute(
        """
        UPDATE running_jobs
        SET started_at = now() - make_interval(secs => $2),
            first_heartbeat_at = now() - make_interval(secs => $3),
            last_heartbeat_at = now() - make_interval(secs => $4)
        WHERE job_execution_id = $1
        """,
        execution_id,
        started,
        first,
        last,
    )


async def stale_lease(conn: Conn, session: SessionClaims, seconds: float = 600) -> ClaimedJob:
    """A claimed lease that heartbeated once and then went silent `seconds` ago."""
    job = await claimed_job(conn, session)
    await set_lease_times(
        conn, job.identity.job_execution_id, started=seconds + 60, first=seconds + 30, last=seconds
    )
    return job


async def expired_events(conn: Conn) -> list[UUID]:
    rows = await conn.fetch(
        "SELECT job_execution_id FROM events WHERE event_type = 'job.lease_expired' ORDER BY seq"
    )
    return [row["job_execution_id"] for row in rows]


async def is_running(conn: Conn, execution_id: UUID) -> bool:
    found: bool = await conn.fetchval(
        "SELECT EXISTS (SELECT 1 FROM running_jobs WHERE job_execution_id = $1)", execution_id
    )
    return found


async def pending_count(conn: Conn, execution_id: UUID) -> int:
    found: int = await conn.fetchval(
        "SELECT count(*) FROM pending_jobs WHERE job_execution_id = $1", execution_id
    )
    return found


async def add_orphan(conn: Conn, execution_id: UUID) -> None:
    """A pending row for an execution that already has a lease (as a replay race leaves one)."""
    await conn.execute(
        """
        INSERT INTO pending_jobs (workspace_id, workflow_run_id, workflow_run_attempt_id, job_id,
            job_execution_id, project_id, required_labels, payload, created_at)
        SELECT workspace_id, workflow_run_id, workflow_run_attempt_id, job_id, job_execution_id,
               project_id, required_labels, payload, queued_at
        FROM running_jobs WHERE job_execution_id = $1
        """,
        execution_id,
    )


def lock_parts(execution_id: UUID) -> tuple[int, int]:
    """The (classid, objid) pair pg_locks shows for an execution's advisory lock."""
    key = locks.execution(execution_id) & 0xFFFFFFFFFFFFFFFF
    return (key >> 32, key & 0xFFFFFFFF)


async def advisory_locks_of(observer: asyncpg.Connection, pid: int) -> list[tuple[int, int]]:
    rows = await observer.fetch(
        """
        SELECT classid::oid::bigint AS hi, objid::oid::bigint AS lo FROM pg_locks
        WHERE locktype = 'advisory' AND pid = $1 AND granted
        """,
        pid,
    )
    return [(row["hi"], row["lo"]) for row in rows]


async def holds_execution_lock(observer: asyncpg.Connection, pid: int, execution_id: UUID) -> bool:
    return lock_parts(execution_id) in await advisory_locks_of(observer, pid)


def ids(reaped: list[EndedLease]) -> list[UUID]:
    return [lease.identity.job_execution_id for lease in reaped]


async def test_j64_lease_silent_for_600s_is_reaped_with_one_event(
    conn: Conn, workspace: UUID
) -> None:
    """Ours: the payload adds outcome='expired' (snake_case keys) and a tombstone is written."""
    session = await manual_session(conn, workspace)
    job = await stale_lease(conn, session, 600)
    execution = job.identity.job_execution_id

    reaped = await leases.reap(conn, RULE)

    assert ids(reaped) == [execution]
    assert not await is_running(conn, execution)
    rows = await conn.fetch(
        "SELECT workspace_id, payload::text AS payload FROM events"
        " WHERE event_type = 'job.lease_expired'"
    )
    assert len(rows) == 1
    assert rows[0]["workspace_id"] == workspace
    assert json.loads(rows[0]["payload"]) == {
        "workflow_run_id": str(job.identity.workflow_run_id),
        "workflow_run_attempt_id": str(job.identity.workflow_run_attempt_id),
        "job_id": str(job.identity.job_id),
        "job_execution_id": str(execution),
        "outcome": "expired",
    }
    ended = await conn.fetchrow(
        "SELECT outcome, ended_by FROM ended_executions WHERE job_execution_id = $1", execution
    )
    assert ended is not None
    assert (ended["outcome"], ended["ended_by"]) == ("expired", "reaper")


async def test_j66_enqueue_after_reap_creates_no_pending_row(conn: Conn, workspace: UUID) -> None:
    session = await manual_session(conn, workspace)
    job = await stale_lease(conn, session)
    assert len(await leases.reap(conn, RULE)) == 1
    await conn.execute("DELETE FROM events")  # the tombstone does not live in the feed

    replay = new_job(workspace, execution_id=job.identity.job_execution_id)
    assert await queue.enqueue(conn, [replay]) == [EnqueueResult.ENDED]

    assert await pending_count(conn, job.identity.job_execution_id) == 0


async def test_j67_never_heartbeated_lease_past_grace_is_reaped(
    conn: Conn, workspace: UUID
) -> None:
    session = await manual_session(conn, workspace)
    job = await claimed_job(conn, session)
    execution = job.identity.job_execution_id
    await set_lease_times(conn, execution, started=90, last=90)

    assert ids(await leases.reap(conn, RULE)) == [execution]

    assert not await is_running(conn, execution)
    assert await expired_events(conn) == [execution]


async def test_j68_never_heartbeated_lease_within_grace_is_kept(
    conn: Conn, workspace: UUID
) -> None:
    session = await manual_session(conn, workspace)
    job = await claimed_job(conn, session)
    execution = job.identity.job_execution_id
    await set_lease_times(conn, execution, started=30, last=30)

    assert await leases.reap(conn, RULE) == []

    assert await is_running(conn, execution)
    assert await expired_events(conn) == []


async def test_j69_heartbeated_lease_silent_for_90s_is_kept(conn: Conn, workspace: UUID) -> None:
    session = await manual_session(conn, workspace)
    job = await claimed_job(conn, session)
    execution = job.identity.job_execution_id
    await set_lease_times(conn, execution, started=120, first=110, last=90)

    assert await leases.reap(conn, RULE) == []

    assert await is_running(conn, execution)
    assert await expired_events(conn) == []


async def test_j70_legacy_row_heartbeated_30s_ago_is_kept(conn: Conn, workspace: UUID) -> None:
    session = await manual_session(conn, workspace)
    job = await claimed_job(conn, session)
    execution = job.identity.job_execution_id
    await set_lease_times(conn, execution, started=90, first=None, last=30)

    assert await leases.reap(conn, RULE) == []

    assert await is_running(conn, execution)
    assert await expired_events(conn) == []


async def test_j71_legacy_row_silent_for_600s_is_reaped(conn: Conn, workspace: UUID) -> None:
    session = await manual_session(conn, workspace)
    job = await claimed_job(conn, session)
    execution = job.identity.job_execution_id
    await set_lease_times(conn, execution, started=900, first=None, last=600)

    assert ids(await leases.reap(conn, RULE)) == [execution]

    assert not await is_running(conn, execution)
    assert await expired_events(conn) == [execution]


async def test_j72_lease_heartbeated_60s_ago_is_kept(conn: Conn, workspace: UUID) -> None:
    session = await manual_session(conn, workspace)
    job = await claimed_job(conn, session)
    execution = job.identity.job_execution_id
    await set_lease_times(conn, execution, started=300, first=290, last=60)

    assert await leases.reap(conn, RULE) == []

    assert await is_running(conn, execution)
    assert await expired_events(conn) == []


async def test_j73_mixed_batch_reaps_only_the_stale_leases(conn: Conn, workspace: UUID) -> None:
    session = await manual_session(conn, workspace)
    stale_a = await stale_lease(conn, session, 600)
    stale_b = await stale_lease(conn, session, 400)
    fresh = await claimed_job(conn, session)
    await set_lease_times(conn, fresh.identity.job_execution_id, started=20, first=15, last=10)

    reaped = await leases.reap(conn, RULE)

    stale = {stale_a.identity.job_execution_id, stale_b.identity.job_execution_id}
    assert set(ids(reaped)) == stale
    assert set(await expired_events(conn)) == stale
    assert len(await expired_events(conn)) == 2
    assert await is_running(conn, fresh.identity.job_execution_id)


async def test_j74_no_stale_leases_reaps_nothing(conn: Conn, workspace: UUID) -> None:
    session = await manual_session(conn, workspace)
    job = await claimed_job(conn, session)
    await set_lease_times(conn, job.identity.job_execution_id, started=59, last=59)

    assert await leases.reap(conn, RULE) == []

    assert await conn.fetchval("SELECT count(*) FROM running_jobs") == 1
    assert await conn.fetchval("SELECT count(*) FROM ended_executions") == 0
    assert await expired_events(conn) == []


async def test_j75_heartbeat_between_scan_and_delete_keeps_the_lease(
    conn: Conn, pool: asyncpg.Pool, observer: asyncpg.Connection, workspace: UUID
) -> None:
    session = await manual_session(conn, workspace)
    job = await stale_lease(conn, session)
    execution = job.identity.job_execution_id
    reaped: list[list[EndedLease]] = []

    async with pool.acquire() as beating, pool.acquire() as reaper:
        reaper_pid: int = await reaper.fetchval("SELECT pg_backend_pid()")

        async def run_reap() -> None:
            reaped.append(await leases.reap(reaper, RULE))

        with anyio.fail_after(10):
            # The heartbeat has updated the running row but not committed: the reaper's scan
            # still sees the stale version, and its DELETE waits for the row. Leaving the
            # block commits the heartbeat.
            async with anyio.create_task_group() as tasks, beating.transaction():
                await leases.heartbeat(beating, execution, session.runner_session_id)
                tasks.start_soon(run_reap)
                await wait_until_blocked(observer, reaper_pid)

    assert reaped == [[]]
    assert await is_running(conn, execution)
    assert await event_types(conn, execution) == ["job.claimed"]
    assert await conn.fetchval("SELECT count(*) FROM ended_executions") == 0


async def test_j76_reaping_twice_writes_one_event_per_lease(conn: Conn, workspace: UUID) -> None:
    session = await manual_session(conn, workspace)
    job = await stale_lease(conn, session)

    assert ids(await leases.reap(conn, RULE)) == [job.identity.job_execution_id]
    assert await leases.reap(conn, RULE) == []

    assert await expired_events(conn) == [job.identity.job_execution_id]


async def test_j77_reaping_a_lease_also_deletes_its_orphan_pending_row(
    conn: Conn, workspace: UUID
) -> None:
    session = await manual_session(conn, workspace)
    job = await stale_lease(conn, session)
    execution = job.identity.job_execution_id
    await add_orphan(conn, execution)
    assert await pending_count(conn, execution) == 1

    assert ids(await leases.reap(conn, RULE)) == [execution]

    assert await pending_count(conn, execution) == 0
    assert not await is_running(conn, execution)


async def test_j78_orphan_pending_row_is_kept_while_its_lease_is_fresh(
    conn: Conn, workspace: UUID
) -> None:
    session = await manual_session(conn, workspace)
    fresh = await claimed_job(conn, session)
    stale = await stale_lease(conn, session)
    await add_orphan(conn, fresh.identity.job_execution_id)

    assert ids(await leases.reap(conn, RULE)) == [stale.identity.job_execution_id]

    assert await pending_count(conn, fresh.identity.job_execution_id) == 1
    assert await is_running(conn, fresh.identity.job_execution_id)


async def test_j79_reaper_returns_identities_without_internal_ids(
    conn: Conn, workspace: UUID
) -> None:
    session = await manual_session(conn, workspace)
    job = await stale_lease(conn, session)
    internal_id = await conn.fetchval(
        "SELECT id FROM running_jobs WHERE job_execution_id = $1", job.identity.job_execution_id
    )

    reaped = await leases.reap(conn, RULE)

    assert reaped == [
        EndedLease(
            identity=job.identity,
            provisioner_id=None,
            provider_runner_id=None,
            cancellation_requested=False,
            newly_ended=True,
        )
    ]
    returned = [getattr(reaped[0], field.name) for field in dataclasses.fields(EndedLease)]
    assert internal_id not in returned
    assert internal_id not in dataclasses.astuple(reaped[0].identity)


async def test_j80_concurrent_reapers_reap_each_once(
    conn: Conn,
    pool: asyncpg.Pool,
    observer: asyncpg.Connection,
    database_url: str,
    workspace: UUID,
) -> None:
    session = await manual_session(conn, workspace)
    older = await stale_lease(conn, session, 700)
    newer = await stale_lease(conn, session, 600)
    first_tick: list[list[EndedLease]] = []

    async with pool.acquire() as reaper_a, pool.acquire() as reaper_b:
        pid_a: int = await reaper_a.fetchval("SELECT pg_backend_pid()")

        async def run_first() -> None:
            first_tick.append(await leases.reap(reaper_a, RULE, limit=1))

        with anyio.fail_after(10):
            # Tick A takes the older lease and then waits on its row, still holding its
            # execution lock, while tick B runs to completion.
            async with (
                anyio.create_task_group() as tasks,
                holding(
                    database_url,
                    "SELECT 1 FROM running_jobs WHERE job_execution_id = $1 FOR UPDATE",
                    older.identity.job_execution_id,
                ),
            ):
                tasks.start_soon(run_first)
                await wait_until_blocked(observer, pid_a)
                second_tick = await leases.reap(reaper_b, RULE)
                assert ids(second_tick) == [newer.identity.job_execution_id]

    assert [ids(tick) for tick in first_tick] == [[older.identity.job_execution_id]]
    assert await conn.fetchval("SELECT count(*) FROM running_jobs") == 0
    assert sorted(await expired_events(conn)) == sorted(
        [older.identity.job_execution_id, newer.identity.job_execution_id]
    )


async def test_j81_busy_oldest_lease_is_skipped_and_reaped_next_tick(
    conn: Conn, database_url: str, workspace: UUID
) -> None:
    """Ours: candidates are try-locked in order, so none past the limit is ever taken."""
    session = await manual_session(conn, workspace)
    oldest = await stale_lease(conn, session, 700)
    second = await stale_lease(conn, session, 600)

    async with holding_lock(database_url, locks.execution(oldest.identity.job_execution_id)):
        assert ids(await leases.reap(conn, RULE, limit=1)) == [second.identity.job_execution_id]
        assert await is_running(conn, oldest.identity.job_execution_id)

    assert ids(await leases.reap(conn, RULE, limit=1)) == [oldest.identity.job_execution_id]
    assert await expired_events(conn) == [
        second.identity.job_execution_id,
        oldest.identity.job_execution_id,
    ]


async def test_j81_reaper_holds_no_execution_lock_beyond_its_limit(
    conn: Conn,
    pool: asyncpg.Pool,
    observer: asyncpg.Connection,
    database_url: str,
    workspace: UUID,
) -> None:
    """Ours: the reference could try-lock stale rows past `limit`; we lock only what we keep."""
    session = await manual_session(conn, workspace)
    busy = await stale_lease(conn, session, 900)
    kept = await stale_lease(conn, session, 800)
    beyond = await stale_lease(conn, session, 700)
    held: list[tuple[int, int]] = []

    async with pool.acquire() as reaper:
        reaper_pid: int = await reaper.fetchval("SELECT pg_backend_pid()")

        async def run_reap() -> None:
            await leases.reap(reaper, RULE, limit=1)

        with anyio.fail_after(10):
            # The row lock pauses the reaper in its DELETE so its advisory locks can be inspected.
            async with (
                holding_lock(database_url, locks.execution(busy.identity.job_execution_id)),
                anyio.create_task_group() as tasks,
                holding(
                    database_url,
                    "SELECT 1 FROM running_jobs WHERE job_execution_id = $1 FOR UPDATE",
                    kept.identity.job_execution_id,
                ),
            ):
                tasks.start_soon(run_reap)
                await wait_until_blocked(observer, reaper_pid)
                held = await advisory_locks_of(observer, reaper_pid)

    assert held == [lock_parts(kept.identity.job_execution_id)]
    assert lock_parts(beyond.identity.job_execution_id) not in held
    assert await expired_events(conn) == [kept.identity.job_execution_id]
    assert await is_running(conn, beyond.identity.job_execution_id)


async def test_j82_reaper_tick_during_an_orphan_claim_does_not_deadlock(
    conn: Conn,
    pool: asyncpg.Pool,
    observer: asyncpg.Connection,
    database_url: str,
    workspace: UUID,
) -> None:
    session = await manual_session(conn, workspace)
    job = await stale_lease(conn, session)
    execution = job.identity.job_execution_id
    await add_orphan(conn, execution)
    claimer_session = await manual_session(conn, workspace)
    claims: list[ClaimedJob | None] = []

    async with pool.acquire() as claimer, pool.acquire() as reaper:
        claimer_pid: int = await claimer.fetchval("SELECT pg_backend_pid()")

        async def run_claim() -> None:
            claims.append(await claiming.claim(claimer, claimer_session))

        with anyio.fail_after(10):
            # An uncommitted update of the lease row makes the orphan's insert wait on its
            # conflict check: the claim then holds the orphan row and the execution lock.
            async with (
                anyio.create_task_group() as tasks,
                holding(
                    database_url,
                    "UPDATE running_jobs SET payload = payload WHERE job_execution_id = $1",
                    execution,
                ),
            ):
                tasks.start_soon(run_claim)
                await wait_until_blocked(observer, claimer_pid)
                assert await holds_execution_lock(observer, claimer_pid, execution)
                assert await leases.reap(reaper, RULE) == []

    assert claims == [None]
    assert await pending_count(conn, execution) == 0
    assert ids(await leases.reap(conn, RULE)) == [execution]
    assert not await is_running(conn, execution)
    assert await expired_events(conn) == [execution]
    assert await event_types(conn, execution) == ["job.claimed", "job.lease_expired"]
    assert await claiming.claim(conn, claimer_session) is None


async def test_j82_orphan_claim_during_a_reaper_tick_does_not_deadlock(
    conn: Conn,
    pool: asyncpg.Pool,
    observer: asyncpg.Connection,
    database_url: str,
    workspace: UUID,
) -> None:
    session = await manual_session(conn, workspace)
    job = await stale_lease(conn, session)
    execution = job.identity.job_execution_id
    await add_orphan(conn, execution)
    claimer_session = await manual_session(conn, workspace)
    reaped: list[list[EndedLease]] = []

    async with pool.acquire() as claimer, pool.acquire() as reaper:
        reaper_pid: int = await reaper.fetchval("SELECT pg_backend_pid()")

        async def run_reap() -> None:
            reaped.append(await leases.reap(reaper, RULE))

        with anyio.fail_after(10):
            # The reaper has swept the orphan (row locked) and waits on the running row.
            async with (
                anyio.create_task_group() as tasks,
                holding(
                    database_url,
                    "SELECT 1 FROM running_jobs WHERE job_execution_id = $1 FOR UPDATE",
                    execution,
                ),
            ):
                tasks.start_soon(run_reap)
                await wait_until_blocked(observer, reaper_pid)
                assert await claiming.claim(claimer, claimer_session) is None

    assert [ids(tick) for tick in reaped] == [[execution]]
    assert await pending_count(conn, execution) == 0
    assert not await is_running(conn, execution)
    assert await expired_events(conn) == [execution]
    assert await claiming.claim(conn, claimer_session) is None


async def test_j83_reaper_takes_the_oldest_stale_instant_first_ties_by_id(
    conn: Conn, workspace: UUID
) -> None:
    session = await manual_session(conn, workspace)
    tie_low = await claimed_job(conn, session)  # claimed first: the lower uuidv7 id
    tie_high = await claimed_job(conn, session)
    never_200 = await claimed_job(conn, session)
    beat_500 = await claimed_job(conn, session)
    never_100 = await claimed_job(conn, session)
    legacy_300 = await claimed_job(conn, session)
    await set_lease_times(conn, never_200.identity.job_execution_id, started=200, last=200)
    await set_lease_times(conn, beat_500.identity.job_execution_id, started=50, first=40, last=500)
    await set_lease_times(conn, never_100.identity.job_execution_id, started=100, last=100)
    await set_lease_times(conn, legacy_300.identity.job_execution_id, started=900, last=300)
    tie = datetime.now(UTC) - timedelta(seconds=400)
    # Update the higher id first so the lower id's newer tuple sits later in the heap.
    for job in (tie_high, tie_low):
        await conn.execute(
            """
            UPDATE running_jobs SET started_at = $2::timestamptz - interval '1 minute',
                first_heartbeat_at = $2::timestamptz - interval '30 seconds', last_heartbeat_at = $2
            WHERE job_execution_id = $1
            """,
            job.identity.job_execution_id,
            tie,
        )

    order = []
    for _ in range(6):
        order.extend(ids(await leases.reap(conn, RULE, limit=1)))

    assert order == [
        beat_500.identity.job_execution_id,
        tie_low.identity.job_execution_id,
        tie_high.identity.job_execution_id,
        legacy_300.identity.job_execution_id,
        never_200.identity.job_execution_id,
        never_100.identity.job_execution_id,
    ]


async def test_reaping_a_lease_cancelled_by_reconcile_writes_no_second_terminal_event(
    conn: Conn, workspace: UUID
) -> None:
    """Ours: the reference wrote lease_expired for already-ended executions; we do not."""
    session = await manual_session(conn, workspace)
    job = await stale_lease(conn, session)
    execution = job.identity.job_execution_id
    await leases.reconcile(conn, execution, Outcome.CANCELLED)

    reaped = await leases.reap(conn, RULE)

    assert len(reaped) == 1
    assert reaped[0].newly_ended is False
    assert reaped[0].cancellation_requested is True
    assert not await is_running(conn, execution)
    assert await event_types(conn, execution) == ["job.claimed", "job.cancelled"]
    ended = await conn.fetchrow(
        "SELECT outcome, ended_by FROM ended_executions WHERE job_execution_id = $1", execution
    )
    assert ended is not None
    assert (ended["outcome"], ended["ended_by"]) == ("cancelled", "orchestrator")
