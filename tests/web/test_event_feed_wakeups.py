"""Held event-feed reads on an in-process daemon: the per-key cap, and re-reads only on wake-ups.

The daemon reaches PostgreSQL through a counting proxy (tests/pgproxy.py) where a test needs to
know how many times a read was re-run.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any

import anyio
import asyncpg
import httpx

from controlplane.store import credentials
from tests.pgproxy import pg_proxy
from tests.web import conftest as web

FEED_READ = "($3::uuid IS NULL OR workspace_id = $3)"  # store/events.py read()

daemon_context = contextlib.asynccontextmanager(web.run_daemon)


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def _api_key(database_url: str, workspace: uuid.UUID | None = None) -> str:
    conn = await asyncpg.connect(database_url)
    try:
        _, token = await credentials.create_api_key(
            conn, kind="orchestrator", name="o", workspace_id=workspace
        )
        return token
    finally:
        await conn.close()


async def _registration(database_url: str, workspace: uuid.UUID) -> str:
    conn = await asyncpg.connect(database_url)
    try:
        _, token = await credentials.create_manual_token(conn, workspace_id=workspace, name="r")
        return token
    finally:
        await conn.close()


async def _until(condition: Any) -> None:
    while not condition():
        await anyio.sleep(0.01)


async def test_held_reads_beyond_the_per_key_cap_get_429_and_a_client_that_leaves_frees_its_place(
    database_url: str,
) -> None:
    key, other_key = await _api_key(database_url), await _api_key(database_url)
    config = web.test_settings(events__held_reads_per_key=2)
    async with (
        daemon_context(database_url, config) as daemon,
        httpx.AsyncClient(base_url=daemon.address, timeout=30) as http,
    ):
        assert daemon.replica is not None
        feed = daemon.replica.feed

        async def hold(token: str, scope: anyio.CancelScope) -> None:
            with scope:
                await http.get("/v1/events?wait=8", headers=_bearer(token))

        leaving = anyio.CancelScope()
        async with anyio.create_task_group() as group:
            group.start_soon(hold, key, leaving)
            group.start_soon(hold, key, anyio.CancelScope())
            with anyio.fail_after(5):
                await _until(lambda: feed.held == 2)

            refused = await http.get("/v1/events?wait=8", headers=_bearer(key))
            assert refused.status_code == 429, refused.text
            assert refused.headers["Retry-After"] == "1"
            assert refused.json()["error"]["code"] == "rate-limited"
            assert refused.json()["error"]["details"] == {"retry_after_seconds": 1}
            # Only held reads count, and only against their own key.
            assert (await http.get("/v1/events", headers=_bearer(key))).status_code == 200
            group.start_soon(hold, other_key, anyio.CancelScope())
            with anyio.fail_after(5):
                await _until(lambda: feed.held == 3)

            # A client that hangs up gives its place back at once, not at its `wait`.
            leaving.cancel()
            with anyio.fail_after(5):
                await _until(lambda: feed.held == 2)
            group.start_soon(hold, key, anyio.CancelScope())
            with anyio.fail_after(5):
                await _until(lambda: feed.held == 3)
            group.cancel_scope.cancel()


async def test_a_held_read_is_read_again_only_when_its_own_feed_grew(database_url: str) -> None:
    mine, theirs = uuid.uuid4(), uuid.uuid4()
    scoped = await _api_key(database_url, mine)
    orchestrator = await _api_key(database_url)
    async with (
        pg_proxy(database_url) as proxy,
        daemon_context(proxy.url, web.test_settings(runners__long_poll_max_seconds=60)) as daemon,
        httpx.AsyncClient(base_url=daemon.address, timeout=30) as http,
    ):
        assert daemon.replica is not None
        feed = daemon.replica.feed

        async def claim_one(workspace: uuid.UUID) -> None:
            api = web.Api(http=http, database_url=database_url, daemon=daemon, workspace=workspace)
            api.orchestrator_key = orchestrator
            api.registration_token = await _registration(database_url, workspace)
            assert (await api.enqueue(api.job())).status_code == 200
            assert (await api.request_job(await api.register(["linux"]))).status_code == 200

        async def checked_twice_more() -> None:
            """The watcher has run two checks that started after this call."""
            target = feed.checks + 2
            with anyio.fail_after(5):
                await _until(lambda: feed.checks >= target)

        answers: list[httpx.Response] = []

        async def held_read() -> None:
            answers.append(await http.get("/v1/events?wait=60", headers=_bearer(scoped)))

        blocker = await asyncpg.connect(database_url)
        try:
            async with anyio.create_task_group() as group:
                reads = proxy.count(FEED_READ)
                group.start_soon(held_read)
                with anyio.fail_after(5):
                    await _until(lambda: proxy.count(FEED_READ) == reads + 1)

                # Events of another workspace, written on this replica, each poking the watcher:
                # the read is not run again.
                for _ in range(3):
                    await claim_one(theirs)
                await checked_twice_more()
                assert proxy.count(FEED_READ) == reads + 1

                # An event of its own workspace, but hidden behind an older open transaction (the
                # feed shows only the stable prefix): still nothing to read, so no re-read.
                hold_back = blocker.transaction()
                await hold_back.start()
                await blocker.fetchval("SELECT pg_current_xact_id()")
                await claim_one(mine)
                await checked_twice_more()
                assert proxy.count(FEED_READ) == reads + 1
                assert answers == []

                # The transaction ends without any notification: the replica's periodic check
                # finds the event and wakes the read, which reads once more and answers.
                await hold_back.rollback()
                with anyio.fail_after(5):  # inside the read's `wait`: it was woken
                    await _until(lambda: answers)
        finally:
            await blocker.close()
        assert answers[0].status_code == 200, answers[0].text
        assert [event["type"] for event in answers[0].json()["events"]] == ["job.claimed"]
        assert answers[0].json()["events"][0]["workspace_id"] == str(mine)
        assert proxy.count(FEED_READ) == reads + 2
