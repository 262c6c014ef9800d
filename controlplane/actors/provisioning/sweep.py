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

Nothing is read while the replica holds no session. A failed read is logged and retried at the
next tick: the actors' slow full round (`provisioners.demand_full_round_seconds`) still runs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
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
    def __init__(self, board: DemandBoard, store: SweepStore, *, tick_seconds: float) -> None:
        self._board = board
        self._store = store
        self._tick = tick_seconds
        self._seen: dict[ProvisionerActor, Figures] = {}
        self._since: datetime | None = None  # the previous read's database time

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        task_status.started()
        due = anyio.current_time() + self._tick
        while True:
            await anyio.sleep(max(0.0, due - anyio.current_time()))
            due = max(due + self._tick, anyio.current_time())
            try:
                found = await self.sweep()
            except Exception as error:
                metrics.demand_sweeps.labels("error").inc()
                log.warning("provisioning.sweep_failed", extra={"error": repr(error)})
                continue
            await self.wake(found, over=self._tick * SPREAD)

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

    async def wake(self, found: Sequence[tuple[ProvisionerActor, int]], *, over: float) -> int:
        """Wake the actors found, evenly over `over` seconds (the first at once), except those
        that began a round since the read; how many were woken."""
        started, woken = anyio.current_time(), 0
        for index, (actor, begun) in enumerate(found):
            await anyio.sleep(max(0.0, started + over * index / len(found) - anyio.current_time()))
            if actor.rounds_begun == begun:
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
