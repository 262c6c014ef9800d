"""Exponential back-off with full jitter, as pure arithmetic over an injected random source."""

from __future__ import annotations

import random as _random
from collections.abc import Callable


class Backoff:
    """The n-th delay (from 0) is uniform in [0, min(cap, base * 2**n)): 1, 2, 4, 5, 5 … s.

    Full jitter spreads the retries of many runners that lost the control plane at the same
    moment, so they do not come back in step.
    """

    def __init__(
        self,
        base: float = 1.0,
        cap: float = 5.0,
        random: Callable[[], float] = _random.random,
    ) -> None:
        self.base = base
        self.cap = cap
        self._random = random
        self.attempt = 0

    @property
    def ceiling(self) -> float:
        """The upper bound of the next delay."""
        return min(self.cap, self.base * 2.0 ** min(self.attempt, 64))

    def next(self) -> float:
        delay = self._random() * self.ceiling
        self.attempt += 1
        return delay

    def reset(self) -> None:
        self.attempt = 0
