"""The stale runner reaper and its drain (spec 4.12), against real PostgreSQL."""

from __future__ import annotations

import uuid
from datetime import timedelta
from uuid import UUID

import asyncpg

from controlplane.store import locks, runner_release
from controlplane.store.pool import Conn
from tests.factories import holding_lock
from tests.provisioning import provisioner, reservation
from tests.store.test_runner_reports import (
    FAILED,
    count_of,
    ev,
    lease,
    pid_of,
    queued_behind,
    released_at,
    runner,
    send,
)

THRESHOLD = timedelta(seconds=300)
OLD = timedelta(minutes=10)


async def reap(conn: Conn, limit: int = 100) -> tuple[int, int]:
    return await runner_release.reap_stale_runners(conn, threshold=THRESHOLD, limit=limit)


async def state_of(conn: Conn, runner_id: UUID) -> tuple[str, str | None]:
    row = await conn.fetchrow("SELECT state, reason FROM runner_instances WHERE id = $1", runner_id)
    assert row is not None
    return row["state"], row["reason"]


async def test_p106_stale_runners_fail_and_release_their_units(conn: Conn, workspace: UUID) -> None:
    scoped = await provisioner(conn, workspace)
    installation = await provisioner(conn)
    assigned = await reservation(conn, workspace_id=workspace, provisioner_id=scoped.id)
    intended = await reservation(conn, workspace_id=workspace, provisioner_id=installation.id)
    a = await runner(
        conn, scoped.id, workspace_id=workspace, reservation_id=assigned, assigned=True, age=OLD
    )
    b = await runner(
        conn,
        installation.id,
        provider_runner_id=None,
        intended_reservation_id=intended,
        state="starting",
        age=OLD,
    )

    assert await reap(conn) == (2, 2)

    assert await state_of(conn, a) == ("failed", "stale-provisioner")
    assert await state_of(conn, b) == ("failed", "stale-provisioner")
    assert await count_of(conn, assigned) is None and await count_of(conn, intended) is None
    failed_at = await conn.fetchval("SELECT failed_at FROM runner_instances WHERE id = $1", b)
    assert failed_at is not None and await released_at(conn, b) is not None


async def test_p107_fresh_seen_finished_leased_and_session_active_rows_are_skipped(
    conn: Conn, workspace: UUID
) -> None:
    prov = await provisioner(conn, workspace)
    seen = await provisioner(conn, workspace)
    await conn.execute("UPDATE provisioner_tokens SET last_seen_at = now() WHERE id = $1", seen.id)
    fresh = await runner(conn, prov.id, workspace_id=workspace)
    live_provisioner = await runner(conn, seen.id, workspace_id=workspace, age=OLD)
    finished = await runner(conn, prov.id, workspace_id=workspace, state="stopped", age=OLD)
    leased = await runner(conn, prov.id, workspace_id=workspace, age=OLD)
    await lease(conn, workspace, prov.id, await pid_of(conn, leased))
    with_session = await runner(conn, prov.id, workspace_id=workspace, age=OLD)
    await conn.execute(
        """
        INSERT INTO runner_sessions (workspace_id, registration_token_id, registration_token_kind,
            labels, max_claims, provisioner_id, provider_runner_id)
        VALUES ($1, $2, 'ephemeral', '{linux}', 1, $3, $4)
        """,
        workspace,
        uuid.uuid4(),
        prov.id,
        await pid_of(conn, with_session),
    )
    stale = await runner(conn, prov.id, workspace_id=workspace, age=OLD)

    assert await reap(conn) == (1, 0)

    assert (await state_of(conn, stale))[0] == "failed"
    for skipped in (fresh, live_provisioner, leased, with_session):
        assert (await state_of(conn, skipped))[0] == "running"
    assert (await state_of(conn, finished))[0] == "stopped"


async def test_p108_stale_terminal_session_linked_rows_are_drained(
    conn: Conn, workspace: UUID
) -> None:
    prov = await provisioner(conn, workspace)
    res = await reservation(conn, workspace_id=workspace, provisioner_id=prov.id, count=2)
    drained = await runner(
        conn,
        prov.id,
        workspace_id=workspace,
        reservation_id=res,
        runner_session_id=uuid.uuid4(),
        state="terminated",
        age=OLD,
    )
    stale = await runner(conn, prov.id, workspace_id=workspace, age=OLD)

    assert await reap(conn) == (1, 0)  # stale active rows first: no drain in that run
    assert await released_at(conn, drained) is None
    assert await reap(conn) == (0, 1)
    assert await released_at(conn, drained) is not None and await count_of(conn, res) == 1
    assert (await state_of(conn, stale))[0] == "failed"
    assert await reap(conn) == (0, 0)


async def test_p109_the_limit_bounds_each_run(conn: Conn, workspace: UUID) -> None:
    prov = await provisioner(conn, workspace)
    for _ in range(3):
        await runner(conn, prov.id, workspace_id=workspace, age=OLD)
    assert await reap(conn, limit=2) == (2, 0)
    assert await reap(conn, limit=2) == (1, 0)
    assert await reap(conn, limit=2) == (0, 0)


async def test_p48_terminal_report_and_reaper_on_one_workspace_lock_release_once(
    conn: Conn,
    pool: asyncpg.Pool,
    observer: asyncpg.Connection,
    database_url: str,
    workspace: UUID,
) -> None:
    prov = await provisioner(conn, workspace)
    res = await reservation(conn, workspace_id=workspace, provisioner_id=prov.id, count=3)
    rid = await runner(conn, prov.id, workspace_id=workspace, reservation_id=res, age=OLD)
    pid = await pid_of(conn, rid)

    async def reaper(c: Conn) -> int:
        return (await reap(c))[1]

    async def terminal_report(c: Conn) -> int:
        return (await send(c, prov, ev(pid, FAILED))).reservations_released

    # Either order: whoever comes second finds the unit already given back.
    orders = ((reaper, terminal_report), (terminal_report, reaper))
    for (first, second), left in zip(orders, (2, 1), strict=True):
        await conn.execute(
            "UPDATE runner_instances SET state = 'running', reservation_released_at = NULL,"
            " reported_at = now() - interval '10 minutes', updated_at = now() - interval"
            " '10 minutes' WHERE id = $1",
            rid,
        )
        holder = holding_lock(database_url, locks.workspace(workspace))
        assert sorted(await queued_behind(pool, observer, holder, first, second)) == [0, 1]
        assert await count_of(conn, res) == left
