"""The fair pick (store/ordering.py `fair_pick`) against a real PostgreSQL: on random queues it
returns exactly the rows, in the same order and with the same shares, as the full ranking it
replaced (every claimable row of the workspace numbered within its project), and it reads each
project's first rows instead of the whole workspace (docs/policies.md Q-29)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from uuid import UUID

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from controlplane.store import claiming, ordering
from controlplane.store.ordering import Ordering
from controlplane.store.pool import Conn
from tests.factories import manual_session, minutes_ago, new_job
from tests.store.test_claim import enqueue
from tests.store.test_ordering import claim_reads

_COLUMNS = "id, job_execution_id, concurrency_key, concurrency_limit, priority, created_at"

# The pick as it was before sql/0024: a window over every claimable row of the workspace, each
# with a correlated count of its project's leases. The reference the new pick must equal.
_FULL_RANK = f"""SELECT {_COLUMNS}, share FROM (
      SELECT {_COLUMNS},
             coalesce((SELECT count(*) FROM running_jobs r
                       WHERE r.workspace_id = $1
                         AND r.project_id = pending_jobs.project_id), 0)
             + row_number() OVER (PARTITION BY project_id ORDER BY {ordering.PLAIN_ORDER})
             AS share
      FROM pending_jobs
      WHERE {ordering.CLAIMABLE} AND {ordering.FAIR}) AS ranked
  ORDER BY share, {ordering.PLAIN_ORDER}
  LIMIT $4"""  # noqa: S608 -- store/ordering.py's constants only

# Keys and their limits; a key's `running` is drawn below its limit or at it (full).
_KEYS = {"k1": 1, "k2": 2}
_LABELS = (["linux"], ["linux", "gpu"])


@dataclass(frozen=True)
class Job:
    project: int
    priority: int
    age: int  # minutes; equal ages tie and are ordered by id
    labels: int
    key: str | None


_job = st.builds(
    Job,
    project=st.integers(0, 4),
    priority=st.integers(-1, 1),
    age=st.integers(0, 4),
    labels=st.integers(0, 1),
    key=st.sampled_from([None, None, "k1", "k2"]),
)


@dataclass(frozen=True)
class Queue:
    jobs: list[Job]
    running: list[int]  # leases per project
    key_running: dict[str, int]
    stepped_over: list[int]  # indexes into jobs
    session_labels: int
    limit: int
    bound: int  # the walk's bound beyond the limit (ordering.FAIR_WALK in claims)


_queue = st.builds(
    Queue,
    jobs=st.lists(_job, max_size=20),
    # Projects with no lease (the walk's heads), one lease, and busy ones.
    running=st.lists(st.sampled_from([0, 0, 1, 2, 4]), min_size=5, max_size=5),
    key_running=st.fixed_dictionaries({key: st.integers(0, limit) for key, limit in _KEYS.items()}),
    stepped_over=st.lists(st.integers(0, 19), max_size=3),
    session_labels=st.integers(0, 1),
    limit=st.integers(1, 8),
    bound=st.integers(0, 6),
)


async def _fill(conn: Conn, workspace: UUID, queue: Queue) -> list[UUID]:
    """The queue's rows, written directly (the pick reads tables, not how they were filled)."""
    projects = [uuid.uuid4() for _ in queue.running]
    session = await manual_session(conn, workspace, ("linux", "gpu"))
    await conn.execute(
        "INSERT INTO workspace_settings (workspace_id, ordering) VALUES ($1, 'fair')", workspace
    )
    await conn.executemany(
        "INSERT INTO concurrency_keys (workspace_id, concurrency_key, running) VALUES ($1, $2, $3)",
        [(workspace, key, running) for key, running in queue.key_running.items()],
    )
    ids: list[UUID] = []
    now = minutes_ago(0)  # one instant, so that equal ages tie and the id decides
    for job in queue.jobs:
        ids.append(
            await conn.fetchval(
                """
                INSERT INTO pending_jobs (workspace_id, workflow_run_id, workflow_run_attempt_id,
                    job_id, job_execution_id, project_id, required_labels, created_at, priority,
                    concurrency_key, concurrency_limit)
                VALUES ($1, gen_random_uuid(), gen_random_uuid(), gen_random_uuid(),
                        gen_random_uuid(), $2, $3, $4, $5, $6, $7)
                RETURNING id
                """,
                workspace,
                projects[job.project],
                _LABELS[job.labels],
                now - timedelta(minutes=job.age),
                job.priority,
                job.key,
                None if job.key is None else _KEYS[job.key],
            )
        )
    for project, leases in zip(projects, queue.running, strict=True):
        for _ in range(leases):
            await conn.execute(
                """
                INSERT INTO running_jobs (pending_id, workspace_id, workflow_run_id,
                    workflow_run_attempt_id, job_id, job_execution_id, project_id,
                    runner_session_id, required_labels, runner_labels, payload, queued_at)
                VALUES (gen_random_uuid(), $1, gen_random_uuid(), gen_random_uuid(),
                        gen_random_uuid(), gen_random_uuid(), $2, $3, '{linux}', '{linux}',
                        '{}', now())
                """,
                workspace,
                project,
                session.runner_session_id,
            )
    return ids


# Shapes the random queues may miss, each through a different way of the pick (store/ordering.py,
# "The fair pick"): a hot leased project owning the front of the walk (every project probed),
# many projects with no lease (their heads on the walk), heads the session's labels or a full key
# skip, and a queue shorter than the walk (the walk ranked whole).
_HOT = [Job(0, 0, 4, 0, None)] * 6 + [Job(p, 0, 1, 0, None) for p in range(1, 5)]
_SKIPPED = [Job(p, 1, 4, 1, None) for p in range(5)] + [Job(p, 0, 2, 0, "k1") for p in range(5)]


@example(Queue(_HOT, [4, 0, 0, 0, 0], {"k1": 0, "k2": 0}, [], 0, 1, 2))
@example(Queue(_HOT, [4, 0, 1, 0, 0], {"k1": 0, "k2": 0}, [], 0, 3, 2))
@example(Queue(_HOT, [2, 1, 1, 1, 1], {"k1": 0, "k2": 0}, [6], 0, 4, 0))
@example(Queue([Job(p % 5, 0, p % 3, 0, None) for p in range(15)], [0] * 5, {}, [], 0, 4, 0))
@example(Queue(_SKIPPED, [0, 1, 0, 2, 0], {"k1": 1, "k2": 0}, [], 0, 2, 1))
@example(Queue(_SKIPPED, [0, 1, 0, 2, 0], {"k1": 0, "k2": 0}, [], 0, 3, 6))
@settings(
    max_examples=200,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(queue=_queue)
async def test_q29_the_fair_pick_equals_the_full_ranking_row_for_row(
    conn: Conn, queue: Queue
) -> None:
    workspace = uuid.uuid4()  # one per example: the examples share the database
    ids = await _fill(conn, workspace, queue)
    args = (
        workspace,
        _LABELS[queue.session_labels],
        [ids[i] for i in queue.stepped_over if i < len(ids)],
    )
    expected = await conn.fetch(_FULL_RANK, *args, queue.limit)
    got = await conn.fetch(ordering.fair_pick(str(queue.limit), "", queue.bound), *args)
    assert [tuple(row) for row in got] == [tuple(row) for row in expected]
    # And nothing at all for a workspace that orders by priority and FIFO.
    await conn.execute(
        "UPDATE workspace_settings SET ordering = 'fifo' WHERE workspace_id = $1", workspace
    )
    assert await conn.fetch(ordering.fair_pick(str(queue.limit), ""), *args) == []


def _read(reads: list[dict[str, Any]]) -> int:
    return sum(n["Actual Rows"] * n["Actual Loops"] for n in reads)


async def test_q29_a_fair_claim_with_no_leases_reads_the_plain_walks_first_row(
    conn: Conn, workspace: UUID
) -> None:
    await ordering.set_workspace_ordering(conn, workspace, Ordering.FAIR)
    projects = [uuid.uuid4() for _ in range(100)]
    jobs = [
        new_job(workspace, queued_at=minutes_ago(2000 - i), project_id=projects[i % 100])
        for i in range(2000)
    ]
    reads = await claim_reads(conn, workspace, jobs, fair=True)
    # The walk's first row is a project with no lease, so its head and the fair pick (share 1,
    # first by priority and age); then the candidate's lock and the delete's primary-key probe.
    # Neither the 100 projects nor the 2,000 rows.
    assert _read(reads) <= 3, [
        (n.get("Index Name"), n["Actual Rows"], n["Actual Loops"]) for n in reads
    ]
    assert all(n["Node Type"] != "Seq Scan" for n in reads), reads
    assert (
        await conn.fetchval("SELECT count(*) FROM running_jobs WHERE workspace_id = $1", workspace)
        == 1
    )


async def test_q29_a_hot_leased_project_costs_the_bounded_walk_then_each_projects_head(
    conn: Conn, workspace: UUID
) -> None:
    await ordering.set_workspace_ordering(conn, workspace, Ordering.FAIR)
    hot, *others = (uuid.uuid4() for _ in range(21))
    # The hot project's 1,000 jobs are the oldest; one of them is leased (the first claim).
    jobs = [
        new_job(workspace, queued_at=minutes_ago(5000 - i), project_id=hot) for i in range(1000)
    ]
    quiet = [
        new_job(workspace, queued_at=minutes_ago(20 - i), project_id=p)
        for i, p in enumerate(others)
    ]
    await enqueue(conn, *jobs[:1])
    first = await claiming.claim(conn, await manual_session(conn, workspace))
    assert first is not None and first.identity.project_id == hot
    reads = await claim_reads(conn, workspace, jobs[1:] + quiet, fair=True)
    # The walk finds only the hot project's rows up to its bound, so every project is probed:
    # one skip-scan probe and its head each. Never the 999 hot rows.
    assert _read(reads) <= ordering.FAIR_WALK + 1 + 2 * 21 + 2, [
        (n.get("Index Name"), n["Actual Rows"], n["Actual Loops"]) for n in reads
    ]
    taken = await conn.fetchval(
        "SELECT job_execution_id FROM running_jobs WHERE workspace_id = $1 AND project_id <> $2",
        workspace,
        hot,
    )
    assert taken == quiet[0].identity.job_execution_id  # the oldest head of a quiet project
