"""Heartbeat at the store level (J-48 .. J-53) and our capability-report rule."""

from __future__ import annotations

from typing import Any
from uuid import UUID, uuid4

import asyncpg
import pytest

from controlplane.domain.jobs import ClaimedJob, Outcome, SessionClaims
from controlplane.errors import RunningJobExecutionNotFound
from controlplane.store import claiming, leases, queue
from controlplane.store.pool import Conn
from tests.factories import manual_session, new_job


async def claimed_job(conn: Conn, workspace: UUID) -> tuple[SessionClaims, ClaimedJob]:
    session = await manual_session(conn, workspace)
    await queue.enqueue(conn, [new_job(workspace)])
    job = await claiming.claim(conn, session)
    assert job is not None
    return session, job


async def lease_row(conn: Conn, execution_id: UUID) -> asyncpg.Record:
    row = await conn.fetchrow(
        "SELECT * FROM running_jobs WHERE job_execution_id = $1", execution_id
    )
    assert row is not None
    return row


async def age_lease(conn: Conn, execution_id: UUID, seconds: float) -> None:
    """Move every timestamp of the lease `seconds` into the past, keeping their order."""
    await conn.execute(
        """
        UPDATE running_jobs
        SET started_at = started_at - make_interval(secs => $2),
            first_heartbeat_at = first_heartbeat_at - make_interval(secs => $2),
            last_heartbeat_at = last_heartbeat_at - make_interval(secs => $2)
        WHERE job_execution_id = $1
        """,
        execution_id,
        seconds,
    )


async def session_row(conn: Conn, session_id: UUID) -> asyncpg.Record:
    row = await conn.fetchrow(
        """
        SELECT tool_capabilities::text AS caps, tool_capabilities_reported_at, updated_at
        FROM runner_sessions WHERE id = $1
        """,
        session_id,
    )
    assert row is not None
    return row


async def test_j48_first_heartbeat_stamps_first_and_advances_last(
    conn: Conn, workspace: UUID
) -> None:
    session, job = await claimed_job(conn, workspace)
    execution = job.identity.job_execution_id
    await age_lease(conn, execution, 30)
    before = await lease_row(conn, execution)
    assert before["first_heartbeat_at"] is None

    result = await leases.heartbeat(conn, execution, session.runner_session_id)

    after = await lease_row(conn, execution)
    assert result.cancellation_requested is False
    assert result.identity == job.identity
    assert after["first_heartbeat_at"] is not None
    assert after["first_heartbeat_at"] > before["started_at"]
    assert after["last_heartbeat_at"] > before["last_heartbeat_at"]
    assert after["last_heartbeat_at"] == after["first_heartbeat_at"]


async def test_j49_later_heartbeats_keep_first_and_advance_last(
    conn: Conn, workspace: UUID
) -> None:
    session, job = await claimed_job(conn, workspace)
    execution = job.identity.job_execution_id
    await leases.heartbeat(conn, execution, session.runner_session_id)
    await age_lease(conn, execution, 30)
    first = (await lease_row(conn, execution))["first_heartbeat_at"]

    await leases.heartbeat(conn, execution, session.runner_session_id)
    await leases.heartbeat(conn, execution, session.runner_session_id)

    after = await lease_row(conn, execution)
    assert after["first_heartbeat_at"] == first
    assert after["last_heartbeat_at"] > first


async def test_j50_heartbeat_after_reconcile_reports_cancel_and_refreshes(
    conn: Conn, workspace: UUID
) -> None:
    session, job = await claimed_job(conn, workspace)
    execution = job.identity.job_execution_id
    await leases.reconcile(conn, execution, Outcome.CANCELLED)
    await age_lease(conn, execution, 30)
    before = await lease_row(conn, execution)

    result = await leases.heartbeat(conn, execution, session.runner_session_id)

    after = await lease_row(conn, execution)
    assert result.cancellation_requested is True
    assert after["last_heartbeat_at"] > before["last_heartbeat_at"]
    assert after["cancellation_requested_at"] == before["cancellation_requested_at"]


async def test_j51_heartbeat_for_unknown_execution_is_not_found(
    conn: Conn, workspace: UUID
) -> None:
    session = await manual_session(conn, workspace)
    before = await session_row(conn, session.runner_session_id)

    with pytest.raises(RunningJobExecutionNotFound, match="Running job execution not found"):
        await leases.heartbeat(conn, uuid4(), session.runner_session_id)

    assert await session_row(conn, session.runner_session_id) == before


async def test_j52_heartbeat_by_another_session_is_not_found_and_changes_nothing(
    conn: Conn, workspace: UUID
) -> None:
    owner, job = await claimed_job(conn, workspace)
    intruder = await manual_session(conn, workspace)
    execution = job.identity.job_execution_id
    await age_lease(conn, execution, 30)
    lease_before = await lease_row(conn, execution)
    owner_before = await session_row(conn, owner.runner_session_id)
    intruder_before = await session_row(conn, intruder.runner_session_id)

    with pytest.raises(RunningJobExecutionNotFound):
        await leases.heartbeat(conn, execution, intruder.runner_session_id, {"tools": []})

    assert await lease_row(conn, execution) == lease_before
    assert await session_row(conn, owner.runner_session_id) == owner_before
    assert await session_row(conn, intruder.runner_session_id) == intruder_before


async def test_j53_heartbeat_touches_session_every_time_without_throttle(
    conn: Conn, workspace: UUID
) -> None:
    session, job = await claimed_job(conn, workspace)
    execution = job.identity.job_execution_id
    for _ in range(2):
        # One second ago is well inside the claim's 10 s liveness throttle.
        stamped = await conn.fetchval(
            """
            UPDATE runner_sessions SET updated_at = now() - interval '1 second'
            WHERE id = $1 RETURNING updated_at
            """,
            session.runner_session_id,
        )
        await leases.heartbeat(conn, execution, session.runner_session_id)
        after = await session_row(conn, session.runner_session_id)
        assert after["updated_at"] > stamped


async def test_heartbeats_rewrite_the_lease_in_place(conn: Conn, workspace: UUID) -> None:
    """A heartbeat is a HOT update of its lease (sql/0031): no index of running_jobs holds a
    column it sets, so PostgreSQL writes no index entry for it. The first heartbeat and a later
    one, each in a transaction of its own (so each sets a later now()), counted by the backend's
    statistics not yet reported, which stay put within a transaction: read before and after."""

    async def counts() -> tuple[int, int]:
        row = await conn.fetchrow(
            """
            SELECT pg_stat_get_xact_tuples_updated('running_jobs'::regclass) AS updated,
                   pg_stat_get_xact_tuples_hot_updated('running_jobs'::regclass) AS hot
            """
        )
        assert row is not None
        return row["updated"], row["hot"]

    session, job = await claimed_job(conn, workspace)
    execution = job.identity.job_execution_id
    for _ in range(2):
        async with conn.transaction():
            updated, hot = await counts()
            await leases.heartbeat(conn, execution, session.runner_session_id)
            assert await counts() == (updated + 1, hot + 1)


async def test_heartbeat_stores_reported_capabilities(conn: Conn, workspace: UUID) -> None:
    session, job = await claimed_job(conn, workspace)
    execution = job.identity.job_execution_id
    report: dict[str, Any] = {"tools": [{"name": "node", "version": "22.1.0"}]}

    result = await leases.heartbeat(conn, execution, session.runner_session_id, report)

    row = await session_row(conn, session.runner_session_id)
    assert result.previous_capabilities is None
    assert result.current_capabilities == report
    assert await conn.fetchval(
        "SELECT tool_capabilities = $2::jsonb FROM runner_sessions WHERE id = $1",
        session.runner_session_id,
        '{"tools": [{"name": "node", "version": "22.1.0"}]}',
    )
    assert row["tool_capabilities_reported_at"] is not None


async def test_heartbeat_without_capabilities_keeps_the_stored_report(
    conn: Conn, workspace: UUID
) -> None:
    """Differs from J-123: omitting capabilities keeps the stored report (reference cleared it)."""
    session, job = await claimed_job(conn, workspace)
    execution = job.identity.job_execution_id
    report: dict[str, Any] = {"tools": [{"name": "git", "version": "2.45"}]}
    await leases.heartbeat(conn, execution, session.runner_session_id, report)
    before = await session_row(conn, session.runner_session_id)

    result = await leases.heartbeat(conn, execution, session.runner_session_id)

    after = await session_row(conn, session.runner_session_id)
    assert result.previous_capabilities == report
    assert result.current_capabilities == report
    assert after["caps"] == before["caps"]
    assert after["tool_capabilities_reported_at"] == before["tool_capabilities_reported_at"]
    assert after["updated_at"] > before["updated_at"]


async def test_heartbeat_with_explicit_none_clears_the_stored_report(
    conn: Conn, workspace: UUID
) -> None:
    """Ours: an explicit None clears the report (the reference cleared it on omission instead)."""
    session, job = await claimed_job(conn, workspace)
    execution = job.identity.job_execution_id
    report: dict[str, Any] = {"tools": [{"name": "git", "version": "2.45"}]}
    await leases.heartbeat(conn, execution, session.runner_session_id, report)

    result = await leases.heartbeat(conn, execution, session.runner_session_id, None)

    after = await session_row(conn, session.runner_session_id)
    assert result.previous_capabilities == report
    assert result.current_capabilities is None
    assert after["caps"] is None
    assert after["tool_capabilities_reported_at"] is None
