"""The life of an execution: its run deadline, its queue deadline and whether a lost lease is
retried (docs/policies.md, "The life of an execution"). The store applies the same rules in SQL,
set-wise, under its locks (store/deadlines.py, store/retries.py); these are their definitions."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from controlplane.errors import InvalidInput


@dataclass(frozen=True, slots=True)
class Bounds:
    """A per-job policy value's default and its largest allowed value (settings)."""

    default: int
    maximum: int
    minimum: int = 1


def resolve(requested: int | None, bounds: Bounds, *, field: str, index: int) -> int:
    """The value an enqueued job gets: its own within bounds, or the default when it has none.
    Out of bounds is a 400 naming `jobs[index].field` and the bounds."""
    if requested is None:
        return bounds.default
    if not bounds.minimum <= requested <= bounds.maximum:
        raise InvalidInput(
            f"jobs[{index}].{field} must be between {bounds.minimum} and {bounds.maximum}",
            field=field,
            index=index,
            minimum=bounds.minimum,
            maximum=bounds.maximum,
        )
    return requested


def run_deadline(started_at: datetime, timeout_seconds: int | None) -> datetime | None:
    """When the lease must stop: fixed at its start; None without a run timeout."""
    return None if timeout_seconds is None else started_at + timedelta(seconds=timeout_seconds)


def timed_out(now: datetime, deadline: datetime | None, grace: timedelta) -> bool:
    """The leader ends the lease: its runner was told to stop and `grace` has passed too."""
    return deadline is not None and now >= deadline + grace


def queue_expired(now: datetime, expires_at: datetime | None) -> bool:
    """A pending execution past its queue deadline: no claim takes it, the leader removes it."""
    return expires_at is not None and now >= expires_at


def may_retry(
    *,
    attempt: int,
    retries_on_lost: int,
    cancel_requested: bool,
    ended: bool,
    now: datetime,
    deadline: datetime | None,
) -> bool:
    """A lease lost with its runner goes back to the queue as attempt + 1 only while retries are
    left, never after a cancel was asked or the execution ended, and never past its run deadline
    (the execution had its time)."""
    if cancel_requested or ended or attempt > retries_on_lost:
        return False
    return deadline is None or now < deadline
