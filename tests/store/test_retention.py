from __future__ import annotations

from datetime import timedelta
from uuid import UUID

from controlplane.domain.jobs import EnqueueResult, Outcome
from controlplane.store import claiming, leases, queue, retention, runner_instances
from controlplane.store.pool import Conn
from tests.factories import manual_session, new_job
from tests.provisioning import provisioner

DAY = timedelta(days=1)


async def test_old_events_are_pruned_in_batches_and_recent_ones_kept(
    conn: Conn, workspace: UUID
) -> None:
    jobs = [new_job(workspace) for _ in range(3)]
    await queue.enqueue(conn, jobs)
    for job in jobs:
        await leases.reconcile(conn, job.identity.job_execution_id, Outcome.CANCELLED)
    await conn.execute("UPDATE events SET created_at = now() - interval '40 days'")
    fresh = new_job(workspace)
    await queue.enqueue(conn, [fresh])
    await leases.reconcile(conn, fresh.identity.job_execution_id, Outcome.CANCELLED)

    assert await retention.prune_events(conn, 30 * DAY, limit=2) == 2
    assert await retention.prune_events(conn, 30 * DAY, limit=2) == 1
    assert await retention.prune_events(conn, 30 * DAY, limit=2) == 0
    remaining = await conn.fetch("SELECT job_execution_id FROM events")
    assert [row["job_execution_id"] for row in remaining] == [fresh.identity.job_execution_id]


async def test_old_tombstones_are_pruned_but_not_while_a_lease_drains(
    conn: Conn, workspace: UUID
) -> None:
    session = await manual_session(conn, workspace)
    running, ended = new_job(workspace), new_job(workspace)
    await queue.enqueue(conn, [running, ended])
    assert await claiming.claim(conn, session) is not None  # `running` is older: claimed first
    for job in (running, ended):
        await leases.reconcile(conn, job.identity.job_execution_id, Outcome.CANCELLED)
    await conn.execute("UPDATE ended_executions SET ended_at = now() - interval '100 days'")

    assert await retention.prune_tombstones(conn, 90 * DAY, limit=10) == 1
    left = await conn.fetchval("SELECT job_execution_id FROM ended_executions")
    assert left == running.identity.job_execution_id
    # Past its retention a replay is accepted again: the documented limit of the guarantee.
    assert await queue.enqueue(conn, [ended]) == [EnqueueResult.ENQUEUED]


async def test_runner_credentials_are_pruned_once_dead_longer_than_the_retention(
    conn: Conn, workspace: UUID
) -> None:
    owner = await provisioner(conn, workspace)
    await runner_instances.create_batch(
        conn, owner.id, provider_kind=None, entries=[(None, None)] * 3, bootstrap_ttl=DAY
    )
    # Two tokens expired two days ago; the third is still usable.
    await conn.execute(
        "UPDATE runner_bootstrap_tokens SET expires_at = now() - interval '2 days'"
        " WHERE id IN (SELECT id FROM runner_bootstrap_tokens ORDER BY id LIMIT 2)"
    )
    assert await retention.prune_runner_credentials(conn, 3 * DAY, limit=10) == 0
    assert await retention.prune_runner_credentials(conn, DAY, limit=1) == 1
    assert await retention.prune_runner_credentials(conn, DAY, limit=10) == 1
    assert await conn.fetchval("SELECT count(*) FROM runner_bootstrap_tokens") == 1
