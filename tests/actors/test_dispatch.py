"""The workspace actor's logic with a fake store, on trio with a mock clock: nothing here waits
for real time, and the same code runs on asyncio in the daemon (it uses only anyio)."""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import anyio
import pytest
import trio.testing

from controlplane.actors.dispatch import Dispatcher
from controlplane.actors.waiters import Waiter, WaiterState
from controlplane.domain.jobs import ClaimedJob, JobIdentity, SessionClaims
from controlplane.domain.labels import LabelSet
from controlplane.errors import DatabaseUnavailable, Unavailable

WORKSPACE = uuid.uuid4()


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})


class FakeStore:
    """Jobs by required labels, FIFO, each in its workspace (WORKSPACE unless told); records
    every call. The tick's read (`claimable`) answers from the same jobs."""

    def __init__(self) -> None:
        self.jobs: deque[tuple[LabelSet, ClaimedJob]] = deque()
        self.claims: list[LabelSet] = []
        self.put_backs: list[UUID] = []
        self.put_back_failures = 0
        self.claim_started = anyio.Event()
        self.touches: list[list[UUID]] = []
        self.batches: list[int] = []  # sessions per batch claim
        self.before_empty_answer: Any = None  # awaited by a claim that is about to find nothing
        self.failure: Exception | None = None  # raised by every claim while set
        self.reads: list[list[tuple[UUID, LabelSet]]] = []  # the tick's reads, pairs each
        self.read_delay = 0.0
        self.read_failure: Exception | None = None  # raised by every tick read while set

    def add(self, labels: LabelSet, workspace: UUID = WORKSPACE) -> ClaimedJob:
        job = ClaimedJob(
            identity=JobIdentity(workspace, *(uuid.uuid4() for _ in range(5))),
            required_labels=labels,
            payload={},
            queued_at=datetime.now(UTC),
            started_at=datetime.now(UTC),
        )
        self.jobs.append((labels, job))
        return job

    async def claim(self, session: SessionClaims) -> ClaimedJob | None:
        self.claims.append(session.labels)
        self.claim_started.set()
        await anyio.sleep(0.001)  # a claim takes a round trip
        if self.failure is not None:
            raise self.failure
        for index, (labels, job) in enumerate(self.jobs):
            if _takes(session.workspace_id, session.labels, labels, job):
                del self.jobs[index]
                return job
        if self.before_empty_answer is not None:  # what happens after its snapshot was taken
            late, self.before_empty_answer = self.before_empty_answer, None
            await late()
        return None

    async def claim_batch(
        self, workspace_id: UUID, labels: LabelSet, runner_session_ids: list[UUID]
    ) -> dict[UUID, ClaimedJob]:
        """One statement: the k-th oldest compatible job to the k-th session."""
        assert len(set(runner_session_ids)) == len(runner_session_ids), "a session twice"
        self.claims.append(labels)
        self.batches.append(len(runner_session_ids))
        self.claim_started.set()
        await anyio.sleep(0.001)
        if self.failure is not None:
            raise self.failure
        claimed: dict[UUID, ClaimedJob] = {}
        for session_id in runner_session_ids:
            for index, (required, job) in enumerate(self.jobs):
                if _takes(workspace_id, labels, required, job):
                    del self.jobs[index]
                    claimed[session_id] = job
                    break
        return claimed

    async def claimable(self, pairs: Sequence[tuple[UUID, LabelSet]]) -> list[bool]:
        self.reads.append(list(pairs))
        await anyio.sleep(self.read_delay or 0.001)
        if self.read_failure is not None:
            raise self.read_failure
        return [
            any(_takes(workspace, labels, required, job) for required, job in self.jobs)
            for workspace, labels in pairs
        ]

    async def touch(self, sessions: Sequence[tuple[UUID, UUID]]) -> None:
        """One statement for every parked session of the replica: recorded as one batch."""
        self.touches.append([session for _, session in sessions])

    async def put_back(self, job_execution_id: UUID, runner_session_id: UUID) -> bool:
        if self.put_back_failures:
            self.put_back_failures -= 1
            raise Unavailable("database blip")
        self.put_backs.append(job_execution_id)
        return True


def _takes(workspace: UUID, labels: LabelSet, required: LabelSet, job: ClaimedJob) -> bool:
    return job.identity.workspace_id == workspace and set(required) <= set(labels)


def waiter(*labels: str) -> Waiter:
    return Waiter(SessionClaims(uuid.uuid4(), WORKSPACE, tuple(sorted(labels)), None))


async def _run(store: FakeStore, body: Any) -> None:
    dispatcher = Dispatcher(store, tick_seconds=5)
    async with anyio.create_task_group() as group:
        await group.start(dispatcher.run)
        await body(dispatcher)
        group.cancel_scope.cancel()


async def test_a_burst_reaches_every_waiter_in_arrival_order_with_one_batch_claim() -> None:
    store = FakeStore()
    waiters = [waiter("linux") for _ in range(5)]

    async def body(dispatcher: Dispatcher) -> None:
        for each in waiters:
            dispatcher.park(each)
        await anyio.sleep(1)  # mock clock: the newcomers are tried and find nothing
        store.claims.clear()
        jobs = [store.add(("linux",)) for _ in range(5)]
        dispatcher.wake(WORKSPACE, ("linux",))
        with anyio.fail_after(5):
            for each in waiters:
                await each.done.wait()
        assert [each.job for each in waiters] == jobs
        assert store.claims == [("linux",)]
        assert store.batches[-1] == 5

    await _run(store, body)


async def test_batches_break_at_other_labels_capped_waiters_and_a_repeated_session() -> None:
    """Runs keep arrival order: a batch never mixes label sets, never holds a capped (one-job)
    waiter, and never holds one session twice (it could not tell the two claims apart)."""
    store = FakeStore()
    twice = SessionClaims(uuid.uuid4(), WORKSPACE, ("linux",), None)
    capped = Waiter(SessionClaims(uuid.uuid4(), WORKSPACE, ("linux",), 1))
    order = [
        waiter("linux"),
        waiter("linux"),
        waiter("linux", "x64"),
        capped,
        waiter("linux"),
        Waiter(twice),
        Waiter(twice),
    ]

    async def body(dispatcher: Dispatcher) -> None:
        for each in order:
            dispatcher.park(each)
        await anyio.sleep(1)  # every newcomer is tried alone and finds nothing
        store.claims.clear()
        store.batches.clear()
        jobs = [store.add(("linux",)) for _ in range(len(order))]
        dispatcher.wake(WORKSPACE, None)
        with anyio.fail_after(5):
            for each in order:
                await each.done.wait()
        assert [each.job for each in order] == jobs  # FIFO jobs to waiters in arrival order
        assert store.claims == [
            ("linux",),  # the first two, batched
            ("linux", "x64"),
            ("linux",),  # the capped waiter alone (claim, not claim_batch)
            ("linux",),  # the next linux waiter with the first use of `twice`
            ("linux",),  # `twice` again, alone
        ]
        assert store.batches == [2, 2]

    await _run(store, body)


async def test_labels_found_empty_mid_pass_skip_the_later_waiters_they_cover() -> None:
    """Arrival order linux, linux+x64, linux: once the first two come up empty, the third is
    covered (its labels are a subset of an empty set) and costs no claim in the same pass."""
    store = FakeStore()

    async def body(dispatcher: Dispatcher) -> None:
        for each in (waiter("linux"), waiter("linux", "x64"), waiter("linux")):
            dispatcher.park(each)
        await anyio.sleep(1)
        store.claims.clear()
        dispatcher.wake(WORKSPACE, None)  # "anything may have changed", and nothing did
        await anyio.sleep(1)
        assert store.claims == [("linux",), ("linux", "x64")]

    await _run(store, body)


async def test_a_wake_for_other_labels_costs_no_claims_for_these_waiters() -> None:
    store = FakeStore()
    linux = [waiter("linux") for _ in range(3)]

    async def body(dispatcher: Dispatcher) -> None:
        for each in linux:
            dispatcher.park(each)
        await anyio.sleep(1)
        store.claims.clear()
        store.add(("macos",))
        dispatcher.wake(WORKSPACE, ("macos",))
        await anyio.sleep(1)
        assert store.claims == []
        assert all(each.state is WaiterState.WAITING for each in linux)

    await _run(store, body)


async def test_once_a_label_set_finds_nothing_narrower_waiters_are_not_tried() -> None:
    store = FakeStore()

    async def body(dispatcher: Dispatcher) -> None:
        wide, narrow = waiter("linux", "x64"), waiter("linux")
        dispatcher.park(wide)
        dispatcher.park(narrow)
        await anyio.sleep(1)
        store.claims.clear()
        dispatcher.wake(WORKSPACE, None)  # "anything may have changed", and nothing did
        await anyio.sleep(1)
        assert store.claims == [("linux", "x64")]

    await _run(store, body)


async def test_a_claim_for_an_abandoned_waiter_is_put_back_retrying_a_blip() -> None:
    store = FakeStore()
    store.put_back_failures = 2

    async def body(dispatcher: Dispatcher) -> None:
        job = store.add(("linux",))
        gone = waiter("linux")
        dispatcher.park(gone)  # a newcomer is tried at once
        with anyio.fail_after(5):
            await store.claim_started.wait()
        assert gone.abandon()  # the runner leaves while its claim is in flight
        await anyio.sleep(5)
        assert gone.job is None
        assert store.put_backs == [job.identity.job_execution_id]  # third attempt succeeded
        assert store.put_back_failures == 0

    await _run(store, body)


async def test_the_safety_tick_finds_work_whose_notification_was_lost() -> None:
    store = FakeStore()

    async def body(dispatcher: Dispatcher) -> None:
        parked = waiter("linux")
        dispatcher.park(parked)
        await anyio.sleep(1)
        job = store.add(("linux",))  # enqueued, but no wake arrives
        with anyio.fail_after(30):
            await parked.done.wait()
        assert parked.job == job

    await _run(store, body)


async def test_close_answers_every_parked_waiter() -> None:
    store = FakeStore()

    async def body(dispatcher: Dispatcher) -> None:
        parked = [waiter("linux") for _ in range(3)]
        for each in parked:
            dispatcher.park(each)
        await anyio.sleep(1)
        dispatcher.close()
        assert all(each.state is WaiterState.FAILED for each in parked)
        late = waiter("linux")
        dispatcher.park(late)
        assert late.state is WaiterState.FAILED

    await _run(store, body)


async def test_a_runner_polling_again_in_an_idle_workspace_costs_no_claim() -> None:
    """Once a label set came up empty, newcomers it covers park without a claim until a wake
    for labels they could take; then they are tried and served."""
    store = FakeStore()

    async def body(dispatcher: Dispatcher) -> None:
        first = waiter("linux", "x64")
        dispatcher.park(first)
        await anyio.sleep(1)
        assert store.claims == [("linux", "x64")]
        again = [waiter("linux", "x64"), waiter("linux")]
        for each in again:
            dispatcher.park(each)
        await anyio.sleep(1)  # before the safety tick
        assert store.claims == [("linux", "x64")]
        jobs = [store.add(("linux",)) for _ in range(3)]
        dispatcher.wake(WORKSPACE, ("linux",))
        with anyio.fail_after(3):
            for each in (first, *again):
                await each.done.wait()
        assert [each.job for each in (first, *again)] == jobs

    await _run(store, body)


async def test_a_wake_during_an_empty_claim_keeps_its_labels_from_being_cached() -> None:
    """The claim's snapshot predates the job the wake announces: the next pass must try."""
    store = FakeStore()

    async def body(dispatcher: Dispatcher) -> None:
        async def job_commits_meanwhile() -> None:
            store.add(("linux",))
            dispatcher.wake(WORKSPACE, ("linux",))

        store.before_empty_answer = job_commits_meanwhile
        parked = waiter("linux")
        dispatcher.park(parked)
        with anyio.fail_after(3):  # well before the 5 s safety tick
            await parked.done.wait()
        assert parked.job is not None
        assert store.claims == [("linux",), ("linux",)]

    await _run(store, body)


async def test_parked_sessions_are_touched_together_once_per_interval() -> None:
    store = FakeStore()
    parked = [waiter("linux") for _ in range(4)]

    async def body(dispatcher: Dispatcher) -> None:
        for each in parked:
            dispatcher.park(each)
        await anyio.sleep(31)  # six safety ticks
        ids = {each.session.runner_session_id for each in parked}
        assert all(set(batch) == ids for batch in store.touches[1:])
        assert 3 <= len(store.touches) <= 4  # every 10 s, not per tick or per runner

    await _run(store, body)


async def test_a_claim_that_fails_for_a_named_reason_answers_each_waiter_with_it() -> None:
    """A store error with a code (the database unreachable) reaches every waiter of the claim,
    single or batched, as itself; anything else is a generic `unavailable`."""
    store = FakeStore()
    store.failure = DatabaseUnavailable("database unavailable; retry")
    batch = [waiter("linux") for _ in range(3)]
    single = waiter("macos")

    async def body(dispatcher: Dispatcher) -> None:
        for each in [*batch, single]:
            dispatcher.park(each)
        with anyio.fail_after(5):
            for each in [*batch, single]:
                await each.done.wait()
        assert store.batches == [3]
        assert all(each.state is WaiterState.FAILED for each in [*batch, single])
        assert [each.error.code for each in [*batch, single] if each.error] == [
            "database-unavailable"
        ] * 4

        store.failure = RuntimeError("not ours")
        unnamed = [waiter("linux") for _ in range(2)]
        for each in unnamed:
            dispatcher.park(each)
        with anyio.fail_after(5):
            for each in unnamed:
                await each.done.wait()
        assert [each.error.code for each in unnamed if each.error] == ["unavailable"] * 2

    await _run(store, body)
