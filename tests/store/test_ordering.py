"""Ordering of the queue (docs/policies.md, "Ordering", Q-01..Q-39) against a real PostgreSQL:
priority, concurrency keys and fair share, in the claim, the batch claim and put-back."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from typing import Any
from uuid import UUID

import anyio
import asyncpg

from controlplane.domain.jobs import NewJob, Outcome, SessionClaims, StaleRule
from controlplane.store import claiming, demand_inputs, leases, locks, ordering, queue
from controlplane.store.ordering import Ordering
from controlplane.store.pool import Conn
from tests.factories import holding_lock, manual_session, minutes_ago, new_job, plan_nodes
from tests.store.test_claim import claim_ok, enqueue, make_stale, pending_ids


def ex(job: NewJob) -> UUID:
    return job.identity.job_execution_id


async def claimed_ex(conn: Conn, session: SessionClaims) -> UUID | None:
    job = await claiming.claim(conn, session)
    return None if job is None else job.identity.job_execution_id


async def key_running(conn: Conn, workspace: UUID, key: str) -> int:
    running: int = await conn.fetchval(
        "SELECT running FROM concurrency_keys WHERE workspace_id = $1 AND concurrency_key = $2",
        workspace,
        key,
    )
    return running


# --- priority ---------------------------------------------------------------------------------


async def test_q01_a_higher_priority_job_goes_before_an_older_lower_one(
    conn: Conn, workspace: UUID
) -> None:
    old = new_job(workspace, queued_at=minutes_ago(10))
    urgent = new_job(workspace, queued_at=minutes_ago(1), priority=5)
    await enqueue(conn, old, urgent)
    runner = await manual_session(conn, workspace)
    assert await claimed_ex(conn, runner) == ex(urgent)
    assert await claimed_ex(conn, runner) == ex(old)


async def test_q02_fifo_by_queued_at_within_one_priority(conn: Conn, workspace: UUID) -> None:
    jobs = [new_job(workspace, queued_at=minutes_ago(10 - i), priority=3) for i in range(3)]
    low = new_job(workspace, queued_at=minutes_ago(20))
    await enqueue(conn, low, *reversed(jobs))
    runner = await manual_session(conn, workspace)
    assert [await claimed_ex(conn, runner) for _ in range(4)] == [*map(ex, jobs), ex(low)]


async def test_q03_a_negative_priority_waits_behind_newer_default_jobs(
    conn: Conn, workspace: UUID
) -> None:
    later = new_job(workspace, queued_at=minutes_ago(10), priority=-1)
    default = new_job(workspace, queued_at=minutes_ago(1))
    await enqueue(conn, later, default)
    row = await conn.fetchrow(
        "SELECT priority FROM pending_jobs WHERE job_execution_id = $1", ex(default)
    )
    assert row is not None and row["priority"] == 0
    runner = await manual_session(conn, workspace)
    assert await claimed_ex(conn, runner) == ex(default)


async def test_q04_a_busy_highest_priority_head_is_stepped_over_in_priority_order(
    conn: Conn, workspace: UUID, database_url: str
) -> None:
    head = new_job(workspace, queued_at=minutes_ago(1), priority=9)
    second = new_job(workspace, queued_at=minutes_ago(2), priority=5)
    oldest = new_job(workspace, queued_at=minutes_ago(30))
    await enqueue(conn, head, second, oldest)
    runner = await manual_session(conn, workspace)
    async with holding_lock(database_url, locks.execution(ex(head))):
        assert await claimed_ex(conn, runner) == ex(second)
    assert await claimed_ex(conn, runner) == ex(head)


async def test_q05_a_put_back_returns_to_its_place_with_its_priority(
    conn: Conn, workspace: UUID
) -> None:
    urgent = new_job(workspace, queued_at=minutes_ago(1), priority=7)
    plain = new_job(workspace, queued_at=minutes_ago(10))
    await enqueue(conn, urgent, plain)
    runner = await manual_session(conn, workspace)
    assert await claimed_ex(conn, runner) == ex(urgent)
    late = new_job(workspace, priority=7)  # same priority, younger: stays behind the put-back
    await enqueue(conn, late)
    assert await queue.put_back(conn, ex(urgent), runner.runner_session_id)
    assert [await claimed_ex(conn, runner) for _ in range(3)] == [ex(urgent), ex(late), ex(plain)]


async def test_q06_a_batch_claim_serves_sessions_in_priority_order(
    conn: Conn, workspace: UUID
) -> None:
    jobs = [
        new_job(workspace, queued_at=minutes_ago(5), priority=1),
        new_job(workspace, queued_at=minutes_ago(9)),
        new_job(workspace, queued_at=minutes_ago(1), priority=2),
    ]
    await enqueue(conn, *jobs)
    runners = [await manual_session(conn, workspace) for _ in range(3)]
    ids = [r.runner_session_id for r in runners]
    claimed = await claiming.claim_batch(conn, workspace, runners[0].labels, ids)
    assert [ex_of.identity.job_execution_id for ex_of in (claimed[i] for i in ids)] == [
        ex(jobs[2]),
        ex(jobs[0]),
        ex(jobs[1]),
    ]


async def test_q07_priority_is_per_workspace(conn: Conn, workspace: UUID) -> None:
    elsewhere = new_job(uuid.uuid4(), priority=100)
    mine = new_job(workspace, queued_at=minutes_ago(1))
    await enqueue(conn, elsewhere, mine)
    runner = await manual_session(conn, workspace)
    assert await claimed_ex(conn, runner) == ex(mine)
    assert await claimed_ex(conn, runner) is None


# --- concurrency keys -------------------------------------------------------------------------


async def one_running_one_waiting(
    conn: Conn, workspace: UUID
) -> tuple[NewJob, NewJob, SessionClaims]:
    """Two jobs of key `deploy` (limit 1), the first claimed by the returned runner."""
    first = new_job(workspace, queued_at=minutes_ago(10), key=("deploy", 1))
    second = new_job(workspace, queued_at=minutes_ago(9), key=("deploy", 1))
    await enqueue(conn, first, second)
    runner = await manual_session(conn, workspace)
    assert await claimed_ex(conn, runner) == ex(first)
    return first, second, runner


async def test_q10_a_full_key_waits_without_blocking_the_jobs_behind_it(
    conn: Conn, workspace: UUID
) -> None:
    first = new_job(workspace, queued_at=minutes_ago(10), key=("deploy", 1))
    second = new_job(workspace, queued_at=minutes_ago(9), key=("deploy", 1))
    free = new_job(workspace, queued_at=minutes_ago(8))
    await enqueue(conn, first, second, free)
    runner = await manual_session(conn, workspace)
    assert await claimed_ex(conn, runner) == ex(first)
    assert await claimed_ex(conn, runner) == ex(free)
    assert await claimed_ex(conn, runner) is None
    assert await pending_ids(conn, workspace) == [ex(second)]
    assert await key_running(conn, workspace, "deploy") == 1


async def test_q11_completing_a_keyed_lease_lets_the_next_job_of_the_key_run(
    conn: Conn, workspace: UUID
) -> None:
    first, second, runner = await one_running_one_waiting(conn, workspace)
    assert await claimed_ex(conn, runner) is None
    await leases.complete(conn, ex(first), runner.runner_session_id, Outcome.SUCCEEDED)
    assert await key_running(conn, workspace, "deploy") == 0
    assert await claimed_ex(conn, runner) == ex(second)


async def test_q12_a_cancelled_lease_holds_its_slot_until_its_runner_completes(
    conn: Conn, workspace: UUID
) -> None:
    first, second, runner = await one_running_one_waiting(conn, workspace)
    await leases.reconcile(conn, ex(first), Outcome.CANCELLED)
    assert await claimed_ex(conn, runner) is None  # still running: the runner drains it
    await leases.complete(conn, ex(first), runner.runner_session_id, Outcome.CANCELLED)
    assert await claimed_ex(conn, runner) == ex(second)


async def test_q13_a_reaped_keyed_lease_frees_its_slot(conn: Conn, workspace: UUID) -> None:
    first, second, runner = await one_running_one_waiting(conn, workspace)
    await make_stale(conn, ex(first))
    [reaped] = await leases.reap(conn, StaleRule())
    assert reaped.identity.job_execution_id == ex(first)
    assert await claimed_ex(conn, runner) == ex(second)


async def test_q14_a_put_back_frees_the_slot_and_keeps_the_key(conn: Conn, workspace: UUID) -> None:
    first, _, runner = await one_running_one_waiting(conn, workspace)
    assert await queue.put_back(conn, ex(first), runner.runner_session_id)
    assert await key_running(conn, workspace, "deploy") == 0
    assert await claimed_ex(conn, runner) == ex(first)  # its place, ahead of the second
    assert await claimed_ex(conn, runner) is None  # and the key is full again


async def test_q15_a_limit_of_n_runs_n_at_once(conn: Conn, workspace: UUID) -> None:
    jobs = [new_job(workspace, queued_at=minutes_ago(10 - i), key=("db", 3)) for i in range(5)]
    await enqueue(conn, *jobs)
    runner = await manual_session(conn, workspace)
    got = [await claimed_ex(conn, runner) for _ in range(4)]
    assert got == [*map(ex, jobs[:3]), None]
    assert await key_running(conn, workspace, "db") == 3


async def test_q16_a_key_counts_per_workspace(conn: Conn, workspace: UUID) -> None:
    other = uuid.uuid4()
    mine = new_job(workspace, key=("deploy", 1))
    theirs = new_job(other, key=("deploy", 1))
    await enqueue(conn, mine, theirs)
    assert await claimed_ex(conn, await manual_session(conn, workspace)) == ex(mine)
    assert await claimed_ex(conn, await manual_session(conn, other)) == ex(theirs)


async def test_q17_a_batch_admits_the_keys_free_slots_and_serves_the_jobs_behind(
    conn: Conn, workspace: UUID
) -> None:
    keyed = [new_job(workspace, queued_at=minutes_ago(30 - i), key=("k", 2)) for i in range(40)]
    free = [new_job(workspace, queued_at=minutes_ago(5 - i)) for i in range(3)]
    await enqueue(conn, *keyed, *free)
    runners = [await manual_session(conn, workspace) for _ in range(5)]
    ids = [r.runner_session_id for r in runners]
    claimed = await claiming.claim_batch(conn, workspace, runners[0].labels, ids)
    got = {job.identity.job_execution_id for job in claimed.values()}
    assert got == {ex(keyed[0]), ex(keyed[1]), *map(ex, free)}
    assert await key_running(conn, workspace, "k") == 2


async def test_q18_two_claims_admitting_the_last_slot_at_once_only_one_wins(
    pool: asyncpg.Pool, workspace: UUID, observer: asyncpg.Connection
) -> None:
    # Forced: the first claim has admitted the key's last slot and not yet committed (its
    # transaction holds the key row); the second claim runs in full meanwhile. It must neither
    # wait (a claim never waits for a lock) nor admit a second job of the key.
    jobs = [new_job(workspace, queued_at=minutes_ago(10 - i), key=("deploy", 1)) for i in range(3)]
    async with pool.acquire() as setup:
        await enqueue(setup, *jobs)
        first_runner = await manual_session(setup, workspace)
        second_runner = await manual_session(setup, workspace)
    async with pool.acquire() as one, pool.acquire() as two:
        async with one.transaction():
            assert await claimed_ex(one, first_runner) == ex(jobs[0])
            with anyio.fail_after(10):
                assert await claimed_ex(two, second_runner) is None
        # committed: the key is full for everyone
        assert await claimed_ex(two, second_runner) is None
    assert await key_running(observer, workspace, "deploy") == 1
    running = await observer.fetchval(
        "SELECT count(*) FROM running_jobs WHERE workspace_id = $1", workspace
    )
    assert running == 1


async def test_q19_a_released_slot_wakes_the_runners_of_the_keys_waiting_jobs(
    conn: Conn, workspace: UUID, database_url: str
) -> None:
    first = new_job(workspace, ["linux"], queued_at=minutes_ago(10), key=("deploy", 1))
    waiting = new_job(workspace, ["gpu", "linux"], queued_at=minutes_ago(9), key=("deploy", 1))
    await enqueue(conn, first, waiting)
    runner = await manual_session(conn, workspace, ("gpu", "linux"))
    assert await claimed_ex(conn, runner) == ex(first)
    heard: list[str] = []
    got = anyio.Event()
    listener = await asyncpg.connect(database_url)
    try:

        def on_notify(
            _c: asyncpg.Connection | asyncpg.pool.PoolConnectionProxy,
            _pid: int,
            _channel: str,
            payload: object,
        ) -> None:
            heard.append(str(payload))
            got.set()

        await listener.add_listener(queue.ENQUEUED_CHANNEL, on_notify)
        await leases.complete(conn, ex(first), runner.runner_session_id, Outcome.SUCCEEDED)
        with anyio.fail_after(10):
            await got.wait()
    finally:
        await listener.close()
    assert heard == [queue.enqueued_payload(workspace, ("gpu", "linux"))]


async def test_q23_a_key_with_a_running_job_does_not_count_its_waiting_jobs_as_startable(
    conn: Conn, workspace: UUID
) -> None:
    jobs = [new_job(workspace, queued_at=minutes_ago(10 - i), key=("deploy", 2)) for i in range(5)]
    free = new_job(workspace)
    await enqueue(conn, *jobs, free)
    groups = await demand_inputs.startable_demand(conn, workspace)
    assert sum(g.queued for g in groups) == 3  # the key's two free slots and the unkeyed job
    runner = await manual_session(conn, workspace)
    assert await claimed_ex(conn, runner) == ex(jobs[0])
    groups = await demand_inputs.startable_demand(conn, workspace)
    assert sum(g.queued for g in groups) == 2


# --- fair share -------------------------------------------------------------------------------


async def test_q30_fair_serves_the_project_with_fewest_running_first(
    conn: Conn, workspace: UUID
) -> None:
    busy, quiet = uuid.uuid4(), uuid.uuid4()
    busy_jobs = [
        new_job(workspace, queued_at=minutes_ago(60 - i), project_id=busy) for i in range(3)
    ]
    quiet_job = new_job(workspace, queued_at=minutes_ago(1), project_id=quiet)
    await enqueue(conn, *busy_jobs, quiet_job)
    runner = await manual_session(conn, workspace)
    assert await claimed_ex(conn, runner) == ex(busy_jobs[0])  # fifo: oldest first
    assert await ordering.set_workspace_ordering(conn, workspace, Ordering.FAIR)
    assert await claimed_ex(conn, runner) == ex(quiet_job)  # busy runs 1, quiet 0
    assert await claimed_ex(conn, runner) == ex(busy_jobs[1])


async def test_q31_fair_ties_go_by_priority_then_age(conn: Conn, workspace: UUID) -> None:
    await ordering.set_workspace_ordering(conn, workspace, Ordering.FAIR)
    a, b, c = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    old = new_job(workspace, queued_at=minutes_ago(30), project_id=a)
    urgent = new_job(workspace, queued_at=minutes_ago(1), project_id=b, priority=4)
    young = new_job(workspace, queued_at=minutes_ago(2), project_id=c)
    await enqueue(conn, old, urgent, young)
    runner = await manual_session(conn, workspace)
    assert [await claimed_ex(conn, runner) for _ in range(3)] == [ex(urgent), ex(old), ex(young)]


async def test_q32_fifo_ignores_how_many_a_project_runs(conn: Conn, workspace: UUID) -> None:
    busy, quiet = uuid.uuid4(), uuid.uuid4()
    busy_jobs = [
        new_job(workspace, queued_at=minutes_ago(60 - i), project_id=busy) for i in range(2)
    ]
    quiet_job = new_job(workspace, queued_at=minutes_ago(1), project_id=quiet)
    await enqueue(conn, *busy_jobs, quiet_job)
    assert await ordering.workspace_ordering(conn, workspace) is Ordering.FIFO
    runner = await manual_session(conn, workspace)
    assert [await claimed_ex(conn, runner) for _ in range(3)] == [
        *map(ex, busy_jobs),
        ex(quiet_job),
    ]


async def test_q34_a_fair_batch_interleaves_the_projects(conn: Conn, workspace: UUID) -> None:
    await ordering.set_workspace_ordering(conn, workspace, Ordering.FAIR)
    a, b = uuid.uuid4(), uuid.uuid4()
    a_jobs = [new_job(workspace, queued_at=minutes_ago(60 - i), project_id=a) for i in range(4)]
    b_jobs = [new_job(workspace, queued_at=minutes_ago(10 - i), project_id=b) for i in range(4)]
    await enqueue(conn, *a_jobs, *b_jobs)
    runners = [await manual_session(conn, workspace) for _ in range(4)]
    ids = [r.runner_session_id for r in runners]
    claimed = await claiming.claim_batch(conn, workspace, runners[0].labels, ids)
    assert [claimed[i].identity.job_execution_id for i in ids] == [
        ex(a_jobs[0]),
        ex(b_jobs[0]),
        ex(a_jobs[1]),
        ex(b_jobs[1]),
    ]


async def test_q35_fair_keeps_concurrency_keys(conn: Conn, workspace: UUID) -> None:
    await ordering.set_workspace_ordering(conn, workspace, Ordering.FAIR)
    a, b = uuid.uuid4(), uuid.uuid4()
    keyed = [
        new_job(workspace, queued_at=minutes_ago(9 - i), project_id=a, key=("k", 1))
        for i in range(2)
    ]
    other = new_job(workspace, queued_at=minutes_ago(1), project_id=b)
    await enqueue(conn, *keyed, other)
    runner = await manual_session(conn, workspace)
    got = [await claimed_ex(conn, runner) for _ in range(3)]
    assert got == [ex(keyed[0]), ex(other), None]


async def test_q36_with_every_policy_off_the_claim_walks_the_priority_index(
    conn: Conn, workspace: UUID
) -> None:
    jobs = [new_job(workspace, queued_at=minutes_ago(3000 - i)) for i in range(3000)]
    ran = [n for n in await claim_reads(conn, workspace, jobs) if n["Actual Loops"] > 0]
    # The index walk stops at the first row; the only other read of pending_jobs is the
    # delete's primary-key probe. The statement has no fair pick (test_ordering_choice.py).
    assert [(n["Node Type"], n.get("Index Name"), n["Actual Rows"]) for n in ran] == [
        ("Index Scan", "pending_jobs_workspace_priority_created_idx", 1),
        ("Index Scan", "pending_jobs_pkey", 1),
    ]
    assert await pending_ids(conn, workspace) == [ex(j) for j in jobs[1:]]


async def test_q36_with_every_policy_off_the_claim_sorts_nothing_and_reads_each_guard_once(
    conn: Conn, workspace: UUID
) -> None:
    # What a claim pays for the policies when no job uses one: the one-time guards (pauses, the
    # ordering setting) and per-row filters, but no sort or window over its one candidate, no
    # read of the key rows for an unkeyed candidate, and the ordering setting read once (the
    # `fair` it returns is the pick's guard when the pick found a row). Each of these is planned
    # again for the first claims of every connection (store/claiming.py, `_claim_statement`).
    await enqueue(conn, *[new_job(workspace) for _ in range(20)])
    runner = await manual_session(conn, workspace)
    plan = await conn.fetchval(
        "EXPLAIN (ANALYZE, FORMAT JSON) " + claiming._CLAIM[False], *claim_args(runner)
    )
    nodes = plan_nodes(json.loads(plan)[0]["Plan"])
    assert not [n["Node Type"] for n in nodes if n["Node Type"] in ("Sort", "WindowAgg", "Hash")]
    reads = [n["Relation Name"] for n in nodes if n["Actual Loops"] > 0 and "Relation Name" in n]
    assert reads.count("workspace_settings") == 1
    assert "concurrency_keys" not in reads
    assert len(await pending_ids(conn, workspace)) == 19


async def claim_reads(
    conn: Conn, workspace: UUID, jobs: list[NewJob], *, fair: bool = False
) -> list[dict[str, Any]]:
    """Enqueue `jobs`, analyse, and EXPLAIN ANALYZE one claim of a new session by the statement
    of the workspace's ordering (`fair`): the plan's nodes that read pending_jobs (the delete
    itself left out)."""
    for start in range(0, len(jobs), 500):
        await enqueue(conn, *jobs[start : start + 500])
    await conn.execute("ANALYZE pending_jobs")
    runner = await manual_session(conn, workspace)
    plan = await conn.fetchval(
        "EXPLAIN (ANALYZE, FORMAT JSON) " + claiming._CLAIM[fair], *claim_args(runner)
    )
    return [
        n
        for n in plan_nodes(json.loads(plan)[0]["Plan"])
        if n.get("Relation Name") == "pending_jobs" and n["Node Type"] != "ModifyTable"
    ]


def claim_args(runner: SessionClaims) -> tuple[object, ...]:
    """The parameters of one uncapped claim statement (store/claiming.py `_CLAIM`) by `runner`,
    with nothing stepped over."""
    return (
        runner.workspace_id,
        list(runner.labels),
        [],
        runner.runner_session_id,
        None,
        None,
        timedelta(seconds=10),
        False,
    )


async def test_q37_put_back_restores_key_and_limit(conn: Conn, workspace: UUID) -> None:
    job = new_job(workspace, key=("deploy", 4), priority=2)
    await enqueue(conn, job)
    runner = await manual_session(conn, workspace)
    await claim_ok(conn, runner)
    assert await queue.put_back(conn, ex(job), runner.runner_session_id)
    row = await conn.fetchrow(
        "SELECT priority, concurrency_key, concurrency_limit FROM pending_jobs"
        " WHERE job_execution_id = $1",
        ex(job),
    )
    assert row is not None and tuple(row) == (2, "deploy", 4)
