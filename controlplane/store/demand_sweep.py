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

A session's own grants are live reservations, and an enqueue adds a pending job: both would
move its figures at the next tick and wake it for a round with nothing to do (one per enqueue
and per granting round, for every busy session), though its own round made the one and the
enqueue's notification already woke it for the other. So the pending jobs and the live
reservations are counted twice over (`Figures.counted`, what the next tick compares with, and
`counted_before`, the same over the rows created by the previous read's time, which is compared
with the previous tick's `counted`: it differs when a row there then is gone or smaller: a claim,
an expiry, a release, a cancel), beside the count of live reservations another provisioner
created since (`others_new`, which must be 0). A pending row's creation time is its id's
(uuidv7, written by the enqueue's INSERT): a put-back or a retry keeps its old id, so it moves
the figures (and notifies too). A reservation this provisioner created since the previous read
moves nothing: only its own rounds create them, and those read everything they act on; a claim
that uses a unit of it removes a pending job of before the read, or one the enqueue notified.
A row committed after the previous read by a transaction that began before it counts as created
before it, so it moves the figures (a wake too many, not too few).

The sweep's slow full round asks a second question, every half of
`provisioners.demand_full_round_seconds` and again in one statement for the replica's quiet
sessions (`full_round_due`): which sessions a round could find anything for at all, so that the
safety round runs for those and an idle session's costs nothing.

Locks: none. Each is one read-only statement for all the replica's sessions (a transaction of
its own, as every statement is); it holds nothing any other transaction waits for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from uuid import UUID

from controlplane.store.pool import Conn
from controlplane.store.reservations import ACTIVE_SQL


@dataclass(frozen=True, slots=True)
class Figures:
    """One session's figures (see the module's docstring)."""

    fixed: tuple[object, ...]  # compared as they are: keys, runners, timeouts, eligibility
    # Pending jobs (capped) and live reservations (workspace, own, installation-wide).
    counted: tuple[object, ...]
    counted_before: tuple[object, ...]  # the same over rows created by the previous read
    others_new: int  # live reservations another provisioner created since the previous read


@dataclass(frozen=True, slots=True)
class Read:
    """One sweep statement's result: its database time (the next read's `since`) and each
    session's figures."""

    at: datetime | None
    figures: list[Figures]


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
           count(*) FILTER (WHERE created_at <= $6) AS n_before,
           coalesce(sum(count) FILTER (WHERE created_at <= $6), 0) AS units_before,
           count(*) FILTER (WHERE created_at > $6) AS n_new,
           (SELECT count(*) FROM provisioner_templates pt
             WHERE pt.workspace_id IS NOT NULL AND pt.advertised_at > now() - $5::interval)
               AS covering
      FROM reservations WHERE expires_at > now()
)
SELECT s.ord, now() AS read_at,
       (SELECT count(*) FROM (
            SELECT 1 FROM pending_jobs p
             WHERE p.workspace_id = s.workspace_id
               AND (p.expires_at IS NULL OR p.expires_at > now())
               AND NOT EXISTS (SELECT 1 FROM paused_workspaces pw
                                WHERE pw.workspace_id = s.workspace_id)
             LIMIT $4) AS capped) AS pending,
       (SELECT count(*) FROM (
            SELECT 1 FROM pending_jobs p
             WHERE p.workspace_id = s.workspace_id
               AND (p.expires_at IS NULL OR p.expires_at > now())
               AND uuid_extract_timestamp(p.id) <= $6
               AND NOT EXISTS (SELECT 1 FROM paused_workspaces pw
                                WHERE pw.workspace_id = s.workspace_id)
             LIMIT $4) AS capped) AS pending_before,
       (SELECT coalesce(sum(k.running), 0) FROM concurrency_keys k
         WHERE k.workspace_id = s.workspace_id) AS keys_running,
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
           row(g.covering, (SELECT e.updated_at FROM provisioner_eligibility e
                             WHERE e.provisioner_id = s.provisioner_id))::text
       END AS installation,
       w.n AS workspace_n, w.units AS workspace_units,
       w.n_before AS workspace_n_before, w.units_before AS workspace_units_before,
       w.others_new AS workspace_others_new,
       o.n AS own_n, o.units AS own_units, o.n_before AS own_n_before,
       o.units_before AS own_units_before,
       CASE WHEN s.workspace_id IS NULL THEN g.n END AS everywhere_n,
       CASE WHEN s.workspace_id IS NULL THEN g.units END AS everywhere_units,
       CASE WHEN s.workspace_id IS NULL THEN g.n_before END AS everywhere_n_before,
       CASE WHEN s.workspace_id IS NULL THEN g.units_before END AS everywhere_units_before,
       CASE WHEN s.workspace_id IS NULL THEN g.n_new - o.n_new ELSE 0 END
           AS everywhere_others_new
  FROM s CROSS JOIN everywhere g
  CROSS JOIN LATERAL (
       SELECT count(*) AS n, coalesce(sum(r.count), 0) AS units,
              count(*) FILTER (WHERE r.created_at <= $6) AS n_before,
              coalesce(sum(r.count) FILTER (WHERE r.created_at <= $6), 0) AS units_before,
              count(*) FILTER (WHERE r.created_at > $6 AND r.provisioner_id <> s.provisioner_id)
                  AS others_new
         FROM reservations r
        WHERE r.workspace_id = s.workspace_id AND r.expires_at > now()) w
  CROSS JOIN LATERAL (
       SELECT count(*) AS n, coalesce(sum(r.count), 0) AS units,
              count(*) FILTER (WHERE r.created_at <= $6) AS n_before,
              coalesce(sum(r.count) FILTER (WHERE r.created_at <= $6), 0) AS units_before,
              count(*) FILTER (WHERE r.created_at > $6) AS n_new
         FROM reservations r
        WHERE r.provisioner_id = s.provisioner_id AND r.expires_at > now()) o
 ORDER BY s.ord
"""  # noqa: S608 -- interpolates constants only: ACTIVE_SQL


async def sweep_figures(
    conn: Conn,
    sessions: Sequence[SweptSession],
    *,
    since: datetime | None,
    activation_timeout: timedelta,
    covering_window: timedelta,
    pending_cap: int,
) -> Read:
    """Each session's figures, in the order given (one statement); `since` is the previous
    read's `Read.at` (None: no previous read, so nothing counts as created before it). Pending
    jobs are counted up to `pending_cap` (`provisioners.demand_sweep_pending_cap`): past it a
    change in their number shows only through its other figures, an enqueue's notification or
    the slow full round. `covering_window` is `provisioners.active_window_seconds` (the
    installation walk's)."""
    if not sessions:
        return Read(since, [])
    rows = await conn.fetch(
        _SWEEP,
        [s.provisioner_id for s in sessions],
        [s.workspace_id for s in sessions],
        activation_timeout,
        pending_cap,
        covering_window,
        since,
    )
    figures = [
        Figures(
            fixed=(
                r["keys_running"],
                r["runners"],
                r["timed_out"],
                r["installation"],
            ),
            counted=(
                r["pending"],
                r["workspace_n"],
                r["workspace_units"],
                r["own_n"],
                r["own_units"],
                r["everywhere_n"],
                r["everywhere_units"],
            ),
            counted_before=(
                r["pending_before"],
                r["workspace_n_before"],
                r["workspace_units_before"],
                r["own_n_before"],
                r["own_units_before"],
                r["everywhere_n_before"],
                r["everywhere_units_before"],
            ),
            others_new=r["workspace_others_new"] + r["everywhere_others_new"],
        )
        for r in rows
    ]
    return Read(rows[0]["read_at"], figures)


# The full-round check (actors/provisioning/sweep.py): which sessions a round could find
# anything for. The pending probe of a workspace session is one entry of
# pending_jobs_workspace_oldest_idx; an installation session's is one uncorrelated probe of
# workspace_demand (a row per workspace that may have pending jobs), run once for the statement.
_FULL_ROUND_DUE = f"""
WITH s AS (
    SELECT * FROM unnest($1::uuid[], $2::uuid[])
           WITH ORDINALITY AS s(provisioner_id, workspace_id, ord)
), holding AS (
    SELECT r.provisioner_id FROM reservations r
     WHERE r.provisioner_id = ANY($1::uuid[]) AND r.expires_at > now()
    UNION
    SELECT ri.provisioner_id FROM runner_instances ri
     WHERE ri.provisioner_id = ANY($1::uuid[]) AND ri.state IN {ACTIVE_SQL}
)
SELECT s.ord,
       s.provisioner_id IN (SELECT provisioner_id FROM holding)
       OR CASE WHEN s.workspace_id IS NULL THEN
               (SELECT EXISTS (SELECT 1 FROM workspace_demand d
                                WHERE EXISTS (SELECT 1 FROM pending_jobs p
                                               WHERE p.workspace_id = d.workspace_id)))
          ELSE EXISTS (SELECT 1 FROM pending_jobs p WHERE p.workspace_id = s.workspace_id)
          END AS due
  FROM s
 ORDER BY s.ord
"""  # noqa: S608 -- interpolates constants only: ACTIVE_SQL


async def full_round_due(conn: Conn, sessions: Sequence[SweptSession]) -> list[bool]:
    """For each session, in the order given, whether a round could find anything to act on: a
    pending job where it may serve (its workspace; for installation scope, any workspace, its
    eligibility aside), or a live reservation or an active runner instance of its own. A
    session with none of those gets nothing from a round: no demand figure, grant, bound
    runner or terminate intent (only its own active instances are candidates); warm launches
    (an advertised `idle_target`) are the actor's own to judge. One statement for all of them.

    Locks: none. Read-only, a transaction of its own."""
    if not sessions:
        return []
    rows = await conn.fetch(
        _FULL_ROUND_DUE,
        [s.provisioner_id for s in sessions],
        [s.workspace_id for s in sessions],
    )
    return [bool(r["due"]) for r in rows]
