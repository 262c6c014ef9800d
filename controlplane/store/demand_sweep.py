"""The per-replica demand sweep's one statement (actors/provisioning/sweep.py): for every
provisioner control session held on this replica, the figures an allocation round of that
session reads and that can change without a notification reaching its actor.

A round is due when its inputs changed: demand in the workspace (an enqueue NOTIFYs, but a
claim, a queue deadline passing or a concurrency key's admission do not), the workspace's live
reservations (a claim releases a unit; any provisioner's reservation expires), the session's own
live reservations and runners (an enrollment, an activation, a job starting on one of them: the
warm pool's supply; only runners with a provider identity: the others change only through the
session's own requests), the workspace provisioner's activation timeouts (one falling due;
a cancelled job's runner has its own NOTIFY), an installation provisioner's eligibility
(changed through another replica), the installation's live reservations and the workspace
templates advertised within `provisioners.active_window_seconds` (a workspace provisioner gone
quiet stops covering its labels, and the installation one takes that demand). The sweep
compares each session's figures with the ones it read at its previous tick and wakes only the
sessions whose figures moved, so a session whose state stays put costs nothing, whatever that
state is (even demand it cannot serve).

An installation session's figures leave pending jobs out (that would be a scan of the whole
queue every tick): demand reaches it by the enqueue NOTIFY, and a claim elsewhere changes its
pushed figures at its next round.

Locks: none. One read-only statement for all the replica's sessions (a transaction of its
own, as every statement is); it holds nothing any other transaction waits for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from uuid import UUID

from controlplane.store.pool import Conn
from controlplane.store.reservations import ACTIVE_SQL

Figures = tuple[object, ...]


@dataclass(frozen=True, slots=True)
class SweptSession:
    """One control session on this replica: its provisioner and, for workspace scope, its
    workspace (None: installation scope)."""

    provisioner_id: UUID
    workspace_id: UUID | None


_SWEEP = f"""
WITH s AS (
    SELECT * FROM unnest($1::uuid[], $2::uuid[])
           WITH ORDINALITY AS s(provisioner_id, workspace_id, ord)
), everywhere AS (
    SELECT count(*) AS n, coalesce(sum(count), 0) AS units,
           (SELECT count(*) FROM provisioner_templates pt
             WHERE pt.workspace_id IS NOT NULL AND pt.advertised_at > now() - $5::interval)
               AS covering
      FROM reservations WHERE expires_at > now()
)
SELECT s.ord,
       (SELECT count(*) FROM (
            SELECT 1 FROM pending_jobs p
             WHERE p.workspace_id = s.workspace_id
               AND (p.expires_at IS NULL OR p.expires_at > now())
               AND NOT EXISTS (SELECT 1 FROM paused_workspaces pw
                                WHERE pw.workspace_id = s.workspace_id)
             LIMIT $4) AS capped) AS pending,
       (SELECT coalesce(sum(k.running), 0) FROM concurrency_keys k
         WHERE k.workspace_id = s.workspace_id) AS keys_running,
       (SELECT row(count(*), coalesce(sum(r.count), 0))::text FROM reservations r
         WHERE r.workspace_id = s.workspace_id AND r.expires_at > now()) AS workspace_reserved,
       (SELECT row(count(*), coalesce(sum(r.count), 0))::text FROM reservations r
         WHERE r.provisioner_id = s.provisioner_id AND r.expires_at > now()) AS own_reserved,
       (SELECT row(count(*),
                   count(*) FILTER (WHERE ri.state = 'running'),
                   count(*) FILTER (WHERE ri.runner_session_id IS NOT NULL),
                   count(*) FILTER (WHERE ri.reservation_id IS NOT NULL),
                   count(*) FILTER (WHERE ri.intended_reservation_id IS NOT NULL),
                   count(*) FILTER (WHERE ri.reservation_released_at IS NOT NULL),
                   count(*) FILTER (WHERE ri.drained_at IS NOT NULL),
                   count(*) FILTER (WHERE EXISTS (
                       SELECT 1 FROM runner_control_sessions cs
                        WHERE cs.runner_instance_id = ri.id
                          AND cs.provisioner_id = ri.provisioner_id
                          AND cs.closed_at IS NULL AND cs.expires_at > now()))
                  )::text
          FROM runner_instances ri
         WHERE ri.provisioner_id = s.provisioner_id AND ri.provider_runner_id IS NOT NULL
           AND ri.state IN {ACTIVE_SQL}) AS runners,
       (SELECT count(*) FILTER (WHERE t.timed_out)
          FROM cp_terminate_candidates(s.workspace_id, s.provisioner_id, $3) AS t) AS timed_out,
       CASE WHEN s.workspace_id IS NULL THEN
           row(g.n, g.units, g.covering,
               (SELECT e.updated_at FROM provisioner_eligibility e
                 WHERE e.provisioner_id = s.provisioner_id))::text
       END AS installation
  FROM s CROSS JOIN everywhere g
 ORDER BY s.ord
"""  # noqa: S608 -- interpolates constants only: ACTIVE_SQL


async def sweep_figures(
    conn: Conn,
    sessions: Sequence[SweptSession],
    *,
    activation_timeout: timedelta,
    covering_window: timedelta,
    pending_cap: int,
) -> list[Figures]:
    """Each session's figures, in the order given (one statement). Pending jobs are counted up
    to `pending_cap` (`provisioners.demand_sweep_pending_cap`): past it a change in their number
    shows only through its other figures, an enqueue's notification or the slow full round.
    `covering_window` is `provisioners.active_window_seconds` (the installation walk's)."""
    if not sessions:
        return []
    rows = await conn.fetch(
        _SWEEP,
        [s.provisioner_id for s in sessions],
        [s.workspace_id for s in sessions],
        activation_timeout,
        pending_cap,
        covering_window,
    )
    return [tuple(row.values())[1:] for row in rows]
