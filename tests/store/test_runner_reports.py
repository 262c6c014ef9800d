"""Provider reports, reconcile and terminal release (spec 4.8-4.10) against real PostgreSQL.

Races are forced by holding a lock (or an uncommitted report) on a second connection and
waiting until PostgreSQL shows the other side blocked; no test sleeps.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

import anyio
import asyncpg

from controlplane.actors.maintenance.reaper import LeaseReaper, PoolReaperStore
from controlplane.domain.jobs import StaleRule
from controlplane.domain.provisioners import Provisioner
from controlplane.domain.reports import HonoredIntent, ReportOutcome, RunnerEvent
from controlplane.domain.runner_instances import RunnerState
from controlplane.store import locks, reconcile, runner_release, runner_reports
from controlplane.store.pool import Conn
from tests import provisioning
from tests.factories import holding_lock, wait_until_blocked
from tests.provisioning import provisioner, reservation

GRACE = timedelta(seconds=120)
STOPPED, FAILED, TERMINATED = RunnerState.STOPPED, RunnerState.FAILED, RunnerState.TERMINATED
RUNNING, STARTING, STOPPING = RunnerState.RUNNING, RunnerState.STARTING, RunnerState.STOPPING


async def runner(conn: Conn, provisioner_id: UUID, **fields: Any) -> UUID:
    """`tests.provisioning.runner`, without a control session unless one is asked for: reports,
    reconcile and the reaper never look at it."""
    fields.setdefault("control_session", None)
    return await provisioning.runner(conn, provisioner_id, **fields)


def now() -> datetime:
    return datetime.now(UTC)


def ev(pid: str, state: RunnerState, at: datetime | None = None, **fields: Any) -> RunnerEvent:
    return RunnerEvent(pid, state, at or now(), **fields)


async def send(
    conn: Conn, prov: Provisioner, *events: RunnerEvent, reserved: tuple[str, ...] = ()
) -> ReportOutcome:
    return await runner_reports.report(
        conn, prov, list(events), received_at=now(), reserved_labels=reserved
    )


async def row_of(conn: Conn, prov: Provisioner, pid: str) -> asyncpg.Record:
    found = await conn.fetchrow(
        "SELECT * FROM runner_instances WHERE provisioner_id = $1 AND provider_runner_id = $2",
        prov.id,
        pid,
    )
    assert found is not None
    return found


async def pid_of(conn: Conn, runner_id: UUID) -> str:
    value = await conn.fetchval(
        "SELECT provider_runner_id FROM runner_instances WHERE id = $1", runner_id
    )
    assert isinstance(value, str)
    return value


async def count_of(conn: Conn, reservation_id: UUID) -> int | None:
    value = await conn.fetchval("SELECT count FROM reservations WHERE id = $1", reservation_id)
    assert value is None or isinstance(value, int)
    return value


async def released_at(conn: Conn, runner_id: UUID) -> datetime | None:
    value = await conn.fetchval(
        "SELECT reservation_released_at FROM runner_instances WHERE id = $1", runner_id
    )
    assert value is None or isinstance(value, datetime)
    return value


async def lease(
    conn: Conn,
    workspace: UUID,
    provisioner_id: UUID,
    pid: str,
    *,
    cancelled: bool = False,
    started_ago: timedelta = timedelta(0),
    execution_id: UUID | None = None,
) -> UUID:
    """A running job of the provider runner, with the one-claim session it was claimed by."""
    session_id = await conn.fetchval(
        """
        INSERT INTO runner_sessions (workspace_id, registration_token_id, registration_token_kind,
            labels, max_claims, claims_used, provisioner_id, provider_runner_id)
        VALUES ($1, $2, 'ephemeral', '{linux}', 1, 1, $3, $4) RETURNING id
        """,
        workspace,
        uuid.uuid4(),
        provisioner_id,
        pid,
    )
    execution = execution_id or uuid.uuid4()
    await conn.execute(
        """
        INSERT INTO running_jobs (pending_id, workspace_id, workflow_run_id,
            workflow_run_attempt_id, job_id, job_execution_id, project_id, runner_session_id,
            provisioner_id, provider_runner_id, required_labels, runner_labels, payload,
            queued_at, started_at, cancellation_requested_at)
        VALUES (uuidv7(), $1, uuidv7(), uuidv7(), uuidv7(), $2, uuidv7(), $3, $4, $5, '{linux}',
                '{linux}', '{}', now(), now() - $6::interval, CASE WHEN $7 THEN now() END)
        """,
        workspace,
        execution,
        session_id,
        provisioner_id,
        pid,
        started_ago,
        cancelled,
    )
    return execution


@asynccontextmanager
async def uncommitted_report(
    url: str, prov: Provisioner, *events: RunnerEvent
) -> AsyncIterator[int]:
    """A report applied on a second connection and held uncommitted until the block ends
    (yields that backend's pid); it commits when the block exits normally."""
    holder = await asyncpg.connect(url)
    try:
        async with holder.transaction():
            await send(holder, prov, *events)
            yield holder.get_server_pid()
    finally:
        await holder.close()


# Reporting ---------------------------------------------------------------------------------


async def test_p75_installation_report_creates_a_neutral_row_reconcile_sees(conn: Conn) -> None:
    prov = await provisioner(conn)
    outcome = await send(conn, prov, ev("i-1", RUNNING, template_key="small"))
    row = await row_of(conn, prov, "i-1")
    assert (outcome.accepted, row["workspace_id"], row["launch_kind"]) == (1, None, "manual")
    seen = await reconcile.reconcile(conn, prov, ["i-1"], grace=GRACE)
    assert seen.runners[0].state is RUNNING


async def test_p76_duplicate_ids_collapse_to_one_row(conn: Conn, workspace: UUID) -> None:
    prov = await provisioner(conn, workspace)
    t = now()
    outcome = await send(
        conn,
        prov,
        ev("a", STARTING, t - timedelta(seconds=2)),
        ev("a", RUNNING, t - timedelta(seconds=1)),
        ev("b", RUNNING, t),
    )
    assert outcome.accepted == 2
    rows = await conn.fetchval(
        "SELECT count(*) FROM runner_instances WHERE provisioner_id = $1", prov.id
    )
    assert rows == 2
    assert (await row_of(conn, prov, "a"))["state"] == "running"


async def test_p77_reports_never_change_launch_kind(conn: Conn, workspace: UUID) -> None:
    prov = await provisioner(conn, workspace)
    warm = await runner(conn, prov.id, workspace_id=workspace, launch_kind="warm", state="starting")
    await send(conn, prov, ev(await pid_of(conn, warm), TERMINATED))
    kind = await conn.fetchval("SELECT launch_kind FROM runner_instances WHERE id = $1", warm)
    assert kind == "warm"


async def test_p78_equal_timestamps_resolve_by_rank_in_any_order(
    conn: Conn, workspace: UUID
) -> None:
    prov = await provisioner(conn, workspace)
    t = now()
    await send(conn, prov, ev("a", FAILED, t), ev("a", RUNNING, t))
    await send(conn, prov, ev("b", RUNNING, t), ev("b", FAILED, t))
    await send(conn, prov, ev("c", FAILED, t))
    await send(conn, prov, ev("c", RUNNING, t))
    for pid in ("a", "b", "c"):
        assert (await row_of(conn, prov, pid))["state"] == "failed"


async def test_p79_delayed_higher_rank_applies_older_same_rank_does_not(
    conn: Conn, workspace: UUID
) -> None:
    prov = await provisioner(conn, workspace)
    t = now()
    await send(conn, prov, ev("a", RUNNING, t, reason="fresh"))
    await send(conn, prov, ev("a", RUNNING, t - timedelta(seconds=10), reason="old"))
    assert (await row_of(conn, prov, "a"))["reason"] == "fresh"
    await send(conn, prov, ev("a", STOPPING, t - timedelta(seconds=5)))
    assert (await row_of(conn, prov, "a"))["state"] == "stopping"


async def test_p80_an_older_terminal_report_moves_state_but_releases_nothing(
    conn: Conn, workspace: UUID
) -> None:
    prov = await provisioner(conn, workspace)
    res = await reservation(conn, workspace_id=workspace, provisioner_id=prov.id)
    rid = await runner(conn, prov.id, workspace_id=workspace, reservation_id=res, assigned=True)
    outcome = await send(
        conn, prov, ev(await pid_of(conn, rid), FAILED, now() - timedelta(minutes=1))
    )
    assert outcome.reservations_released == 0
    assert (await count_of(conn, res), await released_at(conn, rid)) == (1, None)
    state = await conn.fetchval("SELECT state FROM runner_instances WHERE id = $1", rid)
    assert state == "failed"


async def test_p81_a_rebound_reservation_survives_stale_ids_and_is_released(
    conn: Conn, workspace: UUID
) -> None:
    prov = await provisioner(conn, workspace)
    old = await reservation(conn, workspace_id=workspace, provisioner_id=prov.id, count=2)
    new = await reservation(conn, workspace_id=workspace, provisioner_id=prov.id, count=2)
    rid = await runner(conn, prov.id, workspace_id=workspace, reservation_id=new, assigned=True)
    pid = await pid_of(conn, rid)
    await send(conn, prov, ev(pid, RUNNING, reservation_id=old))
    assert (await row_of(conn, prov, pid))["reservation_id"] == new
    outcome = await send(conn, prov, ev(pid, STOPPED, reservation_id=old))
    assert outcome.reservations_released == 1
    assert (await count_of(conn, old), await count_of(conn, new)) == (2, 1)


async def test_p82_a_report_adopts_a_launch_reservation_never_a_bound_one(
    conn: Conn, workspace: UUID
) -> None:
    prov = await provisioner(conn, workspace)
    launch = await reservation(conn, workspace_id=workspace, provisioner_id=prov.id)
    bound = await reservation(conn, workspace_id=workspace, provisioner_id=prov.id, kind="bound")
    idle = await runner(conn, prov.id, workspace_id=workspace)
    await send(
        conn,
        prov,
        ev(await pid_of(conn, idle), RUNNING, reservation_id=launch),
        ev("new", STARTING, reservation_id=bound),
    )
    adopted = await conn.fetchval("SELECT reservation_id FROM runner_instances WHERE id = $1", idle)
    assert adopted == launch
    assert (await row_of(conn, prov, "new"))["reservation_id"] is None


async def test_p83_adoption_cannot_exceed_capacity(conn: Conn, workspace: UUID) -> None:
    prov = await provisioner(conn, workspace)
    res = await reservation(conn, workspace_id=workspace, provisioner_id=prov.id, count=1)
    await send(
        conn,
        prov,
        ev("first", STARTING, reservation_id=res),
        ev("second", STARTING, reservation_id=res),
    )
    assert (await row_of(conn, prov, "first"))["reservation_id"] == res
    assert (await row_of(conn, prov, "second"))["reservation_id"] is None


async def test_p84_failed_is_not_revived(conn: Conn, workspace: UUID) -> None:
    prov = await provisioner(conn, workspace)
    t = now() - timedelta(seconds=30)
    await send(conn, prov, ev("a", FAILED, t))
    await send(conn, prov, ev("a", RUNNING, t))
    await send(conn, prov, ev("a", RUNNING))
    assert (await row_of(conn, prov, "a"))["state"] == "failed"


async def test_p85_future_timestamps_are_clamped(conn: Conn, workspace: UUID) -> None:
    prov = await provisioner(conn, workspace)
    received = now()
    await runner_reports.report(
        conn,
        prov,
        [ev("a", RUNNING, received + timedelta(hours=1))],
        received_at=received,
        reserved_labels=(),
    )
    row = await row_of(conn, prov, "a")
    assert row["reported_at"] == received == row["started_at"]


async def test_p86_every_milestone_is_kept_without_reviving_state(
    conn: Conn, workspace: UUID
) -> None:
    prov = await provisioner(conn, workspace)
    t = now() - timedelta(minutes=5)
    s = timedelta(seconds=1)
    await send(conn, prov, ev("a", STOPPING, t + 2 * s), ev("a", STOPPED, t + 3 * s))
    await send(conn, prov, ev("a", RUNNING, t + s))
    row = await row_of(conn, prov, "a")
    assert row["state"] == "stopped"
    assert (row["started_at"], row["stopping_at"], row["stopped_at"]) == (
        t + s,
        t + 2 * s,
        t + 3 * s,
    )
    await send(conn, prov, ev("a", RUNNING, t))
    assert (await row_of(conn, prov, "a"))["started_at"] == t


async def test_p88_terminal_report_releases_the_intended_reservation(
    conn: Conn, workspace: UUID
) -> None:
    for scope in (workspace, None):
        prov = await provisioner(conn, scope)
        res = await reservation(conn, workspace_id=workspace, provisioner_id=prov.id, count=2)
        rid = await runner(conn, prov.id, intended_reservation_id=res, state="starting")
        outcome = await send(conn, prov, ev(await pid_of(conn, rid), FAILED, reservation_id=res))
        assert outcome.reservations_released == 1
        assert await count_of(conn, res) == 1
        intended = await conn.fetchval(
            "SELECT intended_reservation_id FROM runner_instances WHERE id = $1", rid
        )
        assert intended is None and await released_at(conn, rid) is not None


async def test_p89_with_both_ids_the_intended_one_is_released(conn: Conn, workspace: UUID) -> None:
    prov = await provisioner(conn, workspace)
    intended = await reservation(conn, workspace_id=workspace, provisioner_id=prov.id, count=2)
    assigned = await reservation(conn, workspace_id=workspace, provisioner_id=prov.id, count=2)
    rid = await runner(
        conn,
        prov.id,
        workspace_id=workspace,
        intended_reservation_id=intended,
        reservation_id=assigned,
    )
    await send(conn, prov, ev(await pid_of(conn, rid), TERMINATED))
    assert (await count_of(conn, intended), await count_of(conn, assigned)) == (1, 2)


async def test_p90_an_unknown_terminal_report_does_not_consume_capacity(
    conn: Conn, workspace: UUID
) -> None:
    prov = await provisioner(conn, workspace)
    res = await reservation(conn, workspace_id=workspace, provisioner_id=prov.id)
    outcome = await send(conn, prov, ev("ghost", FAILED, reservation_id=res))
    assert outcome.reservations_released == 0
    assert await count_of(conn, res) == 1
    assert (await row_of(conn, prov, "ghost"))["reservation_id"] is None


async def test_p91_other_workspaces_and_provisioners_reservations_are_kept(
    conn: Conn, workspace: UUID
) -> None:
    prov = await provisioner(conn, workspace)
    other = await provisioner(conn, workspace)
    foreign_ws = await reservation(conn, workspace_id=uuid.uuid4(), provisioner_id=prov.id)
    foreign_prov = await reservation(conn, workspace_id=workspace, provisioner_id=other.id)
    a = await runner(conn, prov.id, workspace_id=workspace, reservation_id=foreign_ws)
    b = await runner(conn, prov.id, workspace_id=workspace, intended_reservation_id=foreign_prov)
    outcome = await send(
        conn, prov, ev(await pid_of(conn, a), FAILED), ev(await pid_of(conn, b), FAILED)
    )
    assert outcome.reservations_released == 0
    assert (await count_of(conn, foreign_ws), await count_of(conn, foreign_prov)) == (1, 1)


async def test_p92_repeated_terminal_reports_release_once(conn: Conn, workspace: UUID) -> None:
    prov = await provisioner(conn, workspace)
    res = await reservation(conn, workspace_id=workspace, provisioner_id=prov.id, count=3)
    rid = await runner(conn, prov.id, workspace_id=workspace, reservation_id=res, assigned=True)
    pid = await pid_of(conn, rid)
    first = await send(conn, prov, ev(pid, TERMINATED))
    second = await send(conn, prov, ev(pid, TERMINATED))
    assert (first.reservations_released, second.reservations_released) == (1, 0)
    assert await count_of(conn, res) == 2
    assert (await row_of(conn, prov, pid))["terminated_at"] is not None


async def test_p93_units_release_in_one_batch_and_expired_ones_credit_nothing(
    conn: Conn, workspace: UUID
) -> None:
    prov = await provisioner(conn, workspace)
    res = await reservation(conn, workspace_id=workspace, provisioner_id=prov.id, count=3)
    expired = await reservation(
        conn, workspace_id=workspace, provisioner_id=prov.id, ttl=timedelta(seconds=-1)
    )
    ids = [
        await runner(conn, prov.id, workspace_id=workspace, reservation_id=res) for _ in range(3)
    ]
    late = await runner(conn, prov.id, workspace_id=workspace, reservation_id=expired)
    outcome = await send(conn, prov, *[ev(await pid_of(conn, r), STOPPED) for r in [*ids, late]])
    assert outcome.reservations_released == 3
    assert await count_of(conn, res) is None
    assert await count_of(conn, expired) == 1
    assert await released_at(conn, late) is not None


async def test_p94_j141_uncancelled_leases_block_the_release(conn: Conn, workspace: UUID) -> None:
    prov = await provisioner(conn, workspace)
    res = await reservation(conn, workspace_id=workspace, provisioner_id=prov.id, count=3)
    linked = await runner(
        conn, prov.id, workspace_id=workspace, reservation_id=res, runner_session_id=uuid.uuid4()
    )
    busy = await runner(conn, prov.id, workspace_id=workspace, reservation_id=res)
    cancelled = await runner(conn, prov.id, workspace_id=workspace, reservation_id=res)
    await lease(conn, workspace, prov.id, await pid_of(conn, busy), cancelled=True)
    await lease(conn, workspace, prov.id, await pid_of(conn, busy))
    await lease(conn, workspace, prov.id, await pid_of(conn, cancelled), cancelled=True)
    outcome = await send(
        conn, prov, *[ev(await pid_of(conn, r), FAILED) for r in (linked, busy, cancelled)]
    )
    assert outcome.reservations_released == 2
    assert await released_at(conn, linked) is not None
    assert await released_at(conn, busy) is None
    assert await released_at(conn, cancelled) is not None


async def test_p96_session_metadata_of_a_losing_event_is_kept(conn: Conn, workspace: UUID) -> None:
    prov = await provisioner(conn, workspace)
    session = uuid.uuid4()
    t = now()
    running = ev(
        "a", RUNNING, t - timedelta(seconds=1), runner_session_id=session, provider_kind="ec2"
    )
    await send(conn, prov, running, ev("a", FAILED, t))
    await send(conn, prov, ev("b", FAILED, t), ev("b", RUNNING, t, runner_session_id=session))
    row = await row_of(conn, prov, "a")
    assert (row["state"], row["runner_session_id"], row["provider_kind"]) == (
        "failed",
        session,
        "ec2",
    )
    assert (await row_of(conn, prov, "b"))["runner_session_id"] == session


async def test_p97_honored_intents_only_on_the_first_termination(
    conn: Conn, workspace: UUID
) -> None:
    prov = await provisioner(conn, workspace)
    other = await provisioner(conn, workspace)
    cancelled = await runner(conn, prov.id, workspace_id=workspace)
    timed_out = await runner(conn, prov.id, workspace_id=workspace, age=timedelta(minutes=10))
    newer_lease = await runner(conn, prov.id, workspace_id=workspace)
    foreign_lease = await runner(conn, prov.id, workspace_id=workspace)
    pids = {r: await pid_of(conn, r) for r in (cancelled, timed_out, newer_lease, foreign_lease)}
    await lease(conn, workspace, prov.id, pids[cancelled], cancelled=True)
    await lease(
        conn,
        workspace,
        prov.id,
        pids[newer_lease],
        cancelled=True,
        started_ago=timedelta(minutes=1),
    )
    await lease(conn, workspace, prov.id, pids[newer_lease])
    await lease(conn, workspace, other.id, pids[foreign_lease], cancelled=True)
    events = [ev(pid, TERMINATED) for pid in pids.values()]

    first = await send(conn, prov, *events)
    second = await send(conn, prov, *events)

    assert set(first.terminate_intents_honored) == {
        HonoredIntent(pids[cancelled], "job-cancelled"),
        HonoredIntent(pids[timed_out], "activation-timeout"),
    }
    assert second.terminate_intents_honored == ()


async def test_p98_reserved_labels_are_stripped_from_workspace_reports(
    conn: Conn, workspace: UUID
) -> None:
    scoped = await provisioner(conn, workspace)
    installation = await provisioner(conn)
    for prov in (scoped, installation):
        await send(
            conn, prov, ev("a", RUNNING, labels=("Linux", "gpu-pool")), reserved=("gpu-pool",)
        )
    assert (await row_of(conn, scoped, "a"))["labels"] == ["linux"]
    assert (await row_of(conn, installation, "a"))["labels"] == ["gpu-pool", "linux"]


# Terminal release by lease finalisation (jobs.md) ----------------------------------------


async def release_for_lease(conn: Conn, prov: Provisioner, runner_id: UUID) -> int:
    return await runner_release.release_terminal(
        conn,
        workspace_id=prov.workspace_id,
        provisioner_id=prov.id,
        provider_runner_ids=[await pid_of(conn, runner_id)],
        require_unlinked_session=False,
        require_terminal_state=False,
    )


async def test_j61_a_unit_released_at_first_claim_is_not_released_again(
    conn: Conn, workspace: UUID
) -> None:
    prov = await provisioner(conn, workspace)
    res = await reservation(conn, workspace_id=workspace, provisioner_id=prov.id, count=1)
    rid = await runner(
        conn,
        prov.id,
        workspace_id=workspace,
        reservation_id=res,
        runner_session_id=uuid.uuid4(),
        released=True,
        state="terminated",
    )
    assert await release_for_lease(conn, prov, rid) == 0
    assert await count_of(conn, res) == 1


async def test_j62_a_terminal_runner_with_a_cancelled_lease_releases_once(
    conn: Conn, workspace: UUID
) -> None:
    prov = await provisioner(conn, workspace)
    res = await reservation(conn, workspace_id=workspace, provisioner_id=prov.id, count=1)
    rid = await runner(
        conn, prov.id, workspace_id=workspace, reservation_id=res, state="terminated"
    )
    await lease(conn, workspace, prov.id, await pid_of(conn, rid), cancelled=True)
    assert await release_for_lease(conn, prov, rid) == 1
    stamped = await released_at(conn, rid)
    assert await count_of(conn, res) is None and stamped is not None
    assert await release_for_lease(conn, prov, rid) == 0
    assert await released_at(conn, rid) == stamped


async def test_j63_a_running_runner_keeps_its_reservation(conn: Conn, workspace: UUID) -> None:
    prov = await provisioner(conn, workspace)
    res = await reservation(conn, workspace_id=workspace, provisioner_id=prov.id, count=1)
    rid = await runner(conn, prov.id, workspace_id=workspace, reservation_id=res)
    assert await release_for_lease(conn, prov, rid) == 0
    assert (await count_of(conn, res), await released_at(conn, rid)) == (1, None)


async def test_j65_reaping_the_lease_of_a_terminal_runner_deletes_its_reservation(
    pool: asyncpg.Pool, conn: Conn, workspace: UUID
) -> None:
    """Through the maintenance reaper itself: the stale lease expires, then the failed runner's
    unit goes back (its reservation of 1 is deleted)."""
    prov = await provisioner(conn, workspace)
    res = await reservation(conn, workspace_id=workspace, provisioner_id=prov.id, count=1)
    rid = await runner(conn, prov.id, workspace_id=workspace, reservation_id=res, state="failed")
    execution = await lease(conn, workspace, prov.id, await pid_of(conn, rid))
    await conn.execute(  # silent for an hour: no heartbeat since
        "UPDATE running_jobs SET started_at = now() - interval '1 hour',"
        " last_heartbeat_at = now() - interval '1 hour' WHERE job_execution_id = $1",
        execution,
    )
    reaper = LeaseReaper(PoolReaperStore(pool), rule=StaleRule(), interval=1, limit=10)
    assert await reaper.run_once() == 1
    assert await conn.fetchval("SELECT count(*) FROM running_jobs") == 0
    assert await count_of(conn, res) is None
    assert await released_at(conn, rid) is not None


async def test_j141_a_terminal_runner_keeps_its_unit_while_an_uncancelled_lease_lives(
    conn: Conn, workspace: UUID
) -> None:
    prov = await provisioner(conn, workspace)
    res = await reservation(conn, workspace_id=workspace, provisioner_id=prov.id, count=2)
    rid = await runner(conn, prov.id, workspace_id=workspace, reservation_id=res, state="stopped")
    pid = await pid_of(conn, rid)
    await lease(conn, workspace, prov.id, pid, cancelled=True)
    live = await lease(conn, workspace, prov.id, pid)
    assert await release_for_lease(conn, prov, rid) == 0
    await conn.execute(
        "UPDATE running_jobs SET cancellation_requested_at = now() WHERE job_execution_id = $1",
        live,
    )
    assert await release_for_lease(conn, prov, rid) == 1
    assert await count_of(conn, res) == 1


# Reconcile -----------------------------------------------------------------------------------


async def test_p99_absent_stale_runners_are_terminated_and_released(
    conn: Conn, workspace: UUID
) -> None:
    prov = await provisioner(conn, workspace)
    res = await reservation(conn, workspace_id=workspace, provisioner_id=prov.id, count=2)
    stale = await runner(
        conn, prov.id, workspace_id=workspace, reservation_id=res, age=timedelta(minutes=5)
    )
    fresh = await runner(conn, prov.id, workspace_id=workspace, reservation_id=res)
    kept = await reconcile.reconcile(conn, prov, [], grace=GRACE)
    assert kept.terminated_absent_provider_runner_ids == ()
    assert await count_of(conn, res) == 2

    outcome = await reconcile.reconcile(conn, prov, ["elsewhere"], grace=GRACE)

    assert outcome.terminated_absent_provider_runner_ids == (await pid_of(conn, stale),)
    assert outcome.reservations_released == 1 and await count_of(conn, res) == 1
    states = await conn.fetch(
        "SELECT id, state, terminated_at FROM runner_instances WHERE id = ANY($1::uuid[])",
        [stale, fresh],
    )
    by_id = {row["id"]: row for row in states}
    assert by_id[stale]["state"] == "terminated" and by_id[stale]["terminated_at"] is not None
    assert by_id[fresh]["state"] == "running"


async def test_p100_reconcile_keeps_to_its_scope_and_is_idempotent(
    conn: Conn, workspace: UUID
) -> None:
    prov = await provisioner(conn, workspace)
    other = await provisioner(conn, workspace)
    old = timedelta(minutes=5)
    mine = await runner(conn, prov.id, workspace_id=workspace, age=old)
    elsewhere = await runner(conn, prov.id, workspace_id=uuid.uuid4(), age=old)
    theirs = await runner(conn, other.id, workspace_id=workspace, age=old)
    first = await reconcile.reconcile(conn, prov, ["x"], grace=GRACE)
    second = await reconcile.reconcile(conn, prov, ["x"], grace=GRACE)
    assert first.terminated_absent_provider_runner_ids == (await pid_of(conn, mine),)
    assert second.terminated_absent_provider_runner_ids == ()
    states = await conn.fetch(
        "SELECT state FROM runner_instances WHERE id = ANY($1::uuid[])", [elsewhere, theirs]
    )
    assert [row["state"] for row in states] == ["running", "running"]


async def test_p101_session_bound_absent_runners_are_released(conn: Conn, workspace: UUID) -> None:
    prov = await provisioner(conn, workspace)
    res = await reservation(conn, workspace_id=workspace, provisioner_id=prov.id, count=1)
    await runner(
        conn,
        prov.id,
        workspace_id=workspace,
        reservation_id=res,
        runner_session_id=uuid.uuid4(),
        age=timedelta(minutes=5),
    )
    outcome = await reconcile.reconcile(conn, prov, ["x"], grace=GRACE)
    assert outcome.reservations_released == 1 and await count_of(conn, res) is None


async def test_p102_the_newest_running_job_is_the_bound_job(conn: Conn, workspace: UUID) -> None:
    prov = await provisioner(conn, workspace)
    rid = await runner(conn, prov.id, workspace_id=workspace)
    pid = await pid_of(conn, rid)
    low, high = sorted([uuid.uuid4(), uuid.uuid4()])
    await lease(conn, workspace, prov.id, pid, started_ago=timedelta(minutes=1), execution_id=high)
    await lease(conn, workspace, prov.id, pid, started_ago=timedelta(minutes=5))
    await lease(conn, workspace, prov.id, pid, started_ago=timedelta(minutes=1), execution_id=low)
    await conn.execute(
        "UPDATE running_jobs SET started_at = date_trunc('second', now())"
        " WHERE job_execution_id = ANY($1::uuid[])",
        [low, high],
    )
    outcome = await reconcile.reconcile(conn, prov, [pid], grace=GRACE)
    bound = outcome.runners[0].bound_job
    assert bound is not None and bound.job_execution_id == high


async def test_p103_a_later_running_report_cannot_revive_a_reconciled_runner(
    conn: Conn, workspace: UUID
) -> None:
    prov = await provisioner(conn, workspace)
    rid = await runner(conn, prov.id, workspace_id=workspace, age=timedelta(minutes=5))
    await reconcile.reconcile(conn, prov, ["x"], grace=GRACE)
    await send(conn, prov, ev(await pid_of(conn, rid), RUNNING))
    state = await conn.fetchval("SELECT state FROM runner_instances WHERE id = $1", rid)
    assert state == "terminated"


async def test_p104_observed_ids_get_their_intent(conn: Conn, workspace: UUID) -> None:
    prov = await provisioner(conn, workspace)
    other = await provisioner(conn, workspace)
    done = await pid_of(conn, await runner(conn, prov.id, workspace_id=workspace, state="failed"))
    busy = await pid_of(conn, await runner(conn, prov.id, workspace_id=workspace))
    theirs = await pid_of(conn, await runner(conn, other.id, workspace_id=workspace))
    await lease(conn, workspace, prov.id, busy, cancelled=True)
    outcome = await reconcile.reconcile(conn, prov, ["orphan", done, busy, theirs], grace=GRACE)
    answers = [
        (r.provider_runner_id, r.state, r.desired_intent, r.intent_reason) for r in outcome.runners
    ]
    assert answers == [
        ("orphan", None, "keep", None),
        (done, FAILED, "terminate", "terminal-state"),
        (busy, RUNNING, "terminate", "job-cancelled"),
        (theirs, None, "keep", None),
    ]


async def test_p105_intended_reservation_only_when_asked(conn: Conn, workspace: UUID) -> None:
    prov = await provisioner(conn, workspace)
    res = await reservation(conn, workspace_id=workspace, provisioner_id=prov.id)
    pid = await pid_of(
        conn, await runner(conn, prov.id, workspace_id=workspace, intended_reservation_id=res)
    )
    plain = await reconcile.reconcile(conn, prov, [pid], grace=GRACE)
    asked = await reconcile.reconcile(conn, prov, [pid], grace=GRACE, include_intended=True)
    assert plain.runners[0].intended_reservation_id is None
    assert asked.runners[0].intended_reservation_id == res


# Races -----------------------------------------------------------------------------------------


Operation = Callable[[Conn], Awaitable[int]]


async def queued_behind(
    pool: asyncpg.Pool,
    observer: asyncpg.Connection,
    holder: AbstractAsyncContextManager[object],
    *operations: Operation,
) -> list[int]:
    """Start each operation on its own connection while `holder` holds a lock, wait until each is
    blocked on it (in the order given), then let go; returns their results in that order."""
    results: dict[int, int] = {}

    async def run(index: int, operation: Operation, conn: Conn) -> None:
        results[index] = await operation(conn)

    async with AsyncExitStack() as stack:
        conns = [await stack.enter_async_context(pool.acquire()) for _ in operations]
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks, holder:
                for index, (operation, conn) in enumerate(zip(operations, conns, strict=True)):
                    tasks.start_soon(run, index, operation, conn)
                    await wait_until_blocked(observer, conn.get_server_pid())
    return [results[i] for i in range(len(operations))]


async def test_p49_terminal_report_and_reconcile_on_one_workspace_lock_release_once(
    conn: Conn,
    pool: asyncpg.Pool,
    observer: asyncpg.Connection,
    database_url: str,
    workspace: UUID,
) -> None:
    prov = await provisioner(conn, workspace)
    res = await reservation(conn, workspace_id=workspace, provisioner_id=prov.id, count=2)
    rid = await runner(
        conn, prov.id, workspace_id=workspace, reservation_id=res, age=timedelta(minutes=5)
    )
    pid = await pid_of(conn, rid)

    async def reconciled(c: Conn) -> int:
        return (await reconcile.reconcile(c, prov, ["other"], grace=GRACE)).reservations_released

    async def terminal_report(c: Conn) -> int:
        return (await send(c, prov, ev(pid, FAILED))).reservations_released

    # Either order: whoever comes second finds the unit already given back.
    orders = ((reconciled, terminal_report), (terminal_report, reconciled))
    for (first, second), left in zip(orders, (1, None), strict=True):
        await conn.execute(
            "UPDATE runner_instances SET state = 'running', reservation_released_at = NULL,"
            " reported_at = now() - interval '5 minutes' WHERE id = $1",
            rid,
        )
        holder = holding_lock(database_url, locks.workspace(workspace))
        assert sorted(await queued_behind(pool, observer, holder, first, second)) == [0, 1]
        assert await count_of(conn, res) == left


async def test_p50_terminal_release_waits_for_a_held_assignment_lock(
    conn: Conn,
    pool: asyncpg.Pool,
    observer: asyncpg.Connection,
    database_url: str,
    workspace: UUID,
) -> None:
    prov = await provisioner(conn, workspace)
    res = await reservation(conn, workspace_id=workspace, provisioner_id=prov.id, count=2)
    rid = await runner(conn, prov.id, workspace_id=workspace, reservation_id=res, state="stopped")
    seen_while_blocked: list[datetime | None] = []

    async def release(c: Conn) -> int:
        return await runner_release.release_terminal(
            c, workspace_id=workspace, provisioner_id=prov.id, runner_instance_ids=[rid]
        )

    @asynccontextmanager
    async def assignment_held() -> AsyncIterator[None]:
        async with holding_lock(database_url, locks.assignment(prov.id, res)):
            yield
            seen_while_blocked.append(await released_at(observer, rid))

    assert await queued_behind(pool, observer, assignment_held(), release) == [1]
    assert seen_while_blocked == [None]
    assert await released_at(conn, rid) is not None and await count_of(conn, res) == 1


async def test_p51_reconcile_respects_a_report_committed_after_its_selection(
    conn: Conn,
    pool: asyncpg.Pool,
    observer: asyncpg.Connection,
    database_url: str,
    workspace: UUID,
) -> None:
    prov = await provisioner(conn, workspace)
    rid = await runner(conn, prov.id, workspace_id=workspace, age=timedelta(minutes=5))
    pid = await pid_of(conn, rid)

    async def reconciled(c: Conn) -> int:
        outcome = await reconcile.reconcile(c, prov, ["other"], grace=GRACE)
        return len(outcome.terminated_absent_provider_runner_ids)

    # The uncommitted report holds the row; reconcile has already chosen it when it blocks.
    holder = uncommitted_report(database_url, prov, ev(pid, RUNNING))
    assert await queued_behind(pool, observer, holder, reconciled) == [0]
    state = await conn.fetchval("SELECT state FROM runner_instances WHERE id = $1", rid)
    assert state == "running"


async def test_p52_two_concurrent_single_unit_releases_delete_a_count_two_row(
    conn: Conn,
    pool: asyncpg.Pool,
    observer: asyncpg.Connection,
    database_url: str,
    workspace: UUID,
) -> None:
    prov = await provisioner(conn, workspace)
    res = await reservation(conn, workspace_id=workspace, provisioner_id=prov.id, count=2)
    a, b = [
        await runner(conn, prov.id, workspace_id=workspace, reservation_id=res, state="failed")
        for _ in range(2)
    ]

    def release(runner_id: UUID) -> Operation:
        async def run(c: Conn) -> int:
            return await runner_release.release_terminal(
                c, workspace_id=workspace, provisioner_id=prov.id, runner_instance_ids=[runner_id]
            )

        return run

    holder = holding_lock(database_url, locks.assignment(prov.id, res))
    assert await queued_behind(pool, observer, holder, release(a), release(b)) == [1, 1]
    assert await count_of(conn, res) is None
