from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from controlplane.domain.jobs import StaleRule

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
RULE = StaleRule()


def ago(seconds: float) -> datetime:
    return NOW - timedelta(seconds=seconds)


def test_never_heartbeated_lease_is_stale_after_the_grace() -> None:
    assert RULE.is_stale(NOW, ago(90), None, ago(90))
    assert not RULE.is_stale(NOW, ago(30), None, ago(30))


def test_heartbeated_lease_is_stale_after_the_threshold() -> None:
    assert not RULE.is_stale(NOW, ago(900), ago(890), ago(90))
    assert RULE.is_stale(NOW, ago(900), ago(890), ago(600))


def test_legacy_rows_use_the_threshold() -> None:
    assert not RULE.is_stale(NOW, ago(90), None, ago(30))
    assert RULE.is_stale(NOW, ago(900), None, ago(600))


def test_stale_since_orders_by_start_for_never_heartbeated_rows() -> None:
    assert RULE.stale_since(ago(90), None, ago(90)) == ago(90)
    assert RULE.stale_since(ago(900), ago(800), ago(60)) == ago(60)


@pytest.mark.parametrize("grace", [0, 180, 200])
def test_j133_grace_must_be_positive_and_below_threshold(grace: int) -> None:
    with pytest.raises(ValueError, match="grace"):
        StaleRule(threshold=timedelta(seconds=180), grace=timedelta(seconds=grace))
