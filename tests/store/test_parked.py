"""What a replica reads and writes for all its parked runners in one statement each
(store/parked.py): which (workspace, label set) pairs have claimable work (the dispatch safety
tick's read, which must never miss a row a claim would take, and takes no lock), the parked
sessions' liveness (`touch_sessions`); and, through the dispatcher with no listener, that a job
whose notification was lost still reaches its parked runner."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import timedelta
from uuid import UUID

import anyio
import asyncpg
import pytest

from controlplane.actors.dispatch import Dispatcher
from controlplane.actors.waiters import Waiter
from controlplane.app import PoolClaims
from controlplane.domain.jobs import ClaimedJob, SessionClaims
from controlplane.domain.labels import LabelSet
from controlplane.store import claiming, parked, queue
from controlplane.store.pool import Conn
from tests.factories import holding, manual_session, new_job
from tests.store.test_demand_policies import set_paused

THROTTLE = timedelta(seconds=10)


async def _age(conn: Conn, session: UUID, seconds: int) -> None:
    await conn.execute(
        "UPDATE runner_sessions SET updated_at = now() - $2::interval WHERE id = $1",
        session,
        timedelta(seconds=seconds),
    )


async def _stamped(conn: Conn, session: UUID) -> bool:
    fresh: bool = await conn.fetchval(
        "SELECT updated_at > now() - interval '5 seconds' FROM runner_sessions WHERE id = $1",
        session,
    )
    return fresh


async def test_due_sessions_are_stamped_recent_and_foreign_ones_are_not(
    conn: Conn, workspace: UUID
) -> None:
    due, recent = await manual_session(conn, workspace), await manual_session(conn, workspace)
    await _age(conn, due.runner_session_id, 60)
    await _age(conn, recent.runner_session_id, 6)
    ids = [due.runner_session_id, recent.runner_session_id]
    await parked.touch_sessions(conn, [(workspace, each) for each in ids], THROTTLE)
    assert await _stamped(conn, due.runner_session_id)
    # Within its throttle window: left alone (6 s old is not "fresh" by the 5 s check).
    assert not await _stamped(conn, recent.runner_session_id)
    other = await manual_session(conn, workspace)
    await _age(conn, other.runner_session_id, 60)
    await parked.touch_sessions(conn, [(UUID(int=0), other.runner_session_id)], THROTTLE)
    assert not await _stamped(conn, other.runner_session_id)  # not of that workspace


async def test_a_session_row_held_elsewhere_is_skipped_not_waited_for(
    conn: Conn, database_url: str, workspace: UUID
) -> None:
    held, free = await manual_session(conn, workspace), await manual_session(conn, workspace)
    for session in (held, free):
        await _age(conn, session.runner_session_id, 60)
    lock = "SELECT 1 FROM runner_sessions WHERE id = $1 FOR UPDATE"
    async with holding(database_url, lock, held.runner_session_id):
        await conn.execute("SET lock_timeout = '1s'")  # a wait would fail the statement
        await parked.touch_sessions(
            conn,
            [(workspace, held.runner_session_id), (workspace, free.runner_session_id)],
            THROTTLE,
        )
    assert await _stamped(conn, free.runner_session_id)
    assert not await _stamped(conn, held.runner_session_id)


async def test_sessions_of_several_workspaces_are_stamped_in_one_statement(conn: Conn) -> None:
    first, second = uuid.uuid4(), uuid.uuid4()
    due = [await manual_session(conn, first), await manual_session(conn, second)]
    for session in due:
        await _age(conn, session.runner_session_id, 60)
    await parked.touch_sessions(
        conn, [(s.workspace_id, s.runner_session_id) for s in due], THROTTLE
    )
    assert all([await _stamped(conn, s.runner_session_id) for s in due])


async def _claimable(conn: Conn, *pairs: tuple[UUID, LabelSet]) -> list[bool]:
    return await parked.claimable(conn, list(pairs))


async def test_the_tick_read_finds_exactly_the_pairs_a_claim_could_serve(conn: Conn) -> None:
    """Labels by containment, per workspace; no labels finds nothing."""
    busy, idle = uuid.uuid4(), uuid.uuid4()
    await queue.enqueue(conn, [new_job(busy, ["linux", "x64"])])
    assert await _claimable(
        conn,
        (busy, ("linux", "x64")),
        (busy, ("arm", "linux", "x64")),
        (busy, ("linux",)),  # cannot take a job needing x64
        (idle, ("linux", "x64")),
        (busy, ()),
    ) == [True, True, False, False, False]
    assert await _claimable(conn) == []


async def test_the_tick_read_applies_the_claims_filter(conn: Conn) -> None:
    """A paused workspace, a full concurrency key and a passed queue deadline: nothing a claim
    could take, so nothing to wake for; each released, the read finds the job again."""
    paused, keyed, expired = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    await queue.enqueue(conn, [new_job(paused)])
    await set_paused(conn, paused, True)
    keyed_jobs = [new_job(keyed, key=("deploy", 1)) for _ in range(2)]
    await queue.enqueue(conn, keyed_jobs)
    runner = await manual_session(conn, keyed, ("linux",))
    lease = await claiming.claim(conn, runner)  # the key's only slot
    assert lease is not None
    late = new_job(expired)
    await queue.enqueue(conn, [late])
    await conn.execute(
        "UPDATE pending_jobs SET expires_at = now() - interval '1 second'"
        " WHERE job_execution_id = $1",
        late.identity.job_execution_id,
    )
    linux: LabelSet = ("linux",)
    pairs = [(paused, linux), (keyed, linux), (expired, linux)]
    assert await _claimable(conn, *pairs) == [False, False, False]
    await set_paused(conn, paused, False)
    await conn.execute(
        "UPDATE concurrency_keys SET running = 0 WHERE workspace_id = $1", keyed
    )  # as the lease's end does (its trigger), without ending it here
    assert await _claimable(conn, *pairs) == [True, True, False]


async def test_many_pairs_are_read_in_several_statements_in_order(
    conn: Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(parked, "MAX_PAIRS", 2)
    workspaces = [uuid.uuid4() for _ in range(5)]
    await queue.enqueue(conn, [new_job(workspaces[1]), new_job(workspaces[4])])
    found = await _claimable(conn, *[(w, ("linux",)) for w in workspaces])
    assert found == [False, True, False, False, True]


async def test_the_tick_read_waits_for_no_lock(
    conn: Conn, database_url: str, workspace: UUID
) -> None:
    """A pending row a claim holds, and its execution lock: the read neither waits nor skips
    it (a claim may still take it, or one behind it)."""
    job = new_job(workspace)
    await queue.enqueue(conn, [job])
    lock = "SELECT 1 FROM pending_jobs WHERE job_execution_id = $1 FOR UPDATE"
    async with holding(database_url, lock, job.identity.job_execution_id):
        await conn.execute("SET lock_timeout = '1s'")  # a wait would fail the statement
        assert await _claimable(conn, (workspace, ("linux",))) == [True]


class CountedClaims(PoolClaims):
    """The dispatcher's real store, telling when a claim has returned."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        super().__init__(pool, THROTTLE)
        self.claimed = anyio.Event()

    async def claim_batch(
        self, workspace_id: UUID, labels: LabelSet, runner_session_ids: list[UUID]
    ) -> dict[UUID, ClaimedJob]:
        try:
            return await super().claim_batch(workspace_id, labels, runner_session_ids)
        finally:
            self.claimed.set()

    async def claim(self, session: SessionClaims) -> ClaimedJob | None:
        try:
            return await super().claim(session)
        finally:
            self.claimed.set()


async def test_a_job_whose_notification_was_lost_is_dispatched_by_the_tick(
    pool: asyncpg.Pool, conn: Conn, workspace: UUID
) -> None:
    """No listener at all, as while it reconnects: the NOTIFY of the enqueue reaches nobody.
    The parked runner's first claim found nothing; the replica's tick read finds the job and
    wakes its actor, whose claim delivers it."""
    store = CountedClaims(pool)
    dispatcher = Dispatcher(store, tick_seconds=0.2, touch_seconds=30)
    runner = await manual_session(conn, workspace, ("linux",))
    waiting = Waiter(runner)
    async with anyio.create_task_group() as group:
        await group.start(dispatcher.run)
        dispatcher.park(waiting)
        with anyio.fail_after(10):
            await store.claimed.wait()  # the newcomer's claim: nothing queued yet
        assert not waiting.done.is_set()
        job = new_job(workspace)
        await queue.enqueue(conn, [job])  # commits; its NOTIFY reaches no listener
        with anyio.fail_after(30):
            await waiting.done.wait()
        group.cancel_scope.cancel()
    assert waiting.job is not None
    assert waiting.job.identity.job_execution_id == job.identity.job_execution_id


async def test_many_sessions_are_stamped_in_several_statements(
    conn: Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No statement holds more than MAX_PAIRS session rows locked; none is left out."""
    monkeypatch.setattr(parked, "MAX_PAIRS", 2)
    statements: list[int] = []
    touch = parked._touch

    async def counted(
        conn: Conn, sessions: Sequence[tuple[UUID, UUID]], throttle: timedelta
    ) -> None:
        statements.append(len(sessions))
        await touch(conn, sessions, throttle)

    monkeypatch.setattr(parked, "_touch", counted)
    workspace = uuid.uuid4()
    due = [await manual_session(conn, workspace) for _ in range(5)]
    for session in due:
        await _age(conn, session.runner_session_id, 60)
    await parked.touch_sessions(conn, [(workspace, s.runner_session_id) for s in due], THROTTLE)
    assert statements == [2, 2, 1]
    assert all([await _stamped(conn, s.runner_session_id) for s in due])
