"""`controlplane enqueue`'s life-policy flags (docs/policies.md, "The life of an execution"),
as processes against a real daemon."""

from __future__ import annotations

import uuid

import asyncpg
import pytest

from tests.system import agents
from tests.system.conftest import SpawnDaemon

pytestmark = pytest.mark.system


async def test_enqueue_sends_its_life_policy_flags_and_reports_a_refused_one(
    spawn_daemon: SpawnDaemon, database_url: str
) -> None:
    creds = await agents.make_credentials(database_url)
    flags = ["--run-timeout", "900", "--queue-timeout", "120", "--retries-on-lost", "2"]
    async with spawn_daemon() as daemon:
        base = ["enqueue", "--url", daemon.address, "--workspace", str(creds.workspace)]
        queued = await agents.run_client(
            *base, "--labels", "linux", *flags, "--", "true",
            CONTROLPLANE_ORCHESTRATOR_KEY=creds.orchestrator_key,
        )  # fmt: skip
        assert queued.returncode == 0, queued.stderr
        execution = uuid.UUID(queued.stdout.strip())
        refused = await agents.run_client(
            *base, "--labels", "linux", "--retries-on-lost", "101", "--", "true",
            CONTROLPLANE_ORCHESTRATOR_KEY=creds.orchestrator_key,
        )  # fmt: skip
        assert refused.returncode != 0
        assert "retries_on_lost" in refused.stderr
    conn = await asyncpg.connect(database_url)
    try:
        row = await conn.fetchrow(
            "SELECT timeout_seconds, queue_timeout_seconds, retries_on_lost FROM pending_jobs"
            " WHERE job_execution_id = $1",
            execution,
        )
        count = await conn.fetchval("SELECT count(*) FROM pending_jobs")
    finally:
        await conn.close()
    assert row is not None and tuple(row) == (900, 120, 2)
    assert count == 1
