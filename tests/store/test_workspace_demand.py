"""The demand summary (sql/0022, store/demand.py `walk_list`, `prune_demand`) against real
PostgreSQL: after random queue operations it lists exactly what the GROUP BY over pending_jobs
listed before issue 16, in the same order; every workspace with a pending row has its summary
row, and a prune leaves exactly those; a prune never deletes the row of a workspace whose new
pending row is not committed yet (the interleaving forced from a second connection)."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from uuid import UUID

import asyncpg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.domain.jobs import Outcome, SessionClaims, StaleRule
from controlplane.domain.labels import canonicalise
from controlplane.domain.pauses import Operator, PauseKind
from controlplane.store import claiming, deadlines, demand, leases, pauses, queue
from controlplane.store.pool import Conn
from tests.conftest import with_database
from tests.factories import holding, manual_session, new_job, wait_until_blocked

# The list as issue 14 computed it: a GROUP BY over the whole of pending_jobs. The summary must
# give the same workspaces in the same order (eligibility is the same clause in both).
OLD_LIST = """
SELECT workspace_id FROM pending_jobs
 WHERE ($1::uuid[] IS NULL OR workspace_id = ANY($1::uuid[]))
   AND (expires_at IS NULL OR expires_at > now())
   AND NOT EXISTS (SELECT 1 FROM paused_workspaces pw
                    WHERE pw.workspace_id = pending_jobs.workspace_id)
 GROUP BY workspace_id ORDER BY min(created_at), workspace_id LIMIT $2
"""

WORKSPACES = [UUID(int=n) for n in range(1, 6)]
LABELS = [canonicalise(x) for x in (["linux"], ["linux", "x64"], ["macos"])]
KINDS = [
    "enqueue",
    "enqueue",
    "enqueue",
    "claim",
    "claim",
    "complete",
    "cancel",
    "put_back",
    "expire",
    "retry",
    "pause",
    "resume",
    "prune",
]
OPERATOR = Operator(uuid.UUID(int=16), "property")
BASE = datetime(2026, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class Op:
    kind: str
    workspace: int
    pick: int
    minute: int  # an enqueue's queued_at: BASE + minutes (ties between workspaces happen)


ops = st.builds(
    Op,
    kind=st.sampled_from(KINDS),
    workspace=st.integers(0, len(WORKSPACES) - 1),
    pick=st.integers(0, 31),
    minute=st.integers(0, 6),
)


async def apply(conn: Conn, op: Op, sessions: dict[UUID, SessionClaims]) -> None:
    workspace = WORKSPACES[op.workspace]
    if op.kind == "enqueue":
        job = new_job(
            workspace,
            list(LABELS[op.pick % len(LABELS)]),
            queued_at=BASE + timedelta(minutes=op.minute),
            key=("deploy", 1) if op.pick % 4 == 0 else None,
        )
        if op.pick % 3 == 0:  # a queue deadline, and a retry on a lost runner
            job = replace(job, queue_timeout_seconds=600, retries_on_lost=1)
        await queue.enqueue(conn, [job])
    elif op.kind == "claim":
        if workspace not in sessions:
            sessions[workspace] = await manual_session(conn, workspace, ("linux", "macos", "x64"))
        await claiming.claim(conn, sessions[workspace])
    elif op.kind in ("complete", "put_back", "retry"):
        rows = await conn.fetch(
            "SELECT job_execution_id, runner_session_id FROM running_jobs ORDER BY id"
        )
        if not rows:
            return
        row = rows[op.pick % len(rows)]
        execution, session = row["job_execution_id"], row["runner_session_id"]
        if op.kind == "complete":
            await leases.complete(conn, execution, session, Outcome.SUCCEEDED)
        elif op.kind == "put_back":
            await queue.put_back(conn, execution, session)
        else:  # the runner is lost: the reaper retries the ones that allow it, ends the rest
            await conn.execute(
                """
                UPDATE running_jobs SET started_at = started_at - interval '1 hour',
                       first_heartbeat_at = now() - interval '1 hour',
                       last_heartbeat_at = now() - interval '1 hour'
                 WHERE job_execution_id = $1
                """,
                execution,
            )
            await leases.reap(conn, StaleRule())
    elif op.kind in ("cancel", "expire"):
        rows = await conn.fetch("SELECT job_execution_id FROM pending_jobs ORDER BY id")
        if not rows:
            return
        execution = rows[op.pick % len(rows)]["job_execution_id"]
        if op.kind == "cancel":
            await leases.reconcile(conn, execution, Outcome.CANCELLED)
        else:  # past its queue deadline; every other time the leader has removed it too
            await conn.execute(
                "UPDATE pending_jobs SET expires_at = now() - interval '1 second'"
                " WHERE job_execution_id = $1",
                execution,
            )
            if op.pick % 2:
                await deadlines.expire_queued(conn)
    elif op.kind in ("pause", "resume"):
        await pauses.change(
            conn,
            PauseKind.WORKSPACE,
            workspace,
            paused=op.kind == "pause",
            operator=OPERATOR,
            reason=None,
        )
    else:
        await prune_all(conn)


async def prune_all(conn: Conn) -> int:
    summary = await conn.fetch("SELECT workspace_id FROM workspace_demand")
    return await demand.prune_demand(conn, [r["workspace_id"] for r in summary])


async def recount(conn: Conn) -> tuple[set[UUID], set[UUID]]:
    """The workspaces with a pending row (a full recount) and those with a summary row."""
    pending = await conn.fetch("SELECT DISTINCT workspace_id AS w FROM pending_jobs")
    summary = await conn.fetch("SELECT workspace_id AS w FROM workspace_demand")
    return {r["w"] for r in pending}, {r["w"] for r in summary}


async def check(conn: Conn, eligible: list[UUID] | None, limit: int) -> None:
    old = [r["workspace_id"] for r in await conn.fetch(OLD_LIST, eligible, limit)]
    entries, _ = await demand.walk_list(conn, eligible, limit=limit)
    assert [e.workspace_id for e in entries] == old
    with_rows, summary = await recount(conn)
    assert with_rows <= summary, "a workspace with pending jobs has no summary row"


async def run_steps(conn: Conn, steps: list[Op], eligible: list[UUID] | None, limit: int) -> None:
    sessions: dict[UUID, SessionClaims] = {}
    for step in steps:
        await apply(conn, step, sessions)
        await check(conn, eligible, limit)
    await prune_all(conn)
    with_rows, summary = await recount(conn)
    assert summary == with_rows, "a prune left a row without pending jobs, or removed one with"
    await check(conn, eligible, limit)


def test_the_summary_lists_what_a_full_recount_lists(server_url: str, template: str) -> None:
    """Random operations over five workspaces (enqueue with random labels, keys, queue deadlines
    and retries; claim, complete, cancel, put-back, expire with and without the leader's
    removal, a lost runner's retry, pause, resume, prune), checked after every one; the
    database carries over from one example to the next, as a long-lived installation would."""
    loop = asyncio.new_event_loop()
    name = f"cp_test_{uuid.uuid4().hex[:16]}"

    async def open_db() -> asyncpg.Connection:
        admin = await asyncpg.connect(server_url)
        try:
            await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
        finally:
            await admin.close()
        return await asyncpg.connect(with_database(server_url, name))

    async def drop_db() -> None:
        admin = await asyncpg.connect(server_url)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()

    conn = loop.run_until_complete(open_db())

    @settings(
        max_examples=25,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(
        steps=st.lists(ops, min_size=1, max_size=25),
        eligible=st.none() | st.lists(st.sampled_from(WORKSPACES), unique=True),
        limit=st.sampled_from([1, 2, 1000]),
    )
    def run(steps: list[Op], eligible: list[UUID] | None, limit: int) -> None:
        loop.run_until_complete(run_steps(conn, steps, eligible, limit))

    try:
        run()
    finally:
        loop.run_until_complete(conn.close())
        loop.run_until_complete(drop_db())
        loop.close()


async def test_a_prune_never_removes_a_row_under_an_uncommitted_enqueue(
    conn: Conn, database_url: str, workspace: UUID
) -> None:
    """An enqueue into a workspace whose summary row is still there (its old jobs all gone) holds
    the row's key shared until it commits: a prune in between leaves the row, and once the
    enqueue commits the workspace is listed."""
    first = new_job(workspace)
    await queue.enqueue(conn, [first])
    await leases.reconcile(conn, first.identity.job_execution_id, Outcome.CANCELLED)
    assert await demand.demand_workspaces(conn, [workspace]) == []
    async with holding(database_url, "SELECT 1") as enqueuer:
        await queue.enqueue(enqueuer, [new_job(workspace)])  # inside the held transaction
        assert await demand.prune_demand(conn, [workspace]) == 0  # busy key: left alone
        assert await conn.fetchval(
            "SELECT count(*) FROM workspace_demand WHERE workspace_id = $1", workspace
        )
    assert await demand.demand_workspaces(conn, [workspace]) == [workspace]


async def test_an_enqueue_waits_for_a_prune_that_holds_the_key_and_adds_the_row_back(
    conn: Conn, database_url: str, observer: asyncpg.Connection, workspace: UUID
) -> None:
    """The other order: the prune holds the key exclusive (deleted, not committed); an enqueue
    into the workspace waits for it at its trigger, then finds the row gone and adds it."""
    first = new_job(workspace)
    await queue.enqueue(conn, [first])
    await leases.reconcile(conn, first.identity.job_execution_id, Outcome.CANCELLED)
    async with holding(database_url, "SELECT 1") as pruner:
        assert await demand.prune_demand(pruner, [workspace]) == 1  # a savepoint: still held
        enqueue = asyncio.ensure_future(queue.enqueue(conn, [new_job(workspace)]))
        await wait_until_blocked(observer, conn.get_server_pid())
        assert not enqueue.done()
    await enqueue
    assert await demand.demand_workspaces(conn, [workspace]) == [workspace]
