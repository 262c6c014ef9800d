"""The event feed: cursor reads in (xid, seq) order that never skip a late commit."""

from __future__ import annotations

from uuid import UUID, uuid4

import asyncpg
import pytest

from controlplane.domain.jobs import EventType, JobIdentity
from controlplane.store import claiming, events, queue
from controlplane.store.pool import Conn
from tests.factories import manual_session, new_job


def identity(workspace: UUID) -> JobIdentity:
    return new_job(workspace).identity


async def write_one(conn: Conn, kind: EventType, job: JobIdentity) -> None:
    async with conn.transaction():
        await events.write(conn, [(kind, job, events.identity_payload(job))])


def executions(feed: list[events.Event]) -> list[UUID | None]:
    return [event.job_execution_id for event in feed]


async def test_read_returns_committed_events_in_order_from_a_cursor(
    conn: Conn, workspace: UUID
) -> None:
    jobs = [identity(workspace) for _ in range(3)]
    for job in jobs:
        await write_one(conn, EventType.CLAIMED, job)

    first = list(await events.read(conn, limit=2))
    rest = list(await events.read(conn, after=events.parse_cursor(first[-1].cursor)))

    assert executions(first + rest) == [job.job_execution_id for job in jobs]
    assert [(e.xid, e.seq) for e in first + rest] == sorted((e.xid, e.seq) for e in first + rest)
    assert first[0].event_type == "job.claimed"
    assert first[0].payload["job_execution_id"] == str(jobs[0].job_execution_id)
    assert await events.read(conn, after=events.parse_cursor(rest[-1].cursor)) == []


async def test_late_committing_transaction_is_not_skipped(
    conn: Conn, pool: asyncpg.Pool, workspace: UUID
) -> None:
    """Ours: a seq-only cursor would skip T1's event; the feed holds T2 back until T1 ends."""
    session = await manual_session(conn, workspace)
    late_job = new_job(workspace)
    early = identity(workspace)
    await write_one(conn, EventType.CLAIMED, identity(workspace))
    cursor = events.parse_cursor((await events.read(conn))[-1].cursor)

    async with pool.acquire() as t1_conn, pool.acquire() as t2_conn:
        async with t1_conn.transaction():
            # T1 claims (writing job.claimed) and stays open; T2 writes and commits after it.
            await queue.enqueue(t1_conn, [late_job])
            assert await claiming.claim(t1_conn, session) is not None
            await write_one(t2_conn, EventType.REQUEUED, early)

            assert await events.read(conn, after=cursor) == []

        feed = list(await events.read(conn, after=cursor))

    assert executions(feed) == [late_job.identity.job_execution_id, early.job_execution_id]
    assert [e.event_type for e in feed] == ["job.claimed", "job.requeued"]
    assert feed[0].xid < feed[1].xid


async def test_event_written_later_by_an_older_transaction_is_read_first(
    conn: Conn, pool: asyncpg.Pool, workspace: UUID
) -> None:
    """Ours: T1 took its xid before T2 but writes its event after T2 commits (seq out of order)."""
    late, early = identity(workspace), identity(workspace)
    await write_one(conn, EventType.CLAIMED, identity(workspace))
    cursor = events.parse_cursor((await events.read(conn))[-1].cursor)

    async with pool.acquire() as t1_conn, pool.acquire() as t2_conn:
        async with t1_conn.transaction():
            await t1_conn.execute("SELECT pg_current_xact_id()")  # T1 takes its xid now
            await write_one(t2_conn, EventType.CLAIMED, early)
            assert await events.read(conn, after=cursor) == []
            await events.write(t1_conn, [(EventType.CLAIMED, late, events.identity_payload(late))])
            assert await events.read(conn, after=cursor) == []

        feed = list(await events.read(conn, after=cursor))

    assert executions(feed) == [late.job_execution_id, early.job_execution_id]
    assert feed[0].seq > feed[1].seq


async def test_read_filters_by_workspace(conn: Conn, workspace: UUID) -> None:
    mine, theirs = identity(workspace), identity(uuid4())
    await write_one(conn, EventType.CLAIMED, mine)
    await write_one(conn, EventType.CLAIMED, theirs)

    feed = await events.read(conn, workspace_id=workspace)

    assert executions(list(feed)) == [mine.job_execution_id]
    assert feed[0].workspace_id == workspace


async def test_the_database_allows_one_terminal_event_per_execution(
    conn: Conn, workspace: UUID
) -> None:
    job = identity(workspace)
    await write_one(conn, EventType.CLAIMED, job)
    await write_one(conn, EventType.CLAIMED, job)  # non-terminal events may repeat
    await write_one(conn, EventType.COMPLETED, job)

    for kind in (EventType.COMPLETED, EventType.CANCELLED, EventType.LEASE_EXPIRED):
        with pytest.raises(asyncpg.UniqueViolationError):
            await write_one(conn, kind, job)

    assert [e.event_type for e in await events.read(conn)] == [
        "job.claimed",
        "job.claimed",
        "job.completed",
    ]


def test_cursor_round_trips_and_rejects_garbage() -> None:
    assert events.parse_cursor(None) == (0, 0)
    assert events.parse_cursor("") == (0, 0)
    assert events.parse_cursor("812.40") == (812, 40)
    for bad in ("812", "a.1", "1.-2", "1.2.3"):
        with pytest.raises(ValueError, match="cursor"):
            events.parse_cursor(bad)
