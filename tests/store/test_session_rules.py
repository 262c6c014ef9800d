from __future__ import annotations

import uuid
from uuid import UUID

import asyncpg
import pytest

from controlplane.store import claiming, queue, sessions
from controlplane.store.pool import Conn
from tests.factories import capped_session, new_job


async def test_j94_database_refuses_capped_sessions_without_cap_or_link(
    conn: Conn, workspace: UUID
) -> None:
    with pytest.raises(asyncpg.CheckViolationError):
        await sessions.create(
            conn,
            workspace_id=workspace,
            registration_token_id=uuid.uuid4(),
            kind="ephemeral",
            labels=("linux",),
            max_claims=None,
            provisioner_id=uuid.uuid4(),
            provider_runner_id="r-1",
        )
    with pytest.raises(asyncpg.CheckViolationError):
        await sessions.create(
            conn,
            workspace_id=workspace,
            registration_token_id=uuid.uuid4(),
            kind="ephemeral",
            labels=("linux",),
            max_claims=1,
        )
    assert await conn.fetchval("SELECT count(*) FROM runner_sessions") == 0


async def test_j37_capped_empty_poll_spends_nothing_and_a_claim_spends_one(
    conn: Conn, workspace: UUID
) -> None:
    """The runner-instance `first_claimed_at` part belongs to provisioning (not built yet)."""
    session = await capped_session(conn, workspace)
    assert await claiming.claim(conn, session) is None
    used = "SELECT claims_used FROM runner_sessions WHERE id = $1"
    assert await conn.fetchval(used, session.runner_session_id) == 0
    await queue.enqueue(conn, [new_job(workspace)])
    assert await claiming.claim(conn, session) is not None
    assert await conn.fetchval(used, session.runner_session_id) == 1
