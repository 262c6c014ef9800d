"""The operator overview's read (/ui/), in one statement: the queue's depth, the live runners,
every pending (workspace, label set) group with its takers, and per shown workspace its queued
and running counts by label set and whether it is paused.

It answers exactly what the admin API's separate reads answer in a row (`job_views.
pending_groups`, `queries.active_runners`, `queries.workspace_counts` of the workspaces those
name, `queries.depth`, `pauses.paused_among`; tests/store/test_overview.py compares them on one
seeded queue), but scans pending_jobs once instead of three times and takes one round trip
instead of five: at 10,000 pending the two groupings of every pending row were most of the
page's time (docs/benchmarks.md, "Notes on the page render"). Being one statement, every part is
of the same snapshot.

Reads only; no locks beyond a snapshot's.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from uuid import UUID

from controlplane.store.job_views import GROUP_TAKERS_CTES, GROUPS_WITH_TAKERS, PendingGroup, group
from controlplane.store.pool import Conn
from controlplane.store.queries import LabelCounts, QueueDepth, WorkspaceCounts


@dataclass(frozen=True, slots=True)
class Overview:
    depth: QueueDepth
    live_runners: int  # sessions seen within the window, at most `limit`
    groups: list[PendingGroup]  # oldest first, at most `limit` (as `pending_groups`)
    # The groups' workspaces in the groups' order, then the live runners' (most recent first),
    # each once, with its counts (as `workspace_counts`).
    workspaces: list[WorkspaceCounts]
    paused: frozenset[UUID]  # which of those workspaces are paused


# $1 the limit of groups and of runners, $2 the liveness window. `pend` groups every pending row
# once, counting both what workspace_counts counts (every row) and what pending_groups counts
# (rows with no tombstone yet); the rest reads the groups, the runners and the running leases.
_OVERVIEW = f"""
    WITH pend AS (
        SELECT p.workspace_id, p.required_labels, count(*) AS queued,
               min(p.created_at) AS oldest_queued,
               count(*) FILTER (WHERE e.job_execution_id IS NULL) AS live,
               min(p.enqueued_at) FILTER (WHERE e.job_execution_id IS NULL) AS oldest_live
        FROM pending_jobs p
        LEFT JOIN ended_executions e ON e.job_execution_id = p.job_execution_id
        GROUP BY p.workspace_id, p.required_labels
    ), groups AS (
        SELECT workspace_id, required_labels, live AS pending, oldest_live AS oldest
        FROM pend WHERE live > 0
        ORDER BY oldest, workspace_id
        LIMIT $1
    ), {GROUP_TAKERS_CTES}, grouped AS (
        {GROUPS_WITH_TAKERS}
    ), runners AS (
        SELECT s.id, s.workspace_id, s.updated_at
        FROM runner_sessions s
        WHERE s.updated_at > now() - $2::interval
        ORDER BY s.updated_at DESC, s.id DESC
        LIMIT $1
    ), shown AS (
        SELECT workspace_id, min(n) AS n
        FROM (SELECT workspace_id, row_number() OVER (ORDER BY oldest, workspace_id) AS n
              FROM groups
              UNION ALL
              SELECT workspace_id, $1 + row_number() OVER (ORDER BY updated_at DESC, id DESC)
              FROM runners) AS o
        GROUP BY workspace_id
    ), per_labels AS (
        SELECT workspace_id, required_labels, sum(q)::int AS queued, sum(r)::int AS running,
               min(oldest) AS oldest
          FROM (SELECT workspace_id, required_labels, queued AS q, 0 AS r,
                       oldest_queued AS oldest
                  FROM pend WHERE workspace_id IN (SELECT workspace_id FROM shown)
                UNION ALL
                SELECT workspace_id, required_labels, 0, count(*), NULL
                  FROM running_jobs WHERE workspace_id IN (SELECT workspace_id FROM shown)
                 GROUP BY workspace_id, required_labels) AS t
         GROUP BY workspace_id, required_labels
    ), totals AS (
        SELECT (SELECT coalesce(sum(queued), 0) FROM pend)::bigint AS total_pending,
               (SELECT count(*) FROM running_jobs) AS total_running,
               (SELECT count(*) FROM paused_workspaces) AS paused_workspaces,
               (SELECT count(*) FROM paused_runners) AS paused_runners,
               (SELECT count(*) FROM runners) AS live_runners
    )
    SELECT d.*, w.workspace_id AS space,
           EXISTS (SELECT 1 FROM paused_workspaces pw WHERE pw.workspace_id = w.workspace_id)
               AS space_paused,
           c.required_labels AS labels, c.queued, c.running, c.oldest AS oldest_queued,
           g.*
    FROM totals d
    LEFT JOIN shown w ON true
    LEFT JOIN per_labels c ON c.workspace_id = w.workspace_id
    LEFT JOIN grouped g
           ON g.workspace_id = c.workspace_id AND g.required_labels = c.required_labels
    ORDER BY w.n, c.queued DESC, c.running DESC, c.required_labels
"""  # noqa: S608 -- interpolates constants only


async def overview(conn: Conn, window: timedelta, limit: int) -> Overview:
    """The overview's data: runners and takers live within `window`, at most `limit` groups and
    `limit` runners. One statement, reads only."""
    rows = await conn.fetch(_OVERVIEW, limit, window)
    first = rows[0]  # totals is one row, so there is always one
    groups: list[PendingGroup] = []
    labels: dict[UUID, list[LabelCounts]] = {}
    paused: set[UUID] = set()
    for row in rows:
        space = row["space"]
        if space is None:  # nothing pending and no live runner: no workspace to show
            continue
        found = labels.setdefault(space, [])
        if row["space_paused"]:
            paused.add(space)
        if row["labels"] is None:  # a live runner's workspace with nothing queued or running
            continue
        found.append(
            LabelCounts(tuple(row["labels"]), row["queued"], row["running"], row["oldest_queued"])
        )
        if row["pending"] is not None:
            groups.append(group(row))
    groups.sort(key=lambda g: (g.oldest_enqueued_at, g.workspace_id))
    return Overview(
        depth=QueueDepth(
            first["total_pending"],
            first["total_running"],
            first["paused_workspaces"],
            first["paused_runners"],
        ),
        live_runners=first["live_runners"],
        groups=groups,
        workspaces=[
            WorkspaceCounts(
                space,
                sum(c.queued for c in counted),
                sum(c.running for c in counted),
                tuple(counted),
            )
            for space, counted in labels.items()
        ],
        paused=frozenset(paused),
    )
