"""A provisioned runner's first claim, through the real claim statement (spec 4.14, J-40), and
how it meets an allocation round.

The claim of a one-claim activation session takes the runner's assignment locks before its
session row (the order of every transaction that takes both, provisioner revocation included),
then gives one reservation unit back after the lease is written. A round that runs meanwhile reads
demand and reservations from one snapshot, after its own assignment locks.
"""

from __future__ import annotations

from datetime import timedelta
from uuid import UUID

import anyio
import asyncpg
import pytest

from controlplane.domain import tokens
from controlplane.domain.binding import Scope
from controlplane.domain.demand import Template
from controlplane.domain.jobs import SessionClaims
from controlplane.domain.rounds import WorkspaceRound
from controlplane.errors import RunnerSessionExhausted
from controlplane.store import activations, claiming, demand, locks, queue
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
    token, _ = await activations.issue_activation_token(conn, runner, TTL)
    assert token is not None
    grant = await activations.activation_by_digest(conn, tokens.digest(token))
    assert grant is not None
    session = await activations.consume_activation(
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
    claimed = await claiming.claim(conn, _claims(session, workspace))
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
        await claiming.claim(conn, _claims(session, workspace))
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
            result.append(await claiming.claim(own, _claims(session, workspace)))

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


async def test_a_claim_committing_during_a_round_is_never_granted_again(
    pool: asyncpg.Pool, conn: Conn, observer: asyncpg.Connection, database_url: str, workspace: UUID
) -> None:
    """A round waits on its provisioner's assignment lock while a claim (from the lock holder)
    takes the last pending job and releases the bound unit that was reserved for it. The round
    must read demand and reservations after that, from one snapshot: no launch grant for a job
    that is no longer queued."""
    p = await provisioning.provisioner(conn, workspace)
    bound = await provisioning.reservation(
        conn, workspace_id=workspace, provisioner_id=p.id, kind="bound"
    )
    await queue.enqueue(conn, [new_job(workspace)])
    result: list[WorkspaceRound | None] = []
    async with pool.acquire() as own:

        async def allocate() -> None:
            result.append(
                await demand.allocate_workspace(
                    own,
                    provisioner_id=p.id,
                    scope=Scope.WORKSPACE,
                    workspace_id=workspace,
                    templates=[Template("small", ("linux",), available_slots=5)],
                    max_reservations=5,
                    launch_ttl=TTL,
                    activation_grace=TTL,
                )
            )

        async with (
            anyio.create_task_group() as group,
            holding_lock(database_url, locks.assignment(p.id, bound)) as holder,
        ):
            group.start_soon(allocate)
            await wait_until_blocked(observer, own.get_server_pid())
            # What a first claim commits: the job leaves the queue, its unit is given back.
            await holder.execute("DELETE FROM pending_jobs WHERE workspace_id = $1", workspace)
            await holder.execute("DELETE FROM reservations WHERE id = $1", bound)
    [round_] = result
    assert round_ is not None
    assert round_.grants == ()
    assert round_.allocation.stats == ()
    assert await conn.fetchval("SELECT count(*) FROM reservations") == 0
