"""Reservation cleanup against PostgreSQL (spec 4.11): deletion by id and by expiry, what happens
to the runners of a deleted reservation, and cleanup racing a poll on the same runner rows."""

from __future__ import annotations

import uuid
from datetime import timedelta
from uuid import UUID

import anyio
import asyncpg
import pytest

from controlplane.domain.provisioners import Provisioner
from controlplane.store import reservation_cleanup
from controlplane.store.pool import Conn
from tests import provisioning as rows
from tests.factories import holding, wait_until_blocked
from tests.store.test_demand_store import (
    LINUX,
    activation_token,
    bound_to,
    poll,
    runner,
    runner_row,
    token_revoked,
)

MINUTE = timedelta(minutes=1)


@pytest.fixture
async def wsp(conn: Conn, workspace: UUID) -> Provisioner:
    return await rows.provisioner(conn, workspace)


async def existing(conn: Conn, *ids: UUID) -> list[UUID]:
    found = await conn.fetch(
        "SELECT id FROM reservations WHERE id = ANY($1::uuid[]) ORDER BY id", list(ids)
    )
    return [r["id"] for r in found]


async def link(conn: Conn, runner_id: UUID) -> tuple[UUID | None, UUID | None, bool, UUID | None]:
    """(workspace, reservation, assigned, intended) of a runner."""
    row = await runner_row(conn, runner_id)
    return (
        row["workspace_id"],
        row["reservation_id"],
        row["assigned_at"] is not None,
        row["intended_reservation_id"],
    )


async def test_p110_expired_reservations_are_deleted_and_live_ones_kept(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    expired = [
        await rows.reservation(conn, workspace_id=workspace, provisioner_id=wsp.id, ttl=-age)
        for age in (MINUTE, 3 * MINUTE, 2 * MINUTE)
    ]
    live = await rows.reservation(conn, workspace_id=workspace, provisioner_id=wsp.id)

    # Oldest expiry first, at most `limit` per call.
    assert await reservation_cleanup.delete_expired_reservations(conn, limit=2) == 2
    assert await existing(conn, *expired, live) == sorted([expired[0], live])
    assert await reservation_cleanup.delete_expired_reservations(conn) == 1
    assert await reservation_cleanup.delete_expired_reservations(conn) == 0
    assert await existing(conn, *expired, live) == [live]


async def test_p111_deleting_by_id_removes_only_the_listed_reservation(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    listed = await rows.reservation(conn, workspace_id=workspace, provisioner_id=wsp.id)
    other = await rows.reservation(conn, workspace_id=workspace, provisioner_id=wsp.id)
    expired = await rows.reservation(
        conn, workspace_id=workspace, provisioner_id=wsp.id, ttl=-MINUTE
    )

    assert await reservation_cleanup.delete_reservations(conn, [listed, uuid.uuid4()]) == 1

    assert await existing(conn, listed, other, expired) == sorted([other, expired])
    assert await reservation_cleanup.delete_reservations(conn, []) == 0


@pytest.mark.parametrize("how", ["by-id", "by-expiry"])
async def test_p112_deletion_unbinds_unactivated_runners_and_revokes_their_tokens(
    conn: Conn, workspace: UUID, wsp: Provisioner, how: str
) -> None:
    ttl = -MINUTE if how == "by-expiry" else MINUTE
    doomed = await rows.reservation(
        conn, workspace_id=workspace, provisioner_id=wsp.id, kind="bound", count=2, ttl=ttl
    )
    kept = await rows.reservation(conn, workspace_id=workspace, provisioner_id=wsp.id)
    unactivated = await runner(
        conn, wsp.id, workspace_id=workspace, reservation_id=doomed, assigned=True
    )
    bystander = await runner(
        conn, wsp.id, workspace_id=workspace, reservation_id=kept, assigned=True
    )
    token = await activation_token(conn, unactivated)
    bystander_token = await activation_token(conn, bystander)

    if how == "by-id":
        deleted = await reservation_cleanup.delete_reservations(conn, [doomed])
    else:
        deleted = await reservation_cleanup.delete_expired_reservations(conn)

    assert deleted == 1
    assert await existing(conn, doomed, kept) == [kept]
    assert await link(conn, unactivated) == (None, None, False, None)
    assert (await runner_row(conn, unactivated))["state"] == "running"
    assert await token_revoked(conn, token)
    assert await link(conn, bystander) == (workspace, kept, True, None)
    assert not await token_revoked(conn, bystander_token)


async def test_p113_activated_runners_keep_their_links_and_tokens(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    doomed = await rows.reservation(conn, workspace_id=workspace, provisioner_id=wsp.id)
    intended = await rows.reservation(conn, workspace_id=workspace, provisioner_id=wsp.id)
    activated = await runner(
        conn,
        wsp.id,
        workspace_id=workspace,
        reservation_id=doomed,
        intended_reservation_id=intended,
        assigned=True,
        runner_session_id=uuid.uuid4(),
    )
    released = await runner(
        conn, wsp.id, workspace_id=workspace, reservation_id=doomed, assigned=True, released=True
    )
    token = await activation_token(conn, activated)

    assert await reservation_cleanup.delete_reservations(conn, [doomed, intended]) == 2

    assert await link(conn, activated) == (workspace, doomed, True, None)
    assert not await token_revoked(conn, token)
    assert await link(conn, released) == (workspace, doomed, True, None)


async def test_p114_deletion_clears_intended_ids_and_the_runner_becomes_rebindable(
    conn: Conn, workspace: UUID, wsp: Provisioner
) -> None:
    doomed = await rows.reservation(conn, workspace_id=workspace, provisioner_id=wsp.id)
    other = await rows.reservation(conn, workspace_id=workspace, provisioner_id=wsp.id)
    enrolled = await runner(conn, wsp.id, intended_reservation_id=doomed)
    booting = await runner(
        conn,
        wsp.id,
        intended_reservation_id=doomed,
        state="starting",
        provider_runner_id=None,
        control_session=None,
    )
    elsewhere = await runner(conn, wsp.id, intended_reservation_id=other)

    assert await reservation_cleanup.delete_reservations(conn, [doomed]) == 1

    assert await link(conn, enrolled) == (None, None, False, None)
    assert await link(conn, booting) == (None, None, False, None)
    assert await link(conn, elsewhere) == (None, None, False, other)
    await rows.pending_jobs(conn, workspace, LINUX, 2)  # `other` reserves one of them
    result = await poll(conn, wsp, workspace)
    assert result.bound == 1
    assert await bound_to(conn, enrolled) == "bound"


@pytest.mark.parametrize("first", ["cleanup", "poll"])
async def test_p45_poll_and_expiry_cleanup_on_the_same_runners_do_not_deadlock(
    conn: Conn,
    pool: asyncpg.Pool,
    database_url: str,
    observer: asyncpg.Connection,
    workspace: UUID,
    wsp: Provisioner,
    first: str,
) -> None:
    expired = await rows.reservation(
        conn, workspace_id=workspace, provisioner_id=wsp.id, count=2, ttl=-MINUTE
    )
    a, b = sorted(
        [
            await runner(
                conn, wsp.id, workspace_id=workspace, reservation_id=expired, assigned=True
            )
            for _ in range(2)
        ]
    )
    tokens = [await activation_token(conn, r) for r in (a, b)]
    await rows.pending_jobs(conn, workspace, LINUX, 2)
    cleaned: list[int] = []

    async def cleanup(connection: Conn) -> None:
        cleaned.append(await reservation_cleanup.delete_expired_reservations(connection))

    async def allocate(connection: Conn) -> None:
        await poll(connection, wsp, workspace)

    order = [cleanup, allocate] if first == "cleanup" else [allocate, cleanup]
    async with pool.acquire() as one, pool.acquire() as two:
        with anyio.fail_after(10):
            async with (
                anyio.create_task_group() as tg,
                holding(database_url, "SELECT 1 FROM runner_instances WHERE id = $1 FOR UPDATE", a),
            ):
                # Both queue on the lowest runner row; whichever gets it then takes the other
                # in the same order, so neither can hold b while waiting for a.
                for job, connection in zip(order, (one, two), strict=True):
                    tg.start_soon(job, connection)
                    await wait_until_blocked(observer, connection.get_server_pid())

    assert cleaned == [1]
    assert await existing(observer, expired) == []
    assert [await bound_to(observer, r) for r in (a, b)] == ["bound", "bound"]
    assert all([await token_revoked(observer, t) for t in tokens])
