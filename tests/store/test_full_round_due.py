"""The sweep's full-round check (store/demand_sweep.py `full_round_due`) against PostgreSQL:
one statement says, for every session of a replica, whether a round could find anything to act
on: a pending job where it serves (its workspace; any workspace for installation scope), a live
reservation or an active runner instance of its own. Anything else (another provisioner's
reservation, an expired one, a terminated runner, a workspace_demand row left behind by a
claim) leaves an idle session idle, so its full round costs nothing."""

from __future__ import annotations

import uuid
from datetime import timedelta

from controlplane.domain.provisioners import Provisioner
from controlplane.store.demand_sweep import SweptSession, full_round_due
from controlplane.store.pool import Conn
from tests import provisioning as rows


async def due(conn: Conn, *provisioners: Provisioner) -> list[bool]:
    return await full_round_due(conn, [SweptSession(p.id, p.workspace_id) for p in provisioners])


async def test_no_session_reads_nothing(conn: Conn) -> None:
    assert await full_round_due(conn, []) == []


async def test_pending_jobs_make_the_sessions_that_serve_them_due(conn: Conn) -> None:
    w1, w2 = uuid.uuid4(), uuid.uuid4()
    p1, p2, inst = (
        await rows.provisioner(conn, w1),
        await rows.provisioner(conn, w2),
        await rows.provisioner(conn),
    )
    assert await due(conn, p1, p2, inst) == [False, False, False]
    # A job in w1 whose notification was lost: its workspace's session and every installation
    # session (eligibility aside) could serve it.
    [job] = await rows.pending_jobs(conn, w1, ("gpu",))
    assert await due(conn, p1, p2, inst) == [True, False, True]
    # Claimed: w1's workspace_demand row stays until a walk prunes it, but nothing is pending.
    await conn.execute("DELETE FROM pending_jobs WHERE job_execution_id = $1", job)
    assert await conn.fetchval("SELECT count(*) FROM workspace_demand") == 1
    assert await due(conn, p1, p2, inst) == [False, False, False]


async def test_own_live_reservations_and_active_runners_make_a_session_due(conn: Conn) -> None:
    w1, w2 = uuid.uuid4(), uuid.uuid4()
    p1, p2 = await rows.provisioner(conn, w1), await rows.provisioner(conn, w2)
    other = await rows.provisioner(conn, w1)
    # Another provisioner's grant in p1's workspace, and p2's own grant expired: nothing.
    await rows.reservation(conn, workspace_id=w1, provisioner_id=other.id)
    expired = await rows.reservation(
        conn, workspace_id=w2, provisioner_id=p2.id, ttl=timedelta(seconds=-1)
    )
    assert await due(conn, p1, p2) == [False, False]
    # p2's grant is live again: it expires (a deadline its actor keeps) and may be launched.
    await conn.execute(
        "UPDATE reservations SET expires_at = now() + interval '1 minute' WHERE id = $1", expired
    )
    assert await due(conn, p1, p2) == [False, True]
    # p1's runner: active, it may be bound, timed out, counted for a warm pool; ended, not.
    runner = await rows.runner(conn, p1.id, state="starting", workspace_id=w1)
    assert await due(conn, p1) == [True]
    await conn.execute("UPDATE runner_instances SET state = 'terminated' WHERE id = $1", runner)
    assert await due(conn, p1) == [False]
