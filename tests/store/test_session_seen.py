"""The batched last-seen stamp of a replica's pinged control sessions
(`provisioner_sessions.stamp_seen`) against PostgreSQL: one statement stamps every session still
holding its generation and a valid token, leaves out a stale generation and a revoked token, and
skips a row another transaction holds rather than wait for it."""

from __future__ import annotations

import uuid
from datetime import timedelta
from uuid import UUID

import anyio
from asyncpg import Pool

from controlplane.actors.control import ControlSessions, LastSeen, LocalSession, PoolSeen
from controlplane.domain.demand import Template
from controlplane.domain.provisioners import Fence
from controlplane.store import demand_inputs, job_views, provisioner_sessions, provisioners
from controlplane.store.pool import Conn
from tests import provisioning as rows
from tests.factories import holding


async def _session(conn: Conn) -> tuple[UUID, int]:
    made = await rows.provisioner(conn, uuid.uuid4())
    generation = await provisioner_sessions.take_over(conn, made.id, uuid.uuid4())
    assert generation is not None
    await conn.execute(
        "UPDATE provisioner_sessions SET last_seen_at = now() - interval '1 hour'"
        " WHERE provisioner_id = $1",
        made.id,
    )
    return made.id, generation


async def _fresh(conn: Conn, provisioner_id: UUID) -> bool:
    fresh = await conn.fetchval(
        "SELECT last_seen_at > now() - interval '1 minute' FROM provisioner_sessions"
        " WHERE provisioner_id = $1",
        provisioner_id,
    )
    assert isinstance(fresh, bool)
    return fresh


async def test_one_statement_stamps_the_current_sessions_only(conn: Conn) -> None:
    live, stale, revoked = await _session(conn), await _session(conn), await _session(conn)
    await conn.execute(
        "UPDATE provisioner_sessions SET generation = generation + 1 WHERE provisioner_id = $1",
        stale[0],
    )
    await provisioners.revoke(conn, revoked[0])
    assert await provisioner_sessions.stamp_seen(conn, [live, stale, revoked]) == {live}
    assert [await _fresh(conn, p) for p, _ in (live, stale, revoked)] == [True, False, False]
    # Left out: fenced alone, they tell why.
    assert await provisioner_sessions.fence(conn, *stale) is Fence.SUPERSEDED
    assert await provisioner_sessions.fence(conn, *revoked) is Fence.REVOKED
    assert await provisioner_sessions.stamp_seen(conn, []) == set()


async def test_a_row_held_by_a_session_write_is_skipped_not_waited_for(
    conn: Conn, database_url: str
) -> None:
    held, free = await _session(conn), await _session(conn)
    # A session's write holds its fencing row FOR SHARE until it commits (hold_fence).
    async with holding(
        database_url,
        "SELECT 1 FROM provisioner_sessions WHERE provisioner_id = $1 FOR SHARE",
        held[0],
    ):
        with anyio.fail_after(5):
            assert await provisioner_sessions.stamp_seen(conn, [held, free]) == {free}
    # Once the write committed, the session is still current: fenced alone, it is stamped.
    assert await provisioner_sessions.fence(conn, *held) is Fence.CURRENT
    assert await _fresh(conn, held[0])


async def test_a_dead_replicas_sessions_stop_counting_as_live(conn: Conn, pool: Pool) -> None:
    """Two replicas' batches over one database. Replica B dies: its sessions are stamped no more,
    so they stop counting as live once `provisioners.active_window_seconds` passes without a
    stamp (here: their stamps are an hour old), while replica A's one statement keeps all of
    its own live, however many they are."""
    workspace = uuid.uuid4()
    registries = {name: ControlSessions() for name in "AB"}
    labels = {"A": ("linux",), "B": ("gpu",)}
    for name, registry in registries.items():
        for _ in range(3):
            made = await rows.provisioner(conn, workspace)
            generation = await provisioner_sessions.take_over(conn, made.id, uuid.uuid4())
            assert generation is not None
            await demand_inputs.replace_templates(
                conn, made.id, workspace, [Template(f"t-{name}", labels[name], 1)]
            )
            local = LocalSession(made.id, uuid.uuid4(), generation, anyio.CancelScope())
            registry.register(local)
            local.seen = True  # pinged since the previous batch, on both replicas
    await conn.execute("UPDATE provisioner_sessions SET last_seen_at = now() - interval '1 hour'")
    window = timedelta(seconds=120)  # provisioners.active_window_seconds
    for name in "AB":
        assert (await job_views.takers(conn, workspace, labels[name], window)).templates == 0
    # Replica A's batch runs; replica B is gone and runs nothing.
    assert await LastSeen(registries["A"], PoolSeen(pool), every=10).flush() == []
    assert (await job_views.takers(conn, workspace, labels["A"], window)).templates == 3
    assert (await job_views.takers(conn, workspace, labels["B"], window)).templates == 0
