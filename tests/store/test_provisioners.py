from __future__ import annotations

import uuid
from uuid import UUID

import anyio
import asyncpg
import pytest

from controlplane.domain import tokens
from controlplane.domain.provisioners import Fence, Provisioner
from controlplane.errors import RunnerSessionExhausted
from controlplane.store import claiming, locks, provisioner_sessions, provisioners, queue
from controlplane.store.pool import Conn
from tests.factories import capped_session, new_job, wait_until_blocked
from tests.provisioning import reservation
from tests.store.test_runner_reports import runner


async def test_j100_revoking_a_provisioner_revokes_only_its_unused_sessions(
    conn: Conn, workspace: UUID
) -> None:
    created, _ = await provisioners.create(conn, name="p", workspace_id=workspace)
    other, _ = await provisioners.create(conn, name="q", workspace_id=workspace)
    used = await capped_session(conn, workspace, provisioner_id=created.id, provider_runner_id="a")
    unused = await capped_session(
        conn, workspace, provisioner_id=created.id, provider_runner_id="b"
    )
    elsewhere = await capped_session(
        conn, workspace, provisioner_id=other.id, provider_runner_id="c"
    )
    await queue.enqueue(conn, [new_job(workspace)])
    assert await claiming.claim(conn, used) is not None

    await provisioners.revoke(conn, created.id)

    revoked = "SELECT revoked_at IS NOT NULL FROM runner_sessions WHERE id = $1"
    assert await conn.fetchval(revoked, used.runner_session_id) is False
    assert await conn.fetchval(revoked, unused.runner_session_id) is True
    assert await conn.fetchval(revoked, elsewhere.runner_session_id) is False
    await queue.enqueue(conn, [new_job(workspace)])
    with pytest.raises(RunnerSessionExhausted):
        await claiming.claim(conn, unused)


async def test_scope_and_workspace_agree_in_the_database(conn: Conn) -> None:
    with pytest.raises(asyncpg.CheckViolationError):
        await conn.execute(
            """
            INSERT INTO provisioner_tokens (scope, workspace_id, name, token_sha256, display_prefix)
            VALUES ('workspace', NULL, 'x', repeat('a', 64), 'cp_pt_x')
            """
        )


# The revocation cascade (spec 4.13) ----------------------------------------------------------


async def _boot_credentials(conn: Conn, provisioner_id: UUID, runner_id: UUID) -> None:
    """A bootstrap token, an open control session and an unconsumed activation token."""
    for table, kind, extra in (
        ("runner_bootstrap_tokens", tokens.Kind.BOOTSTRAP, {"provisioner_id": provisioner_id}),
        ("runner_activation_tokens", tokens.Kind.ACTIVATION, {}),
    ):
        token = tokens.new_opaque(kind)
        columns = ["runner_instance_id", "token_sha256", "display_prefix", "expires_at", *extra]
        values = [runner_id, token.sha256, token.display_prefix, *extra.values()]
        placeholders = ["$1", "$2", "$3", "now() + interval '5 minutes'"]
        placeholders += [f"${i}" for i in range(4, 4 + len(extra))]
        await conn.execute(
            f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join(placeholders)})",  # noqa: S608 -- table and column names from the literal tuple above
            *values,
        )
    session = tokens.new_opaque(tokens.Kind.CONTROL_SESSION)
    await conn.execute(
        """
        INSERT INTO runner_control_sessions
            (runner_instance_id, provisioner_id, token_sha256, display_prefix, expires_at)
        VALUES ($1, $2, $3, $4, now() + interval '1 hour')
        """,
        runner_id,
        provisioner_id,
        session.sha256,
        session.display_prefix,
    )


async def test_s43_p133_revocation_cascades_to_what_the_provisioner_launched(
    conn: Conn, workspace: UUID
) -> None:
    created, _ = await provisioners.create(conn, name="p", workspace_id=workspace)
    other, _ = await provisioners.create(conn, name="q", workspace_id=workspace)
    res = await reservation(conn, workspace_id=workspace, provisioner_id=created.id, count=3)
    booting = await runner(
        conn, created.id, intended_reservation_id=res, state="starting", control_session=None
    )
    activated = await runner(
        conn,
        created.id,
        workspace_id=workspace,
        reservation_id=res,
        runner_session_id=uuid.uuid4(),
        control_session=None,
    )
    finished = await runner(conn, created.id, state="failed", control_session=None)
    theirs = await runner(conn, other.id, control_session=None)
    for runner_id, owner in ((booting, created.id), (activated, created.id), (theirs, other.id)):
        await _boot_credentials(conn, owner, runner_id)

    await provisioners.revoke(conn, created.id)

    instances = {
        row["id"]: row
        for row in await conn.fetch(
            "SELECT id, state, terminated_at, reservation_released_at FROM runner_instances"
        )
    }
    assert instances[booting]["state"] == "terminated"
    assert instances[booting]["terminated_at"] is not None
    assert instances[booting]["reservation_released_at"] is not None
    assert await conn.fetchval("SELECT count FROM reservations WHERE id = $1", res) == 2
    assert instances[activated]["state"] == "running"  # it has a runner session
    assert instances[finished]["state"] == "failed"  # finished rows keep their own end
    assert instances[theirs]["state"] == "running"
    boot = await conn.fetch(
        "SELECT runner_instance_id, revoked_at IS NOT NULL AS revoked FROM runner_bootstrap_tokens"
    )
    assert {r["runner_instance_id"]: r["revoked"] for r in boot} == {
        booting: True,
        activated: True,
        theirs: False,
    }
    control = await conn.fetch(
        "SELECT runner_instance_id, close_reason FROM runner_control_sessions"
    )
    assert {r["runner_instance_id"]: r["close_reason"] for r in control} == {
        booting: "provisioner-revoked",
        activated: "provisioner-revoked",
        theirs: None,
    }
    activation = await conn.fetch(
        "SELECT runner_instance_id, revoked_at IS NOT NULL AS revoked FROM runner_activation_tokens"
    )
    assert {r["runner_instance_id"]: r["revoked"] for r in activation} == {
        booting: True,
        activated: True,
        theirs: False,
    }


async def test_s44_after_revocation_unclaimed_sessions_are_exhausted_claimed_ones_kept(
    conn: Conn, workspace: UUID
) -> None:
    created, _ = await provisioners.create(conn, name="p", workspace_id=workspace)
    claimed = await capped_session(
        conn, workspace, provisioner_id=created.id, provider_runner_id="a"
    )
    unclaimed = await capped_session(
        conn, workspace, provisioner_id=created.id, provider_runner_id="b"
    )
    await queue.enqueue(conn, [new_job(workspace)])
    assert await claiming.claim(conn, claimed) is not None

    await provisioners.revoke(conn, created.id)

    revoked = "SELECT revoked_at FROM runner_sessions WHERE id = $1"
    assert await conn.fetchval(revoked, claimed.runner_session_id) is None
    await queue.enqueue(conn, [new_job(workspace)])
    with pytest.raises(RunnerSessionExhausted):
        await claiming.claim(conn, unclaimed)


async def test_s45_re_revoking_keeps_the_original_revocation_and_cascades_nothing(
    conn: Conn, workspace: UUID
) -> None:
    created, _ = await provisioners.create(conn, name="p", workspace_id=workspace)
    runner_id = await runner(conn, created.id, control_session=None)
    first = await provisioners.revoke(conn, created.id)
    terminated_at = await conn.fetchval(
        "SELECT terminated_at FROM runner_instances WHERE id = $1", runner_id
    )

    second = await provisioners.revoke(conn, created.id)

    assert first.revoked_at is not None and second.revoked_at == first.revoked_at
    assert (
        await conn.fetchval("SELECT terminated_at FROM runner_instances WHERE id = $1", runner_id)
        == terminated_at
    )


async def test_revocation_waits_for_a_session_write_then_closes_it(
    pool: asyncpg.Pool, conn: Conn, observer: asyncpg.Connection, workspace: UUID
) -> None:
    """A control session's write holds its fencing row FOR SHARE, then takes the workspace lock.
    Revocation bumps that row first, so it waits for the write without holding the workspace
    lock the write needs next: no deadlock, and the write commits under its generation."""
    created, _ = await provisioners.create(conn, name="fleet", workspace_id=workspace)
    generation = await provisioner_sessions.take_over(conn, created.id, uuid.uuid4())
    assert generation is not None
    revoked: list[Provisioner] = []
    async with pool.acquire() as writer, pool.acquire() as revoker:

        async def revoke() -> None:
            revoked.append(await provisioners.revoke(revoker, created.id))

        async with anyio.create_task_group() as group, writer.transaction():
            fence = await provisioner_sessions.hold_fence(writer, created.id, generation)
            assert fence is Fence.CURRENT
            group.start_soon(revoke)
            await wait_until_blocked(observer, revoker.get_server_pid())
            # The write goes on: the workspace lock is free (revocation has not taken it).
            assert await writer.fetchval(
                "SELECT pg_try_advisory_xact_lock($1)", locks.workspace(workspace)
            )
        # Our commit let the revocation through.
    assert revoked[0].revoked_at is not None
    after = await provisioner_sessions.fence(conn, created.id, generation)
    assert after is Fence.REVOKED
