"""Which claim statement runs (store/ordering.py, "One statement per ordering"; docs/policies.md
Q-27, Q-28) against a real PostgreSQL: the plain statement carries nothing of the fair pick, each
statement's guard makes a stale belief pick nothing rather than a row in the wrong order, and the
claim learns the setting from the statement and runs the other one."""

from __future__ import annotations

import json
import uuid
from typing import Any
from uuid import UUID

import pytest

from controlplane.domain.jobs import NewJob, SessionClaims
from controlplane.store import claiming, ordering
from controlplane.store.ordering import KnownOrderings, Ordering
from controlplane.store.pool import Conn
from tests.factories import capped_session, manual_session, minutes_ago, new_job, plan_nodes
from tests.store.test_claim import enqueue, pending_ids
from tests.store.test_ordering import claim_args


def _fair_reads(nodes: list[dict[str, Any]]) -> list[str]:
    """The plan nodes only the fair pick has: the skip scan's recursion over the projects, and
    any read of running_jobs (the count of each project's leases; the lease's insert left out)."""
    return [
        n["Node Type"]
        for n in nodes
        if n["Node Type"] == "Recursive Union"
        or (n.get("Relation Name") == "running_jobs" and n["Node Type"] != "ModifyTable")
    ]


def ex(job: NewJob) -> UUID:
    return job.identity.job_execution_id


async def _plan(conn: Conn, statement: str, runner: SessionClaims) -> list[dict[str, Any]]:
    plan = await conn.fetchval("EXPLAIN (FORMAT JSON) " + statement, *claim_args(runner))
    return plan_nodes(json.loads(plan)[0]["Plan"])


async def test_q27_the_plain_claim_statement_carries_nothing_of_the_fair_pick(
    conn: Conn, workspace: UUID
) -> None:
    await enqueue(conn, *(new_job(workspace) for _ in range(3)))
    runner = await manual_session(conn, workspace)
    plain = await _plan(conn, claiming._CLAIM[False], runner)
    assert "pending_jobs_workspace_priority_created_idx" in {n.get("Index Name") for n in plain}
    assert _fair_reads(plain) == []
    assert "Recursive Union" in _fair_reads(await _plan(conn, claiming._CLAIM[True], runner))
    # The batch statements likewise.
    for fair in (False, True):
        plan = await conn.fetchval(
            "EXPLAIN (FORMAT JSON) " + claiming._CLAIM_BATCH[fair],
            workspace,
            list(runner.labels),
            [],
            [runner.runner_session_id],
        )
        assert bool(_fair_reads(plan_nodes(json.loads(plan)[0]["Plan"]))) is fair


async def test_q27_the_plain_claim_keeps_a_generic_plan(conn: Conn, workspace: UUID) -> None:
    # PostgreSQL plans a prepared statement's first five runs for their parameters, then keeps
    # a generic plan unless its estimate is dearer. The plain pick reads the labels and the rows
    # stepped over as one-time subqueries so that it is not (store/ordering.py, "Plans"): were
    # the labels the planner's to see, every claim would be planned again.
    await enqueue(conn, *(new_job(workspace) for _ in range(40)))
    await conn.execute("ANALYZE pending_jobs")
    runner = await manual_session(conn, workspace)
    for _ in range(8):
        assert await claiming.claim(conn, runner) is not None
    assert await _plans(conn, claiming._CLAIM[False]) == (3, 5)
    ids = [runner.runner_session_id]
    for _ in range(8):
        assert await claiming.claim_batch(conn, workspace, runner.labels, ids) != {}
    assert await _plans(conn, claiming._CLAIM_BATCH[False]) == (3, 5)


async def test_q27_the_fair_claim_keeps_a_generic_plan(conn: Conn, workspace: UUID) -> None:
    # The fair pick hides the labels and the rows stepped over from the planner as the plain one
    # does, and its walks' bounds too (store/ordering.py, "Plans"), so it is not planned at
    # every claim either.
    await ordering.set_workspace_ordering(conn, workspace, Ordering.FAIR)
    projects = [uuid.uuid4() for _ in range(4)]
    await enqueue(conn, *(new_job(workspace, project_id=projects[i % 4]) for i in range(40)))
    await conn.execute("ANALYZE pending_jobs")
    runner = await manual_session(conn, workspace)
    orderings = KnownOrderings()
    orderings.learn(workspace, True)
    for _ in range(8):
        assert await claiming.claim(conn, runner, orderings=orderings) is not None
    assert await _plans(conn, claiming._CLAIM[True]) == (3, 5)
    ids = [runner.runner_session_id]
    for _ in range(8):
        assert await claiming.claim_batch(conn, workspace, runner.labels, ids, orderings) != {}
    assert await _plans(conn, claiming._CLAIM_BATCH[True]) == (3, 5)


async def _plans(conn: Conn, statement: str) -> tuple[int, int]:
    """How often this connection's prepared `statement` ran a generic and a custom plan."""
    plans = await conn.fetchrow(
        "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement = $1",
        statement,
    )
    assert plans is not None
    return plans["generic_plans"], plans["custom_plans"]


async def _busy_and_quiet(conn: Conn, workspace: UUID) -> tuple[list[NewJob], NewJob]:
    """Two jobs of a busy project (one running) and a younger one of a quiet project: fifo
    serves the busy project's second job next, fair the quiet project's."""
    busy, quiet = uuid.uuid4(), uuid.uuid4()
    busy_jobs = [
        new_job(workspace, queued_at=minutes_ago(60 - i), project_id=busy) for i in range(3)
    ]
    quiet_job = new_job(workspace, queued_at=minutes_ago(1), project_id=quiet)
    await enqueue(conn, *busy_jobs, quiet_job)
    first = await claiming.claim(conn, await manual_session(conn, workspace))
    assert first is not None and first.identity.job_execution_id == ex(busy_jobs[0])
    return busy_jobs, quiet_job


@pytest.mark.parametrize("setting", [Ordering.FAIR, Ordering.FIFO])
async def test_q28_a_stale_statement_takes_nothing_and_reports_the_setting(
    conn: Conn, workspace: UUID, setting: Ordering
) -> None:
    await _busy_and_quiet(conn, workspace)
    await ordering.set_workspace_ordering(conn, workspace, setting)
    before = await pending_ids(conn, workspace)
    runner = await manual_session(conn, workspace)
    fair = setting is Ordering.FAIR
    # The other ordering's statement.
    row = await conn.fetchrow(claiming._CLAIM[not fair], *claim_args(runner))
    assert row is not None
    assert (row["candidate"], row["job_execution_id"], row["fair"]) == (None, None, fair)
    rows = await conn.fetch(
        claiming._CLAIM_BATCH[not fair],
        workspace,
        list(runner.labels),
        [],
        [runner.runner_session_id],
    )
    assert [(r["candidate"], r["fair"]) for r in rows] == [(None, fair)]
    assert await pending_ids(conn, workspace) == before  # nothing taken in the wrong order


async def test_q28_a_claim_believing_fifo_in_a_fair_workspace_serves_fairly_and_learns(
    conn: Conn, workspace: UUID
) -> None:
    busy_jobs, quiet_job = await _busy_and_quiet(conn, workspace)
    orderings = KnownOrderings()  # a replica that has only seen the workspace plain
    assert await ordering.set_workspace_ordering(conn, workspace, Ordering.FAIR)
    runner = await manual_session(conn, workspace)
    job = await claiming.claim(conn, runner, orderings=orderings)
    assert job is not None and job.identity.job_execution_id == ex(quiet_job)
    assert orderings.fair(workspace)
    # Set back to fifo, by another replica: this one's belief is stale the other way.
    assert await ordering.set_workspace_ordering(conn, workspace, Ordering.FIFO)
    job = await claiming.claim(conn, runner, orderings=orderings)
    assert job is not None and job.identity.job_execution_id == ex(busy_jobs[1])
    assert not orderings.fair(workspace)


async def test_q28_a_capped_claim_with_a_stale_belief_serves_fairly_and_spends_one_claim(
    conn: Conn, workspace: UUID
) -> None:
    _, quiet_job = await _busy_and_quiet(conn, workspace)
    await ordering.set_workspace_ordering(conn, workspace, Ordering.FAIR)
    session = await capped_session(conn, workspace, max_claims=2)
    job = await claiming.claim(conn, session, orderings=KnownOrderings())
    assert job is not None and job.identity.job_execution_id == ex(quiet_job)
    used = await conn.fetchval(
        "SELECT claims_used FROM runner_sessions WHERE id = $1", session.runner_session_id
    )
    assert used == 1


async def test_q28_a_batch_with_a_stale_belief_serves_in_the_setting_s_order(
    conn: Conn, workspace: UUID
) -> None:
    busy_jobs, quiet_job = await _busy_and_quiet(conn, workspace)
    orderings = KnownOrderings()
    orderings.learn(workspace, True)  # believed fair; the setting is fifo
    runners = [await manual_session(conn, workspace) for _ in range(2)]
    ids = [r.runner_session_id for r in runners]
    claimed = await claiming.claim_batch(conn, workspace, runners[0].labels, ids, orderings)
    assert [claimed[i].identity.job_execution_id for i in ids] == [
        ex(busy_jobs[1]),
        ex(busy_jobs[2]),
    ]
    assert not orderings.fair(workspace)
    await ordering.set_workspace_ordering(conn, workspace, Ordering.FAIR)
    claimed = await claiming.claim_batch(conn, workspace, runners[0].labels, ids[:1], orderings)
    assert claimed[ids[0]].identity.job_execution_id == ex(quiet_job)
    assert orderings.fair(workspace)


async def test_q28_an_empty_queue_learns_the_setting_too(conn: Conn, workspace: UUID) -> None:
    await ordering.set_workspace_ordering(conn, workspace, Ordering.FAIR)
    orderings = KnownOrderings()
    runner = await manual_session(conn, workspace)
    assert await claiming.claim(conn, runner, orderings=orderings) is None
    assert orderings.fair(workspace)
    batch_orderings = KnownOrderings()
    ids = [runner.runner_session_id]
    assert await claiming.claim_batch(conn, workspace, runner.labels, ids, batch_orderings) == {}
    assert batch_orderings.fair(workspace)


async def _generic_candidate_reads(conn: Conn, statement: str, args: str) -> list[dict[str, Any]]:
    """The plan nodes of the candidate pick in the generic plan PostgreSQL keeps for a prepared
    `statement` after its first runs (made without knowing the workspace)."""
    name = f"generic_{uuid.uuid4().hex}"
    await conn.execute("SET plan_cache_mode = force_generic_plan")
    try:
        await conn.execute(f"PREPARE {name} AS {statement}")
        plan = await conn.fetchval(f"EXPLAIN (FORMAT JSON) EXECUTE {name}({args})")
        await conn.execute(f"DEALLOCATE {name}")
    finally:
        await conn.execute("RESET plan_cache_mode")
    pick = next(
        n
        for n in plan_nodes(json.loads(plan)[0]["Plan"])
        if n.get("Subplan Name") == "CTE candidate"
    )
    return plan_nodes(pick)


@pytest.mark.parametrize(
    ("small", "each", "hot"), [(30, 3, 200), (300, 1, 600), (1000, 1, 2000), (2000, 2, 100)]
)
async def test_q27_the_generic_plan_walks_the_index_whatever_the_statistics(
    conn: Conn, workspace: UUID, small: int, each: int, hot: int
) -> None:
    # Many small workspaces and one hot one, then ANALYZE: the planner's guess of a workspace's
    # rows is small. Before sql/0028 and the label test's estimate (store/ordering.py, "Plans")
    # the generic plan of these shapes read every row of the workspace by a bitmap scan and
    # sorted them, at every claim; it must walk the claim's index and stop at the first row.
    jobs = [new_job(workspace) for _ in range(hot)]
    for _ in range(small):
        other = uuid.uuid4()
        jobs.extend(new_job(other) for _ in range(each))
    await enqueue(conn, *jobs)
    await conn.execute("ANALYZE pending_jobs")
    single = "gen_random_uuid(), '{a}', '{}', gen_random_uuid(), NULL, NULL, '10 s', false"
    batch = "gen_random_uuid(), '{a}', '{}', ARRAY[gen_random_uuid()]"
    for statement, args in (
        (claiming._CLAIM[False], single),
        (claiming._CLAIM_BATCH[False], batch),
    ):
        reads = [
            (n["Node Type"], n.get("Index Name"))
            for n in await _generic_candidate_reads(conn, statement, args)
            if n.get("Relation Name") == "pending_jobs"
        ]
        assert reads == [("Index Scan", "pending_jobs_workspace_priority_created_idx")], reads
