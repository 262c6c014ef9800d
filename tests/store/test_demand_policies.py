"""Provisioner demand counts only jobs that could start now (docs/policies.md Q-24, Q-89): a
paused workspace's jobs and jobs past their queue deadline are no demand, against real
PostgreSQL, through the allocation round itself; and the counter of jobs a claim stepped over
because their concurrency key had no free slot (Q-25)."""

from __future__ import annotations

import uuid
from uuid import UUID

import anyio

from controlplane import metrics
from controlplane.domain.demand import Template
from controlplane.domain.pauses import Operator, PauseKind
from controlplane.store import claiming, demand_inputs, demand_list, pauses, queue
from controlplane.store.pool import Conn
from tests import provisioning as rows
from tests.factories import holding, manual_session, minutes_ago, new_job
from tests.store.test_demand_store import launched, poll

OPERATOR = Operator(uuid.uuid4(), "ops-key")


async def set_paused(conn: Conn, workspace: UUID, paused: bool) -> None:
    await pauses.change(
        conn, PauseKind.WORKSPACE, workspace, paused=paused, operator=OPERATOR, reason=None
    )


async def queued(conn: Conn, workspace: UUID) -> int:
    return sum(g.queued for g in await demand_inputs.startable_demand(conn, workspace))


async def test_q24_jobs_past_their_queue_deadline_are_no_demand(
    conn: Conn, workspace: UUID
) -> None:
    expired = [new_job(workspace) for _ in range(2)]
    keyed = new_job(workspace, key=("deploy", 1))  # expired: it must not take the key's slot
    live_keyed = new_job(workspace, key=("deploy", 1))
    await queue.enqueue(conn, [*expired, keyed, live_keyed, new_job(workspace)])
    provisioner = await rows.provisioner(conn, workspace)
    assert await queued(conn, workspace) == 5 - 1  # the key's second job waits for its slot
    gone = [j.identity.job_execution_id for j in [*expired, keyed]]
    # Past the deadline, not yet removed by the leader (it has not run in this test).
    await conn.execute(
        "UPDATE pending_jobs SET expires_at = now() - interval '1 second'"
        " WHERE job_execution_id = ANY($1::uuid[])",
        gone,
    )
    assert await queued(conn, workspace) == 2  # the unkeyed live job and the key's live one
    result = await poll(conn, provisioner, workspace, templates=(Template("small", ("linux",), 9),))
    assert launched(result) == [(("linux",), 2)]
    # A workspace whose every job is past its deadline is not walked at all.
    other = uuid.uuid4()
    stale = new_job(other)
    await queue.enqueue(conn, [stale])
    assert other in await demand_list.demand_workspaces(conn, [other])
    await conn.execute(
        "UPDATE pending_jobs SET expires_at = now() WHERE job_execution_id = $1",
        stale.identity.job_execution_id,
    )
    assert await demand_list.demand_workspaces(conn, [other]) == []


async def test_q89_a_paused_workspace_is_no_demand_until_resumed(
    conn: Conn, workspace: UUID
) -> None:
    await queue.enqueue(conn, [new_job(workspace), new_job(workspace, key=("deploy", 1))])
    provisioner = await rows.provisioner(conn, workspace)
    await set_paused(conn, workspace, True)
    assert await queued(conn, workspace) == 0
    assert await demand_list.demand_workspaces(conn, [workspace]) == []
    result = await poll(conn, provisioner, workspace)
    assert launched(result) == []
    assert [(s.labels, s.queued) for s in result.allocation.stats if s.queued] == []
    await set_paused(conn, workspace, False)
    assert await queued(conn, workspace) == 2
    assert await demand_list.demand_workspaces(conn, [workspace]) == [workspace]
    assert launched(await poll(conn, provisioner, workspace)) == [(("linux",), 2)]


# --- the key-full step-over counter (Q-25) -----------------------------------------------------


def key_full_steps() -> float:
    return metrics.REGISTRY.get_sample_value("controlplane_claim_key_full_steps_total") or 0.0


async def test_q25_jobs_stepped_over_because_their_key_had_no_free_slot_are_counted(
    conn: Conn, workspace: UUID, database_url: str
) -> None:
    keyed = [new_job(workspace, queued_at=minutes_ago(10 - i), key=("deploy", 1)) for i in range(3)]
    free = new_job(workspace, queued_at=minutes_ago(1))
    await queue.enqueue(conn, [*keyed, free])
    runners = [await manual_session(conn, workspace) for _ in range(3)]
    key_row = (
        "SELECT 1 FROM concurrency_keys WHERE workspace_id = $1 AND concurrency_key = 'deploy'"
        " FOR UPDATE"
    )
    # Forced: another claim is admitting the key's last slot (its key row is held). Our claim
    # locks each keyed job, finds its key row held and steps over it, then takes the free job.
    before = key_full_steps()
    async with holding(database_url, key_row, workspace):
        with anyio.fail_after(10):
            claimed = await claiming.claim(conn, runners[0])
    assert claimed is not None and claimed.identity == free.identity
    assert key_full_steps() - before == 3
    # A batch of two: the key's one free slot admits its first job; the second job the batch
    # locked for the other runner is stepped over and counted.
    before = key_full_steps()
    got = await claiming.claim_batch(
        conn,
        workspace,
        runners[1].labels,
        [runners[1].runner_session_id, runners[2].runner_session_id],
    )
    assert [j.identity for j in got.values()] == [keyed[0].identity]
    assert key_full_steps() - before == 1
    # The key is full when the claim's statement starts: its jobs are filtered out, not counted.
    before = key_full_steps()
    assert await claiming.claim(conn, runners[1]) is None
    assert key_full_steps() == before
