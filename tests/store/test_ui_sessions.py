"""The operator pages' sessions and one-time links against PostgreSQL: only digests stored, ended
sessions not found, a link spent once even by two browsers at the same instant, audit entries."""

from __future__ import annotations

import hashlib
from datetime import timedelta
from uuid import UUID, uuid4

import anyio
import asyncpg

from controlplane.store import claiming, credentials, events, queue, ui_reads, ui_sessions
from controlplane.store.pool import Conn
from tests.factories import manual_session, minutes_ago, new_job, wait_until_blocked

TTL = timedelta(hours=1)


async def admin_key(conn: Conn) -> UUID:
    key, _raw = await credentials.create_api_key(conn, kind="admin", name="operator")
    return key.id


async def test_a_session_is_stored_as_its_digest_and_found_by_its_secret(conn: Conn) -> None:
    key = await admin_key(conn)
    secret = await ui_sessions.create(conn, key, TTL)
    stored = await conn.fetchval("SELECT token_sha256 FROM ui_sessions")
    assert stored == hashlib.sha256(secret.encode()).hexdigest() and secret not in stored
    found = await ui_sessions.by_secret(conn, secret)
    assert found is not None and found.key.id == key
    # The key read with the session is the key as its own lookup reads it, role included.
    assert found.key == await credentials.api_key_by_id(conn, key)
    assert found.session_id == await conn.fetchval("SELECT id FROM ui_sessions")
    assert await ui_sessions.by_secret(conn, secret + "x") is None


async def test_expired_and_signed_out_sessions_are_not_found(conn: Conn) -> None:
    key = await admin_key(conn)
    expired = await ui_sessions.create(conn, key, TTL)
    await conn.execute(
        "UPDATE ui_sessions SET expires_at = now() - interval '1 second' WHERE token_sha256 = $1",
        ui_sessions.digest(expired),
    )
    assert await ui_sessions.by_secret(conn, expired) is None
    left = await ui_sessions.create(conn, key, TTL)
    found = await ui_sessions.by_secret(conn, left)
    assert found is not None
    await ui_sessions.sign_out(conn, found.session_id)
    assert await ui_sessions.by_secret(conn, left) is None


async def test_a_new_session_clears_the_keys_sessions_ended_a_day_ago(conn: Conn) -> None:
    key = await admin_key(conn)
    old = await ui_sessions.create(conn, key, TTL)
    recent = await ui_sessions.create(conn, key, TTL)
    await conn.execute(
        "UPDATE ui_sessions SET expires_at = now() - interval '2 days' WHERE token_sha256 = $1",
        ui_sessions.digest(old),
    )
    await conn.execute(
        "UPDATE ui_sessions SET expires_at = now() - interval '1 hour' WHERE token_sha256 = $1",
        ui_sessions.digest(recent),
    )
    await ui_sessions.create(conn, key, TTL)
    kept = {row["token_sha256"] for row in await conn.fetch("SELECT token_sha256 FROM ui_sessions")}
    assert ui_sessions.digest(old) not in kept and ui_sessions.digest(recent) in kept
    assert len(kept) == 2


async def test_a_link_signs_in_once_and_not_after_it_expired(conn: Conn) -> None:
    key = await admin_key(conn)
    link = await ui_sessions.create_link(conn, key, TTL)
    assert await ui_sessions.use_link(conn, link) == key
    assert await ui_sessions.use_link(conn, link) is None
    late = await ui_sessions.create_link(conn, key, TTL)
    await conn.execute("UPDATE ui_sign_in_links SET expires_at = now() - interval '1 second'")
    assert await ui_sessions.use_link(conn, late) is None


async def test_two_browsers_spending_one_link_at_once_get_one_session(
    conn: Conn, pool: asyncpg.Pool, database_url: str, observer: asyncpg.Connection
) -> None:
    """A second connection spends the link and holds its row, uncommitted; a `use_link` of the
    same link waits on that row, and once the first commits it finds the link spent."""
    key = await admin_key(conn)
    link = await ui_sessions.create_link(conn, key, TTL)
    got: list[UUID | None] = []
    first = await asyncpg.connect(database_url)
    try:
        spending = first.transaction()
        await spending.start()
        spent = await first.fetchval(
            """
            UPDATE ui_sign_in_links SET used_at = now()
            WHERE token_sha256 = $1 RETURNING api_key_id
            """,
            ui_sessions.digest(link),
        )
        assert spent == key
        async with pool.acquire() as second, anyio.create_task_group() as group:

            async def spend() -> None:
                got.append(await ui_sessions.use_link(second, link))

            group.start_soon(spend)
            await wait_until_blocked(observer, second.get_server_pid())
            assert got == []
            await spending.commit()
    finally:
        await first.close()
    assert got == [None]


async def test_audit_entries_go_to_the_feed_without_a_secret(conn: Conn) -> None:
    key_id = await admin_key(conn)
    key = await credentials.api_key_by_id(conn, key_id)
    assert key is not None
    await ui_sessions.audit(conn, "signed_in", key, details={"how": "admin key"})
    (entry,) = await events.read(conn)
    assert entry.event_type == "ui.signed_in" and entry.workspace_id is None
    assert entry.payload == {
        "api_key_id": str(key_id),
        "api_key_name": "operator",
        "how": "admin key",
    }


async def test_a_queue_sample_counts_pending_and_the_median_pickup_per_workspace(
    conn: Conn,
) -> None:
    busy, quiet, other = uuid4(), uuid4(), uuid4()
    await queue.enqueue(conn, [new_job(busy) for _ in range(3)] + [new_job(quiet)])
    runner = await manual_session(conn, other)
    for minutes in (1, 3, 20):  # queued that long ago, claimed now
        await queue.enqueue(conn, [new_job(other, queued_at=minutes_ago(minutes))])
        await claiming.claim(conn, runner)
    at, found = await ui_reads.queue_sample(conn, timedelta(minutes=1), limit=10)
    by_workspace = {sample.workspace_id: sample for sample in found}
    assert [sample.workspace_id for sample in found][:2] == [busy, quiet]  # most pending first
    assert (by_workspace[busy].pending, by_workspace[busy].pickup_seconds) == (3, None)
    assert by_workspace[other].pending == 0
    pickup = by_workspace[other].pickup_seconds
    assert pickup is not None and 170 < pickup < 200  # the median: three minutes
    assert at.tzinfo is not None
