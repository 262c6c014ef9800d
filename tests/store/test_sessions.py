"""Session rows and their garbage collection (J-88 row part, J-97 .. J-99)."""

from __future__ import annotations

from datetime import timedelta
from uuid import UUID, uuid4

import anyio
import asyncpg

from controlplane.domain.labels import canonicalise
from controlplane.store import claiming, queue, sessions
from controlplane.store.pool import Conn
from tests.factories import manual_session, new_job

MANUAL_RETENTION = timedelta(days=30)
CAPPED_RETENTION = timedelta(days=7)


async def collect(conn: Conn, limit: int = 1000) -> int:
    return await sessions.collect_garbage(
        conn, manual_retention=MANUAL_RETENTION, capped_retention=CAPPED_RETENTION, limit=limit
    )


async def session_of_kind(conn: Conn, workspace: UUID, kind: str, age_days: float) -> UUID:
    linked = kind != "manual"
    created = await sessions.create(
        conn,
        workspace_id=workspace,
        registration_token_id=uuid4(),
        kind=kind,
        labels=("linux",),
        max_claims=1 if linked else None,
        runner_instance_id=uuid4() if kind == "activation" else None,
        provisioner_id=uuid4() if linked else None,
        provider_runner_id=f"runner-{uuid4()}" if linked else None,
    )
    await set_age(conn, created.id, age_days)
    return created.id


async def set_age(conn: Conn, session_id: UUID, days: float) -> None:
    await conn.execute(
        "UPDATE runner_sessions SET created_at = now() - make_interval(secs => $2) WHERE id = $1",
        session_id,
        days * 86400,
    )


async def surviving(conn: Conn) -> set[UUID]:
    return {row["id"] for row in await conn.fetch("SELECT id FROM runner_sessions")}


async def test_j88_manual_session_row_stores_canonical_labels_uncapped_and_unlinked(
    conn: Conn, workspace: UUID
) -> None:
    created = await sessions.create(
        conn,
        workspace_id=workspace,
        registration_token_id=uuid4(),
        kind="manual",
        labels=canonicalise([" Linux ", "x64", "linux"]),
    )

    row = await conn.fetchrow("SELECT * FROM runner_sessions WHERE id = $1", created.id)
    assert row is not None
    assert row["labels"] == ["linux", "x64"]
    assert row["registration_token_kind"] == "manual"
    assert (row["max_claims"], row["claims_used"], row["revoked_at"]) == (None, 0, None)
    assert (row["runner_instance_id"], row["provisioner_id"], row["provider_runner_id"]) == (
        None,
        None,
        None,
    )
    assert (row["tool_capabilities"], row["tool_capabilities_reported_at"]) == (None, None)
    assert created.labels == ("linux", "x64")
    assert created.max_claims is None


async def test_j97_gc_applies_each_kinds_retention_from_creation(
    conn: Conn, workspace: UUID
) -> None:
    doomed = {
        await session_of_kind(conn, workspace, "manual", 31),
        await session_of_kind(conn, workspace, "ephemeral", 8),
        await session_of_kind(conn, workspace, "activation", 8),
    }
    kept = {
        await session_of_kind(conn, workspace, "manual", 29),
        await session_of_kind(conn, workspace, "manual", 10),  # past 7 d: judged as manual
        await session_of_kind(conn, workspace, "ephemeral", 6),
        await session_of_kind(conn, workspace, "activation", 6),
    }
    # Recent activity does not save a session: age counts from creation.
    await conn.execute("UPDATE runner_sessions SET updated_at = now()")

    assert await collect(conn) == len(doomed)

    assert await surviving(conn) == kept
    assert await collect(conn) == 0


async def test_j98_gc_keeps_an_expired_session_that_still_holds_a_lease(
    conn: Conn, workspace: UUID
) -> None:
    session = await manual_session(conn, workspace)
    await queue.enqueue(conn, [new_job(workspace)])
    assert await claiming.claim(conn, session) is not None
    await set_age(conn, session.runner_session_id, 45)

    assert await collect(conn) == 0

    assert await surviving(conn) == {session.runner_session_id}


async def test_j99_gc_limit_deletes_the_oldest_first(conn: Conn, workspace: UUID) -> None:
    # Created youngest-first, so the oldest have the highest ids and come last on disk.
    youngest = await session_of_kind(conn, workspace, "manual", 31)
    oldest = await session_of_kind(conn, workspace, "manual", 40)
    middle = await session_of_kind(conn, workspace, "manual", 35)
    assert oldest != middle

    assert await collect(conn, limit=2) == 2

    assert await surviving(conn) == {youngest}


async def test_gc_skips_a_session_whose_claim_is_in_flight(
    conn: Conn, pool: asyncpg.Pool, workspace: UUID
) -> None:
    """Ours: GC skips (SKIP LOCKED) instead of failing on the foreign key after waiting."""
    session = await manual_session(conn, workspace)
    await queue.enqueue(conn, [new_job(workspace)])
    await set_age(conn, session.runner_session_id, 45)

    async with pool.acquire() as claimer:
        with anyio.fail_after(10):
            async with claimer.transaction():
                assert await claiming.claim(claimer, session) is not None
                # The uncommitted lease holds a key-share lock on the session row.
                assert await collect(conn) == 0

    assert await collect(conn) == 0
    assert await surviving(conn) == {session.runner_session_id}
