"""Long-poll dispatch: one actor per workspace with parked runners, on each replica.

A runner's job request parks a `Waiter` with the workspace actor. The actor owns, in memory and in
arrival order, every waiter of its workspace on this replica, and is the only code that claims
for them, so claims for one workspace never interleave within a replica.

Wake-ups, each coalesced into the actor's pending *hint* (the label sets of new work, or "all"):
* a NOTIFY on `cp_enqueued` from any replica (payload: workspace and the job's labels), delivered by
  the listener after the enqueue committed, or after a keyed lease ended (its key's waiting jobs);
* a new waiter (it is tried at once, alone);
* the replica's safety tick (actors/ticks.py), for notifications lost while the listener
  reconnected: one read per replica finds which actors' label sets have claimable work and
  wakes only those, with that label set as the hint; an actor with nothing to take is not
  woken. After a reconnect the listener also wakes every actor.

A pass walks the waiters in arrival order and claims for them. A run of consecutive uncapped
waiters with the same labels is served by one batch claim (one statement pairs the k-th job in
the workspace's order with the k-th waiter: the same outcome as claiming for each in turn, in one
round trip instead of k); capped waiters (one-job runners) are claimed for one at a time. A waiter
whose labels cannot match the hint is not tried; once a claim for label set L finds nothing, no
waiter whose labels are a subset of L is tried again (it could only find less) until a wake-up
says that work a subset of L could take may have arrived: a NOTIFY carrying labels R forgets
every empty L with R a subset of L (the safety tick wakes with the waiters' own set L, which
forgets L and every wider set), a wake without labels forgets them all. So a burst of N jobs
reaches N waiters with about N/100 statements, a runner re-polling an idle workspace parks
without touching the database, and an idle workspace costs no statement of its own: its share of
the replica's one tick read.

Liveness. Parked runners' sessions are stamped by the replica's tick, all of them every
`touch_seconds` in one statement per 1,000 (actors/ticks.py), none per runner or per workspace.

Delivery and put-back: actors/waiters.py. A waiter that stops waiting (answered, failed, or
abandoned by its request handler when its deadline passed or its client went away) leaves its
actor's waiters in that same step, so the actor holds only waiting runners and `parked` is exact.

Retirement. An actor costs nothing once nobody is parked with it: `idle_seconds`
(`maintenance.dispatch_actor_idle_seconds`) after its last waiter left it returns, and the
dispatcher forgets it; the next waiter of the workspace starts a new one. Wake-ups that arrive
while nobody is parked update the hint and the empty label sets but run no pass and do not
extend the idle time (every replica hears every enqueue). The rule that loses no wake-up:
* the actor decides to retire only with nobody parked, and that check, its return and the
  dispatcher's removal of it happen in one event-loop step, with no await between;
* so a waiter parked before that step is the actor's (it is not retired), and one parked after
  it finds no actor and starts a fresh one, which knows no label set to be empty and claims for
  its first waiter at once;
* a wake-up for a retired actor is dropped: nobody on this replica waits for it, and the NOTIFY
  is sent only after its job committed, so the fresh actor's first claim, made later, sees it;
* a wake-up that reaches the actor while nobody is parked, before it retires, still forgets the
  empty label sets it covers, so a waiter parked next is tried, not skipped as "known empty".

Pauses: the claim statements refuse paused workspaces and sessions (store/pauses.py). A NOTIFY
that a session was paused answers its waiters `RunnerPaused` (a "paused" 204), and its later
requests at once while `paused` (actors/paused.py) holds it.

Bounds: at most `max_waiters` per workspace (then the request is refused as overloaded); the hint
holds at most `_MAX_HINTS` label sets before it collapses to "all".
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Protocol
from uuid import UUID

import anyio
from anyio.abc import TaskGroup

from controlplane.actors.paused import PausedSessions
from controlplane.actors.ticks import SafetyTick, TickStore
from controlplane.actors.waiters import PutBackStore, Waiter, WaiterState, observe_claim, put_back
from controlplane.domain.jobs import ClaimedJob, SessionClaims
from controlplane.domain.labels import LabelSet
from controlplane.errors import ControlPlaneError, RunnerPaused, ShuttingDown, Unavailable
from controlplane.store.claiming import MAX_BATCH

log = logging.getLogger("controlplane.dispatch")

_MAX_HINTS = 64
_ALL = None  # a hint of None means: anything may have changed


class ClaimStore(PutBackStore, Protocol):
    async def claim(self, session: SessionClaims) -> ClaimedJob | None: ...

    async def claim_batch(
        self, workspace_id: UUID, labels: LabelSet, runner_session_ids: list[UUID]
    ) -> dict[UUID, ClaimedJob]: ...


class DispatchStore(ClaimStore, TickStore, Protocol):
    """The actors' claims and the replica's tick reads."""


def _covered(labels: LabelSet, exhausted: Iterable[LabelSet]) -> bool:
    own = set(labels)
    return any(own <= set(other) for other in exhausted)


def _wanted(labels: LabelSet, hint: set[LabelSet] | None) -> bool:
    if hint is None:
        return True
    own = set(labels)
    return any(set(required) <= own for required in hint)


class WorkspaceActor:
    def __init__(
        self,
        workspace_id: UUID,
        store: ClaimStore,
    ) -> None:
        self.workspace_id = workspace_id
        self._store = store
        # Exactly the waiters still waiting, in arrival order (dicts as ordered sets): a waiter
        # leaves them in the step it stops waiting (`_left`), so `parked` is exact and an actor
        # whose runners all went away knows it at once.
        self._waiters: dict[Waiter, None] = {}
        self._new: dict[Waiter, None] = {}
        self._idle_since = anyio.current_time()  # when the last waiter left
        self._hint: set[LabelSet] | None = set()
        self._empty: list[LabelSet] = []  # label sets a claim found nothing for, still true
        self._wakes = 0  # wake-ups with labels so far: an empty claim they overlap is not cached
        self._wake = anyio.Event()

    @property
    def parked(self) -> int:
        return len(self._waiters) + len(self._new)

    def label_sets(self) -> list[LabelSet]:
        """The distinct label sets of the waiters (for the replica's tick)."""
        return list({w.session.labels: None for w in [*self._waiters, *self._new]})

    def sessions(self) -> list[UUID]:
        """The parked runners' sessions whose liveness the replica's tick stamps."""
        return [w.session.runner_session_id for w in self._waiters]

    def park(self, waiter: Waiter) -> None:
        waiter.on_leave = self._left
        self._new[waiter] = None
        self._wake.set()

    def _left(self, waiter: Waiter) -> None:
        self._waiters.pop(waiter, None)
        self._new.pop(waiter, None)
        if not self._waiters and not self._new:
            self._idle_since = anyio.current_time()
            self._wake.set()  # from waiting for a wake-up to the idle timer

    def wake(self, labels: LabelSet | None) -> None:
        if labels is None or self._hint is None:
            self._hint = _ALL
            self._empty = []
        else:
            self._wakes += 1
            self._hint.add(labels)
            # Work needing `labels` can be taken by any waiter whose labels are a superset:
            # an empty set that contains `labels` is not known to be empty any more.
            self._empty = [e for e in self._empty if not set(labels) <= set(e)]
            if len(self._hint) > _MAX_HINTS:
                self._hint = _ALL
                self._empty = []
        if self._waiters or self._new:  # else nobody to claim for, and the idle time runs on
            self._wake.set()

    def answer_paused(self, runner_session_id: UUID) -> None:
        """Answer a paused session's waiters; wake the rest (a claim may have cached empty)."""
        for waiter in [*self._waiters, *self._new]:
            if waiter.session.runner_session_id == runner_session_id:
                waiter.fail(RunnerPaused("this runner is paused"))
        self.wake(None)

    def drain(self, error: ControlPlaneError) -> None:
        for waiter in [*self._waiters, *self._new]:
            waiter.fail(error)  # each leaves the dicts as it fails

    async def run(self, idle_seconds: float) -> None:
        """Serve until nobody has waited for `idle_seconds`, then return (the caller retires us
        in the same step: see "Retirement" above)."""
        while True:
            if self._waiters or self._new:
                await self._wake.wait()  # the replica's safety tick wakes us too (actors/ticks.py)
            else:
                retire_at = self._idle_since + idle_seconds
                with anyio.move_on_after(retire_at - anyio.current_time()):
                    await self._wake.wait()
                if not self._waiters and not self._new and anyio.current_time() >= retire_at:
                    return
            self._wake = anyio.Event()
            await self._pass()

    async def _pass(self) -> None:
        newcomers = list(self._new)
        self._new.clear()
        hint, self._hint = self._hint, set()
        order: list[Waiter] = []
        if hint is _ALL or hint:
            # Decided once per label set: a pass over 1,000 waiters with a few label sets costs
            # dictionary lookups, not 1,000 set comparisons.
            wanted: dict[LabelSet, bool] = {}
            for waiter in self._waiters:
                labels = waiter.session.labels
                if labels not in wanted:
                    wanted[labels] = _wanted(labels, hint)
                if wanted[labels]:
                    order.append(waiter)
        for waiter in newcomers:
            # Newcomers queue behind everyone already parked; each is tried once on arrival.
            self._waiters[waiter] = None
            order.append(waiter)
        await self._serve(order)

    async def _serve(self, order: list[Waiter]) -> None:
        """Claim for `order`, in order. A run of consecutive uncapped waiters with the same labels
        (distinct sessions) is served by one batch claim; capped ones one at a time. A waiter is
        skipped when an equal-or-wider label set is known to be empty."""
        exhausted = list(self._empty)  # known empty now, plus what this pass finds empty
        covered: dict[LabelSet, bool] = {}  # _covered by label set, while `exhausted` holds
        known = len(exhausted)
        run: list[Waiter] = []
        sessions: set[UUID] = set()  # the run's sessions
        for waiter in order:
            session = waiter.session
            if run and not (
                session.max_claims is None
                and session.labels == run[0].session.labels
                and len(run) < MAX_BATCH
                and session.runner_session_id not in sessions
            ):
                await self._try_run(run, exhausted)
                run, sessions = [], set()
            if waiter.state is not WaiterState.WAITING:
                continue
            if len(exhausted) != known:
                covered, known = {}, len(exhausted)
            labels = session.labels
            if labels not in covered:
                covered[labels] = _covered(labels, exhausted)
            if covered[labels]:
                continue
            if session.max_claims is None:
                run.append(waiter)
                sessions.add(session.runner_session_id)
            else:
                await self._try_and_remember(waiter, exhausted)
        if run:
            await self._try_run(run, exhausted)

    async def _try_run(self, run: list[Waiter], exhausted: list[LabelSet]) -> None:
        """One claim for a run of waiters; the labels are exhausted when some found nothing."""
        run = [w for w in run if w.state is WaiterState.WAITING]  # gone while earlier runs ran
        if not run:
            return
        if len(run) == 1:
            await self._try_and_remember(run[0], exhausted)
            return
        wakes = self._wakes
        labels = run[0].session.labels
        # Shielded, as in _try: every committed claim reaches its waiter or is put back.
        with anyio.CancelScope(shield=True):
            try:
                jobs = await self._store.claim_batch(
                    self.workspace_id, labels, [w.session.runner_session_id for w in run]
                )
            except ControlPlaneError as error:  # e.g. DatabaseUnavailable: each hears its code
                for waiter in run:
                    waiter.fail(error)
                return
            except Exception as error:  # a database fault must not kill the actor
                log.warning("dispatch.claim_failed", extra={"error": repr(error)})
                for waiter in run:
                    waiter.fail(Unavailable("claim failed; retry"))
                return
            for waiter in run:
                job = jobs.get(waiter.session.runner_session_id)
                if job is not None:
                    await self._hand_over(job, waiter)
        if len(jobs) < len(run):
            self._found_empty(labels, wakes, exhausted)

    async def _try_and_remember(self, waiter: Waiter, exhausted: list[LabelSet]) -> bool:
        """`_try`; when it finds nothing, its labels are empty for the rest of this pass, and
        for later passes too unless a wake-up came in while the claim ran (the claim's snapshot
        may predate the work that wake-up announced)."""
        wakes = self._wakes
        if await self._try(waiter):
            return True
        self._found_empty(waiter.session.labels, wakes, exhausted)
        return False

    def _found_empty(self, labels: LabelSet, wakes: int, exhausted: list[LabelSet]) -> None:
        """A claim for `labels`, started when `self._wakes` was `wakes`, found nothing."""
        exhausted.append(labels)
        if self._wakes == wakes and self._hint is not _ALL:
            self._empty.append(labels)

    async def _try(self, waiter: Waiter) -> bool:
        """Claim for one waiter. True when a job was found (delivered or put back)."""
        if waiter.state is not WaiterState.WAITING:
            return True
        # Shielded: a claim that committed must reach its waiter or be put back, even when the
        # daemon is shutting down. Statement timeouts bound how long this can take.
        with anyio.CancelScope(shield=True):
            try:
                job = await self._store.claim(waiter.session)
            except ControlPlaneError as error:
                waiter.fail(error)
                return True
            except Exception as error:  # a database fault must not kill the actor
                log.warning("dispatch.claim_failed", extra={"error": repr(error)})
                waiter.fail(Unavailable("claim failed; retry"))
                return True
            if job is None:
                return False
            await self._hand_over(job, waiter)
        return True

    async def _hand_over(self, job: ClaimedJob, waiter: Waiter) -> None:
        """Deliver a committed claim, or put it back when its waiter stopped waiting."""
        if waiter.deliver(job):
            observe_claim(job)
        else:
            await put_back(self._store, job, waiter.session.runner_session_id)


class Dispatcher:
    """Routes waiters and wake-ups to workspace actors, starting them on demand."""

    def __init__(
        self,
        store: DispatchStore,
        *,
        tick_seconds: float,
        touch_seconds: float = 10.0,
        max_waiters_per_workspace: int = 20_000,
        idle_seconds: float = 5.0,
        on_retire: Callable[[UUID], None] | None = None,
    ) -> None:
        """`tick_seconds` and `touch_seconds` pace the replica's safety tick and liveness
        stamps (actors/ticks.py). `on_retire` is called with the workspace in the very step its
        actor is forgotten (tests use it to make a wake-up or a waiter arrive in that step)."""
        self._store = store
        self._max_waiters = max_waiters_per_workspace
        self._idle = idle_seconds
        self._on_retire = on_retire
        self.tick = SafetyTick(
            store,
            lambda: list(self._actors.values()),
            tick_seconds=tick_seconds,
            touch_seconds=touch_seconds,
        )
        self._actors: dict[UUID, WorkspaceActor] = {}
        self._group: TaskGroup | None = None
        self._closed = False
        self.paused = PausedSessions()

    @property
    def parked(self) -> int:
        return sum(actor.parked for actor in self._actors.values())

    @property
    def actors(self) -> int:
        return len(self._actors)

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        async with anyio.create_task_group() as group:
            self._group = group
            group.start_soon(self.tick.run)
            task_status.started()
            await anyio.sleep_forever()

    def park(self, waiter: Waiter) -> None:
        if self._closed or self._group is None:
            waiter.fail(ShuttingDown("the server is shutting down"))
            return
        if self.paused.holds(waiter.session.runner_session_id):
            waiter.fail(RunnerPaused("this runner is paused"))
            return
        actor = self._actors.get(waiter.session.workspace_id)
        if actor is None:
            actor = WorkspaceActor(waiter.session.workspace_id, self._store)
            self._actors[actor.workspace_id] = actor
            self._group.start_soon(self._supervise, actor)
        if actor.parked >= self._max_waiters:
            waiter.fail(Unavailable("too many runners waiting in this workspace"))
            return
        actor.park(waiter)

    async def put_back(self, job: ClaimedJob, runner_session_id: UUID) -> None:
        """For a request handler whose client vanished after its job was delivered."""
        await put_back(self._store, job, runner_session_id)

    def wake(self, workspace_id: UUID, labels: LabelSet | None) -> None:
        actor = self._actors.get(workspace_id)
        if actor is not None:
            actor.wake(labels)

    def runner_paused(self, workspace_id: UUID, runner_session_id: UUID, paused: bool) -> None:
        """A runner session was paused or resumed (NOTIFY from store/pauses.py, any replica)."""
        self.paused.note(runner_session_id, paused)
        actor = self._actors.get(workspace_id)
        if paused and actor is not None:
            actor.answer_paused(runner_session_id)

    def wake_all(self) -> None:
        for actor in self._actors.values():
            actor.wake(None)

    def close(self) -> None:
        """Refuse new waiters and answer every parked one (shutdown)."""
        self._closed = True
        for actor in self._actors.values():
            actor.drain(ShuttingDown("the server is shutting down"))

    async def _supervise(self, actor: WorkspaceActor) -> None:
        """Run the actor, restarting it after a crash; retire it when it returns idle."""
        while True:
            try:
                await actor.run(self._idle)
            except Exception:
                log.exception("dispatch.actor_crashed")
                await anyio.sleep(0.1)
                continue
            # run() returned with nobody parked, and no await separates its check from this
            # removal, so a waiter cannot be parked with a retired actor (module docstring).
            del self._actors[actor.workspace_id]
            if self._on_retire is not None:
                self._on_retire(actor.workspace_id)
            return
