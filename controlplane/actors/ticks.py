"""The dispatch safety tick and the parked runners' liveness: one statement per replica each.

Workspace actors (actors/dispatch.py) claim when a NOTIFY, a new waiter or a listener reconnect
wakes them; a notification lost while the listener was down is caught by the safety tick. It was
one empty claim per actor and label set every tick (4,000 runners parked in 400 workspaces: about
100 claims a second on each replica, bursting together, and a real enqueue's claim waited behind
them). Now every `tick_seconds` the replica makes ONE read (store/parked.py `claimable`): of the
(workspace, label set) pairs of its actors with parked runners, which have a pending row a claim
for those labels could take. Only those actors are woken, each with the label set as its hint
(it forgets that the set, and any wider one, found nothing), and it makes the real claim; an
actor with nothing to take is not touched and makes no statement.

What still holds:
* A lost NOTIFY is noticed within one tick: a row committed before a read starts is seen by it,
  and reads start `tick_seconds` apart (plus the previous read's own time). A row committed
  after the read's snapshot has its NOTIFY, or the next read.
* Pauses, priority, concurrency keys and fair ordering: the woken actor's claim applies them, as
  for any wake-up; the read only chooses whom to wake, with the claim's own filter, so it never
  misses a row the claim would take. A "yes" the claim then finds empty (a row another claim
  holds, a key filled since) costs that one claim, as every tick did before.
* A failed read (the database unreachable, a statement timeout) is logged and falls back to what
  the tick did before it: every actor is woken and claims for itself, so a database that answers
  claims but not this read still loses no job, and waiters hear the fault as their claims fail.
* The read takes no lock (store/parked.py) and never delays a wake-up: actors are woken by their
  notifications while a read runs, whatever it costs.

Liveness. Parked runners' sessions are stamped every `touch_seconds` for the whole replica at
once (store/parked.py `touch_sessions`: one statement per 1,000 sessions), no longer one
statement per workspace; a failure is logged and the next interval retries (best effort).

Nothing is read while no runner is parked on the replica.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol
from uuid import UUID

import anyio

from controlplane import metrics
from controlplane.domain.labels import LabelSet

log = logging.getLogger("controlplane.dispatch")


class TickStore(Protocol):
    async def claimable(self, pairs: Sequence[tuple[UUID, LabelSet]]) -> list[bool]:
        """For each (workspace, label set), in order, whether a claim could take a row."""
        ...

    async def touch(self, sessions: Sequence[tuple[UUID, UUID]]) -> None:
        """Stamp the liveness of (workspace, runner session) pairs."""
        ...


class Parked(Protocol):
    """A workspace actor as the tick sees it."""

    @property
    def workspace_id(self) -> UUID: ...

    def label_sets(self) -> list[LabelSet]:
        """The distinct label sets of its parked runners."""
        ...

    def sessions(self) -> list[UUID]:
        """Its parked runners' sessions."""
        ...

    def wake(self, labels: LabelSet | None) -> None: ...


class SafetyTick:
    def __init__(
        self,
        store: TickStore,
        actors: Callable[[], Sequence[Parked]],
        *,
        tick_seconds: float,
        touch_seconds: float,
    ) -> None:
        self._store = store
        self._actors = actors
        self._tick = tick_seconds
        self._touch = touch_seconds

    async def run(self) -> None:
        async with anyio.create_task_group() as group:
            group.start_soon(self._every, self._tick, self.tick)
            group.start_soon(self._every, self._touch, self.touch)

    @staticmethod
    async def _every(seconds: float, step: Callable[[], Awaitable[object]]) -> None:
        due = anyio.current_time() + seconds
        while True:
            await anyio.sleep(max(0.0, due - anyio.current_time()))
            due = max(due + seconds, anyio.current_time())
            try:
                await step()
            except Exception:  # a bug here must not stop the tick for good, nor the dispatcher
                log.exception("dispatch.tick_crashed")

    async def tick(self) -> int:
        """One read for every parked actor; wake those with claimable work. How many woken."""
        actors = self._actors()
        pairs = [(actor, labels) for actor in actors for labels in actor.label_sets() if labels]
        if not pairs:
            return 0  # nobody parked (or only runners with no labels, who can take nothing)
        try:
            found = await self._store.claimable(
                [(actor.workspace_id, labels) for actor, labels in pairs]
            )
        except Exception as error:
            metrics.dispatch_ticks.labels("error").inc()
            log.warning("dispatch.tick_failed", extra={"error": repr(error)})
            for actor in actors:
                actor.wake(None)  # each claims for itself, as every tick did before this read
            metrics.dispatch_tick_woken.inc(len(actors))
            return len(actors)
        metrics.dispatch_ticks.labels("ok").inc()
        woken: set[UUID] = set()
        for (actor, labels), has_work in zip(pairs, found, strict=True):
            if has_work:
                actor.wake(labels)
                woken.add(actor.workspace_id)
        metrics.dispatch_tick_woken.inc(len(woken))
        return len(woken)

    async def touch(self) -> None:
        """Stamp every parked runner's session, in one statement."""
        sessions = [
            (actor.workspace_id, session)
            for actor in self._actors()
            for session in actor.sessions()
        ]
        if not sessions:
            return
        try:
            await self._store.touch(sessions)
        except Exception as error:  # liveness is best effort; the next interval retries
            log.warning("dispatch.touch_failed", extra={"error": repr(error)})
