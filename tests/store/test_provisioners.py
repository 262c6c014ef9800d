from __future__ import annotations

from uuid import UUID

import asyncpg
import pytest

from controlplane.errors import RunnerSessionExhausted
from controlplane.store import provisioners, queue
from controlplane.store.pool import Conn
from tests.factories import capped_session, new_job


async def test_j100_revoking_a_provisioner_revokes_only_its_unused_sessions(
    conn: Conn, workspace: UUID
) -> None:
    created, _ = await provisioners.create(conn, name="p", workspace_id=workspace)
    other, _ = await provisioners.create(conn, name="q", workspace_id=workspace)
    used = await capped_session(conn, workspace, provisioner_id=created.id, provider_runner_id="a")
    unused = await capped_session(
        conn, workspace, provisioner_id=created.id, provider_runner_id="b"
    )
    elsewhere = await capped_session(
        conn, workspace, provisioner_id=other.id, provider_runner_id="c"
    )
    await queue.enqueue(conn, [new_job(workspace)])
    assert await queue.claim(conn, used) is not None

    await provisioners.revoke(conn, created.id)

    revoked = "SELECT revoked_at IS NOT NULL FROM runner_sessions WHERE id = $1"
    assert await conn.fetchval(revoked, used.runner_session_id) is False
    assert await conn.fetchval(revoked, unused.runner_session_id) is True
    assert await conn.fetchval(revoked, elsewhere.runner_session_id) is False
    await queue.enqueue(conn, [new_job(workspace)])
    with pytest.raises(RunnerSessionExhausted):
        await queue.claim(conn, unused)


async def test_scope_and_workspace_agree_in_the_database(conn: Conn) -> None:
    with pytest.raises(asyncpg.CheckViolationError):
        await conn.execute(
            """
            INSERT INTO provisioner_tokens (scope, workspace_id, name, token_sha256, display_prefix)
            VALUES ('workspace', NULL, 'x', repeat('a', 64), 'cp_pt_x')
            """
        )
