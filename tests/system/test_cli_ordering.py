"""`controlplane enqueue` ordering flags and `controlplane workspaces settings`, as processes
against a spawned daemon (docs/policies.md, "Ordering")."""

from __future__ import annotations

import uuid

import asyncpg
import pytest

from tests.system import agents
from tests.system.conftest import SpawnDaemon

pytestmark = pytest.mark.system


async def test_q39_the_cli_enqueues_with_ordering_fields_and_sets_a_workspace_to_fair(
    spawn_daemon: SpawnDaemon, database_url: str
) -> None:
    creds = await agents.make_credentials(database_url)
    project = uuid.uuid4()
    async with spawn_daemon() as daemon:
        queued = await agents.run_client(
            "enqueue", "--url", daemon.address, "--workspace", str(creds.workspace),
            "--labels", "linux", "--project", str(project), "--priority", "7",
            "--concurrency-key", "deploy/prod", "--concurrency-limit", "2", "--", "true",
            CONTROLPLANE_ORCHESTRATOR_KEY=creds.orchestrator_key,
        )  # fmt: skip
        assert queued.returncode == 0, queued.stderr
        execution = uuid.UUID(queued.stdout.strip())
        refused = await agents.run_client(
            "enqueue", "--url", daemon.address, "--workspace", str(creds.workspace),
            "--labels", "linux", "--concurrency-key", "deploy/prod", "--", "true",
            CONTROLPLANE_ORCHESTRATOR_KEY=creds.orchestrator_key,
        )  # fmt: skip
        assert refused.returncode == 2
        assert "concurrency_limit" in refused.stderr
        settings = ["workspaces", "settings", str(creds.workspace), "--url", daemon.address]
        fair = await agents.run_client(
            *settings, "--ordering", "fair", CONTROLPLANE_ADMIN_KEY=creds.admin_key
        )
        assert fair.returncode == 0, fair.stderr
        assert fair.stdout.strip() == f"workspace {creds.workspace}: ordering fair (set)"
        again = await agents.run_client(
            *settings, "--ordering", "fair", CONTROLPLANE_ADMIN_KEY=creds.admin_key
        )
        assert again.stdout.strip() == f"workspace {creds.workspace}: ordering fair (already set)"
        bad = await agents.run_client(
            *settings, "--ordering", "random", CONTROLPLANE_ADMIN_KEY=creds.admin_key
        )
        assert bad.returncode == 2
    conn = await asyncpg.connect(database_url)
    try:
        row = await conn.fetchrow(
            "SELECT project_id, priority, concurrency_key, concurrency_limit FROM pending_jobs"
            " WHERE job_execution_id = $1",
            execution,
        )
        ordering = await conn.fetchval(
            "SELECT ordering FROM workspace_settings WHERE workspace_id = $1", creds.workspace
        )
    finally:
        await conn.close()
    assert row is not None and tuple(row) == (project, 7, "deploy/prod", 2)
    assert ordering == "fair"
