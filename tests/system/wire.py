"""What the process-level tests send: credentials made in the database and job bodies."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import asyncpg

from controlplane.store import credentials


async def orchestrator_and_registration(database_url: str, workspace: uuid.UUID) -> tuple[str, str]:
    """An orchestrator key and a manual registration token for `workspace`."""
    conn = await asyncpg.connect(database_url)
    try:
        _, orchestrator = await credentials.create_api_key(conn, kind="orchestrator", name="o")
        _, registration = await credentials.create_manual_token(
            conn, workspace_id=workspace, name="r"
        )
        return orchestrator, registration
    finally:
        await conn.close()


def job_body(workspace: uuid.UUID, labels: list[str] | None = None) -> dict[str, Any]:
    """One execution for POST /v1/jobs, with fresh ids, queued now."""
    return {
        "job_execution_id": str(uuid.uuid4()),
        "job_id": str(uuid.uuid4()),
        "workflow_run_id": str(uuid.uuid4()),
        "workflow_run_attempt_id": str(uuid.uuid4()),
        "workspace_id": str(workspace),
        "project_id": str(uuid.uuid4()),
        "required_labels": labels or ["linux"],
        "queued_at": datetime.now(UTC).isoformat(),
    }
