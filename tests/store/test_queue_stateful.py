"""Random concurrent interleavings of the queue and lease operations, checked after every step.

A hypothesis state machine owns one fresh database (cloned from the migrated template), one
asyncio event loop and four worker connections. Its main rule starts two to four operations at
once, each on its own connection (asyncio.gather): enqueue (new executions and replays), claim
(manual and capped sessions), heartbeat, complete, reconcile, reap and put-back. A separate rule
ages leases so the reaper has work. After every step the invariants are checked by SQL on a
separate observer connection, plus a small Python model:

* no execution is both pending and running; at most one pending row and one lease per execution;
* a capped session never exceeds its cap, and its `claims_used` equals its `job.claimed` events
  minus the claims put back (the model counts those: `job.requeued` carries no session id);
* every tombstone has exactly one terminal event, of the type and outcome matching who ended it,
  and every terminal event has exactly one tombstone. The one deliberate exception: a reconcile
  for an execution the store never had writes a tombstone (so a late enqueue cannot bring it
  back) but no event; the model records exactly those and they must have zero events;
* no ended execution is pending, a lease next to a tombstone is cancellation-requested, a
  tombstone never disappears, and an enqueue replay of an ended execution reports ENDED;
* no operation raised anything but the expected domain errors (no deadlock, no lock timeout);
* the life of an execution (docs/policies.md Q-40..): jobs carry run and queue timeouts and
  retries on a lost runner, the leader's run timeout and queue expiry race the rest, and no
  execution is ever retried beyond its limit (its attempt never exceeds `retries_on_lost` + 1,
  and it has exactly `attempt` - 1 lost attempts on record);
* pauses (docs/policies.md, pause and resume): an operator pauses or resumes the workspace or a
  session (store/pauses.py `change`) in the same batches as the claims. A claim made while the
  workspace, or its session, was paused before its batch and not resumed within it hands out
  nothing (a pause or resume racing the claim in the same batch may go either way). After
  every batch the model's paused set is the database's;
* a key never runs over its limit (the `concurrency_keys` count equals its leases, which never
  exceed the limit); nothing runs twice: an execution's `job.claimed` events never exceed 1 +
  its `job.requeued` + its `job.retried` events, and it never has two leases; no job is lost:
  every execution an enqueue answered ENQUEUED is pending, running or has a tombstone; every
  ended execution has exactly one terminal event.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar
from uuid import UUID

import asyncpg
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from controlplane.domain.jobs import (
    ClaimedJob,
    EndedLease,
    EnqueueResult,
    NewJob,
    Outcome,
    ReconcileResult,
    SessionClaims,
    StaleRule,
)
from controlplane.domain.labels import LabelSet, canonicalise
from controlplane.domain.pauses import Operator, PauseKind, PauseState
from controlplane.errors import RunnerSessionExhausted, RunningJobExecutionNotFound
from controlplane.store import claiming, deadlines, leases, pauses, queue
from controlplane.store.pool import PoolSettings, server_settings
from tests.conftest import with_database
from tests.factories import capped_session, manual_session, new_job

WORKERS = 4
JOB_LABELS: list[LabelSet] = [canonicalise(x) for x in (["linux"], ["linux", "x64"], ["macos"])]
SESSION_LABELS: list[LabelSet] = [
    canonicalise(x) for x in (["linux"], ["linux", "x64"], ["macos"], ["linux", "macos", "x64"])
]
COMPLETE_OUTCOMES = [Outcome.SUCCEEDED, Outcome.FAILED, Outcome.CANCELLED]
RECONCILE_OUTCOMES = [Outcome.CANCELLED, Outcome.SUCCEEDED]
REAP_LIMITS = [1, 2, 100]
KEYS: list[tuple[str, int] | None] = [("one", 1), ("two", 2), None, None]
TERMINAL = (
    "job.completed",
    "job.cancelled",
    "job.lease_expired",
    "job.timed_out",
    "job.queue_expired",
)
# Who ended an execution, and how, decides its one terminal event.
EVENT_FOR_ENDED_BY = {
    "runner": "job.completed",
    "orchestrator": "job.cancelled",
    "reaper": "job.lease_expired",
}
EVENT_FOR_LEADER_OUTCOME = {
    "expired": "job.lease_expired",
    "timed_out": "job.timed_out",
    "queue_expired": "job.queue_expired",
}
TIMEOUT_GRACE = timedelta(seconds=60)
# A job's life policies, picked per new job: (run timeout, queue timeout, retries on lost).
LIFETIMES = [(None, None, 0), (60, None, 1), (3600, 60, 2), (None, 60, 0), (60, 120, 0)]
KINDS = [
    "enqueue",
    "enqueue",
    "claim",
    "claim",
    "heartbeat",
    "complete",
    "reconcile",
    "reap",
    "put_back",
    "time_out",
    "expire",
    "pause",
    "resume",
]
OPERATOR = Operator(key_id=uuid.UUID(int=14), name="stateful")
T = TypeVar("T")
STALE = StaleRule()  # 180 s threshold, 60 s no-first-heartbeat grace

# Set by the pytest test below before it runs the machine: the server and the migrated template.
_TARGET: dict[str, str] = {}


@dataclass(frozen=True)
class Op:
    """One operation of a concurrent batch; the integers pick its targets and variants."""

    kind: str
    pick: int
    variant: int
    extra: int


ops = st.builds(
    Op,
    kind=st.sampled_from(KINDS),
    pick=st.integers(0, 31),
    variant=st.integers(0, 7),
    extra=st.integers(0, 7),
)

Runner = Callable[[asyncpg.Connection], Awaitable[Any]]
Check = Callable[[Any], None]


@dataclass
class Planned:
    label: str
    run: Runner
    check: Check
    expected: tuple[type[BaseException], ...] = ()


class QueueMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.server_url = _TARGET["server_url"]
        self.database = f"cp_stateful_{uuid.uuid4().hex[:16]}"
        self.workers: list[asyncpg.Connection] = []
        self.observer: asyncpg.Connection | None = None
        self.workspace = uuid.uuid4()
        self.base_time = datetime.now(UTC) - timedelta(hours=1)
        # The model.
        self.jobs: list[NewJob] = []  # every execution the machine has named, in order
        self.sessions: list[SessionClaims] = []
        self.ever_ended: set[UUID] = set()
        self.unknown_reconciled: set[UUID] = set()  # ended before we ever had them
        self.requeued: Counter[UUID] = Counter()  # claims put back, per session
        self.enqueued: set[UUID] = set()  # every execution an enqueue answered ENQUEUED
        # Paused targets (the workspace's id, sessions' ids) as of the end of the last batch.
        self.paused: set[UUID] = set()
        self.held_paused: set[UUID] = set()  # of those, the ones the current batch keeps paused
        self.unexpected: list[str] = []
        self.steps: list[str] = []
        self.loop.run_until_complete(self._open())

    def _run(self, awaitable: Awaitable[T]) -> T:
        return self.loop.run_until_complete(awaitable)

    async def _open(self) -> None:
        admin = await asyncpg.connect(self.server_url)
        try:
            await admin.execute(
                f'CREATE DATABASE "{self.database}" '
                f'TEMPLATE "{_TARGET["template"]}" STRATEGY FILE_COPY'
            )
        finally:
            await admin.close()
        url = with_database(self.server_url, self.database)
        # The production settings, with short waits: a lock wait that long is a failure here.
        options = server_settings(
            PoolSettings(url=url, statement_timeout_ms=10_000, lock_timeout_ms=5_000)
        )
        self.workers = [await asyncpg.connect(url, server_settings=options) for _ in range(WORKERS)]
        self.observer = await asyncpg.connect(url, server_settings=options)

    async def _close(self) -> None:
        for connection in [*self.workers, *([self.observer] if self.observer else [])]:
            await connection.close()
        admin = await asyncpg.connect(self.server_url)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{self.database}" WITH (FORCE)')
        finally:
            await admin.close()

    def teardown(self) -> None:
        try:
            self.loop.run_until_complete(self._close())
        finally:
            self.loop.close()

    @property
    def db(self) -> asyncpg.Connection:
        assert self.observer is not None
        return self.observer

    # ----------------------------------------------------------------------------- sessions

    @initialize()
    def first_sessions(self) -> None:
        conn = self.workers[0]
        self.sessions.append(self._run(manual_session(conn, self.workspace, ("linux", "x64"))))
        self.sessions.append(
            self._run(capped_session(conn, self.workspace, ("linux", "x64"), max_claims=1))
        )
        self.sessions.append(
            self._run(manual_session(conn, self.workspace, ("linux", "macos", "x64")))
        )

    @precondition(lambda self: len(self.sessions) < 6)
    @rule(
        capped=st.booleans(),
        labels=st.sampled_from(SESSION_LABELS),
        cap=st.integers(1, 2),
    )
    def add_session(self, capped: bool, labels: LabelSet, cap: int) -> None:
        conn = self.workers[0]
        if capped:
            session = self._run(capped_session(conn, self.workspace, labels, max_claims=cap))
        else:
            session = self._run(manual_session(conn, self.workspace, labels))
        self.sessions.append(session)
        self.steps.append(f"add_session capped={capped} labels={labels} cap={cap}")

    # ------------------------------------------------------------------------------ leases

    def _leases(self) -> list[tuple[UUID, UUID]]:
        rows = self._run(
            self.db.fetch(
                "SELECT job_execution_id, runner_session_id FROM running_jobs"
                " ORDER BY started_at, id"
            )
        )
        return [(row["job_execution_id"], row["runner_session_id"]) for row in rows]

    @rule(seconds=st.sampled_from([30, 90, 200]), which=st.integers(0, 7))
    def age_leases(self, seconds: int, which: int) -> None:
        """Move leases into the past (all of them, or one) so the reaper finds stale ones.

        90 s makes a lease that never heartbeated stale (grace 60 s); 200 s makes any stale
        (threshold 180 s). It runs alone, between batches: it is test scaffolding, not an
        operation whose locking is under test.
        """
        self._age(seconds, which)

    def _age(self, seconds: int, which: int) -> None:
        current = self._leases()
        if not current:
            return
        targets = [ex for ex, _ in current] if which == 0 else [current[which % len(current)][0]]
        self._run(
            self.db.execute(
                """
                UPDATE running_jobs
                SET started_at = started_at - $2::interval,
                    first_heartbeat_at = first_heartbeat_at - $2::interval,
                    last_heartbeat_at = last_heartbeat_at - $2::interval
                WHERE job_execution_id = ANY($1::uuid[])
                """,
                targets,
                timedelta(seconds=seconds),
            )
        )
        # Queue deadlines age with the leases, so the leader's queue expiry finds work too.
        self._run(
            self.db.execute(
                "UPDATE pending_jobs SET expires_at = expires_at - $1::interval",
                timedelta(seconds=seconds),
            )
        )
        self.steps.append(f"age_leases {seconds}s x{len(targets)}")

    # ---------------------------------------------------------------------- the batch rule

    @rule(
        batch=st.lists(ops, min_size=2, max_size=WORKERS),
        age=st.sampled_from([0, 0, 90, 200]),
    )
    def concurrently(self, batch: list[Op], age: int) -> None:
        """Run 2-4 operations at once, each on its own connection.

        With `age`, every lease is first aged (alone, as in age_leases), so a reap in the batch
        races heartbeats, completes and put-backs of stale leases.
        """
        if age:
            self._age(age, 0)
        ended_before = set(self.ever_ended)
        current = self._leases()
        # A target paused before the batch stays paused through it unless the batch resumes it.
        resumed = {self._pause_target(op)[1] for op in batch if op.kind == "resume"}
        self.held_paused = self.paused - resumed
        planned = [self._plan(op, ended_before, current) for op in batch]
        self.steps.append("concurrently: " + " | ".join(p.label for p in planned))

        async def run_all() -> list[Any]:
            return await asyncio.gather(
                *(plan.run(conn) for conn, plan in zip(self.workers, planned, strict=False)),
                return_exceptions=True,
            )

        results = self._run(run_all())
        for plan, result in zip(planned, results, strict=True):
            if isinstance(result, BaseException):
                if not isinstance(result, plan.expected):
                    self.unexpected.append(f"{plan.label}: {type(result).__name__}: {result}")
                continue
            plan.check(result)
        rows = self._run(
            self.db.fetch(
                "SELECT workspace_id AS id FROM paused_workspaces"
                " UNION ALL SELECT runner_session_id FROM paused_runners"
            )
        )
        self.paused = {row["id"] for row in rows}

    def _violation(self, message: str) -> None:
        self.unexpected.append(message)

    def _new_job(self, labels: LabelSet, offset: int) -> NewJob:
        # Ordering: three priorities, and one job in four under each of two keys; life policies
        # picked per new job.
        run_timeout, queue_timeout, retries = LIFETIMES[len(self.jobs) % len(LIFETIMES)]
        job = replace(
            new_job(
                self.workspace,
                list(labels),
                queued_at=self.base_time + timedelta(seconds=offset),
                priority=offset % 3 - 1,
                key=KEYS[len(self.jobs) % len(KEYS)],
            ),
            timeout_seconds=run_timeout,
            queue_timeout_seconds=queue_timeout,
            retries_on_lost=retries,
        )
        self.jobs.append(job)
        return job

    def _job_for(self, op: Op) -> NewJob:
        """A new execution (two picks in three, or when there are none), else a replay."""
        labels = JOB_LABELS[op.extra % len(JOB_LABELS)]
        if not self.jobs or op.pick % 3 != 0:
            return self._new_job(labels, op.extra)
        known = self.jobs[op.pick % len(self.jobs)]
        if op.variant % 2:  # a replay may carry other labels and another queued_at: ignored
            return replace(
                known,
                required_labels=labels,
                queued_at=self.base_time + timedelta(seconds=op.extra),
            )
        return known

    def _plan(self, op: Op, ended_before: set[UUID], current: list[tuple[UUID, UUID]]) -> Planned:
        if op.kind == "enqueue":
            return self._plan_enqueue(op, ended_before)
        if op.kind == "claim":
            return self._plan_claim(op, ended_before)
        if op.kind in ("heartbeat", "complete", "put_back"):
            return self._plan_lease_op(op, ended_before, current)
        if op.kind == "reconcile":
            return self._plan_reconcile(op, ended_before)
        if op.kind in ("time_out", "expire"):
            return self._plan_deadline(op, ended_before)
        if op.kind in ("pause", "resume"):
            return self._plan_pause(op)
        assert op.kind == "reap"
        return self._plan_reap(op, ended_before)

    def _plan_enqueue(self, op: Op, ended_before: set[UUID]) -> Planned:
        jobs = [self._job_for(op)]
        if op.variant % 3 == 0:  # two executions in one call: two execution locks, sorted
            jobs.append(self._job_for(replace(op, pick=op.pick // 2 + 1, extra=op.extra + 1)))
        label = "enqueue " + ",".join(str(j.identity.job_execution_id)[-4:] for j in jobs)

        def check(results: list[EnqueueResult]) -> None:
            for job, result in zip(jobs, results, strict=True):
                ex = job.identity.job_execution_id
                if ex in ended_before and result != EnqueueResult.ENDED:
                    self._violation(f"{label}: replay of ended {ex} returned {result}")
                if result == EnqueueResult.ENQUEUED:
                    self.enqueued.add(ex)

        return Planned(label, lambda conn: queue.enqueue(conn, jobs), check)

    def _plan_claim(self, op: Op, ended_before: set[UUID]) -> Planned:
        session = self.sessions[op.pick % len(self.sessions)]
        label = f"claim by {str(session.runner_session_id)[-4:]} cap={session.max_claims}"

        held = {self.workspace, session.runner_session_id} & self.held_paused

        def check(claimed: ClaimedJob | None) -> None:
            if claimed is None:
                return
            ex = claimed.identity.job_execution_id
            if held:
                self._violation(f"{label}: claimed {ex} while {held} stayed paused")
            if ex in ended_before:
                self._violation(f"{label}: claimed ended execution {ex}")
            if not set(claimed.required_labels) <= set(session.labels):
                self._violation(f"{label}: claimed {claimed.required_labels} it cannot run")

        expected: tuple[type[BaseException], ...] = (
            (RunnerSessionExhausted,) if session.max_claims is not None else ()
        )
        return Planned(label, lambda conn: claiming.claim(conn, session), check, expected)

    def _plan_lease_op(
        self, op: Op, ended_before: set[UUID], current: list[tuple[UUID, UUID]]
    ) -> Planned:
        if current:
            ex, session_id = current[op.pick % len(current)]
        else:
            # No lease to aim at: a guess, which must fail cleanly (RunningJobExecutionNotFound).
            known = self.jobs[op.pick % len(self.jobs)] if self.jobs else None
            ex = known.identity.job_execution_id if known else uuid.uuid4()
            session_id = self.sessions[0].runner_session_id
        if op.variant == 0:  # the wrong session (usually): nothing may change
            session_id = self.sessions[op.extra % len(self.sessions)].runner_session_id
        label = f"{op.kind} {str(ex)[-4:]} by {str(session_id)[-4:]}"
        if op.kind == "heartbeat":
            return Planned(
                label,
                lambda conn: leases.heartbeat(conn, ex, session_id),
                lambda _: None,
                (RunningJobExecutionNotFound,),
            )
        if op.kind == "complete":
            outcome = COMPLETE_OUTCOMES[op.extra % len(COMPLETE_OUTCOMES)]

            def check_complete(ended: EndedLease) -> None:
                if ex in ended_before and ended.newly_ended:
                    self._violation(f"{label}: ended {ex} a second time")
                if ended.newly_ended:
                    self.ever_ended.add(ex)

            return Planned(
                label + f" {outcome}",
                lambda conn: leases.complete(conn, ex, session_id, outcome),
                check_complete,
                (RunningJobExecutionNotFound,),
            )

        def check_put_back(put: bool) -> None:
            if put:
                self.requeued[session_id] += 1

        return Planned(label, lambda conn: queue.put_back(conn, ex, session_id), check_put_back)

    def _plan_reconcile(self, op: Op, ended_before: set[UUID]) -> Planned:
        if not self.jobs or op.pick % 8 == 0:  # an execution the store has never seen
            ex = self._new_job(JOB_LABELS[0], op.extra).identity.job_execution_id
        else:
            ex = self.jobs[op.pick % len(self.jobs)].identity.job_execution_id
        status = RECONCILE_OUTCOMES[op.extra % len(RECONCILE_OUTCOMES)]
        label = f"reconcile {str(ex)[-4:]} {status}"

        def check(result: ReconcileResult) -> None:
            if ex in ended_before and result.newly_ended:
                self._violation(f"{label}: ended {ex} a second time")
            if result.newly_ended:
                self.ever_ended.add(ex)
                if not (result.was_pending or result.was_running):
                    self.unknown_reconciled.add(ex)

        return Planned(label, lambda conn: leases.reconcile(conn, ex, status, "test"), check)

    def _pause_target(self, op: Op) -> tuple[PauseKind, UUID]:
        """The workspace (one op in three) or one of the sessions."""
        if op.variant % 3 == 0:
            return PauseKind.WORKSPACE, self.workspace
        return PauseKind.RUNNER, self.sessions[op.pick % len(self.sessions)].runner_session_id

    def _plan_pause(self, op: Op) -> Planned:
        kind, target = self._pause_target(op)
        paused = op.kind == "pause"
        label = f"{op.kind} {kind} {str(target)[-4:]}"

        def check(state: PauseState) -> None:
            if state.paused != paused or state.target_id != target:
                self._violation(f"{label}: answered {state}")

        return Planned(
            label,
            lambda conn: pauses.change(
                conn, kind, target, paused=paused, operator=OPERATOR, reason=None
            ),
            check,
        )

    def _plan_reap(self, op: Op, ended_before: set[UUID]) -> Planned:
        limit = REAP_LIMITS[op.pick % len(REAP_LIMITS)]
        label = f"reap limit={limit}"

        def check(reaped: list[EndedLease]) -> None:
            if len(reaped) > limit:
                self._violation(f"{label}: reaped {len(reaped)}")
            for ended in reaped:
                ex = ended.identity.job_execution_id
                if ex in ended_before and ended.newly_ended:
                    self._violation(f"{label}: ended {ex} a second time")
                if ended.newly_ended:
                    self.ever_ended.add(ex)

        return Planned(label, lambda conn: leases.reap(conn, STALE, limit=limit), check)

    def _plan_deadline(self, op: Op, ended_before: set[UUID]) -> Planned:
        limit = REAP_LIMITS[op.pick % len(REAP_LIMITS)]
        label = f"{op.kind} limit={limit}"

        def check(ended: list[UUID]) -> None:
            if len(ended) > limit:
                self._violation(f"{label}: ended {len(ended)}")
            for ex in ended:
                if ex in ended_before:
                    self._violation(f"{label}: ended {ex} a second time")
                self.ever_ended.add(ex)

        async def run(conn: asyncpg.Connection) -> list[UUID]:
            if op.kind == "expire":
                return [
                    job.job_execution_id for job in await deadlines.expire_queued(conn, limit=limit)
                ]
            timed = await deadlines.time_out(conn, TIMEOUT_GRACE, limit=limit)
            return [lease.identity.job_execution_id for lease in timed if lease.newly_ended]

        return Planned(label, run, check)

    # -------------------------------------------------------------------------- invariants

    def _fail(self, what: str, rows: object) -> str:
        return f"{what}: {rows}\nsteps:\n  " + "\n  ".join(self.steps)

    @invariant()
    def no_unexpected_errors(self) -> None:
        """No deadlock, lock timeout or other surprise; no model violation."""
        assert not self.unexpected, self._fail("unexpected", self.unexpected)

    @invariant()
    def pending_and_running_are_disjoint(self) -> None:
        both = self._run(
            self.db.fetch(
                "SELECT job_execution_id FROM pending_jobs"
                " INTERSECT SELECT job_execution_id FROM running_jobs"
            )
        )
        assert not both, self._fail("both pending and running", both)

    @invariant()
    def one_row_per_execution(self) -> None:
        duplicated = self._run(
            self.db.fetch(
                """
                SELECT 'running' AS t, job_execution_id, count(*) AS n FROM running_jobs
                GROUP BY job_execution_id HAVING count(*) > 1
                UNION ALL
                SELECT 'pending', job_execution_id, count(*) FROM pending_jobs
                GROUP BY job_execution_id HAVING count(*) > 1
                """
            )
        )
        assert not duplicated, self._fail("more than one lease or pending row", duplicated)

    @invariant()
    def capped_sessions_hold_their_cap(self) -> None:
        rows = self._run(
            self.db.fetch(
                """
                SELECT s.id, s.max_claims, s.claims_used,
                       (SELECT count(*) FROM events e WHERE e.event_type = 'job.claimed'
                          AND e.payload->>'runner_session_id' = s.id::text) AS claimed,
                       (SELECT count(*) FROM running_jobs r
                          WHERE r.runner_session_id = s.id) AS leases
                FROM runner_sessions s WHERE s.max_claims IS NOT NULL
                """
            )
        )
        for row in rows:
            assert row["claims_used"] <= row["max_claims"], self._fail("over the cap", row)
            assert row["leases"] <= row["max_claims"], self._fail("more leases than cap", row)
            net = row["claimed"] - self.requeued[row["id"]]
            assert row["claims_used"] == net, self._fail(
                f"claims_used != claimed - requeued ({net})", row
            )

    @invariant()
    def a_key_never_runs_over_its_limit(self) -> None:
        rows = self._run(
            self.db.fetch(
                """
                SELECT k.concurrency_key, k.running,
                       (SELECT count(*) FROM running_jobs r
                         WHERE r.workspace_id = k.workspace_id
                           AND r.concurrency_key = k.concurrency_key) AS leases,
                       (SELECT min(r.concurrency_limit) FROM running_jobs r
                         WHERE r.workspace_id = k.workspace_id
                           AND r.concurrency_key = k.concurrency_key) AS cap
                FROM concurrency_keys k
                """
            )
        )
        for row in rows:
            assert row["running"] == row["leases"], self._fail("key count != its leases", row)
            assert row["cap"] is None or row["leases"] <= row["cap"], self._fail(
                "key over its limit", row
            )

    @invariant()
    def every_end_is_recorded_once(self) -> None:
        tombstones = self._run(
            self.db.fetch(
                """
                SELECT t.job_execution_id, t.workspace_id, t.outcome, t.ended_by,
                       count(e.seq) AS events,
                       min(e.event_type) AS event_type,
                       min(e.payload->>'outcome') AS event_outcome
                FROM ended_executions t
                LEFT JOIN events e ON e.job_execution_id = t.job_execution_id
                     AND e.event_type = ANY($1::text[])
                GROUP BY t.job_execution_id
                """,
                list(TERMINAL),
            )
        )
        for row in tombstones:
            if row["job_execution_id"] in self.unknown_reconciled:
                # Ended by the orchestrator before we ever saw it: no workspace on record.
                assert row["workspace_id"] is None, self._fail("unknown end with workspace", row)
                assert row["ended_by"] == "orchestrator", self._fail("unknown non-cancel", row)
            assert row["events"] == 1, self._fail("several terminal events", row)
            expected = (
                EVENT_FOR_LEADER_OUTCOME[row["outcome"]]
                if row["ended_by"] == "reaper"
                else EVENT_FOR_ENDED_BY[row["ended_by"]]
            )
            assert row["event_type"] == expected, self._fail(
                "terminal event does not match the tombstone", row
            )
            assert row["event_outcome"] == row["outcome"], self._fail("outcome mismatch", row)
        homeless = self._run(
            self.db.fetch(
                """
                SELECT e.job_execution_id, count(*) AS n FROM events e
                WHERE e.event_type = ANY($1::text[])
                GROUP BY e.job_execution_id
                HAVING count(*) <> 1 OR NOT EXISTS (
                    SELECT 1 FROM ended_executions t WHERE t.job_execution_id = e.job_execution_id)
                """,
                list(TERMINAL),
            )
        )
        assert not homeless, self._fail("terminal events without one tombstone", homeless)
        ended = {row["job_execution_id"] for row in tombstones}
        assert self.ever_ended <= ended, self._fail("a tombstone vanished", self.ever_ended - ended)
        self.ever_ended |= ended

    @invariant()
    def ended_executions_stay_ended(self) -> None:
        pending = self._run(
            self.db.fetch(
                """
                SELECT job_execution_id FROM pending_jobs
                WHERE job_execution_id = ANY($1::uuid[])
                   OR job_execution_id IN (SELECT job_execution_id FROM ended_executions)
                """,
                list(self.ever_ended),
            )
        )
        assert not pending, self._fail("an ended execution is pending again", pending)
        live = self._run(
            self.db.fetch(
                """
                SELECT r.job_execution_id FROM running_jobs r
                JOIN ended_executions t USING (job_execution_id)
                WHERE r.cancellation_requested_at IS NULL
                """
            )
        )
        assert not live, self._fail("an ended execution has a live, uncancelled lease", live)

    @invariant()
    def nothing_runs_twice(self) -> None:
        """Each claim of an execution but its first follows a put-back or a retry."""
        twice = self._run(
            self.db.fetch(
                """
                SELECT job_execution_id,
                       count(*) FILTER (WHERE event_type = 'job.claimed') AS claimed,
                       count(*) FILTER (WHERE event_type = 'job.requeued') AS requeued,
                       count(*) FILTER (WHERE event_type = 'job.retried') AS retried
                FROM events WHERE job_execution_id IS NOT NULL
                GROUP BY job_execution_id
                HAVING count(*) FILTER (WHERE event_type = 'job.claimed')
                     > 1 + count(*) FILTER (WHERE event_type IN ('job.requeued', 'job.retried'))
                """
            )
        )
        assert not twice, self._fail("claimed more often than put back or retried", twice)

    @invariant()
    def no_job_is_lost(self) -> None:
        lost = self._run(
            self.db.fetch(
                """
                SELECT ex FROM unnest($1::uuid[]) AS ex
                WHERE NOT EXISTS (SELECT 1 FROM pending_jobs p WHERE p.job_execution_id = ex)
                  AND NOT EXISTS (SELECT 1 FROM running_jobs r WHERE r.job_execution_id = ex)
                  AND NOT EXISTS (SELECT 1 FROM ended_executions t WHERE t.job_execution_id = ex)
                """,
                list(self.enqueued),
            )
        )
        assert not lost, self._fail("enqueued, then neither pending, running nor ended", lost)

    @invariant()
    def never_retried_beyond_the_limit(self) -> None:
        over = self._run(
            self.db.fetch(
                """
                SELECT job_execution_id, attempt, retries_on_lost,
                       (SELECT count(*) FROM execution_attempts a
                         WHERE a.job_execution_id = q.job_execution_id) AS lost
                FROM (SELECT job_execution_id, attempt, retries_on_lost FROM pending_jobs
                      UNION ALL
                      SELECT job_execution_id, attempt, retries_on_lost FROM running_jobs) AS q
                """
            )
        )
        for row in over:
            assert row["attempt"] <= row["retries_on_lost"] + 1, self._fail(
                "retried too often", row
            )
            assert row["lost"] == row["attempt"] - 1, self._fail("lost attempts not kept", row)


SETTINGS = settings(
    max_examples=25,
    stateful_step_count=20,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def test_random_interleavings_keep_the_queue_invariants(server_url: str, template: str) -> None:
    _TARGET.update(server_url=server_url, template=template)
    try:
        run_state_machine_as_test(QueueMachine, settings=SETTINGS)
    finally:
        _TARGET.clear()
