"""The overview's plots without a database: the ring's rules and the SVG they draw."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import cast
from uuid import uuid4

import asyncpg

from controlplane.store.ui_reads import QueueSample
from controlplane.web.ui.plots import QueueHistory, chart

NOW = datetime(2026, 12, 2, 4, 0, tzinfo=UTC)


def history(workspaces: int = 10) -> QueueHistory:
    return QueueHistory(cast(asyncpg.Pool, None), every_seconds=60, workspaces=workspaces)


def test_an_absent_workspace_drops_to_zero_then_is_forgotten_after_an_hour_of_nothing() -> None:
    ring = history()
    busy = uuid4()
    ring.record(NOW, [QueueSample(busy, 4, 2.5)])
    ring.record(NOW + timedelta(minutes=1), [])
    [(workspace, points)] = ring.series()
    assert workspace == busy
    assert [(p.pending, p.pickup_seconds) for p in points] == [(4, 2.5), (0, None)]
    for minute in range(2, 63):
        ring.record(NOW + timedelta(minutes=minute), [])
    assert ring.series() == []  # an hour of zeros pushed the last sample out


def test_the_ring_keeps_an_hour_and_the_busiest_workspaces_past_the_cap() -> None:
    ring = history(workspaces=2)
    small, middle, large = uuid4(), uuid4(), uuid4()
    for minute in range(90):
        ring.record(
            NOW + timedelta(minutes=minute),
            [QueueSample(small, 1, None), QueueSample(middle, 5, None), QueueSample(large, 9, 1)],
        )
    series = ring.series()
    assert [w for w, _ in series] == [large, middle]
    assert len(series[0][1]) == 61  # one hour at one sample a minute, both ends included


def test_a_chart_is_inline_svg_with_gaps_and_says_what_it_shows() -> None:
    points = [
        (NOW - timedelta(minutes=50), 2.0),
        (NOW - timedelta(minutes=40), 4.0),
        (NOW - timedelta(minutes=30), None),
        (NOW - timedelta(minutes=20), 1.0),
        (NOW - timedelta(minutes=10), 3.0),
    ]
    svg = str(chart(points, NOW, "Pickup <latency>", "s"))
    assert svg.startswith("<svg") and 'role="img"' in svg
    assert svg.count("<polyline") == 2  # the gap splits the line
    assert "at most 4 s" in svg and "Pickup &lt;latency&gt;" in svg and "<latency>" not in svg
    empty = str(chart([], NOW, "Pending jobs", ""))
    assert "no data yet" in empty and "<polyline" not in empty


def test_charts_are_drawn_once_per_sample_at_the_samples_time() -> None:
    ring = history()
    assert ring.drawn().at is None and ring.drawn().charts == []
    busy, quiet = uuid4(), uuid4()
    for minute in range(3):
        ring.record(
            NOW + timedelta(minutes=minute),
            [QueueSample(busy, 7, 1.5), QueueSample(quiet, 2, None)],
        )
    drawn = ring.drawn()
    latest = NOW + timedelta(minutes=2)
    assert drawn.at == latest
    # What drawing the series at the sample's time gives, in the series' order.
    assert drawn.charts == [
        (
            workspace,
            chart([(p.at, p.pending) for p in points], latest, "Pending jobs", ""),
            chart([(p.at, p.pickup_seconds) for p in points], latest, "Pickup latency", "s"),
        )
        for workspace, points in ring.series()
    ]
    assert [w for w, _, _ in drawn.charts] == [busy, quiet]
    assert ring.drawn() is drawn  # page views between samples draw nothing
    ring.record(NOW + timedelta(minutes=3), [QueueSample(busy, 1, None)])
    assert ring.drawn() is not drawn and ring.drawn().at == NOW + timedelta(minutes=3)
