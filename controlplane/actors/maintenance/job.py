"""What every maintenance job is: a name, an interval and one round. The leader runs each in a
loop of its own (`every`), so a job that fails or hangs never holds up another."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, dataclass
from typing import Generic, Protocol, TypeVar

import anyio
from prometheus_client import Counter

from controlplane import metrics

log = logging.getLogger("controlplane.maintenance")

StoreT = TypeVar("StoreT")


class Job(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def interval(self) -> float: ...

    async def run_once(self) -> object:
        """One round. An error ends the round only: the next starts `interval` later."""
        ...


@dataclass(frozen=True, slots=True)
class OnStore(Generic[StoreT]):
    """What each job below is built with: the store it runs its rounds on (a `Pool...Store`, or
    a test's fake) and its interval; a job adds its name and its own settings (keyword only)."""

    store: StoreT
    _: KW_ONLY
    interval: float


def tally(count: int, counter: Counter, event: str) -> None:
    """Count what a batch did on `counter` and log it as `event`, when it did anything."""
    if count:
        counter.inc(count)
        log.info(event, extra={"count": count})


def units_released(units: int) -> None:
    """Count the units a batch of ended leases gave back (store/runner_release.py)."""
    if units:
        metrics.units_released.labels("maintenance").inc(units)


async def until_short(batch: Callable[[], Awaitable[tuple[int, int]]], limit: int) -> int:
    """Run `batch` until one comes back short: each call returns how many rows it took (a full
    batch, `limit`, means more may be waiting) and how many of them to count; return the sum of
    the counts."""
    total = 0
    while True:
        taken, counted = await batch()
        total += counted
        if taken < limit:
            return total


async def every(job: Job, stop: anyio.Event) -> None:
    """Run `job` now and then `interval` after each round ends, until `stop` is set: at once if
    it is waiting for its next round, else when the round in flight ends."""
    while True:
        try:
            await job.run_once()
        except Exception as error:
            log.warning("maintenance.round_failed", extra={"job": job.name, "error": repr(error)})
        with anyio.move_on_after(job.interval):
            await stop.wait()
        if stop.is_set():
            return


async def drain(step: Callable[[int], Awaitable[int]], batch: int) -> int:
    """Call `step(batch)`, a statement deleting up to `batch` rows, until one deletes fewer;
    return how many rows went in all."""
    total = 0
    while (n := await step(batch)) > 0:
        total += n
        if n < batch:
            break
    return total
