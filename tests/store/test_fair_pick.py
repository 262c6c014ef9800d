"""The fair pick (store/ordering.py `fair_pick`) against a real PostgreSQL: on random queues it
returns exactly the rows, in the same order and with the same shares, as the full ranking it
replaced (every claimable row of the workspace numbered within its project), and it reads each
project's first rows instead of the whole workspace (docs/policies.md Q-29)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import timedelta
from uuid import UUID

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.store import ordering
from controlplane.store.ordering import Ordering
from controlplane.store.pool import Conn
from tests.factories import manual_session, minutes_ago, new_job
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
    project=st.integers(0, 2),
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


_queue = st.builds(
    Queue,
    jobs=st.lists(_job, max_size=20),
    running=st.lists(st.integers(0, 3), min_size=3, max_size=3),
    key_running=st.fixed_dictionaries({key: st.integers(0, limit) for key, limit in _KEYS.items()}),
    stepped_over=st.lists(st.integers(0, 19), max_size=3),
    session_labels=st.integers(0, 1),
    limit=st.integers(1, 8),
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


@settings(
    max_examples=100,
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
    got = await conn.fetch(ordering.fair_pick(str(queue.limit), ""), *args)
    assert [tuple(row) for row in got] == [tuple(row) for row in expected]
    # And nothing at all for a workspace that orders by priority and FIFO.
    await conn.execute(
        "UPDATE workspace_settings SET ordering = 'fifo' WHERE workspace_id = $1", workspace
    )
    assert await conn.fetch(ordering.fair_pick(str(queue.limit), ""), *args) == []


async def test_q29_a_fair_claim_reads_each_projects_head_not_the_workspace(
    conn: Conn, workspace: UUID
) -> None:
    await ordering.set_workspace_ordering(conn, workspace, Ordering.FAIR)
    projects = [uuid.uuid4() for _ in range(4)]
    jobs = [
        new_job(workspace, queued_at=minutes_ago(2000 - i), project_id=projects[i % 4])
        for i in range(2000)
    ]
    reads = await claim_reads(conn, workspace, jobs, fair=True)
    # Per project: one skip-scan probe and one row of its head (limit 1); then the candidate's
    # lock and the delete's primary-key probes (10 rows in all). Never a read of the 2,000.
    read = sum(n["Actual Rows"] * n["Actual Loops"] for n in reads)
    assert read <= 2 * 4 + 2, [
        (n.get("Index Name"), n["Actual Rows"], n["Actual Loops"]) for n in reads
    ]
    assert all(n["Node Type"] != "Seq Scan" for n in reads), reads
    assert (
        await conn.fetchval("SELECT count(*) FROM running_jobs WHERE workspace_id = $1", workspace)
        == 1
    )
