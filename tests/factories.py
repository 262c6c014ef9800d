"""Builders for test data: jobs, sessions, and the lock-holding second connection."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

import anyio
import asyncpg

from controlplane.domain.jobs import ClaimedJob, JobIdentity, NewJob, SessionClaims
from controlplane.domain.labels import LabelSet, canonicalise
from controlplane.store import claiming, queue, sessions
from controlplane.store.pool import Conn

LINUX_X64: LabelSet = ("linux", "x64")


def new_job(
    workspace_id: UUID,
    labels: list[str] | None = None,
    *,
    queued_at: datetime | None = None,
    job_id: UUID | None = None,
    execution_id: UUID | None = None,
    payload: dict[str, Any] | None = None,
    project_id: UUID | None = None,
    priority: int = 0,
    key: tuple[str, int] | None = None,  # (concurrency_key, concurrency_limit)
) -> NewJob:
    return NewJob(
        identity=JobIdentity(
            workspace_id=workspace_id,
            workflow_run_id=uuid.uuid4(),
            workflow_run_attempt_id=uuid.uuid4(),
            job_id=job_id or uuid.uuid4(),
            job_execution_id=execution_id or uuid.uuid4(),
            project_id=project_id or uuid.uuid4(),
        ),
        required_labels=canonicalise(labels or ["linux"]),
        queued_at=queued_at or datetime.now(UTC),
        payload=payload or {},
        priority=priority,
        concurrency_key=None if key is None else key[0],
        concurrency_limit=None if key is None else key[1],
    )


def minutes_ago(minutes: float) -> datetime:
    return datetime.now(UTC) - timedelta(minutes=minutes)


async def claimed_job(conn: Conn, session: SessionClaims) -> ClaimedJob:
    await queue.enqueue(conn, [new_job(session.workspace_id)])
    job = await claiming.claim(conn, session)
    assert job is not None
    return job


async def event_types(conn: Conn, execution_id: UUID) -> list[str]:
    rows = await conn.fetch(
        "SELECT event_type FROM events WHERE job_execution_id = $1 ORDER BY seq", execution_id
    )
    return [row["event_type"] for row in rows]


async def manual_session(
    conn: Conn, workspace_id: UUID, labels: LabelSet = LINUX_X64
) -> SessionClaims:
    created = await sessions.create(
        conn,
        workspace_id=workspace_id,
        registration_token_id=uuid.uuid4(),
        kind="manual",
        labels=labels,
    )
    return SessionClaims(created.id, workspace_id, labels, None)


async def capped_session(
    conn: Conn,
    workspace_id: UUID,
    labels: LabelSet = LINUX_X64,
    *,
    max_claims: int = 1,
    provisioner_id: UUID | None = None,
    provider_runner_id: str = "runner-1",
) -> SessionClaims:
    created = await sessions.create(
        conn,
        workspace_id=workspace_id,
        registration_token_id=uuid.uuid4(),
        kind="ephemeral",
        labels=labels,
        max_claims=max_claims,
        provisioner_id=provisioner_id or uuid.uuid4(),
        provider_runner_id=provider_runner_id,
    )
    return SessionClaims(created.id, workspace_id, labels, max_claims)


@asynccontextmanager
async def holding(url: str, statement: str, *args: object) -> AsyncIterator[asyncpg.Connection]:
    """Run `statement` in an open transaction on a second connection until the block ends."""
    holder = await asyncpg.connect(url)
    try:
        async with holder.transaction():
            await holder.execute(statement, *args)
            yield holder
    finally:
        await holder.close()


def holding_lock(url: str, key: int) -> AbstractAsyncContextManager[asyncpg.Connection]:
    """Hold a transaction advisory lock on a second connection until the block ends."""
    return holding(url, "SELECT pg_advisory_xact_lock($1)", key)


async def wait_until_blocked(observer: asyncpg.Connection, pid: int) -> None:
    """Return once backend `pid` is waiting on a lock (it is then inside the statement we race).

    This observes PostgreSQL's lock table; it does not guess with a sleep.
    """
    with anyio.fail_after(10):
        while True:
            waiting = await observer.fetchval(
                "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1", pid
            )
            if waiting:
                return
            await anyio.sleep(0.005)


def plan_nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    """Every node of an EXPLAIN (FORMAT JSON) plan, `node` first, then its children's, depth
    first."""
    return [node, *(n for child in node.get("Plans", []) for n in plan_nodes(child))]
