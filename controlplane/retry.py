"""How long to wait before trying again: the one schedule behind every retry loop.

The reference agents' HTTP clients, the dispatcher's put-back, the LISTEN connection and the
maintenance leader all retry with a `Backoff`; each keeps its own numbers. It is arithmetic and a
counter over an injected random source, with no clock and no I/O: the caller sleeps, so tests
pin the jitter and run on a mock clock. Base layer, so `agent/` may use it too.
"""

from __future__ import annotations

import random as _random
from collections.abc import Callable


class Backoff:
    """The n-th delay (from 0) is bounded by its ceiling: `min(cap, base * 2**n)` (doubling),
    `min(cap, base * (n + 1))` with `linear`, and `base` for ever when `cap == base`.

    Without `jitter` the delay is the ceiling itself. With it (a source of floats in [0, 1)),
    the delay is uniform below the ceiling: full jitter, which spreads the retries of many
    clients that lost the server at the same moment, so they do not come back in step.
    """

    def __init__(
        self,
        base: float,
        cap: float,
        *,
        linear: bool = False,
        jitter: Callable[[], float] | None = None,
    ) -> None:
        if base < 0 or cap < base:
            raise ValueError(f"a backoff needs 0 <= base <= cap, not {base} and {cap}")
        self.base = base
        self.cap = cap
        self._linear = linear
        self._jitter = jitter
        self.attempt = 0

    @classmethod
    def full_jitter(
        cls,
        base: float = 1.0,
        cap: float = 5.0,
        random: Callable[[], float] = _random.random,
    ) -> Backoff:
        """The agents' schedule: delays uniform below 1, 2, 4, 5, 5 … s by default."""
        return cls(base, cap, jitter=random)

    @classmethod
    def constant(cls, seconds: float) -> Backoff:
        return cls(seconds, seconds)

    @property
    def ceiling(self) -> float:
        """The upper bound of the next delay."""
        if self._linear:
            return min(self.cap, self.base * (self.attempt + 1))
        return min(self.cap, self.base * 2.0 ** min(self.attempt, 64))

    def next(self) -> float:
        """The delay before the next attempt; counts one more failed attempt."""
        ceiling = self.ceiling
        delay = ceiling if self._jitter is None else self._jitter() * ceiling
        self.attempt += 1
        return delay

    def reset(self) -> None:
        """After a success: the next failure waits the first delay again."""
        self.attempt = 0
