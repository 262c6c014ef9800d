"""Effective tool capabilities (spec jobs 5.6): a runner session's stored report, unless it is
missing or older than the freshness window, when it counts as absent (no harness at all).

Capabilities play no part in matching; they are read back for the orchestrator (which may pick
a harness for a job) and for operators.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

ABSENT: dict[str, Any] = {"harnesses": {}}


@dataclass(frozen=True, slots=True)
class Effective:
    capabilities: dict[str, Any]
    fresh: bool  # the stored report is present and within the window
    reported_at: datetime | None  # when the stored report was sent, fresh or not


def effective_capabilities(
    report: dict[str, Any] | None,
    reported_at: datetime | None,
    *,
    now: datetime,
    stale_after: timedelta,
) -> Effective:
    """The report when it is younger than or exactly `stale_after` at `now`, else absent."""
    if report is None or reported_at is None or now - reported_at > stale_after:
        return Effective(dict(ABSENT), False, reported_at)
    return Effective(report, True, reported_at)
