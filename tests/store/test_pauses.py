"""Pause, resume and drain (docs/policies.md Q-70..Q-75, Q-79) against a real PostgreSQL: the
claim statements' pause filters, idempotent changes with their audit events, the forced races
between a pause and a claim in flight, and a drained runner left out of idle-runner binding."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from typing import Any
from uuid import UUID

import anyio
import asyncpg
import pytest

from controlplane.domain.binding import Scope
from controlplane.domain.demand import Template
from controlplane.domain.jobs import ClaimedJob, Outcome, SessionClaims
from controlplane.domain.pauses import Operator, PauseKind, PauseState
from controlplane.errors import NotFound
from controlplane.store import claiming, demand, leases, pauses, queue
from controlplane.store.pool import Conn
from tests import provisioning as rows
from tests.factories import (
    LINUX_X64,
    capped_session,
    holding,
    manual_session,
    minutes_ago,
    new_job,
    wait_until_blocked,
)

OPERATOR = Operator(uuid.uuid4(), "ops-key")


async def _set(
    conn: Conn, kind: PauseKind, target: UUID, paused: bool, reason: str | None = None
) -> PauseState:
    return await pauses.change(conn, kind, target, paused=paused, operator=OPERATOR, reason=reason)


async def _pending(conn: Conn, workspace: UUID) -> list[UUID]:
    rows = await conn.fetch(
        "SELECT job_execution_id FROM pending_jobs WHERE workspace_id = $1 ORDER BY created_at",
        workspace,
    )
    return [row["job_execution_id"] for row in rows]


async def _audit(conn: Conn, workspace: UUID | None = None) -> list[tuple[str, dict[str, Any]]]:
    rows = await conn.fetch(
        """
        SELECT event_type, payload::text AS payload FROM events
        WHERE job_execution_id IS NULL AND ($1::uuid IS NULL OR workspace_id = $1) ORDER BY seq
        """,
        workspace,
    )
    return [(row["event_type"], json.loads(row["payload"])) for row in rows]


async def test_q70_a_paused_workspace_hands_out_nothing_and_resumes_in_order(
    conn: Conn, workspace: UUID
) -> None:
    single = await manual_session(conn, workspace)
    batch = [await manual_session(conn, workspace) for _ in range(2)]
    await _set(conn, PauseKind.WORKSPACE, workspace, True, "maintenance")
    jobs = [new_job(workspace, ["linux"], queued_at=minutes_ago(3 - n)) for n in range(3)]
    # Enqueue is still accepted while paused.
    assert len(await queue.enqueue(conn, jobs)) == 3

    assert await claiming.claim(conn, single) is None
    assert (
        await claiming.claim_batch(conn, workspace, LINUX_X64, [b.runner_session_id for b in batch])
        == {}
    )
    assert await _pending(conn, workspace) == [j.identity.job_execution_id for j in jobs]

    # Another workspace is not affected.
    elsewhere = uuid.uuid4()
    other = await manual_session(conn, elsewhere)
    await queue.enqueue(conn, [new_job(elsewhere, ["linux"])])
    assert await claiming.claim(conn, other) is not None

    await _set(conn, PauseKind.WORKSPACE, workspace, False)
    first = await claiming.claim(conn, single)
    assert first is not None and first.identity == jobs[0].identity
    claimed = await claiming.claim_batch(
        conn, workspace, LINUX_X64, [b.runner_session_id for b in batch]
    )
    assert [claimed[b.runner_session_id].identity for b in batch] == [
        jobs[1].identity,
        jobs[2].identity,
    ]


async def test_q71_a_paused_runner_takes_no_new_job_and_its_lease_runs_to_the_end(
    conn: Conn, workspace: UUID
) -> None:
    paused = await manual_session(conn, workspace)
    others = [await manual_session(conn, workspace) for _ in range(2)]
    running = new_job(workspace, ["linux"], queued_at=minutes_ago(10))
    await queue.enqueue(conn, [running])
    lease = await claiming.claim(conn, paused)
    assert lease is not None

    await _set(conn, PauseKind.RUNNER, paused.runner_session_id, True)
    jobs = [new_job(workspace, ["linux"], queued_at=minutes_ago(3 - n)) for n in range(3)]
    await queue.enqueue(conn, jobs)
    assert await claiming.claim(conn, paused) is None

    # In a batch, the paused session is skipped and the others get the oldest jobs in order.
    order = [others[0].runner_session_id, paused.runner_session_id, others[1].runner_session_id]
    claimed = await claiming.claim_batch(conn, workspace, LINUX_X64, order)
    assert set(claimed) == {others[0].runner_session_id, others[1].runner_session_id}
    assert claimed[others[0].runner_session_id].identity == jobs[0].identity
    assert claimed[others[1].runner_session_id].identity == jobs[1].identity
    assert await _pending(conn, workspace) == [jobs[2].identity.job_execution_id]

    # The lease it held when paused still heartbeats and completes.
    execution = lease.identity.job_execution_id
    beat = await leases.heartbeat(conn, execution, paused.runner_session_id)
    assert not beat.cancellation_requested
    ended = await leases.complete(
        conn, execution, paused.runner_session_id, Outcome.SUCCEEDED, 0, None
    )
    assert ended.newly_ended

    await _set(conn, PauseKind.RUNNER, paused.runner_session_id, False)
    after = await claiming.claim(conn, paused)
    assert after is not None and after.identity == jobs[2].identity


async def test_q72_pause_and_resume_are_idempotent_and_keep_the_first_pause(
    conn: Conn, workspace: UUID
) -> None:
    first = await _set(conn, PauseKind.WORKSPACE, workspace, True, "first")
    again = await _set(conn, PauseKind.WORKSPACE, workspace, True, "second")
    assert first.changed and first.paused and first.reason == "first"
    assert not again.changed and again.paused
    assert (again.since, again.reason) == (first.since, "first")
    resumed = await _set(conn, PauseKind.WORKSPACE, workspace, False)
    not_paused = await _set(conn, PauseKind.WORKSPACE, workspace, False)
    assert resumed.changed and not resumed.paused
    assert not not_paused.changed and not not_paused.paused and not_paused.since is None
    # Two changes, two events: the repeats wrote none.
    assert [kind for kind, _ in await _audit(conn, workspace)] == [
        "workspace.paused",
        "workspace.resumed",
    ]

    session = await manual_session(conn, workspace)
    runner = session.runner_session_id
    assert (await _set(conn, PauseKind.RUNNER, runner, True)).changed
    assert not (await _set(conn, PauseKind.RUNNER, runner, True)).changed
    assert (await _set(conn, PauseKind.RUNNER, runner, False)).changed
    assert not (await _set(conn, PauseKind.RUNNER, runner, False)).changed

    for kind in (PauseKind.RUNNER, PauseKind.RUNNER_INSTANCE):
        for paused in (True, False):
            with pytest.raises(NotFound):
                await _set(conn, kind, uuid.uuid4(), paused)


async def test_q73_each_change_is_one_audit_event_naming_who_and_why(
    conn: Conn, workspace: UUID
) -> None:
    session = await manual_session(conn, workspace)
    await _set(conn, PauseKind.RUNNER, session.runner_session_id, True, "bad disk")
    await _set(conn, PauseKind.RUNNER, session.runner_session_id, False, "disk replaced")
    events = await _audit(conn, workspace)
    assert events == [
        (
            "runner.paused",
            {
                "runner_session_id": str(session.runner_session_id),
                "by": str(OPERATOR.key_id),
                "by_name": "ops-key",
                "reason": "bad disk",
            },
        ),
        (
            "runner.resumed",
            {
                "runner_session_id": str(session.runner_session_id),
                "by": str(OPERATOR.key_id),
                "by_name": "ops-key",
                "reason": "disk replaced",
            },
        ),
    ]


async def _claim_racing_a_pause(
    pool: asyncpg.Pool,
    observer: asyncpg.Connection,
    database_url: str,
    session: SessionClaims,
) -> ClaimedJob | None:
    """Claim for `session` while a second connection holds its session row; once PostgreSQL
    reports the claim blocked, pause the session's workspace (committed), then release the row
    and let the claim finish. Returns what the claim handed out."""
    found: list[ClaimedJob | None] = []
    async with pool.acquire() as claimer, pool.acquire() as admin:

        async def claim() -> None:
            found.append(
                await claiming.claim(claimer, session, liveness_throttle=timedelta(seconds=10))
            )

        with anyio.fail_after(10):
            async with (
                anyio.create_task_group() as group,
                holding(
                    database_url,
                    "SELECT 1 FROM runner_sessions WHERE id = $1 FOR UPDATE",
                    session.runner_session_id,
                ),
            ):
                group.start_soon(claim)
                await wait_until_blocked(observer, claimer.get_server_pid())
                paused = await _set(admin, PauseKind.WORKSPACE, session.workspace_id, True)
                assert paused.changed
                # The row is released here; the claim goes on, and the group waits for it.
    [claimed] = found
    return claimed


async def test_q74_a_claim_waiting_on_its_session_row_when_the_pause_commits_hands_out_nothing(
    pool: asyncpg.Pool, observer: asyncpg.Connection, database_url: str, workspace: UUID
) -> None:
    """The forced race: a capped claim waits for its session row (held by a second connection);
    the workspace pause commits meanwhile; the row is released. The claim statement that then
    runs starts after the pause committed, so it hands out nothing and the job stays queued."""
    session = await capped_session(observer, workspace)
    job = new_job(workspace, ["linux"])
    await queue.enqueue(observer, [job])

    assert await _claim_racing_a_pause(pool, observer, database_url, session) is None

    assert await _pending(observer, workspace) == [job.identity.job_execution_id]
    running = "SELECT count(*) FROM running_jobs WHERE workspace_id = $1"
    assert await observer.fetchval(running, workspace) == 0


async def test_q75_a_claim_statement_already_running_when_the_pause_commits_may_lease_one_job(
    pool: asyncpg.Pool, observer: asyncpg.Connection, database_url: str, workspace: UUID
) -> None:
    """The exact boundary: a claim statement reads the pause in its snapshot, taken when it
    starts. One that started before the pause committed (forced: it waits on its session row
    for the liveness stamp, after it chose its job) still leases that job, which then runs as
    a paused workspace's running job does; the next claim hands out nothing."""
    session = await manual_session(observer, workspace)
    await observer.execute(
        "UPDATE runner_sessions SET updated_at = now() - interval '1 hour' WHERE id = $1",
        session.runner_session_id,
    )
    jobs = [new_job(workspace, ["linux"], queued_at=minutes_ago(2 - n)) for n in range(2)]
    await queue.enqueue(observer, jobs)

    claimed = await _claim_racing_a_pause(pool, observer, database_url, session)

    assert claimed is not None and claimed.identity == jobs[0].identity
    async with pool.acquire() as conn:
        assert await claiming.claim(conn, session) is None
    assert await _pending(observer, workspace) == [jobs[1].identity.job_execution_id]


async def _round(conn: Conn, provisioner_id: UUID, workspace: UUID) -> tuple[int, int]:
    """One allocation round for one pending linux job: (runners bound, units launched)."""
    await rows.pending_jobs(conn, workspace, ("linux",), 1)
    result = await demand.allocate_workspace(
        conn,
        provisioner_id=provisioner_id,
        scope=Scope.WORKSPACE,
        workspace_id=workspace,
        templates=(Template(key="small", labels=("linux",), available_slots=10),),
        max_reservations=100,
        launch_ttl=timedelta(seconds=60),
        activation_grace=timedelta(seconds=60),
        covering_window=None,
        activation_timeout=None,
        terminate_limit=1000,
    )
    assert result is not None
    return result.bound, sum(grant.count for grant in result.grants)


async def test_q79_a_drained_idle_runner_is_not_bound_to_new_demand_until_undrained(
    conn: Conn, workspace: UUID
) -> None:
    provisioner = await rows.provisioner(conn, workspace)
    idle = await rows.runner(conn, provisioner.id)
    drained = await _set(conn, PauseKind.RUNNER_INSTANCE, idle, True, "kernel upgrade")
    assert drained.changed and drained.paused and drained.reason == "kernel upgrade"

    assert await _round(conn, provisioner.id, workspace) == (0, 1)  # a launch, not the runner
    assert (
        await conn.fetchval("SELECT reservation_id FROM runner_instances WHERE id = $1", idle)
        is None
    )

    assert (await _set(conn, PauseKind.RUNNER_INSTANCE, idle, False)).changed
    assert await _round(conn, provisioner.id, workspace) == (1, 0)
    assert (
        await conn.fetchval("SELECT reservation_id FROM runner_instances WHERE id = $1", idle)
        is not None
    )
    assert [kind for kind, _ in await _audit(conn)][-2:] == [
        "runner_instance.drained",
        "runner_instance.undrained",
    ]
