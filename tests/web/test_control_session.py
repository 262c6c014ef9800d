"""The provisioner control session over a real WebSocket against the in-process daemon."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from uuid import UUID

import anyio
import asyncpg
import pytest
from websockets.exceptions import ConnectionClosed

from controlplane import app
from controlplane.store import provisioners
from tests.web import conftest
from tests.web.conftest import Api, run_daemon
from tests.web.control_client import (
    closed_with,
    hello,
    open_session,
    receive,
    registry,
    send,
)

pytestmark = pytest.mark.anyio


async def generation(db: asyncpg.Connection, provisioner_id: UUID) -> int | None:
    found: int | None = await db.fetchval(
        "SELECT generation FROM provisioner_sessions WHERE provisioner_id = $1", provisioner_id
    )
    return found


async def wait_for(condition: Callable[[], Awaitable[bool]]) -> None:
    with anyio.fail_after(10):
        while not await condition():
            await anyio.sleep(0.01)


@pytest.fixture
async def token(db: asyncpg.Connection) -> tuple[UUID, str]:
    created, raw = await provisioners.create(db, name="fleet", workspace_id=None)
    return created.id, raw


@pytest.fixture
async def other(database_url: str) -> AsyncIterator[app.Daemon]:
    """A second replica on the same database."""
    async for running in run_daemon(database_url, conftest.test_settings()):
        yield running


async def test_refused_tokens_get_their_close_codes(api: Api, db: asyncpg.Connection) -> None:
    revoked, revoked_raw = await provisioners.create(db, name="old", workspace_id=None)
    await provisioners.revoke(db, revoked.id)
    _, expired_raw = await provisioners.create(
        db, name="late", workspace_id=None, ttl=timedelta(seconds=-1)
    )
    cases = [
        (None, 4401, "unauthorized"),
        ("cp_pt_nonsense", 4401, "unauthorized"),
        (api.orchestrator_key, 4401, "unauthorized"),
        (revoked_raw, 4403, "provisioner-token-revoked"),
        (expired_raw, 4404, "provisioner-token-expired"),
    ]
    for raw, code, reason in cases:
        ws = await open_session(api.daemon, raw)
        assert await closed_with(ws) == (code, reason)
    assert await db.fetchval("SELECT count(*) FROM provisioner_sessions") == 0


async def test_hello_welcome_then_ping_pong(
    api: Api, db: asyncpg.Connection, token: tuple[UUID, str]
) -> None:
    provisioner_id, raw = token
    ws = await open_session(api.daemon, raw)
    welcome = await hello(ws, "first")
    assert welcome["request_id"] == "first"
    assert welcome["generation"] == 1
    UUID(welcome["session_id"])
    assert welcome["idle_timeout_seconds"] > 0
    assert await generation(db, provisioner_id) == 1
    await send(ws, {"type": "ping", "request_id": "p1"})
    assert await receive(ws) == {"type": "pong", "request_id": "p1"}
    await ws.close()
    await wait_for(lambda: _none_live(api.daemon, provisioner_id))


async def _none_live(daemon: app.Daemon, provisioner_id: UUID) -> bool:
    return not registry(daemon).sessions(provisioner_id)


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        ('{"type": "hello", "protocol_version": 2, "request_id": "h"}', 4426),
        ("{not json", 4400),
        ('{"type": "subscribe", "request_id": "h"}', 4400),
        ('{"type": "hello", "protocol_version": 1, "request_id": "h", "extra": 1}', 4400),
        ('{"type": "hello", "protocol_version": "1", "request_id": "h"}', 4400),
        ('{"type": "hello", "protocol_version": 1}', 4400),
        (b'{"type": "hello", "protocol_version": 1, "request_id": "h"}', 4400),
        ('{"type": "ping", "request_id": "p"}', 4412),
        ('{"type": "hello", "protocol_version": 1, "request_id": "' + "x" * 65536 + '"}', 1009),
    ],
    ids=[
        "wrong-version",
        "malformed-json",
        "unknown-type",
        "unknown-field",
        "wrong-field-type",
        "missing-field",
        "binary-frame",
        "before-hello",
        "oversized",
    ],
)
async def test_bad_first_frames_close_and_change_nothing(
    api: Api, db: asyncpg.Connection, token: tuple[UUID, str], frame: str | bytes, code: int
) -> None:
    provisioner_id, raw = token
    ws = await open_session(api.daemon, raw)
    await ws.send(frame)
    found, reason = await closed_with(ws)
    assert found == code, reason
    assert reason
    assert await generation(db, provisioner_id) is None


async def test_bad_frames_after_hello_close_it(
    api: Api, db: asyncpg.Connection, token: tuple[UUID, str]
) -> None:
    provisioner_id, raw = token
    ws = await open_session(api.daemon, raw)
    await hello(ws)
    await send(ws, {"type": "ping", "request_id": "p", "surprise": True})
    assert (await closed_with(ws))[0] == 4400
    ws = await open_session(api.daemon, raw)
    await hello(ws)
    await send(ws, {"type": "hello", "protocol_version": 1, "request_id": "again"})
    assert (await closed_with(ws))[0] == 4400
    assert await generation(db, provisioner_id) == 2


async def test_a_second_connection_takes_over(
    api: Api, db: asyncpg.Connection, token: tuple[UUID, str]
) -> None:
    provisioner_id, raw = token
    first = await open_session(api.daemon, raw)
    assert (await hello(first, "one"))["generation"] == 1
    second = await open_session(api.daemon, raw)
    assert (await hello(second, "two"))["generation"] == 2
    assert await closed_with(first) == (4409, "superseded")
    assert await generation(db, provisioner_id) == 2
    await send(second, {"type": "ping", "request_id": "still-here"})
    assert await receive(second) == {"type": "pong", "request_id": "still-here"}
    await wait_for(lambda: _live_generations(api.daemon, provisioner_id, [2]))
    await second.close()


async def _live_generations(daemon: app.Daemon, provisioner_id: UUID, expected: list[int]) -> bool:
    return [s.generation for s in registry(daemon).sessions(provisioner_id)] == expected


async def test_takeover_across_replicas(
    api: Api, other: app.Daemon, db: asyncpg.Connection, token: tuple[UUID, str]
) -> None:
    provisioner_id, raw = token
    first = await open_session(api.daemon, raw)
    await hello(first)
    second = await open_session(other, raw)
    assert (await hello(second))["generation"] == 2
    assert await closed_with(first) == (4409, "superseded")
    await send(second, {"type": "ping", "request_id": "p"})
    assert await receive(second) == {"type": "pong", "request_id": "p"}
    assert await generation(db, provisioner_id) == 2
    await second.close()


async def test_a_stale_generation_is_fenced_without_the_notification(
    api: Api, db: asyncpg.Connection, token: tuple[UUID, str]
) -> None:
    """A lost NOTIFY: the next message of the stale session checks the row and is refused."""
    provisioner_id, raw = token
    ws = await open_session(api.daemon, raw)
    await hello(ws)
    await db.execute(
        "UPDATE provisioner_sessions SET generation = generation + 1 WHERE provisioner_id = $1",
        provisioner_id,
    )
    await send(ws, {"type": "ping", "request_id": "p"})
    assert await closed_with(ws) == (4409, "superseded")


async def test_revocation_is_seen_by_the_next_message(
    api: Api, db: asyncpg.Connection, token: tuple[UUID, str]
) -> None:
    provisioner_id, raw = token
    ws = await open_session(api.daemon, raw)
    await hello(ws)
    await provisioners.revoke(db, provisioner_id)
    # The revocation's notification may close the session before the ping is even sent.
    with contextlib.suppress(ConnectionClosed):
        await send(ws, {"type": "ping", "request_id": "p"})
    assert await closed_with(ws) == (4403, "provisioner-token-revoked")


async def test_revocation_closes_a_live_session_at_once(
    api: Api, db: asyncpg.Connection, token: tuple[UUID, str]
) -> None:
    """No message needed: the revoke supersedes the session on its replica right away."""
    provisioner_id, raw = token
    ws = await open_session(api.daemon, raw)
    await hello(ws)
    revoked = await api.http.post(
        f"/v1/admin/provisioner-tokens/{provisioner_id}/revoke", headers=api.auth(api.admin_key)
    )
    assert revoked.status_code == 200
    assert await closed_with(ws) == (4403, "provisioner-token-revoked")


async def test_a_silent_session_is_closed(api: Api, token: tuple[UUID, str]) -> None:
    registry(api.daemon).idle_seconds = 0.3
    _, raw = token
    ws = await open_session(api.daemon, raw)
    assert await closed_with(ws) == (4408, "idle timeout")
    ws = await open_session(api.daemon, raw)
    await hello(ws)
    assert await closed_with(ws) == (4408, "idle timeout")
