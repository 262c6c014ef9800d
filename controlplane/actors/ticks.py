"""The dispatch safety tick's pacing on one replica: when each workspace actor's next tick is
due, and how many tick passes may run at once.

Every workspace actor with parked runners re-checks for work once per tick (actors/dispatch.py),
one claim per label set. Actors started together (runners parking in a burst, a replica start)
would tick together for ever: with 400 workspaces on a replica, 400 claims in the same few
milliseconds every 5 s, more than the pool has connections, and a job enqueued in that moment
waited behind them (installation bench, 4,000 parked runners: tick claims' p99 31 to 65 ms).
Two rules take the burst apart, and neither changes what a tick finds:

* `next_tick`: each wait for a tick lasts a random time between `SPREAD` of the tick and the
  tick (never longer: the tick stays the bound on how late a lost notification is noticed), so
  actors that started together drift apart within a few ticks.
* `TickTurns`: at most `size` tick passes run at once on the replica; an actor whose tick finds
  every turn taken queues for one, in order. A notification or a newcomer never waits for a
  turn: an actor queued for one that is woken for real serves at once and leaves the queue.
"""

from __future__ import annotations

import random
from typing import Protocol

SPREAD = 0.8  # a tick's wait is uniform in [SPREAD * tick, tick]


def next_tick(tick_seconds: float) -> float:
    return tick_seconds * random.uniform(SPREAD, 1.0)


class TurnTaker(Protocol):
    def granted(self) -> None:
        """Called when a turn queued for becomes this taker's (it then holds it)."""


class TickTurns:
    """At most `size` holders at once; others queue in arrival order. A holder gives its turn
    back with `release`, which hands it to the oldest queued taker; a queued taker that no longer
    wants one leaves with `leave`. All in one event-loop step each: no await inside."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("at least one turn")
        self._free = size
        self._queue: dict[TurnTaker, None] = {}  # an ordered set

    @property
    def queued(self) -> int:
        return len(self._queue)

    def take(self, taker: TurnTaker) -> bool:
        """True when a turn was free (the taker now holds it); else the taker is queued and
        `granted` is called when its turn comes."""
        if self._free:
            self._free -= 1
            return True
        self._queue[taker] = None
        return False

    def leave(self, taker: TurnTaker) -> None:
        self._queue.pop(taker, None)

    def release(self) -> None:
        if self._queue:
            taker = next(iter(self._queue))
            del self._queue[taker]
            taker.granted()
        else:
            self._free += 1
