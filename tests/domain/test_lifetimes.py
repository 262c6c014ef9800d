"""The life of an execution's rules, pure: bounds, deadlines and the retry rule."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from controlplane.domain import lifetimes
from controlplane.errors import InvalidInput

T0 = datetime(2026, 1, 1, tzinfo=UTC)
BOUNDS = lifetimes.Bounds(default=3600, maximum=7200)


def test_an_absent_value_gets_the_default_and_a_present_one_is_kept_within_bounds() -> None:
    assert lifetimes.resolve(None, BOUNDS, field="timeout_seconds", index=0) == 3600
    assert lifetimes.resolve(1, BOUNDS, field="timeout_seconds", index=0) == 1
    assert lifetimes.resolve(7200, BOUNDS, field="timeout_seconds", index=0) == 7200


@pytest.mark.parametrize("value", [0, 7201])
def test_a_value_out_of_bounds_names_the_job_and_the_bounds(value: int) -> None:
    with pytest.raises(InvalidInput) as refused:
        lifetimes.resolve(value, BOUNDS, field="timeout_seconds", index=3)
    assert "jobs[3].timeout_seconds" in refused.value.message
    assert refused.value.details == {
        "field": "timeout_seconds",
        "index": 3,
        "minimum": 1,
        "maximum": 7200,
    }


def test_the_run_deadline_is_the_start_plus_the_timeout_and_ends_after_the_grace() -> None:
    deadline = lifetimes.run_deadline(T0, 60)
    assert deadline == T0 + timedelta(seconds=60)
    assert lifetimes.run_deadline(T0, None) is None
    grace = timedelta(seconds=30)
    assert not lifetimes.timed_out(T0 + timedelta(seconds=89), deadline, grace)
    assert lifetimes.timed_out(T0 + timedelta(seconds=90), deadline, grace)
    assert not lifetimes.timed_out(T0 + timedelta(days=999), None, grace)


def test_the_queue_deadline() -> None:
    assert lifetimes.queue_expired(T0, T0)
    assert not lifetimes.queue_expired(T0, T0 + timedelta(seconds=1))
    assert not lifetimes.queue_expired(T0, None)


def test_a_lost_lease_is_retried_only_with_retries_left_no_cancel_no_end_and_time_left() -> None:
    def may(**changes: object) -> bool:
        case: dict[str, object] = {
            "attempt": 1,
            "retries_on_lost": 1,
            "cancel_requested": False,
            "ended": False,
            "now": T0,
            "deadline": T0 + timedelta(seconds=1),
        }
        case.update(changes)
        return lifetimes.may_retry(**case)  # type: ignore[arg-type]

    assert may()
    assert may(deadline=None)
    assert not may(attempt=2)
    assert not may(retries_on_lost=0)
    assert not may(cancel_requested=True)
    assert not may(ended=True)
    assert not may(deadline=T0)
