"""The per-replica demand sweep: the safety net under the provisioner actors' wake-ups.

A provisioner actor runs a round when it is woken (an enqueue's NOTIFY, a pause, a cancel, its
own requests, a listener reconnect) and when a deadline it knows of falls due (actor.py); it
sleeps otherwise. What can change a round's result with neither (a claim on another replica
releasing a unit, another provisioner's reservation expiring, a runner of this provisioner
enrolling or starting a job, an eligibility change made through another replica, a queue
deadline passing) is caught here: every `provisioners.demand_safety_tick_seconds` ONE statement
(store/demand_sweep.py) reads the figures of every session on this replica, and the sessions
whose figures moved since the previous tick are woken; the others cost nothing. A session seen
for the first time is woken once (its figures may have moved since its first round).

A session's own grants and new pending jobs move nothing (store/demand_sweep.py counts the
rows created since the previous read apart; the enqueue's notification and the session's own
round already saw those): until then every enqueue and every granting round cost the actor a
second, idle round at the next tick, and after a busy tick all those rounds started at the same
instant, queued together for the replica's pool and the database, and an enqueue's round that
arrived then waited behind them (the demand bench's enqueue -> grant p99 at 10 and 100
provisioners). What still moves many sessions at once (a burst of claims, an advertisement
ageing out) wakes them one after another, spread evenly over the first half of the tick
(`SPREAD`). And an actor that began a round after the sweep's read returned is not woken at all:
that round read everything the sweep saw (a busy actor is woken by its enqueues). So a change
the sweep catches reaches its actor at most one and a half ticks after it is made.

The slow full round is the replica's too (the safety net under every wake-up above: a lost
notification, a new pending job past `provisioners.demand_sweep_pending_cap`, an installation
session's demand, which its figures leave out). Every half of
`provisioners.demand_full_round_seconds` the tick that falls due looks at the sessions that
began no round in that half (a busy session is never woken for the safety net) and asks, in
ONE more statement for those that do not say so themselves (store/demand_sweep.py
`full_round_due`), which a round could find anything for; those, and the actors whose own state
calls for one (`holds_work`: demand or terminate intents in their last push, a warm pool), are
woken with the moved ones, spread the same way, and run a round (`fallback`). An idle session
(no pending job where it serves, no live reservation, no active runner of its own, nothing
pushed that a round could take back) would get nothing from that round and is not woken: it
costs no transaction at any interval. So a change that nothing notified (an enqueue whose
NOTIFY was lost, for one) reaches its actor at most `demand_full_round_seconds` (plus one and
a half ticks) after the actor's last round began, as the actor's own timer did before; the
replica pays two statements per interval, whatever the number of sessions.

Nothing is read while the replica holds no session. A failed read is logged and retried at the
next tick (a failed full-round check, at the next tick too: it stays due).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Protocol

import anyio
import anyio.abc
import asyncpg

from controlplane import metrics
from controlplane.actors.provisioning.actor import ProvisionerActor
from controlplane.actors.provisioning.board import DemandBoard
from controlplane.store import demand_sweep
from controlplane.store.demand_sweep import Figures, Read, SweptSession
from controlplane.store.pool import borrow

log = logging.getLogger("controlplane.provisioning")

SPREAD = 0.5  # the share of a tick over which the moved actors are woken


class SweepStore(Protocol):
    async def figures(self, sessions: Sequence[SweptSession], since: datetime | None) -> Read:
        """Each session's figures, in the order given, read by one statement; `since` is the
        previous read's time (store/demand_sweep.py)."""
        ...

    async def full_round_due(self, sessions: Sequence[SweptSession]) -> list[bool]:
        """For each session, in the order given, whether a round could find anything to act
        on (one statement)."""
        ...


def has_moved(now: Figures, before: Figures | None) -> bool:
    """Whether a session's figures moved since the previous tick's (`before`; None: not there
    then): its other figures changed, a pending job or a reservation there then is gone or
    smaller, or another provisioner made a reservation since. New pending jobs (notified) and
    its own new reservations (its rounds made them) move nothing."""
    return (
        before is None
        or now.fixed != before.fixed
        or now.counted_before != before.counted
        or now.others_new > 0
    )


class DemandSweep:
    def __init__(
        self,
        board: DemandBoard,
        store: SweepStore,
        *,
        tick_seconds: float,
        full_round_seconds: float = 600.0,
    ) -> None:
        self._board = board
        self._store = store
        self._tick = tick_seconds
        self._full_every = full_round_seconds
        self._seen: dict[ProvisionerActor, Figures] = {}
        self._since: datetime | None = None  # the previous read's database time

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        task_status.started()
        due = anyio.current_time() + self._tick
        full_due = anyio.current_time() + self._full_every / 2
        while True:
            await anyio.sleep(max(0.0, due - anyio.current_time()))
            due = max(due + self._tick, anyio.current_time())
            found: list[tuple[ProvisionerActor, int]] = []
            full: list[tuple[ProvisionerActor, int]] = []
            try:
                found = await self.sweep()
            except Exception as error:
                metrics.demand_sweeps.labels("error").inc()
                log.warning("provisioning.sweep_failed", extra={"error": repr(error)})
            if anyio.current_time() >= full_due:
                try:
                    full = await self.full_round()
                    full_due = anyio.current_time() + self._full_every / 2
                except Exception as error:  # still due: tried again at the next tick
                    metrics.demand_sweeps.labels("error").inc()
                    log.warning("provisioning.full_round_failed", extra={"error": repr(error)})
            moved = {actor for actor, _ in found}
            full = [(actor, begun) for actor, begun in full if actor not in moved]
            await self.wake(
                found + full, over=self._tick * SPREAD, full={actor for actor, _ in full}
            )

    async def sweep(self) -> list[tuple[ProvisionerActor, int]]:
        """One tick's read: every session's figures; the actors whose figures moved, each with
        the count of rounds it had begun when the read returned."""
        actors = self._board.actors()
        if not actors:
            self._seen.clear()
            self._since = None
            return []
        sessions = [SweptSession(a.provisioner.id, a.provisioner.workspace_id) for a in actors]
        read = await self._store.figures(sessions, self._since)
        found = [
            (actor, actor.rounds_begun)
            for actor, figures in zip(actors, read.figures, strict=True)
            if has_moved(figures, self._seen.get(actor))
        ]
        self._seen = dict(zip(actors, read.figures, strict=True))
        self._since = read.at
        metrics.demand_sweeps.labels("ok").inc()
        return found

    async def full_round(self) -> list[tuple[ProvisionerActor, int]]:
        """The slow full round's check: of the actors that began no round in the last half of
        the interval, those a round could find anything for (each with the count of rounds it
        had begun when the read returned), by their own word (`holds_work`) or by one statement
        for all the others."""
        lately = anyio.current_time() - self._full_every / 2
        actors = [a for a in self._board.actors() if a.round_began_at <= lately]
        asking = [a for a in actors if not a.holds_work]
        sessions = [SweptSession(a.provisioner.id, a.provisioner.workspace_id) for a in asking]
        due = await self._store.full_round_due(sessions) if sessions else []
        if sessions:
            metrics.demand_sweeps.labels("full").inc()
        found = {a for a, d in zip(asking, due, strict=True) if d}
        return [(a, a.rounds_begun) for a in actors if a.holds_work or a in found]

    async def wake(
        self,
        found: Sequence[tuple[ProvisionerActor, int]],
        *,
        over: float,
        full: Collection[ProvisionerActor] = (),
    ) -> int:
        """Wake the actors found, evenly over `over` seconds (the first at once), except those
        that began a round since the read; those in `full` for the full round. How many were
        woken."""
        started, woken = anyio.current_time(), 0
        for index, (actor, begun) in enumerate(found):
            await anyio.sleep(max(0.0, started + over * index / len(found) - anyio.current_time()))
            if actor.rounds_begun == begun:
                if actor in full:
                    actor.full_round()
                else:
                    actor.wake()
                woken += 1
        metrics.demand_sweep_woken.inc(woken)
        return woken


@dataclass(frozen=True, slots=True)
class PoolSweep:
    """The demand sweep's view of the store: one statement on a pooled connection."""

    pool: asyncpg.Pool
    activation_timeout: timedelta
    covering_window: timedelta
    pending_cap: int

    async def figures(
        self, sessions: Sequence[demand_sweep.SweptSession], since: datetime | None
    ) -> demand_sweep.Read:
        async with borrow(self.pool) as conn:
            return await demand_sweep.sweep_figures(
                conn,
                sessions,
                since=since,
                activation_timeout=self.activation_timeout,
                covering_window=self.covering_window,
                pending_cap=self.pending_cap,
            )

    async def full_round_due(self, sessions: Sequence[demand_sweep.SweptSession]) -> list[bool]:
        async with borrow(self.pool) as conn:
            return await demand_sweep.full_round_due(conn, sessions)
