"""Read models of the provisioned fleet, for the admin API, `controlplane status` and metrics:
runner instances (listed, active, counted by state and by lifecycle phase), live reservations,
and the timestamps the lifecycle histograms need.

Plain reads: no locks, no writes. `now` is the database clock, read in the same statement.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from uuid import UUID

import asyncpg

from controlplane.domain.fleet import InstanceFacts
from controlplane.domain.labels import LabelSet
from controlplane.domain.runner_instances import ACTIVE_STATES, RunnerState
from controlplane.store.pool import Conn
from controlplane.store.records import from_row
from controlplane.store.reservations import BOOTING_SQL

_ACTIVE = sorted(ACTIVE_STATES)


@dataclass(frozen=True, slots=True)
class InstanceRow:
    id: UUID
    provisioner_id: UUID
    provisioner_scope: str
    provisioner_name: str
    workspace_id: UUID | None
    provider_runner_id: str | None
    provider_kind: str | None
    launch_kind: str
    template_key: str | None
    labels: LabelSet
    state: RunnerState
    reason: str | None
    created_at: datetime
    updated_at: datetime
    reported_at: datetime
    assigned_at: datetime | None
    first_claimed_at: datetime | None
    closed_at: datetime | None  # the stopped/failed/terminated time matching the state
    facts: InstanceFacts


@dataclass(frozen=True, slots=True)
class InstanceFilter:
    state: RunnerState | None = None
    assigned: bool | None = None
    label: str | None = None  # canonical
    provisioner_id: UUID | None = None
    workspace_id: UUID | None = None


_SELECT = """
SELECT ri.id, ri.provisioner_id, pt.scope AS provisioner_scope, pt.name AS provisioner_name,
       ri.workspace_id, ri.provider_runner_id, ri.provider_kind, ri.launch_kind, ri.template_key,
       ri.labels, ri.state, ri.reason, ri.created_at, ri.updated_at, ri.reported_at,
       ri.assigned_at, ri.first_claimed_at, ri.runner_session_id,
       CASE ri.state WHEN 'stopped' THEN ri.stopped_at WHEN 'failed' THEN ri.failed_at
                     WHEN 'terminated' THEN ri.terminated_at END AS closed_at,
       pt.last_seen_at AS provisioner_last_seen_at,
       EXISTS (SELECT 1 FROM runner_control_sessions cs
                WHERE cs.runner_instance_id = ri.id AND cs.closed_at IS NULL
                  AND cs.expires_at > now()) AS control_session_live,
       now() AS now
  FROM runner_instances ri JOIN provisioner_tokens pt ON pt.id = ri.provisioner_id
"""


def _row(row: asyncpg.Record) -> InstanceRow:
    state = RunnerState(row["state"])
    return from_row(
        InstanceRow,
        row,
        labels=tuple(row["labels"]),
        state=state,
        facts=from_row(InstanceFacts, row, state=state),
    )


async def list_instances(
    conn: Conn,
    where: InstanceFilter,
    *,
    before: tuple[datetime, UUID] | None,
    limit: int,
) -> tuple[list[InstanceRow], datetime]:
    """Up to `limit` instances of every provisioner and scope, newest (created_at, id) first,
    strictly before `before`; and the database's `now`."""
    rows = await conn.fetch(
        _SELECT
        + """
         WHERE ($1::text IS NULL OR ri.state = $1)
           AND ($2::boolean IS NULL OR (ri.workspace_id IS NOT NULL) = $2)
           AND ($3::text IS NULL OR ri.labels @> ARRAY[$3::text])
           AND ($4::uuid IS NULL OR ri.provisioner_id = $4)
           AND ($5::uuid IS NULL OR ri.workspace_id = $5)
           AND ($6::timestamptz IS NULL OR (ri.created_at, ri.id) < ($6, $7::uuid))
         ORDER BY ri.created_at DESC, ri.id DESC
         LIMIT $8
        """,
        None if where.state is None else where.state.value,
        where.assigned,
        where.label,
        where.provisioner_id,
        where.workspace_id,
        None if before is None else before[0],
        None if before is None else before[1],
        limit,
    )
    now = rows[0]["now"] if rows else await conn.fetchval("SELECT now()")
    return [_row(row) for row in rows], now


async def active_instances(
    conn: Conn, workspace_id: UUID, window: timedelta, limit: int = 1000
) -> tuple[list[InstanceRow], datetime]:
    """Active-state instances of the workspace whose row the server updated within `window`
    (server `updated_at`, never a reported time: spec P-87), most recently updated first."""
    rows = await conn.fetch(
        _SELECT
        + """
         WHERE ri.workspace_id = $1 AND ri.state = ANY($2::text[])
           AND ri.updated_at > now() - $3::interval
         ORDER BY ri.updated_at DESC, ri.id DESC
         LIMIT $4
        """,
        workspace_id,
        _ACTIVE,
        window,
        limit,
    )
    now = rows[0]["now"] if rows else await conn.fetchval("SELECT now()")
    return [_row(row) for row in rows], now


async def counts_by_state(conn: Conn) -> dict[str, int]:
    rows = await conn.fetch("SELECT state, count(*) AS n FROM runner_instances GROUP BY state")
    return {row["state"]: row["n"] for row in rows}


@dataclass(frozen=True, slots=True)
class LiveReservations:
    """Unexpired reservations of one workspace and label set, of one kind."""

    workspace_id: UUID
    labels: LabelSet
    kind: str
    reservations: int
    units: int
    next_expiry: datetime


async def live_reservations(conn: Conn, workspace_id: UUID | None) -> list[LiveReservations]:
    rows = await conn.fetch(
        """
        SELECT workspace_id, required_labels, kind, count(*) AS reservations,
               sum(count)::int AS units, min(expires_at) AS next_expiry
          FROM reservations
         WHERE expires_at > now() AND ($1::uuid IS NULL OR workspace_id = $1)
         GROUP BY workspace_id, required_labels, kind
         ORDER BY workspace_id, required_labels, kind
        """,
        workspace_id,
    )
    return [from_row(LiveReservations, row, labels=tuple(row["required_labels"])) for row in rows]


@dataclass(frozen=True, slots=True)
class PhaseCount:
    phase: str
    provider_kind: str | None
    launch_kind: str
    count: int
    oldest_age_seconds: float


async def phase_counts(conn: Conn) -> list[PhaseCount]:
    """Starting/running instances without a runner session, per phase (spec 2.4): no live
    control session -> control_session; not running -> enrollment; intended reservation and no
    workspace -> assignment; workspace -> activation; else idle. The oldest age runs from the
    phase's start: creation, the control session's creation, enrollment (started_at), the
    assignment, or enrollment again for idle."""
    rows = await conn.fetch(
        f"""
        WITH phased AS (
            SELECT ri.provider_kind, ri.launch_kind,
                   CASE WHEN cs.created_at IS NULL THEN 'control_session'
                        WHEN ri.state <> 'running' THEN 'enrollment'
                        WHEN ri.workspace_id IS NULL AND ri.intended_reservation_id IS NOT NULL
                            THEN 'assignment'
                        WHEN ri.workspace_id IS NOT NULL THEN 'activation'
                        ELSE 'idle' END AS phase,
                   CASE WHEN cs.created_at IS NULL THEN ri.created_at
                        WHEN ri.state <> 'running' THEN cs.created_at
                        WHEN ri.workspace_id IS NOT NULL
                            THEN coalesce(ri.assigned_at, ri.updated_at)
                        ELSE coalesce(ri.started_at, cs.created_at) END AS since
              FROM runner_instances ri
              LEFT JOIN runner_control_sessions cs
                ON cs.runner_instance_id = ri.id AND cs.closed_at IS NULL
               AND cs.expires_at > now()
             WHERE ri.state IN {BOOTING_SQL} AND ri.runner_session_id IS NULL
        )
        SELECT phase, provider_kind, launch_kind, count(*) AS n,
               greatest(extract(epoch FROM now() - min(since)), 0)::float8 AS oldest
          FROM phased
         GROUP BY phase, provider_kind, launch_kind
        """  # noqa: S608 -- interpolates constants only: BOOTING_SQL
    )
    return [
        PhaseCount(row["phase"], row["provider_kind"], row["launch_kind"], row["n"], row["oldest"])
        for row in rows
    ]


@dataclass(frozen=True, slots=True)
class Since:
    """A runner instance's provider and launch kind, and seconds since a timestamp of it."""

    provider_kind: str | None
    launch_kind: str
    seconds: float


async def since_created(conn: Conn, runner_instance_id: UUID) -> Since | None:
    """Seconds from the instance's creation to now (its bootstrap exchange just committed)."""
    row = await conn.fetchrow(
        """
        SELECT provider_kind, launch_kind, extract(epoch FROM now() - created_at)::float8 AS s
          FROM runner_instances WHERE id = $1
        """,
        runner_instance_id,
    )
    return None if row is None else Since(row["provider_kind"], row["launch_kind"], row["s"])
