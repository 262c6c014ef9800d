"""The one retry schedule, as each of its users configures it."""

from __future__ import annotations

import pytest

from controlplane.retry import Backoff


def _delays(backoff: Backoff, n: int) -> list[float]:
    return [round(backoff.next(), 9) for _ in range(n)]


def test_the_agents_full_jitter_stays_below_ceilings_of_1_2_4_then_5() -> None:
    top = Backoff.full_jitter(random=lambda: 0.999)
    assert top.ceiling == 1.0
    assert _delays(top, 5) == [0.999, 1.998, 3.996, 4.995, 4.995]
    assert _delays(Backoff.full_jitter(random=lambda: 0.0), 3) == [0, 0, 0]
    failures = Backoff.full_jitter(cap=60.0, random=lambda: 0.5)  # the provisioner's launches
    assert _delays(failures, 8) == [0.5, 1, 2, 4, 8, 16, 30, 30]


def test_reset_starts_over_and_a_huge_attempt_count_stays_at_the_cap() -> None:
    backoff = Backoff(0.05, 2.0)  # the LISTEN connection's
    assert _delays(backoff, 8) == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    backoff.reset()
    assert backoff.next() == 0.05
    backoff.attempt = 10_000
    assert backoff.next() == 2.0


def test_linear_and_constant_schedules() -> None:
    assert _delays(Backoff(0.25, 0.75, linear=True), 4) == [0.25, 0.5, 0.75, 0.75]  # put-back
    assert _delays(Backoff.constant(5.0), 3) == [5.0, 5.0, 5.0]  # the maintenance leader


@pytest.mark.parametrize(("base", "cap"), [(-1.0, 1.0), (2.0, 1.0)])
def test_a_schedule_that_makes_no_sense_is_refused(base: float, cap: float) -> None:
    with pytest.raises(ValueError, match="backoff"):
        Backoff(base, cap)
