"""The ordering fields of an enqueued job (issue 14): priority and concurrency key, checked
against the queue's settings before anything is written."""

from __future__ import annotations

from controlplane.errors import (
    ConcurrencyKeyIncomplete,
    ConcurrencyLimitOutOfRange,
    PriorityOutOfRange,
)

# The widest ranges: the wire schema's, and the ceilings of the settings that may narrow them
# (queue.priority_min, queue.priority_max, queue.max_concurrency_limit).
PRIORITY_BOUND = 1000
MAX_CONCURRENCY_LIMIT = 10_000
MAX_CONCURRENCY_KEY_LENGTH = 200


def check_ordering(
    index: int,
    priority: int,
    key: str | None,
    limit: int | None,
    *,
    priority_min: int,
    priority_max: int,
    max_limit: int,
) -> None:
    """Raise the 400 for job `index` of an enqueue whose ordering fields break the rules: a
    priority outside the configured range, a key without a limit or a limit without a key, a
    limit above the configured one."""
    if not priority_min <= priority <= priority_max:
        raise PriorityOutOfRange(
            f"jobs[{index}].priority must be within {priority_min}..{priority_max}",
            index=index,
            min=priority_min,
            max=priority_max,
        )
    if (key is None) != (limit is None):
        raise ConcurrencyKeyIncomplete(
            f"jobs[{index}] needs both concurrency_key and concurrency_limit, or neither",
            index=index,
        )
    if limit is not None and limit > max_limit:
        raise ConcurrencyLimitOutOfRange(
            f"jobs[{index}].concurrency_limit must be at most {max_limit}",
            index=index,
            limit=max_limit,
        )
