"""A run timeout is a cancel by the server (docs/policies.md Q-67, Q-68): at the deadline the
leader stamps the lease's `cancellation_requested_at` and notifies `cp_cancel`, so a provisioned
runner's provisioner is told to terminate it as after an orchestrator's cancel; against real
PostgreSQL."""

from __future__ import annotations

from datetime import timedelta
from uuid import UUID

import anyio
import asyncpg

from controlplane.store import deadlines, leases
from controlplane.store.pool import Conn
from tests import provisioning as rows
from tests.factories import holding
from tests.store.test_demand_store import busy_runner, cancelled, lease, poll

GRACE = timedelta(seconds=60)


async def with_timeout(conn: Conn, execution: UUID, seconds: int) -> None:
    await conn.execute(
        "UPDATE running_jobs SET timeout_seconds = $2 WHERE job_execution_id = $1",
        execution,
        seconds,
    )


async def test_q67_at_the_run_deadline_the_provisioner_is_told_to_terminate_the_runner(
    conn: Conn, workspace: UUID, database_url: str
) -> None:
    provisioner = await rows.provisioner(conn, workspace)
    for name in ("r-late", "r-on-time", "r-no-timeout"):
        await busy_runner(conn, workspace, provisioner, name)
    # Past its deadline by 30 s (within the grace: the leader does not end it yet).
    late = await lease(
        conn, workspace, provisioner, "r-late", started=timedelta(seconds=630), cancelled=False
    )
    await with_timeout(conn, late, 600)
    on_time = await lease(
        conn, workspace, provisioner, "r-on-time", started=timedelta(minutes=1), cancelled=False
    )
    await with_timeout(conn, on_time, 3600)
    await lease(
        conn, workspace, provisioner, "r-no-timeout", started=timedelta(days=9), cancelled=False
    )
    assert (await poll(conn, provisioner, workspace)).terminate_intents == ()

    heard: list[str] = []
    listener = await asyncpg.connect(database_url)
    try:
        await listener.add_listener(
            leases.CANCEL_CHANNEL, lambda _c, _pid, _channel, payload: heard.append(str(payload))
        )
        assert await deadlines.time_out(conn, GRACE) == []  # within the grace: kept
        with anyio.fail_after(10):
            while not heard:
                await listener.execute("SELECT 1")  # delivers what arrived
    finally:
        await listener.close()
    assert heard == [str(late)]
    stamped = await conn.fetchval(
        "SELECT cancellation_requested_at = started_at + interval '600 seconds'"
        " FROM running_jobs WHERE job_execution_id = $1",
        late,
    )
    assert stamped is True
    assert (await poll(conn, provisioner, workspace)).terminate_intents == cancelled("r-late")
    assert await deadlines.cancel_at_deadline(conn) == 0  # once per lease
    # Past the grace the leader ends it `timed_out`, as before.
    await conn.execute(
        "UPDATE running_jobs SET started_at = now() - interval '700 seconds'"
        " WHERE job_execution_id = $1",
        late,
    )
    ended = await deadlines.time_out(conn, GRACE)
    assert [e.identity.job_execution_id for e in ended] == [late]
    assert ended[0].newly_ended and ended[0].cancellation_requested


async def test_q68_a_lease_row_held_is_not_waited_for_and_is_stamped_at_the_next_round(
    conn: Conn, workspace: UUID, database_url: str
) -> None:
    provisioner = await rows.provisioner(conn, workspace)
    await busy_runner(conn, workspace, provisioner, "r-late")
    late = await lease(
        conn, workspace, provisioner, "r-late", started=timedelta(seconds=630), cancelled=False
    )
    await with_timeout(conn, late, 600)
    held = "SELECT 1 FROM running_jobs WHERE job_execution_id = $1 FOR UPDATE"
    async with holding(database_url, held, late):
        with anyio.fail_after(10):
            assert await deadlines.cancel_at_deadline(conn) == 0
    assert await deadlines.cancel_at_deadline(conn) == 1
    assert (await poll(conn, provisioner, workspace)).terminate_intents == cancelled("r-late")
