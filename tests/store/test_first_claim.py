"""A provisioned runner's first claim, through the real claim statement (spec 4.14, J-40).

The claim of a one-claim activation session takes the runner's assignment locks before its
session row (the order of every transaction that takes both, provisioner revocation included),
then gives one reservation unit back after the lease is written.
"""

from __future__ import annotations

from datetime import timedelta
from uuid import UUID

import anyio
import asyncpg
import pytest

from controlplane.domain import tokens
from controlplane.domain.jobs import SessionClaims
from controlplane.errors import RunnerSessionExhausted
from controlplane.store import locks, queue, runner_instances
from controlplane.store.pool import Conn
from tests import provisioning
from tests.factories import holding_lock, new_job, wait_until_blocked

TTL = timedelta(minutes=5)


async def _activated(conn: Conn, workspace: UUID, count: int) -> tuple[UUID, UUID, UUID, UUID]:
    """An activated runner of a live reservation of `count`: (provisioner, reservation, runner,
    session)."""
    p = await provisioning.provisioner(conn, workspace)
    r = await provisioning.reservation(
        conn, workspace_id=workspace, provisioner_id=p.id, count=count
    )
    runner = await provisioning.runner(
        conn, p.id, workspace_id=workspace, reservation_id=r, assigned=True
    )
    token, _ = await runner_instances.issue_activation_token(conn, runner, TTL)
    assert token is not None
    grant = await runner_instances.activation_by_digest(conn, tokens.digest(token))
    assert grant is not None
    session = await runner_instances.consume_activation(
        conn, grant, labels=("linux",), capabilities=None
    )
    return p.id, r, runner, session.id


def _claims(session: UUID, workspace: UUID) -> SessionClaims:
    return SessionClaims(
        runner_session_id=session, workspace_id=workspace, labels=("linux",), max_claims=1
    )


async def test_j40_the_first_claim_releases_one_unit_and_the_session_is_then_spent(
    conn: Conn, workspace: UUID
) -> None:
    _, reservation, runner, session = await _activated(conn, workspace, count=2)
    await queue.enqueue(conn, [new_job(workspace), new_job(workspace)])
    claimed = await queue.claim(conn, _claims(session, workspace))
    assert claimed is not None
    assert await conn.fetchval("SELECT count FROM reservations WHERE id = $1", reservation) == 1
    row = await conn.fetchrow(
        "SELECT first_claimed_at, reservation_released_at FROM runner_instances WHERE id = $1",
        runner,
    )
    assert row is not None
    stamped = row["reservation_released_at"]
    assert row["first_claimed_at"] is not None
    assert stamped is not None
    # One claim per activation session: the second is refused and releases nothing more.
    with pytest.raises(RunnerSessionExhausted):
        await queue.claim(conn, _claims(session, workspace))
    assert await conn.fetchval("SELECT count FROM reservations WHERE id = $1", reservation) == 1
    again = await conn.fetchval(
        "SELECT reservation_released_at FROM runner_instances WHERE id = $1", runner
    )
    assert again == stamped
    assert await conn.fetchval("SELECT count(*) FROM pending_jobs") == 1


async def test_the_claim_waits_for_the_assignment_lock_before_locking_its_session(
    pool: asyncpg.Pool, conn: Conn, observer: asyncpg.Connection, database_url: str, workspace: UUID
) -> None:
    """Hold the runner's assignment lock from a second connection: the claim waits on it while
    its session row stays free (a revocation holding that lock can still revoke the session,
    so the two cannot deadlock); once released, the claim goes on and gives the unit back."""
    provisioner_id, reservation, _, session = await _activated(conn, workspace, count=1)
    await queue.enqueue(conn, [new_job(workspace)])
    result: list[object] = []
    async with pool.acquire() as own:

        async def claim() -> None:
            result.append(await queue.claim(own, _claims(session, workspace)))

        held = holding_lock(database_url, locks.assignment(provisioner_id, reservation))
        async with anyio.create_task_group() as group, held:
            group.start_soon(claim)
            await wait_until_blocked(observer, own.get_server_pid())
            free = await observer.fetchval(
                "SELECT id FROM runner_sessions WHERE id = $1 FOR UPDATE NOWAIT", session
            )
            assert free == session
            assert result == []
    assert result[0] is not None
    assert await conn.fetchval("SELECT count(*) FROM reservations") == 0
