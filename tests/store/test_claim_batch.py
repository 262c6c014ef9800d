"""The batch claim the dispatcher uses for a run of waiters with the same labels: the same FIFO
outcome, events and lock rules as claiming for each session in turn, in one statement."""

from __future__ import annotations

import json
import uuid
from uuid import UUID

import pytest

from controlplane.domain.jobs import SessionClaims
from controlplane.domain.pauses import Operator, PauseKind
from controlplane.store import claiming, locks, pauses
from controlplane.store.pool import Conn
from controlplane.store.records import json_value
from tests.factories import holding_lock, manual_session, minutes_ago, new_job, plan_nodes
from tests.store.test_claim import (
    claimed_events,
    enqueue,
    pending_ids,
    running_row,
    running_with_orphan,
)

OPERATOR = Operator(uuid.uuid4(), "ops-key")


async def sessions_of(conn: Conn, workspace: UUID, count: int) -> list[SessionClaims]:
    return [await manual_session(conn, workspace) for _ in range(count)]


async def test_the_kth_oldest_job_goes_to_the_kth_session_with_one_event_each(
    conn: Conn, workspace: UUID
) -> None:
    jobs = [new_job(workspace, queued_at=minutes_ago(10 - index)) for index in range(5)]
    await enqueue(conn, *reversed(jobs))  # insertion order does not matter, queued_at does
    runners = await sessions_of(conn, workspace, 3)
    ids = [session.runner_session_id for session in runners]

    claimed = await claiming.claim_batch(conn, workspace, runners[0].labels, ids)

    assert [claimed[i].identity for i in ids] == [job.identity for job in jobs[:3]]
    for session_id, job in zip(ids, jobs[:3], strict=True):
        row = await running_row(conn, job.identity.job_execution_id)
        assert row["runner_session_id"] == session_id
        assert row["first_heartbeat_at"] is None
    assert await pending_ids(conn, workspace) == [j.identity.job_execution_id for j in jobs[3:]]
    events = await claimed_events(conn, workspace)
    assert [e["job_execution_id"] for e in events] == [
        j.identity.job_execution_id for j in jobs[:3]
    ]
    assert [json_value(e["payload"])["runner_session_id"] for e in events] == [str(i) for i in ids]


async def test_fewer_jobs_than_sessions_serves_the_first_sessions(
    conn: Conn, workspace: UUID
) -> None:
    jobs = [new_job(workspace, queued_at=minutes_ago(2)), new_job(workspace)]
    await enqueue(conn, *jobs)
    runners = await sessions_of(conn, workspace, 4)
    ids = [session.runner_session_id for session in runners]

    claimed = await claiming.claim_batch(conn, workspace, runners[0].labels, ids)

    assert list(claimed) == ids[:2]
    assert await pending_ids(conn, workspace) == []
    assert await claiming.claim_batch(conn, workspace, runners[0].labels, ids[2:]) == {}


async def test_labels_still_match_by_subset(conn: Conn, workspace: UUID) -> None:
    wide = new_job(workspace, ["linux", "gpu"], queued_at=minutes_ago(3))
    fits = new_job(workspace, ["linux"], queued_at=minutes_ago(2))
    await enqueue(conn, wide, fits)
    runners = await sessions_of(conn, workspace, 2)  # linux, x64: no gpu

    claimed = await claiming.claim_batch(
        conn, workspace, runners[0].labels, [s.runner_session_id for s in runners]
    )

    assert [job.identity for job in claimed.values()] == [fits.identity]
    assert await pending_ids(conn, workspace) == [wide.identity.job_execution_id]


async def test_a_busy_head_is_stepped_over_and_every_session_is_still_served(
    conn: Conn, database_url: str, workspace: UUID
) -> None:
    """The oldest row's execution lock is held from a second connection (an enqueue replay or a
    reconcile in flight): the batch steps over it and serves both sessions from the rows behind."""
    head, second, third = (new_job(workspace, queued_at=minutes_ago(m)) for m in (3, 2, 1))
    await enqueue(conn, head, second, third)
    runners = await sessions_of(conn, workspace, 2)
    ids = [session.runner_session_id for session in runners]

    async with holding_lock(database_url, locks.execution(head.identity.job_execution_id)):
        claimed = await claiming.claim_batch(conn, workspace, runners[0].labels, ids)

    # The busy head is skipped: the first session gets the second row; the second session,
    # left unserved by that round, gets the third in the retry that steps over the head.
    assert claimed[ids[0]].identity == second.identity
    assert claimed[ids[1]].identity == third.identity
    assert await pending_ids(conn, workspace) == [head.identity.job_execution_id]


async def test_an_orphan_is_dropped_without_a_lease_and_the_session_served_from_behind(
    conn: Conn, workspace: UUID
) -> None:
    orphan = await running_with_orphan(conn, workspace, orphan_queued_at=minutes_ago(40))
    before = await running_row(conn, orphan.identity.job_execution_id)
    genuine = new_job(workspace, queued_at=minutes_ago(1))
    await enqueue(conn, genuine)
    runners = await sessions_of(conn, workspace, 2)
    ids = [session.runner_session_id for session in runners]
    events_before = len(await claimed_events(conn, workspace))

    claimed = await claiming.claim_batch(conn, workspace, runners[0].labels, ids)

    assert [job.identity for job in claimed.values()] == [genuine.identity]
    assert await running_row(conn, orphan.identity.job_execution_id) == before
    assert await pending_ids(conn, workspace) == []
    assert len(await claimed_events(conn, workspace)) == events_before + 1


async def test_a_session_twice_or_too_many_sessions_is_refused_and_changes_nothing(
    conn: Conn, workspace: UUID
) -> None:
    job = new_job(workspace)
    await enqueue(conn, job)
    runner = await manual_session(conn, workspace)
    twice = [runner.runner_session_id, runner.runner_session_id]
    too_many = [(await manual_session(conn, workspace)).runner_session_id for _ in range(101)]

    for session_ids in (twice, too_many):
        with pytest.raises(ValueError, match="distinct sessions"):
            await claiming.claim_batch(conn, workspace, runner.labels, session_ids)

    assert await pending_ids(conn, workspace) == [job.identity.job_execution_id]


async def test_the_sessions_are_checked_for_pauses_in_one_read_when_none_is_paused(
    conn: Conn, workspace: UUID
) -> None:
    # A batch serves its sessions that are not paused. When none is, one probe of paused_runners
    # says so for them all: the sessions are not read one by one (probed, numbered, joined to the
    # leases), which the dispatcher's batches of up to MAX_BATCH paid at every claim, found or
    # empty (store/claiming.py, `_NOT_PAUSED`).
    jobs = [new_job(workspace, queued_at=minutes_ago(3 - n)) for n in range(2)]
    await enqueue(conn, *jobs)
    runners = await sessions_of(conn, workspace, 5)
    ids = [session.runner_session_id for session in runners]

    plan = await conn.fetchval(
        "EXPLAIN (ANALYZE, FORMAT JSON) " + claiming._CLAIM_BATCH[False],
        workspace,
        list(runners[0].labels),
        [],
        ids,
    )

    ran = [n for n in plan_nodes(json.loads(plan)[0]["Plan"]) if n["Actual Loops"] > 0]
    assert sum(n["Actual Loops"] for n in ran if n.get("Relation Name") == "paused_runners") == 1
    assert [n for n in ran if n["Node Type"] == "Function Scan"] == []  # no unnest of the sessions
    leased = await conn.fetch(
        "SELECT job_execution_id, runner_session_id FROM running_jobs WHERE workspace_id = $1",
        workspace,
    )
    assert {(r["job_execution_id"], r["runner_session_id"]) for r in leased} == {
        (jobs[0].identity.job_execution_id, ids[0]),
        (jobs[1].identity.job_execution_id, ids[1]),
    }


async def test_paused_sessions_anywhere_in_the_batch_are_left_out_and_the_rest_served_in_order(
    conn: Conn, workspace: UUID
) -> None:
    jobs = [new_job(workspace, queued_at=minutes_ago(5 - n)) for n in range(3)]
    await enqueue(conn, *jobs)
    runners = await sessions_of(conn, workspace, 5)
    ids = [session.runner_session_id for session in runners]
    for paused in (ids[0], ids[2], ids[4]):
        await pauses.change(
            conn, PauseKind.RUNNER, paused, paused=True, operator=OPERATOR, reason=None
        )

    claimed = await claiming.claim_batch(conn, workspace, runners[0].labels, ids)

    assert {session: job.identity for session, job in claimed.items()} == {
        ids[1]: jobs[0].identity,
        ids[3]: jobs[1].identity,
    }
    # Every session paused: nothing is taken.
    assert await claiming.claim_batch(conn, workspace, runners[0].labels, [ids[0], ids[4]]) == {}
    assert await pending_ids(conn, workspace) == [jobs[2].identity.job_execution_id]
