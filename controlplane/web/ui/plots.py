"""The overview's plots: each workspace's pending count and pickup latency over the last hour.

Each replica keeps its own small ring per workspace, filled by one task (`QueueHistory.run`, in
the root task group) that reads one statement every `pages.plot_sample_seconds`
(store/ui_reads.py `queue_sample`). A replica that just started has a short history; replicas
sample the same database, so their plots agree. `chart` draws a series as inline SVG: no script,
no image request. The charts are drawn once per sample, at the sample's time, by the sampling
task on a worker thread right after it records the sample (the event loop keeps serving between
the thread's GIL slices); every overview until the next sample shows those, and the page says
when they were drawn. A view that comes before that drawing is done draws them itself. A full
hour is up to 721 points a series, and drawing 20 series on every view cost tens of
milliseconds.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from uuid import UUID

import anyio
import anyio.abc
import anyio.to_thread
import asyncpg
from markupsafe import Markup

from controlplane.store import ui_reads

log = logging.getLogger("controlplane.ui")

HOUR = timedelta(hours=1)
WIDTH, HEIGHT, PAD = 300, 80, 4


@dataclass(frozen=True, slots=True)
class Drawn:
    """The charts of every tracked workspace (pending jobs, pickup latency), most pending now
    first, drawn at `at`, the latest sample's time (None before the first sample)."""

    at: datetime | None
    charts: list[tuple[UUID, Markup, Markup]]


@dataclass(frozen=True, slots=True)
class Point:
    at: datetime
    pending: int
    pickup_seconds: float | None


class QueueHistory:
    """The last hour of samples, per workspace, for at most `workspaces` workspaces."""

    def __init__(self, pool: asyncpg.Pool, *, every_seconds: float, workspaces: int) -> None:
        self._pool = pool
        self._every = every_seconds
        self._workspaces = workspaces
        self._size = max(2, int(HOUR.total_seconds() // every_seconds) + 1)
        self._rings: dict[UUID, deque[Point]] = {}
        self.samples = 0
        self._at: datetime | None = None  # the latest sample's time
        self._drawn: tuple[int, Drawn] = (0, Drawn(None, []))  # and after which sample

    async def sample(self) -> None:
        async with self._pool.acquire() as conn:
            at, found = await ui_reads.queue_sample(
                conn, timedelta(seconds=self._every), self._workspaces
            )
        self.record(at, found)
        samples, series = self.samples, self.series()
        drawn = await anyio.to_thread.run_sync(_draw, at, series)
        if self.samples == samples and self._drawn[0] != samples:
            self._drawn = (samples, drawn)

    def record(self, at: datetime, found: Sequence[ui_reads.QueueSample]) -> None:
        """Add a sample: a tracked workspace absent from it had nothing pending (a zero); one
        with nothing in its whole hour is forgotten; the fewest-pending go past the cap."""
        self.samples += 1
        self._at = at
        seen = {sample.workspace_id: sample for sample in found}
        for workspace in seen.keys() | self._rings.keys():
            sample = seen.get(workspace)
            ring = self._rings.setdefault(workspace, deque(maxlen=self._size))
            if sample is None:
                ring.append(Point(at, 0, None))
            else:
                ring.append(Point(at, sample.pending, sample.pickup_seconds))
        for workspace, ring in list(self._rings.items()):
            if all(p.pending == 0 and p.pickup_seconds is None for p in ring):
                del self._rings[workspace]
        if len(self._rings) > self._workspaces:
            ranked = sorted(self._rings, key=lambda w: -self._rings[w][-1].pending)
            for workspace in ranked[self._workspaces :]:
                del self._rings[workspace]

    def drawn(self) -> Drawn:
        """The charts as of the latest sample: drawn now if this is the first call since it."""
        samples, drawn = self._drawn
        if samples != self.samples and self._at is not None:
            drawn = _draw(self._at, self.series())
            self._drawn = (self.samples, drawn)
        return drawn

    def series(self) -> list[tuple[UUID, list[Point]]]:
        """Every tracked workspace's points, oldest first, most pending now first."""
        return sorted(
            ((w, list(ring)) for w, ring in self._rings.items()),
            key=lambda item: (-item[1][-1].pending, str(item[0])),
        )

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        task_status.started()
        while True:
            try:
                with anyio.fail_after(max(self._every, 5)):
                    await self.sample()
            except Exception as error:  # the next sample tries again; the plot shows the gap
                log.warning("ui.plot_sample_failed", extra={"error": repr(error)})
            await anyio.sleep(self._every)


def _draw(at: datetime, series: list[tuple[UUID, list[Point]]]) -> Drawn:
    """Every series' two charts, drawn at `at`."""
    return Drawn(
        at,
        [
            (
                workspace,
                chart([(p.at, p.pending) for p in points], at, "Pending jobs", ""),
                chart([(p.at, p.pickup_seconds) for p in points], at, "Pickup latency", "s"),
            )
            for workspace, points in series
        ],
    )


def chart(
    points: Sequence[tuple[datetime, float | None]], now: datetime, title: str, unit: str
) -> Markup:
    """`points` of the last hour as an inline SVG line (gaps where a value is None), labelled
    with its title and largest value for screen readers and eyes alike."""
    values = [v for _, v in points if v is not None]
    top = max(values, default=0.0) or 1.0
    span = HOUR.total_seconds()

    def xy(at: datetime, value: float) -> str:
        age = min(span, max(0.0, (now - at).total_seconds()))
        x = PAD + (WIDTH - 2 * PAD) * (1 - age / span)
        y = HEIGHT - PAD - (HEIGHT - 2 * PAD) * (value / top)
        return f"{x:.1f},{y:.1f}"

    runs: list[list[str]] = [[]]
    for at, value in points:
        if value is None:
            if runs[-1]:
                runs.append([])
        else:
            runs[-1].append(xy(at, value))
    line = Markup('<polyline points="{}" fill="none" stroke="currentColor" stroke-width="1.5"/>')
    lines = Markup("").join(line.format(" ".join(run)) for run in runs if run)
    if runs[-1]:  # the latest value as a dot: a line of one point draws nothing
        x, y = runs[-1][-1].split(",")
        lines += Markup('<circle cx="{}" cy="{}" r="2.5" fill="currentColor"/>').format(x, y)
    largest = f"{max(values, default=0.0):.3g} {unit}".strip()
    label = f"{title}, last hour: at most {largest}" if values else f"{title}: no data yet"
    return Markup(
        '<svg class="plot" viewBox="0 0 {w} {h}" width="{w}" height="{h}" role="img" '
        'aria-label="{label}"><title>{label}</title>'
        '<rect x="0" y="0" width="{w}" height="{h}" class="plot-frame"/>{lines}'
        '<text x="6" y="14" class="plot-note">{note}</text></svg>'
    ).format(
        w=WIDTH,
        h=HEIGHT,
        label=label,
        lines=lines,
        note=f"max {largest}, 60 min to now" if values else "no data yet",
    )
