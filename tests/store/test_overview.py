"""The overview's one read against a real PostgreSQL: on one seeded queue it answers exactly what
the five reads it replaced answer in a row (pending groups, live runners, the counts of the
workspaces those name, the depth, the paused workspaces)."""

from __future__ import annotations

import uuid
from datetime import timedelta

from controlplane.domain.pauses import Operator, PauseKind
from controlplane.store import claiming, job_views, pauses, queries, queue
from controlplane.store.overview import Overview, overview
from controlplane.store.pool import Conn
from tests.factories import manual_session, new_job

WINDOW = timedelta(minutes=5)


async def _separate_reads(conn: Conn, limit: int) -> Overview:
    """What the overview read before: five statements, as pages.py issued them."""
    groups = await job_views.pending_groups(conn, WINDOW, limit)
    runners = await queries.active_runners(conn, None, WINDOW, limit)
    spaces = list(
        dict.fromkeys([g.workspace_id for g in groups] + [r.workspace_id for r in runners])
    )
    counts = await queries.workspace_counts(conn, spaces)
    depth = await queries.depth(conn)
    paused, _ = await pauses.paused_among(conn, spaces, [])
    return Overview(depth, len(runners), groups, counts, frozenset(paused))


async def _seeded(conn: Conn) -> dict[str, uuid.UUID]:
    a, b, c, d, idle = (uuid.uuid4() for _ in range(5))
    # a: two label sets pending, one of them also running; its runner busy and paused.
    busy = await manual_session(conn, a, ("linux", "x64"))
    await queue.enqueue(conn, [new_job(a, ["linux", "x64"]) for _ in range(3)])
    assert await claiming.claim(conn, busy) is not None
    await pauses.change(
        conn,
        PauseKind.RUNNER,
        busy.runner_session_id,
        paused=True,
        operator=Operator(uuid.uuid4(), "ops"),
        reason=None,
    )
    await queue.enqueue(conn, [new_job(a, ["linux"]) for _ in range(2)])
    # b: pending with no taker, and the workspace paused.
    await queue.enqueue(conn, [new_job(b, ["gpu"]) for _ in range(4)])
    await pauses.change(
        conn,
        PauseKind.WORKSPACE,
        b,
        paused=True,
        operator=Operator(uuid.uuid4(), "ops"),
        reason=None,
    )
    # c: one pending row whose tombstone already exists (counted by the workspace counts, not
    # by the groups), beside a live one of another label set.
    await queue.enqueue(conn, [new_job(c, ["arm"]), new_job(c, ["linux", "arm"])])
    await conn.execute(
        """
        INSERT INTO ended_executions (job_execution_id, workspace_id, job_id, outcome, ended_by)
        SELECT job_execution_id, workspace_id, job_id, 'cancelled', 'orchestrator'
        FROM pending_jobs WHERE workspace_id = $1 AND required_labels = '{arm}'
        """,
        c,
    )
    # d: only tombstoned pending rows, so no group; idle: a live runner and nothing queued.
    await queue.enqueue(conn, [new_job(d, ["linux"])])
    await conn.execute(
        """
        INSERT INTO ended_executions (job_execution_id, workspace_id, job_id, outcome, ended_by)
        SELECT job_execution_id, workspace_id, job_id, 'cancelled', 'orchestrator'
        FROM pending_jobs WHERE workspace_id = $1
        """,
        d,
    )
    await manual_session(conn, idle, ("linux",))
    # Distinct ages per group, so that a limit cuts the same groups in both reads.
    await conn.execute(
        """
        UPDATE pending_jobs p SET enqueued_at = p.enqueued_at - o.n * interval '1 minute'
        FROM (SELECT workspace_id, required_labels,
                     row_number() OVER (ORDER BY workspace_id, required_labels) AS n
              FROM pending_jobs GROUP BY workspace_id, required_labels) AS o
        WHERE o.workspace_id = p.workspace_id AND o.required_labels = p.required_labels
        """
    )
    return {"a": a, "b": b, "c": c, "d": d, "idle": idle}


def _keyed(read: Overview) -> dict[tuple[uuid.UUID, tuple[str, ...]], job_views.PendingGroup]:
    return {(g.workspace_id, g.required_labels): g for g in read.groups}


async def test_one_read_answers_what_the_five_separate_reads_answer(conn: Conn) -> None:
    spaces = await _seeded(conn)
    for limit in (1000, 2):
        alone = await _separate_reads(conn, limit)
        read = await overview(conn, WINDOW, limit)
        assert read.depth == alone.depth, limit
        assert read.live_runners == alone.live_runners, limit
        assert read.workspaces == alone.workspaces, limit
        assert read.paused == alone.paused, limit
        assert _keyed(read) == _keyed(alone), limit
        assert [g.oldest_enqueued_at for g in read.groups] == sorted(
            g.oldest_enqueued_at for g in read.groups
        )
    # The scenario reaches what each part must get right, so the equality compares something.
    full = await overview(conn, WINDOW, 1000)
    assert full.depth.pending == 11 and full.depth.running == 1
    assert full.live_runners == 2
    assert full.paused == {spaces["b"]}
    by_space = {w.workspace_id: w for w in full.workspaces}
    assert set(by_space) == {spaces[k] for k in ("a", "b", "c", "idle")}
    assert by_space[spaces["idle"]].labels == ()
    assert by_space[spaces["c"]].queued == 2  # the tombstoned row counts here...
    groups = _keyed(full)
    assert (spaces["c"], ("arm",)) not in groups  # ...and makes no group
    assert groups[(spaces["c"], ("arm", "linux"))].pending == 1
    assert groups[(spaces["a"], ("linux", "x64"))].takers.busy_runners == 1
    assert groups[(spaces["a"], ("linux", "x64"))].takers.paused_runners == 1
    assert len((await overview(conn, WINDOW, 2)).groups) == 2


async def test_an_empty_queue_reads_zeroes_and_no_workspace(conn: Conn) -> None:
    read = await overview(conn, WINDOW, 100)
    assert read == await _separate_reads(conn, 100)
    assert read.depth == queries.QueueDepth(0, 0, 0, 0)
    assert read.workspaces == [] and read.groups == []
