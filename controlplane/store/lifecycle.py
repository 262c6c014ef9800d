"""Reads behind the provisioned runners' lifecycle metrics: how long an instance waited between
two milestones, the instances a provisioner has per template and state, and the enrolled ones
that stopped reporting. Each is one plain read (no lock) over `runner_instances` and its
control sessions; the callers (web/, actors/) turn them into metrics and never fail a request
over them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from uuid import UUID

from controlplane.store.fleet import Since
from controlplane.store.pool import Conn


@dataclass(frozen=True, slots=True)
class Assigned:
    """An assign request's answer: the ids in request order, and for each instance this request
    assigned (not a replay) the seconds from its control session to the assignment."""

    runner_instance_ids: list[UUID]
    lags: list[Since]


async def assignment_lags(
    conn: Conn, runner_instance_ids: Sequence[UUID], *, this_transaction: bool = False
) -> list[Since]:
    """Seconds from control session (the instance's first: a bootstrap token exchanges once) to
    assignment, for the assigned instances among `runner_instance_ids`. With
    `this_transaction`, only those the caller's transaction assigned: call it inside that
    transaction, after the assignment. An assignment writes `assigned_at = now()`, the
    transaction's start, so a replayed (already committed) one is left out."""
    rows = await conn.fetch(
        """
        SELECT ri.provider_kind, ri.launch_kind,
               extract(epoch FROM ri.assigned_at - (
                   SELECT min(cs.created_at) FROM runner_control_sessions cs
                    WHERE cs.runner_instance_id = ri.id))::float8 AS s
          FROM runner_instances ri
         WHERE ri.id = ANY($1::uuid[]) AND ri.assigned_at IS NOT NULL
           AND (NOT $2 OR ri.assigned_at = now())
        """,
        list(runner_instance_ids),
        this_transaction,
    )
    return [Since(r["provider_kind"], r["launch_kind"], r["s"]) for r in rows if r["s"] is not None]


async def assignment_to_activation(conn: Conn, runner_instance_id: UUID) -> Since | None:
    """Seconds from the instance's assignment to now (its activation just committed)."""
    row = await conn.fetchrow(
        """
        SELECT provider_kind, launch_kind, extract(epoch FROM now() - assigned_at)::float8 AS s
          FROM runner_instances WHERE id = $1
        """,
        runner_instance_id,
    )
    if row is None or row["s"] is None:
        return None
    return Since(row["provider_kind"], row["launch_kind"], row["s"])


async def instance_counts(conn: Conn, provisioner_id: UUID) -> dict[tuple[str, str], int]:
    """The provisioner's starting and running instances that name a template, by (template
    key, state): what its advertised counts are compared with."""
    rows = await conn.fetch(
        """
        SELECT template_key, state, count(*)::int AS n
          FROM runner_instances
         WHERE provisioner_id = $1 AND state IN ('starting', 'running')
           AND template_key IS NOT NULL
         GROUP BY template_key, state
        """,
        provisioner_id,
    )
    return {(r["template_key"], r["state"]): r["n"] for r in rows}


async def enrolled_without_recent_report(conn: Conn, stale_after: timedelta) -> int:
    """Running instances with an open, unexpired control session, no workspace and no runner
    session, whose last report is older than `stale_after`: enrolled machines that went quiet
    before any work reached them."""
    count: int = await conn.fetchval(
        """
        SELECT count(*)::int
          FROM runner_instances ri
         WHERE ri.state = 'running' AND ri.workspace_id IS NULL
           AND ri.runner_session_id IS NULL
           AND ri.reported_at < now() - $1::interval
           AND EXISTS (SELECT 1 FROM runner_control_sessions cs
                        WHERE cs.runner_instance_id = ri.id AND cs.closed_at IS NULL
                          AND cs.expires_at > now())
        """,
        stale_after,
    )
    return count
