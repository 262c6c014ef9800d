"""Cheap requests must not cost a query each, on real daemon processes.

Replica A reaches PostgreSQL through a proxy that counts the statements it runs, by text
(tests/pgproxy.py). Held event-feed reads must cost one re-check per replica per
`events.recheck_seconds`, not one query per read per re-check, and still wake on events written
by another replica (B, on the same database): claims (which do not NOTIFY) through the
re-check, cancels through NOTIFY. /readyz and /metrics, which need no credential, must read the
database at most once per `health.refresh_seconds` however many requests arrive.
"""

from __future__ import annotations

import json
import math
import uuid
from typing import Any

import anyio
import httpx
import pytest

from tests.pgproxy import PgProxy, pg_proxy
from tests.system.conftest import SpawnDaemon
from tests.system.wire import job_body, orchestrator_and_registration

pytestmark = pytest.mark.system

RECHECK_SECONDS = 0.25  # events.recheck_seconds, default
REFRESH_SECONDS = 1.0  # health.refresh_seconds, default
HELD_READS = 40
FEED_READ = "($3::uuid IS NULL OR workspace_id = $3)"  # store/events.py read()
ANY_FEED_STATEMENT = "pg_snapshot_xmin(pg_current_snapshot())"  # every feed read or check
QUEUE_DEPTH = "count(*) FROM pending_jobs"  # store/queries.py depth()
MIGRATIONS_APPLIED = "FROM schema_migrations"  # store/migrations.py applied()


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def _until(proxy: PgProxy, fragment: str, count: int) -> None:
    while proxy.count(fragment) < count:
        await anyio.sleep(0.01)


async def test_held_event_reads_cost_one_recheck_per_replica_and_wake_on_another_replicas_events(
    database_url: str, spawn_daemon: SpawnDaemon
) -> None:
    workspace = uuid.uuid4()
    orchestrator, registration = await orchestrator_and_registration(database_url, workspace)
    limits = httpx.Limits(max_connections=HELD_READS + 10)
    async with (
        pg_proxy(database_url) as proxy,
        spawn_daemon(DATABASE_URL=proxy.url) as replica_a,
        spawn_daemon() as replica_b,
        httpx.AsyncClient(base_url=replica_a.address, timeout=60, limits=limits) as a,
        httpx.AsyncClient(base_url=replica_b.address, timeout=60) as b,
    ):
        job = job_body(workspace)
        assert (
            await b.post("/v1/jobs", json={"jobs": [job]}, headers=_bearer(orchestrator))
        ).is_success
        registered = await b.post(
            "/v1/runners/register", json={"labels": ["linux"]}, headers=_bearer(registration)
        )
        assert registered.status_code == 200, registered.text
        session = registered.json()["session_token"]

        async def hold_reads(after: str | None, write: Any) -> list[httpx.Response]:
            """HELD_READS reads held on A; once all have read, `write()` runs; their answers."""
            answers: list[httpx.Response] = []
            params: dict[str, Any] = {"wait": 30, **({"after": after} if after else {})}

            async def read() -> None:
                answers.append(
                    await a.get("/v1/events", params=params, headers=_bearer(orchestrator))
                )

            first_reads = proxy.count(FEED_READ) + HELD_READS
            with anyio.fail_after(25):  # well inside `wait`: the answers come from a wake-up
                async with anyio.create_task_group() as group:
                    for _ in range(HELD_READS):
                        group.start_soon(read)
                    await _until(proxy, FEED_READ, first_reads)
                    await write()
            return answers

        quiet: dict[str, float] = {}

        async def quiet_window_then_claim_on_b() -> None:
            # Nothing is written for a while: the held reads cost only the replica's re-checks.
            before = proxy.count(ANY_FEED_STATEMENT)
            started = anyio.current_time()
            await anyio.sleep(2.0)  # the window measured, not a synchronisation
            quiet["elapsed"] = anyio.current_time() - started
            quiet["statements"] = proxy.count(ANY_FEED_STATEMENT) - before
            claimed = await b.post("/v1/runners/jobs/request?wait=0", headers=_bearer(session))
            assert claimed.status_code == 200, claimed.text

        answers = await hold_reads(None, quiet_window_then_claim_on_b)
        # One cheap statement per re-check for all 40 reads (each read alone re-querying every
        # 0.25 s would be 40 x 8 = 320).
        assert quiet["statements"] <= math.ceil(quiet["elapsed"] / RECHECK_SECONDS) + 2, quiet
        # B's claim does not NOTIFY; A's re-check found it and woke every read.
        assert len(answers) == HELD_READS
        for answer in answers:
            assert answer.status_code == 200, answer.text
            assert [e["type"] for e in answer.json()["events"]] == ["job.claimed"]
        cursor = answers[0].json()["next_cursor"]

        async def cancel_on_b() -> None:
            cancelled = await b.post(
                f"/v1/jobs/{job['job_execution_id']}/outcome",
                json={"status": "cancelled", "reason": "test"},
                headers=_bearer(orchestrator),
            )
            assert cancelled.status_code == 200, cancelled.text

        answers = await hold_reads(cursor, cancel_on_b)
        # B's cancel NOTIFYs cp_events; A's listener woke every read.
        for answer in answers:
            assert answer.status_code == 200, answer.text
            assert [e["type"] for e in answer.json()["events"]] == ["job.cancelled"]


async def test_a_burst_of_readyz_and_metrics_reads_the_database_at_most_once_a_second(
    database_url: str, spawn_daemon: SpawnDaemon
) -> None:
    limits = httpx.Limits(max_connections=50)
    async with (
        pg_proxy(database_url) as proxy,
        # The readiness read's deadline is the daemon's (1 s by default): on a loaded machine
        # the proxied read may take longer, and /readyz would rightly answer 503. Whether it is
        # read at most once a second is what this test is about, not how fast it is.
        spawn_daemon(DATABASE_URL=proxy.url, CONTROLPLANE_HEALTH_DEADLINE_SECONDS="30") as daemon,
        httpx.AsyncClient(base_url=daemon.address, timeout=60, limits=limits) as http,
    ):
        depth_before = proxy.count(QUEUE_DEPTH)
        migrations_before = proxy.count(MIGRATIONS_APPLIED)
        answers: list[tuple[str, int, str]] = []

        async def probe(path: str) -> None:
            answer = await http.get(path)
            answers.append((path, answer.status_code, answer.text))

        started = anyio.current_time()
        with anyio.fail_after(60):
            async with anyio.create_task_group() as group:
                for index in range(200):
                    group.start_soon(probe, "/readyz" if index % 2 else "/metrics")
        elapsed = anyio.current_time() - started

        assert len(answers) == 200
        assert all(status == 200 for path, status, _ in answers if path == "/metrics"), answers
        # Every readiness answer carries the database's facts. Its listener check is not what
        # this test is about: the proxy runs in this test's event loop, beside the 200 requests,
        # and on a loaded machine it can hold the listener's probe past its 2 s deadline, so the
        # daemon rightly reconnects and /readyz says 503 for a moment (seen once under load 30).
        for path, status, text in answers:
            if path == "/readyz":
                checks = json.loads(text)["checks"]
                assert (checks["database"], checks["migrations"]) == ("ok", "ok"), text
                assert status == 200 or checks["listener"] == "disconnected", text
        bound = math.ceil(elapsed / REFRESH_SECONDS) + 1
        refreshes = proxy.count(QUEUE_DEPTH) - depth_before
        assert 1 <= refreshes <= bound, (refreshes, elapsed)
        assert proxy.count(MIGRATIONS_APPLIED) - migrations_before <= bound
