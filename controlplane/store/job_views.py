"""Read models of job executions for operators: a list across the three tables, one execution in
full, who could take each pending label set, and where a pending execution stands in its queue
(domain/waiting.py reads the last two).

Reads only; no locks beyond what a snapshot takes. An ended execution keeps only its tombstone
(outcome, who ended it, when, exit code and output tail): no labels, so the labels filter applies
to pending and running executions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from uuid import UUID

import asyncpg

from controlplane.domain.waiting import PLACE_CAP, QueuePlace, Takers
from controlplane.store.pool import Conn
from controlplane.store.records import from_row

STATUSES = ("pending", "running", "ended")


@dataclass(frozen=True, slots=True)
class JobView:
    job_execution_id: UUID
    status: str  # 'pending', 'running' or 'ended'
    workspace_id: UUID | None
    job_id: UUID | None
    required_labels: tuple[str, ...] | None  # None once ended: the tombstone keeps none
    enqueued_at: datetime | None
    started_at: datetime | None
    ended_at: datetime | None
    changed_at: datetime  # enqueued, started or ended: what "newest first" sorts on
    runner_session_id: UUID | None
    cancel_requested: bool
    outcome: str | None
    ended_by: str | None
    exit_code: int | None
    output_tail: str | None


# One row shape for the three tables. A running row's tombstone may already exist (a cancelled
# lease draining): the execution is then listed once, as ended.
_ALL = """
    SELECT 'pending' AS status, p.job_execution_id, p.workspace_id, p.job_id, p.required_labels,
           p.enqueued_at, NULL::timestamptz AS started_at, NULL::timestamptz AS ended_at,
           p.enqueued_at AS changed_at, NULL::uuid AS runner_session_id,
           false AS cancel_requested, NULL AS outcome, NULL AS ended_by,
           NULL::integer AS exit_code, NULL AS output_tail
    FROM pending_jobs p
    WHERE NOT EXISTS (SELECT 1 FROM ended_executions e
                      WHERE e.job_execution_id = p.job_execution_id)
    UNION ALL
    SELECT 'running', r.job_execution_id, r.workspace_id, r.job_id, r.required_labels,
           NULL, r.started_at, NULL, r.started_at, r.runner_session_id,
           r.cancellation_requested_at IS NOT NULL, NULL, NULL, NULL, NULL
    FROM running_jobs r
    WHERE NOT EXISTS (SELECT 1 FROM ended_executions e
                      WHERE e.job_execution_id = r.job_execution_id)
    UNION ALL
    SELECT 'ended', e.job_execution_id, e.workspace_id, e.job_id, NULL,
           NULL, NULL, e.ended_at, e.ended_at, NULL, false, e.outcome, e.ended_by, e.exit_code,
           e.output_tail
    FROM ended_executions e
"""


def _view(row: asyncpg.Record, *, with_tail: bool) -> JobView:
    labels = row["required_labels"]
    return from_row(
        JobView,
        row,
        required_labels=None if labels is None else tuple(labels),
        output_tail=row["output_tail"] if with_tail else None,
    )


# The list reads each table on its own: filtered, newest first, and cut to a page before the
# three are merged. Each table's read is one level (filter, tombstone check, order, limit), so
# the planner can walk an index in the list's order and stop at the page: pending_jobs by
# (enqueued_at, job_execution_id) (sql/0025), ended_executions by ended_at; the tombstone check
# then probes only the rows it lists. Read as a sorted subquery instead, the planner sorted all
# 10,000 pending rows of the page benchmark before the check (docs/benchmarks.md, page render).
def _newest(columns: str, table: str, changed: str, status: str) -> str:
    """One table's page: `columns` of `table` aliased x, newest `changed` first; the labels
    filter matches nothing in the tombstones (they keep no labels)."""
    labels = "false" if status == "ended" else "x.required_labels @> $3"
    live = "" if status == "ended" else _LIVE
    return f"""(
        SELECT {columns} FROM {table} x
        WHERE ($2::text IS NULL OR $2 = '{status}')
          AND ($1::uuid IS NULL OR x.workspace_id = $1)
          AND ($3::text[] IS NULL OR {labels})
          AND ($4::timestamptz IS NULL OR (x.{changed}, x.job_execution_id) < ($4, $5::uuid))
          {live}
        ORDER BY x.{changed} DESC, x.job_execution_id DESC
        LIMIT $6
    )"""  # noqa: S608 -- interpolates constants only


_LIVE = """AND NOT EXISTS (SELECT 1 FROM ended_executions e
                         WHERE e.job_execution_id = x.job_execution_id)"""
_PENDING = """
    'pending' AS status, x.job_execution_id, x.workspace_id, x.job_id, x.required_labels,
    x.enqueued_at, NULL::timestamptz AS started_at, NULL::timestamptz AS ended_at,
    x.enqueued_at AS changed_at, NULL::uuid AS runner_session_id, false AS cancel_requested,
    NULL::text AS outcome, NULL::text AS ended_by, NULL::integer AS exit_code,
    NULL::text AS output_tail
"""
_RUNNING = """
    'running' AS status, x.job_execution_id, x.workspace_id, x.job_id, x.required_labels,
    NULL::timestamptz AS enqueued_at, x.started_at, NULL::timestamptz AS ended_at,
    x.started_at AS changed_at, x.runner_session_id,
    x.cancellation_requested_at IS NOT NULL AS cancel_requested, NULL::text AS outcome,
    NULL::text AS ended_by, NULL::integer AS exit_code, NULL::text AS output_tail
"""
_ENDED = """
    'ended' AS status, x.job_execution_id, x.workspace_id, x.job_id,
    NULL::text[] AS required_labels, NULL::timestamptz AS enqueued_at,
    NULL::timestamptz AS started_at, x.ended_at, x.ended_at AS changed_at,
    NULL::uuid AS runner_session_id, false AS cancel_requested, x.outcome, x.ended_by,
    x.exit_code, NULL::text AS output_tail
"""
_LIST = (
    "SELECT * FROM ("  # noqa: S608 -- interpolates constants only
    + _newest(_PENDING, "pending_jobs", "enqueued_at", "pending")
    + " UNION ALL "
    + _newest(_RUNNING, "running_jobs", "started_at", "running")
    + " UNION ALL "
    + _newest(_ENDED, "ended_executions", "ended_at", "ended")
    + ") AS j ORDER BY j.changed_at DESC, j.job_execution_id DESC LIMIT $6"
)


async def list_jobs(
    conn: Conn,
    *,
    workspace_id: UUID | None,
    status: str | None,
    labels: Sequence[str] | None,
    before: tuple[datetime, UUID] | None,
    limit: int,
) -> list[JobView]:
    """Newest change first (enqueued, started or ended), then execution id; a page strictly
    before `before`. Labels match executions that require all of them (so no ended one). The
    rows of `_ALL` in its order, read per table (above)."""
    rows = await conn.fetch(
        _LIST,
        workspace_id,
        status,
        None if labels is None else list(labels),
        None if before is None else before[0],
        None if before is None else before[1],
        limit,
    )
    return [_view(row, with_tail=False) for row in rows]


async def one_job(conn: Conn, job_execution_id: UUID) -> JobView | None:
    row = await conn.fetchrow(
        f"SELECT * FROM ({_ALL}) AS j WHERE j.job_execution_id = $1",  # noqa: S608 -- interpolates constants only: _ALL
        job_execution_id,
    )
    return None if row is None else _view(row, with_tail=True)


@dataclass(frozen=True, slots=True)
class PendingGroup:
    workspace_id: UUID
    required_labels: tuple[str, ...]
    pending: int
    oldest_enqueued_at: datetime
    takers: Takers


_TAKERS = """
    WITH live_runners AS (
        SELECT s.id, s.labels,
               EXISTS (SELECT 1 FROM running_jobs r WHERE r.runner_session_id = s.id) AS busy,
               EXISTS (SELECT 1 FROM paused_runners pr WHERE pr.runner_session_id = s.id)
                   AS paused
        FROM runner_sessions s
        WHERE s.workspace_id = $1 AND s.revoked_at IS NULL
          AND s.updated_at > now() - $3::interval
          AND (s.max_claims IS NULL OR s.claims_used < s.max_claims)
    ), live_templates AS (
        SELECT t.labels
        FROM provisioner_templates t
        JOIN provisioner_tokens p ON p.id = t.provisioner_id
        JOIN provisioner_sessions ps ON ps.provisioner_id = p.id
        WHERE (p.workspace_id = $1 OR p.workspace_id IS NULL)
          AND p.revoked_at IS NULL AND (p.expires_at IS NULL OR p.expires_at > now())
          AND ps.last_seen_at > now() - $3::interval
    )
    SELECT
        (SELECT count(*) FROM live_runners WHERE labels @> $2) AS live,
        (SELECT count(*) FROM live_runners WHERE labels @> $2 AND busy) AS busy,
        (SELECT count(*) FROM live_runners WHERE labels @> $2 AND paused) AS paused,
        (SELECT count(*) FROM live_runners WHERE labels @> $2 AND paused AND NOT busy)
            AS paused_idle,
        (SELECT count(*) FROM live_templates WHERE labels @> $2) AS templates,
        ARRAY(SELECT DISTINCT unnest(labels) FROM live_runners
              UNION SELECT DISTINCT unnest(labels) FROM live_templates) AS offered
"""


def _takers(row: asyncpg.Record) -> Takers:
    """A takers row of `_TAKERS` or `_GROUPS` (the same column names)."""
    return Takers(
        row["live"],
        row["busy"],
        row["templates"],
        frozenset(row["offered"]),
        paused_runners=row["paused"],
        paused_idle=row["paused_idle"],
    )


async def takers(
    conn: Conn, workspace_id: UUID, labels: Sequence[str], window: timedelta
) -> Takers:
    """Who could take jobs of `labels` in the workspace: runners seen within `window` with claims
    left, and templates of provisioners whose session was seen within it."""
    row = await conn.fetchrow(_TAKERS, workspace_id, list(labels), window)
    assert row is not None
    return _takers(row)


# Where a pending execution ($1) stands (domain/waiting.py QueuePlace). The jobs ahead of it are
# those a runner with exactly its labels could claim before it: same workspace, labels within
# its labels, claimable now (key below its limit, queue deadline not passed; as store/ordering.py
# CLAIMABLE), earlier in the plain order (priority, then age). Each count stops at $2 rows.
_PLACE = """
    WITH me AS (
        SELECT id, workspace_id, required_labels, priority, created_at, concurrency_key,
               concurrency_limit, expires_at
        FROM pending_jobs WHERE job_execution_id = $1
    ), ahead AS (
        SELECT p.priority FROM pending_jobs p, me
        WHERE p.workspace_id = me.workspace_id AND p.required_labels <@ me.required_labels
          AND p.id <> me.id
          AND (p.priority > me.priority
               OR (p.priority = me.priority AND (p.created_at, p.id) < (me.created_at, me.id)))
          AND (p.expires_at IS NULL OR p.expires_at > now())
          AND (p.concurrency_key IS NULL
               OR EXISTS (SELECT 1 FROM concurrency_keys k
                          WHERE k.workspace_id = p.workspace_id
                            AND k.concurrency_key = p.concurrency_key
                            AND k.running < p.concurrency_limit))
        ORDER BY p.priority DESC, p.created_at, p.id
        LIMIT $2
    )
    SELECT me.priority, me.concurrency_key, me.concurrency_limit,
           coalesce(me.expires_at <= now(), false) AS expired,
           (SELECT count(*) FROM ahead) AS ahead,
           (SELECT count(*) FROM ahead WHERE ahead.priority > me.priority) AS higher,
           coalesce((SELECT running FROM concurrency_keys k
                     WHERE k.workspace_id = me.workspace_id
                       AND k.concurrency_key = me.concurrency_key), 0) AS key_running,
           EXISTS (SELECT 1 FROM paused_workspaces w WHERE w.workspace_id = me.workspace_id)
               AS workspace_paused
    FROM me
"""


async def queue_place(conn: Conn, job_execution_id: UUID) -> QueuePlace | None:
    """Where the pending execution stands in its workspace's queue; None when it is not pending.
    One statement, reads only."""
    row = await conn.fetchrow(_PLACE, job_execution_id, PLACE_CAP)
    return None if row is None else from_row(QueuePlace, row, ahead_higher_priority=row["higher"])


# Every pending (workspace, label set) with its takers, in one statement: the runners and
# templates of the groups' workspaces are read once and counted per label set (the takers read
# above, for all groups at once). Runners are first folded to (workspace, labels) with counts,
# so each group compares against distinct label sets rather than every session.
#
# GROUP_TAKERS_CTES follow a CTE named `groups` (workspace_id, required_labels, pending, oldest)
# and read the window from $2; GROUPS_WITH_TAKERS then answers each group with its takers. The
# overview's one read (store/overview.py) builds its `groups` differently and shares these.
GROUP_TAKERS_CTES = """
    spaces AS (
        SELECT DISTINCT workspace_id FROM groups
    ), live_runners AS (
        SELECT s.workspace_id, s.labels,
               EXISTS (SELECT 1 FROM running_jobs r WHERE r.runner_session_id = s.id) AS busy,
               EXISTS (SELECT 1 FROM paused_runners pr WHERE pr.runner_session_id = s.id)
                   AS paused
        FROM runner_sessions s
        WHERE s.workspace_id IN (SELECT workspace_id FROM spaces) AND s.revoked_at IS NULL
          AND s.updated_at > now() - $2::interval
          AND (s.max_claims IS NULL OR s.claims_used < s.max_claims)
    ), runner_sets AS (
        SELECT workspace_id, labels, count(*) AS live,
               count(*) FILTER (WHERE busy) AS busy,
               count(*) FILTER (WHERE paused) AS paused,
               count(*) FILTER (WHERE paused AND NOT busy) AS paused_idle
        FROM live_runners
        GROUP BY workspace_id, labels
    ), live_templates AS (
        SELECT w.workspace_id, t.labels
        FROM spaces w
        JOIN provisioner_tokens p ON p.workspace_id = w.workspace_id OR p.workspace_id IS NULL
        JOIN provisioner_templates t ON t.provisioner_id = p.id
        JOIN provisioner_sessions ps ON ps.provisioner_id = p.id
        WHERE p.revoked_at IS NULL AND (p.expires_at IS NULL OR p.expires_at > now())
          AND ps.last_seen_at > now() - $2::interval
    ), offers AS (
        SELECT workspace_id, array_agg(DISTINCT label) AS offered
        FROM (SELECT workspace_id, unnest(labels) AS label FROM runner_sets
              UNION SELECT workspace_id, unnest(labels) FROM live_templates) AS o
        GROUP BY workspace_id
    )
"""
GROUPS_WITH_TAKERS = """
    SELECT g.workspace_id, g.required_labels, g.pending, g.oldest,
           r.live, r.busy, r.paused, r.paused_idle, t.templates,
           coalesce(o.offered, '{}') AS offered
    FROM groups g
    CROSS JOIN LATERAL (
        SELECT coalesce(sum(rs.live), 0)::bigint AS live,
               coalesce(sum(rs.busy), 0)::bigint AS busy,
               coalesce(sum(rs.paused), 0)::bigint AS paused,
               coalesce(sum(rs.paused_idle), 0)::bigint AS paused_idle
        FROM runner_sets rs
        WHERE rs.workspace_id = g.workspace_id AND rs.labels @> g.required_labels
    ) r
    CROSS JOIN LATERAL (
        SELECT count(*) AS templates FROM live_templates lt
        WHERE lt.workspace_id = g.workspace_id AND lt.labels @> g.required_labels
    ) t
    LEFT JOIN offers o ON o.workspace_id = g.workspace_id
"""
_GROUPS = f"""
    WITH groups AS (
        SELECT workspace_id, required_labels, count(*) AS pending,
               min(enqueued_at) AS oldest
        FROM pending_jobs p
        WHERE NOT EXISTS (SELECT 1 FROM ended_executions e
                          WHERE e.job_execution_id = p.job_execution_id)
        GROUP BY workspace_id, required_labels
        ORDER BY oldest, workspace_id
        LIMIT $1
    ), {GROUP_TAKERS_CTES}
    {GROUPS_WITH_TAKERS}
    ORDER BY g.oldest, g.workspace_id
"""  # noqa: S608 -- interpolates constants only


def group(row: asyncpg.Record) -> PendingGroup:
    """A row of GROUPS_WITH_TAKERS's columns."""
    return PendingGroup(
        workspace_id=row["workspace_id"],
        required_labels=tuple(row["required_labels"]),
        pending=row["pending"],
        oldest_enqueued_at=row["oldest"],
        takers=_takers(row),
    )


async def pending_groups(conn: Conn, window: timedelta, limit: int = 1000) -> list[PendingGroup]:
    """Each (workspace, label set) with pending executions, oldest first, with its takers (as
    `takers` answers for one label set). One statement, reads only."""
    return [group(row) for row in await conn.fetch(_GROUPS, limit, window)]
