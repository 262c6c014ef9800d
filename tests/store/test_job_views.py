"""Pending groups against a real PostgreSQL: the one statement that reads every group's takers
answers, group by group, exactly what `takers` answers for that label set alone."""

from __future__ import annotations

import uuid
from datetime import timedelta

from controlplane.domain.demand import Template
from controlplane.domain.jobs import Outcome
from controlplane.domain.pauses import Operator, PauseKind
from controlplane.store import (
    claiming,
    demand_inputs,
    job_views,
    leases,
    pauses,
    provisioner_sessions,
    queue,
)
from controlplane.store.pool import Conn
from tests import provisioning as rows
from tests.factories import capped_session, manual_session, new_job

WINDOW = timedelta(minutes=5)


async def _template(
    conn: Conn, workspace: uuid.UUID | None, labels: tuple[str, ...], *, live: bool
) -> None:
    made = await rows.provisioner(conn, workspace)
    await demand_inputs.replace_templates(
        conn, made.id, workspace, [Template(key="t", labels=labels, available_slots=1)]
    )
    if live:
        assert await provisioner_sessions.take_over(conn, made.id, uuid.uuid4()) is not None


async def _pause(conn: Conn, runner_session_id: uuid.UUID) -> None:
    operator = Operator(uuid.uuid4(), "ops")
    await pauses.change(
        conn, PauseKind.RUNNER, runner_session_id, paused=True, operator=operator, reason=None
    )


async def test_every_group_reads_the_takers_its_label_set_alone_reads(conn: Conn) -> None:
    a, b, c = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    # Workspace a: two x64 runners, one busy and one paused, one plain linux runner paused and
    # idle, and an ephemeral runner with no claims left (not a taker).
    busy = await manual_session(conn, a, ("linux", "x64"))
    await queue.enqueue(conn, [new_job(a, ["linux", "x64"])])
    assert await claiming.claim(conn, busy) is not None
    await _pause(conn, busy.runner_session_id)
    await manual_session(conn, a, ("linux", "x64"))
    idle_paused = await manual_session(conn, a, ("linux",))
    await _pause(conn, idle_paused.runner_session_id)
    spent = await capped_session(conn, a, ("linux", "spent"))
    await queue.enqueue(conn, [new_job(a, ["linux", "spent"])])
    assert await claiming.claim(conn, spent) is not None
    # Workspace b: only a workspace template; everyone: an installation template; a template of
    # a provisioner with no live session counts nowhere.
    await _template(conn, b, ("linux", "gpu"), live=True)
    await _template(conn, None, ("arm", "linux"), live=True)
    await _template(conn, a, ("linux", "x64"), live=False)
    for space, labels in [
        (a, ["linux"]),
        (a, ["linux", "x64"]),
        (a, ["linux", "spent"]),
        (a, ["arm"]),
        (b, ["gpu", "linux"]),
        (b, ["linux", "x64"]),
        (c, ["linux"]),
    ]:
        await queue.enqueue(conn, [new_job(space, labels), new_job(space, labels)])

    groups = await job_views.pending_groups(conn, WINDOW)

    assert len(groups) == 7
    for group in groups:
        alone = await job_views.takers(conn, group.workspace_id, group.required_labels, WINDOW)
        assert group.takers == alone, (group.workspace_id, group.required_labels)
        assert group.pending == 2
    by = {(g.workspace_id, g.required_labels): g.takers for g in groups}
    # The scenario reaches every count, so equality above compares something.
    x64 = by[(a, ("linux", "x64"))]
    assert (x64.live_runners, x64.busy_runners, x64.paused_runners, x64.paused_idle) == (2, 1, 1, 0)
    plain = by[(a, ("linux",))]
    assert (plain.live_runners, plain.paused_idle, plain.templates) == (3, 1, 1)
    assert by[(a, ("linux", "spent"))].live_runners == 0
    assert by[(b, ("gpu", "linux"))].templates == 1
    assert by[(b, ("gpu", "linux"))].offered == {"arm", "gpu", "linux"}
    assert by[(c, ("linux",))].offered == {"arm", "linux"}


# The list as one sort over the three tables (the shape the per-table read replaced): what
# `list_jobs` must answer for every filter and page.
_REFERENCE = f"""
    SELECT j.job_execution_id FROM ({job_views._ALL}) AS j
    WHERE ($1::uuid IS NULL OR j.workspace_id = $1)
      AND ($2::text IS NULL OR j.status = $2)
      AND ($3::text[] IS NULL OR j.required_labels @> $3)
      AND ($4::timestamptz IS NULL OR (j.changed_at, j.job_execution_id) < ($4, $5::uuid))
    ORDER BY j.changed_at DESC, j.job_execution_id DESC
    LIMIT $6
"""  # noqa: S608 -- interpolates constants only


async def test_the_list_answers_what_one_sort_over_the_three_tables_answers(conn: Conn) -> None:
    a, b = uuid.uuid4(), uuid.uuid4()
    for space in (a, b):  # a batch shares one enqueue time: ties break on the execution id
        await queue.enqueue(conn, [new_job(space, ["linux", "x64"]) for _ in range(4)])
        await queue.enqueue(conn, [new_job(space, ["linux"]) for _ in range(3)])
    for space in (a, b):  # two running, one of them then ended by its runner
        session = await manual_session(conn, space, ("linux", "x64"))
        first = await claiming.claim(conn, session)
        assert first is not None
        await leases.complete(
            conn,
            first.identity.job_execution_id,
            session.runner_session_id,
            Outcome.SUCCEEDED,
            0,
            None,
        )
        assert await claiming.claim(conn, session) is not None
    # A pending row whose tombstone already exists is listed once, as ended.
    await conn.execute(
        """
        INSERT INTO ended_executions (job_execution_id, workspace_id, job_id, outcome, ended_by)
        SELECT job_execution_id, workspace_id, job_id, 'cancelled', 'orchestrator'
        FROM pending_jobs WHERE workspace_id = $1 LIMIT 1
        """,
        a,
    )
    everything = await conn.fetch(_REFERENCE, None, None, None, None, None, 100)
    assert len(everything) == 14
    middle = await conn.fetchrow(
        f"SELECT changed_at, job_execution_id FROM ({job_views._ALL}) AS j"  # noqa: S608 -- constants only
        " WHERE job_execution_id = $1",
        everything[6]["job_execution_id"],
    )
    assert middle is not None
    cases = 0
    for workspace in (None, a):
        for status in (None, *job_views.STATUSES):
            for labels in (None, ["x64"]):
                for before in (None, (middle["changed_at"], middle["job_execution_id"])):
                    for limit in (3, 100):
                        expected = await conn.fetch(
                            _REFERENCE,
                            workspace,
                            status,
                            labels,
                            None if before is None else before[0],
                            None if before is None else before[1],
                            limit,
                        )
                        listed = await job_views.list_jobs(
                            conn,
                            workspace_id=workspace,
                            status=status,
                            labels=labels,
                            before=before,
                            limit=limit,
                        )
                        assert [v.job_execution_id for v in listed] == [
                            r["job_execution_id"] for r in expected
                        ], (workspace, status, labels, before, limit)
                        cases += bool(expected)
    assert cases > 40  # most combinations list something, so the comparison is not empty
