"""Client-side database deadlines, on a real daemon process.

The daemon reaches PostgreSQL through a proxy that can stop forwarding (tests/pgproxy.py): its
connections stay open and nothing moves, as with a hung server or a network dropping every
packet, which no server-side timeout can cover. Requests must then answer 503
`database-unavailable` once a client-side deadline passes, the long-lived connections (LISTEN,
the leader lock) must notice and reconnect, and once the proxy forwards again the same process
must serve again.
"""

from __future__ import annotations

import statistics
import uuid

import anyio
import asyncpg
import httpx
import pytest

from controlplane.store import locks
from tests.pgproxy import pg_proxy
from tests.system.conftest import DaemonProcess, SpawnDaemon
from tests.system.wire import orchestrator_and_registration

pytestmark = pytest.mark.system

ACQUIRE_SECONDS = 1.0
COMMAND_SECONDS = 2.0
DEADLINES = {
    "CONTROLPLANE_DATABASE_ACQUIRE_TIMEOUT_SECONDS": str(ACQUIRE_SECONDS),
    "CONTROLPLANE_DATABASE_COMMAND_TIMEOUT_SECONDS": str(COMMAND_SECONDS),
    "CONTROLPLANE_DATABASE_STATEMENT_TIMEOUT_MS": "1500",
    # Leadership is probed on every maintenance round: make rounds frequent.
    "CONTROLPLANE_MAINTENANCE_REAPER_INTERVAL_SECONDS": "0.2",
}


async def _leader_pid(database_url: str) -> int | None:
    """The backend holding the leader lock in this database, if any."""
    key = locks.LEADER_KEY & 0xFFFF_FFFF_FFFF_FFFF
    conn = await asyncpg.connect(database_url)
    try:
        pid: int | None = await conn.fetchval(
            """
            SELECT pid FROM pg_locks
            WHERE locktype = 'advisory' AND granted AND objsubid = 1
              AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
              AND classid::bigint = $1 AND objid::bigint = $2
            """,
            key >> 32,
            key & 0xFFFF_FFFF,
        )
        return pid
    finally:
        await conn.close()


async def _until_logged(daemon: DaemonProcess, *events: str) -> None:
    while not all(f'"{event}"' in daemon.log.read_text() for event in events):
        await anyio.sleep(0.05)


async def _readiness(http: httpx.AsyncClient) -> httpx.Response:
    return await http.get("/readyz")


async def test_a_hung_database_answers_503_database_unavailable_and_the_daemon_recovers(
    database_url: str, spawn_daemon: SpawnDaemon
) -> None:
    orchestrator, _ = await orchestrator_and_registration(database_url, uuid.uuid4())
    headers = {"Authorization": f"Bearer {orchestrator}"}
    unknown_execution = f"/v1/jobs/{uuid.uuid4()}"  # authenticates, then reads: 404

    async with (
        pg_proxy(database_url) as proxy,
        spawn_daemon(DATABASE_URL=proxy.url, **DEADLINES) as daemon,
        httpx.AsyncClient(base_url=daemon.address, timeout=120) as http,
    ):
        idle: list[float] = []
        for _ in range(10):
            started = anyio.current_time()
            assert (await http.get(unknown_execution, headers=headers)).status_code == 404
            idle.append(anyio.current_time() - started)
        slack = max(1.0, 20 * statistics.median(idle))
        with anyio.fail_after(30):
            while (leader := await _leader_pid(database_url)) is None:
                await anyio.sleep(0.05)

        proxy.freeze()
        try:
            answers: list[tuple[httpx.Response, float]] = []

            async def ask() -> None:
                started = anyio.current_time()
                response = await http.get(unknown_execution, headers=headers)
                answers.append((response, anyio.current_time() - started))

            # Some of these find an idle pooled connection and hang in their first statement
            # (command deadline), the rest wait to open a new one (acquire deadline). On
            # 78daf06 they hang for good: this bound is the test's own.
            with anyio.fail_after(60):
                async with anyio.create_task_group() as group:
                    for _ in range(6):
                        group.start_soon(ask)
            for response, elapsed in answers:
                assert response.status_code == 503, response.text
                assert response.json()["error"]["code"] == "database-unavailable"
                assert response.headers["Retry-After"] == "1"
                # Answered because a deadline passed, not because something failed fast...
                assert elapsed >= 0.9 * ACQUIRE_SECONDS
                # ...and within the longest one: a connection, then one statement.
                assert elapsed <= ACQUIRE_SECONDS + COMMAND_SECONDS + slack

            # Readiness says so without hanging either; liveness is untouched.
            with anyio.fail_after(30):
                while True:
                    checks = (await _readiness(http)).json()["checks"]
                    if (
                        checks["database"].startswith("unreachable")
                        and checks["migrations"] == "unknown"
                        and checks["listener"] == "disconnected"
                    ):
                        break
                    await anyio.sleep(0.05)
            assert (await http.get("/healthz")).status_code == 200
            # The long-lived connections gave up on their hung sessions.
            with anyio.fail_after(30):
                await _until_logged(daemon, "listener.lost", "maintenance.lead_failed")
        finally:
            proxy.thaw()

        # The same process recovers by itself: readiness, requests, LISTEN and leadership.
        with anyio.fail_after(30):
            while (await _readiness(http)).status_code != 200:
                await anyio.sleep(0.05)
        assert (await http.get(unknown_execution, headers=headers)).status_code == 404
        with anyio.fail_after(30):
            while (now_leading := await _leader_pid(database_url)) in (None, leader):
                await anyio.sleep(0.05)
        assert now_leading != leader
        assert daemon.process.poll() is None
