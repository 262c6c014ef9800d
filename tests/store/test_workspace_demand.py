"""The demand summary (sql/0022, sql/0030, store/demand_list.py `walk_list`, `prune_demand`)
against real PostgreSQL: after random queue operations it lists exactly what the GROUP BY over
pending_jobs listed before issue 16, in the same order, whatever the page size of its list;
every workspace with a pending row has its summary row, whose bound is at or before its oldest
pending row, and a prune leaves exactly those rows, with their bounds exact; a prune never
deletes the row, nor raises the bound, of a workspace whose new pending row is not committed yet
(the interleavings forced from a second connection); an older row put back lowers a bound a
prune raised."""

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
from controlplane.store import claiming, deadlines, demand_list, leases, pauses, queue
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
    "walk",
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
    elif op.kind == "walk":  # what a walk does: prune the rows its list read in vain
        _, in_vain = await demand_list.walk_list(conn, limit=1 + op.pick % 3, page=1 + op.pick % 2)
        await demand_list.prune_demand(conn, in_vain)
    else:
        await prune_all(conn)


async def prune_all(conn: Conn) -> int:
    summary = await conn.fetch("SELECT workspace_id FROM workspace_demand")
    return await demand_list.prune_demand(conn, [r["workspace_id"] for r in summary])


async def recount(conn: Conn) -> tuple[set[UUID], set[UUID]]:
    """The workspaces with a pending row (a full recount) and those with a summary row."""
    pending = await conn.fetch("SELECT DISTINCT workspace_id AS w FROM pending_jobs")
    summary = await conn.fetch("SELECT workspace_id AS w FROM workspace_demand")
    return {r["w"] for r in pending}, {r["w"] for r in summary}


async def bounds(conn: Conn) -> list[tuple[UUID, datetime, datetime]]:
    """Each summary row's bound beside its workspace's oldest pending row (a full recount)."""
    rows = await conn.fetch(
        """
        SELECT d.workspace_id, d.oldest AS bound, min(p.created_at) AS oldest
          FROM workspace_demand d JOIN pending_jobs p USING (workspace_id)
         GROUP BY d.workspace_id, d.oldest
        """
    )
    return [(r["workspace_id"], r["bound"], r["oldest"]) for r in rows]


async def check(
    conn: Conn, eligible: list[UUID] | None, limit: int, page: int | None = None
) -> None:
    old = [r["workspace_id"] for r in await conn.fetch(OLD_LIST, eligible, limit)]
    entries, _ = await demand_list.walk_list(conn, eligible, limit=limit, page=page)
    assert [e.workspace_id for e in entries] == old
    with_rows, summary = await recount(conn)
    assert with_rows <= summary, "a workspace with pending jobs has no summary row"
    for workspace_id, bound, oldest in await bounds(conn):
        assert bound <= oldest, f"the bound of {workspace_id} is after its oldest pending row"


async def run_steps(
    conn: Conn, steps: list[Op], eligible: list[UUID] | None, limit: int, page: int | None
) -> None:
    sessions: dict[UUID, SessionClaims] = {}
    for step in steps:
        await apply(conn, step, sessions)
        await check(conn, eligible, limit, page)
    await prune_all(conn)
    with_rows, summary = await recount(conn)
    assert summary == with_rows, "a prune left a row without pending jobs, or removed one with"
    for workspace_id, bound, oldest in await bounds(conn):
        assert bound == oldest, f"a prune left the bound of {workspace_id} stale"
    await check(conn, eligible, limit, page)


def test_the_summary_lists_what_a_full_recount_lists(server_url: str, template: str) -> None:
    """Random operations over five workspaces (enqueue with random labels, keys, queue deadlines
    and retries; claim, complete, cancel, put-back, expire with and without the leader's
    removal, a lost runner's retry, pause, resume, prune, a walk's list and its prune), checked
    after every one, the list read with pages of 1, 2 or the default number of rows; the
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
        page=st.sampled_from([1, 2, None]),
    )
    def run(steps: list[Op], eligible: list[UUID] | None, limit: int, page: int | None) -> None:
        loop.run_until_complete(run_steps(conn, steps, eligible, limit, page))

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
    assert await demand_list.demand_workspaces(conn, [workspace]) == []
    async with holding(database_url, "SELECT 1") as enqueuer:
        await queue.enqueue(enqueuer, [new_job(workspace)])  # inside the held transaction
        assert await demand_list.prune_demand(conn, [workspace]) == 0  # busy key: left alone
        assert await conn.fetchval(
            "SELECT count(*) FROM workspace_demand WHERE workspace_id = $1", workspace
        )
    assert await demand_list.demand_workspaces(conn, [workspace]) == [workspace]


async def test_an_enqueue_waits_for_a_prune_that_holds_the_key_and_adds_the_row_back(
    conn: Conn, database_url: str, observer: asyncpg.Connection, workspace: UUID
) -> None:
    """The other order: the prune holds the key exclusive (deleted, not committed); an enqueue
    into the workspace waits for it at its trigger, then finds the row gone and adds it."""
    first = new_job(workspace)
    await queue.enqueue(conn, [first])
    await leases.reconcile(conn, first.identity.job_execution_id, Outcome.CANCELLED)
    async with holding(database_url, "SELECT 1") as pruner:
        assert await demand_list.prune_demand(pruner, [workspace]) == 1  # a savepoint: still held
        enqueue = asyncio.ensure_future(queue.enqueue(conn, [new_job(workspace)]))
        await wait_until_blocked(observer, conn.get_server_pid())
        assert not enqueue.done()
    await enqueue
    assert await demand_list.demand_workspaces(conn, [workspace]) == [workspace]


async def test_an_older_row_put_back_lowers_the_bound_a_prune_raised(
    conn: Conn, workspace: UUID
) -> None:
    """A prune raises a bound once its oldest job is claimed; putting that job back (it keeps
    its created_at) lowers the bound again, so a list reading one row a page still lists the
    workspace first."""
    other = uuid.uuid4()
    first = new_job(workspace, queued_at=BASE)
    await queue.enqueue(conn, [first, new_job(workspace, queued_at=BASE + timedelta(minutes=2))])
    await queue.enqueue(conn, [new_job(other, queued_at=BASE + timedelta(minutes=1))])
    session = await manual_session(conn, workspace, ("linux",))
    claimed = await claiming.claim(conn, session)
    assert claimed is not None and claimed.identity == first.identity
    assert await demand_list.prune_demand(conn, [workspace]) == 0  # raised, not deleted
    assert await demand_list.demand_workspaces(conn, limit=1) == [other]
    await queue.put_back(conn, first.identity.job_execution_id, session.runner_session_id)
    bound = await conn.fetchval(
        "SELECT oldest FROM workspace_demand WHERE workspace_id = $1", workspace
    )
    assert bound == BASE
    entries, _ = await demand_list.walk_list(conn, limit=1, page=1)
    assert [e.workspace_id for e in entries] == [workspace]


async def test_a_prune_never_raises_a_bound_above_an_uncommitted_older_row(
    conn: Conn, database_url: str, workspace: UUID
) -> None:
    """An enqueue of a job older than every committed one except the claimed oldest holds the
    key shared until it commits: a prune in between leaves the bound where it was, so once the
    enqueue commits the bound is still at or before the new row."""
    first = new_job(workspace, queued_at=BASE)
    await queue.enqueue(conn, [first, new_job(workspace, queued_at=BASE + timedelta(minutes=2))])
    session = await manual_session(conn, workspace, ("linux",))
    assert await claiming.claim(conn, session) is not None
    async with holding(database_url, "SELECT 1") as enqueuer:
        await queue.enqueue(enqueuer, [new_job(workspace, queued_at=BASE + timedelta(minutes=1))])
        assert await demand_list.prune_demand(conn, [workspace]) == 0  # busy key: left alone
    for _, bound, oldest in await bounds(conn):
        assert bound <= oldest == BASE + timedelta(minutes=1)
