"""Effective tool capabilities: a report counts while it is at most the window old."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from controlplane.domain.capabilities import effective_capabilities

NOW = datetime(2026, 1, 1, tzinfo=UTC)
WINDOW = timedelta(seconds=60)
REPORT = {"harnesses": {"pi": {"tools": ["read"]}}}


def test_a_report_counts_up_to_and_at_the_window() -> None:
    for age in (timedelta(0), WINDOW):
        found = effective_capabilities(REPORT, NOW - age, now=NOW, stale_after=WINDOW)
        assert (found.capabilities, found.fresh) == (REPORT, True)


def test_an_older_or_missing_report_is_no_harness_at_all() -> None:
    old = NOW - WINDOW - timedelta(microseconds=1)
    stale = effective_capabilities(REPORT, old, now=NOW, stale_after=WINDOW)
    assert (stale.capabilities, stale.fresh, stale.reported_at) == ({"harnesses": {}}, False, old)
    missing = effective_capabilities(None, None, now=NOW, stale_after=WINDOW)
    assert (missing.capabilities, missing.fresh, missing.reported_at) == (
        {"harnesses": {}}, False, None
    )  # fmt: skip
