"""Readiness and database faults on an in-process daemon.

PostgreSQL is stopped under a running daemon, then started again: readiness follows, liveness
does not, and the daemon recovers by itself. The daemon runs on the session's embedded server;
stopping it affects every database on it, so the test restarts it (same port) in a `finally`.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Generator
from datetime import timedelta
from typing import Any, cast
from urllib.parse import urlsplit

import anyio
import asyncpg
import h11
import httpx

from controlplane.app import PoolClaims
from controlplane.domain.jobs import SessionClaims
from controlplane.domain.labels import canonicalise
from controlplane.store import credentials
from controlplane.store.embedded import EmbeddedPostgres
from tests.web import conftest as web


async def _poll_until(http: httpx.AsyncClient, path: str, status: int) -> httpx.Response:
    while True:
        try:
            response = await http.get(path)
        except httpx.TransportError:
            pass
        else:
            if response.status_code == status:
                return response
        await anyio.sleep(0.05)


async def _statuses_on_one_connection(address: str, requests: list[h11.Request]) -> list[int]:
    """Send the requests one after another on a single keep-alive connection."""
    parts = urlsplit(address)
    assert parts.hostname is not None and parts.port is not None
    statuses: list[int] = []
    async with await anyio.connect_tcp(parts.hostname, parts.port) as stream:
        conn = h11.Connection(our_role=h11.CLIENT)
        for request in requests:
            await stream.send(conn.send(request) + conn.send(h11.EndOfMessage()))
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await stream.receive())
                    continue
                if isinstance(event, h11.Response):
                    statuses.append(event.status_code)
                if isinstance(event, h11.EndOfMessage):
                    break
                assert not isinstance(event, h11.ConnectionClosed), "the server hung up"
            conn.start_next_cycle()
    return statuses


async def test_readyz_follows_a_postgres_restart_without_restarting_the_daemon(
    database_url: str, embedded_server: EmbeddedPostgres
) -> None:
    workspace = uuid.uuid4()
    conn = await asyncpg.connect(database_url)
    try:
        _, orchestrator = await credentials.create_api_key(conn, kind="orchestrator", name="o")
        _, registration = await credentials.create_manual_token(
            conn, workspace_id=workspace, name="r"
        )
    finally:
        await conn.close()

    def job() -> dict[str, Any]:
        return {
            "job_execution_id": str(uuid.uuid4()),
            "job_id": str(uuid.uuid4()),
            "workflow_run_id": str(uuid.uuid4()),
            "workflow_run_attempt_id": str(uuid.uuid4()),
            "workspace_id": str(workspace),
            "project_id": str(uuid.uuid4()),
            "required_labels": ["linux"],
            "queued_at": "2024-01-01T00:00:00+00:00",
        }

    daemon_context = contextlib.asynccontextmanager(web.run_daemon)
    async with (
        daemon_context(database_url, web.test_settings()) as daemon,
        httpx.AsyncClient(base_url=daemon.address, timeout=10) as http,
    ):
        ready = await http.get("/readyz")
        assert ready.status_code == 200, ready.text
        assert ready.json()["checks"] == {
            "database": "ok",
            "migrations": "ok",
            "listener": "ok",
        }
        listener = daemon.replica.listener if daemon.replica else None
        assert listener is not None
        reconnects_before = listener.reconnects

        await anyio.to_thread.run_sync(embedded_server.stop, "fast")
        try:
            # The database check is refreshed at most once per health.refresh_seconds, so the
            # first 503 may name only the listener.
            with anyio.fail_after(5):
                down = await _poll_until(http, "/readyz", 503)
                while not down.json()["checks"]["database"].startswith("unreachable"):
                    down = await _poll_until(http, "/readyz", 503)
            assert down.json()["ready"] is False
            alive = await http.get("/healthz")
            assert alive.status_code == 200
            assert alive.json() == {"status": "ok"}
            with anyio.fail_after(5):
                while down.json()["checks"]["listener"] != "disconnected":
                    down = await _poll_until(http, "/readyz", 503)
            # A request that needs the database is refused as retryable, and the connection
            # stays usable (it used to be closed behind every such 503).
            host = urlsplit(daemon.address).netloc
            enqueue = h11.Request(
                method="POST",
                target="/v1/jobs",
                headers=[
                    ("Host", host),
                    ("Authorization", f"Bearer {orchestrator}"),
                    ("Content-Length", "0"),
                ],
            )
            health = h11.Request(method="GET", target="/healthz", headers=[("Host", host)])
            assert await _statuses_on_one_connection(daemon.address, [enqueue, health]) == [
                503,
                200,
            ]
        finally:
            await anyio.to_thread.run_sync(embedded_server.start)

        with anyio.fail_after(10):
            back = await _poll_until(http, "/readyz", 200)
        assert back.json()["checks"] == {
            "database": "ok",
            "migrations": "ok",
            "listener": "ok",
        }
        assert listener.reconnects > reconnects_before

        # The same daemon dispatches again: a parked runner is woken by a new enqueue.
        auth_registration = {"Authorization": f"Bearer {registration}"}
        registered = await http.post(
            "/v1/runners/register", json={"labels": ["linux"]}, headers=auth_registration
        )
        assert registered.status_code == 200, registered.text
        session = registered.json()["session_token"]
        new_job = job()
        received: list[httpx.Response] = []

        async def park() -> None:
            received.append(
                await http.post(
                    "/v1/runners/jobs/request?wait=8",
                    headers={"Authorization": f"Bearer {session}"},
                )
            )

        with anyio.fail_after(15):
            async with anyio.create_task_group() as group:
                group.start_soon(park)
                while daemon.replica is None or daemon.replica.dispatcher.parked < 1:
                    await anyio.sleep(0.01)
                enqueued = await http.post(
                    "/v1/jobs",
                    json={"jobs": [new_job]},
                    headers={"Authorization": f"Bearer {orchestrator}"},
                )
                assert enqueued.status_code == 200, enqueued.text
                assert enqueued.json()["results"][0]["result"] == "enqueued"
        assert received[0].status_code == 200, received[0].text
        assert received[0].json()["job_execution_id"] == new_job["job_execution_id"]


async def test_a_claim_is_not_lost_when_releasing_its_connection_fails(
    api: web.Api,
) -> None:
    """The server going away right after a claim committed makes asyncpg's reset-on-release fail;
    the claim must still be returned (it used to raise, and the lease then expired unseen)."""
    assert api.daemon.replica is not None
    pool = api.daemon.replica.pool
    registered = await api.http.post(
        "/v1/runners/register",
        json={"labels": ["linux"]},
        headers=api.auth(api.registration_token),
    )
    assert registered.status_code == 200, registered.text
    session = SessionClaims(
        uuid.UUID(registered.json()["session_id"]), api.workspace, canonicalise(["linux"]), None
    )
    job = api.job()
    assert (await api.enqueue(job)).json()["results"][0]["result"] == "enqueued"

    class ResetFails:
        """The daemon's pool, except that every release fails after releasing."""

        def acquire(self) -> Acquire:
            return Acquire(self)

        async def release(self, connection: Any) -> None:
            await pool.release(connection)
            raise ConnectionResetError("the reset query found the server gone")

    class Acquire:
        """Awaited, or used as `async with`, like asyncpg's."""

        def __init__(self, owner: ResetFails) -> None:
            self.owner = owner
            self.connection: Any = None

        def __await__(self) -> Generator[Any, None, Any]:
            return pool.acquire().__await__()

        async def __aenter__(self) -> Any:
            self.connection = await pool.acquire()
            return self.connection

        async def __aexit__(self, *_exc: object) -> None:
            await self.owner.release(self.connection)

    claims = PoolClaims(cast(asyncpg.Pool, ResetFails()), timedelta(seconds=10))
    claimed = await claims.claim(session)
    assert claimed is not None
    assert str(claimed.identity.job_execution_id) == job["job_execution_id"]
