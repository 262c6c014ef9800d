"""What an allocation round reads (spec 3.3-3.5): the provisioner's advertised templates, the
workspace's demand and reservations, the provisioner's runners, and the labels the workspace's
own provisioners cover.

`read_inputs` takes the locks that make its reads true for the round (the global order of
`store/reservations.py`: assignment locks, then reservation rows); the other reads take none.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from uuid import UUID

from controlplane.domain.binding import Scope
from controlplane.domain.demand import (
    AllocationInputs,
    DemandGroup,
    Reservation,
    ReservationKind,
    Template,
)
from controlplane.domain.labels import LabelSet, canonicalise
from controlplane.store.pool import Conn
from controlplane.store.reservations import (
    ACTIVE_SQL,
    RESERVATION_COLUMNS,
    RUNNER_COLUMNS,
    hold_reservations,
    lock_assignments,
    reservation_from_row,
    runner_from_row,
)


async def replace_templates(
    conn: Conn, provisioner_id: UUID, workspace_id: UUID | None, templates: Sequence[Template]
) -> None:
    """Replace the provisioner's advertised templates (an empty list withdraws them), labels
    canonical. A repeated template key keeps its first advertisement.

    Locks: the provisioner's template rows (by the DELETE), in one transaction (a savepoint
    inside the caller's), so readers see the old set or the new one, never none.
    """
    keys = []
    seen: set[str] = set()
    for template in templates:
        labels = canonicalise(template.labels)
        if labels and template.key not in seen:  # an empty label set serves nothing
            seen.add(template.key)
            keys.append(replace(template, labels=labels))
    async with conn.transaction():
        await conn.execute(
            "DELETE FROM provisioner_templates WHERE provisioner_id = $1", provisioner_id
        )
        if keys:
            await conn.executemany(
                """
                INSERT INTO provisioner_templates
                    (provisioner_id, template_key, workspace_id, labels, available_slots, starting,
                     running, idle_target, advertised_at)
                VALUES ($1, $2, $3, $4, $5, $6, $7, $8, now())
                """,
                [
                    (
                        provisioner_id,
                        t.key,
                        workspace_id,
                        list(t.labels),
                        t.available_slots,
                        t.starting,
                        t.running,
                        t.idle_target,
                    )
                    for t in keys
                ],
            )


# --- reading the allocation inputs -----------------------------------------------------------


# The pending jobs of a workspace that could start now: every unkeyed one, and of each
# concurrency key only the first `limit - running` in claim order (store/ordering.py); a full
# key's waiting jobs are no demand for a provisioner, whatever it launched could not take them.
# Nor is anything of a paused workspace, nor a job past its queue deadline that the leader has
# not removed yet: no claim takes either (ordering.CLAIMABLE has the same two conditions).
def startable(workspace: str) -> str:
    """The pending rows (labels, enqueue time) of the workspace `workspace` (a SQL expression: a
    parameter, or a column of an enclosing query) that could start now."""
    can_start = f"""(expires_at IS NULL OR expires_at > now())
       AND NOT EXISTS (SELECT 1 FROM paused_workspaces WHERE workspace_id = {workspace})"""  # noqa: S608 -- the caller's expression
    return f"""
    SELECT required_labels, created_at FROM pending_jobs
     WHERE workspace_id = {workspace} AND concurrency_key IS NULL AND {can_start}
    UNION ALL
    SELECT required_labels, created_at FROM (
        SELECT p.required_labels, p.created_at, p.concurrency_limit - k.running AS room,
               row_number() OVER (PARTITION BY p.concurrency_key
                                  ORDER BY p.priority DESC, p.created_at, p.id) AS nth
          FROM pending_jobs p
          JOIN concurrency_keys k
            ON k.workspace_id = p.workspace_id AND k.concurrency_key = p.concurrency_key
         WHERE p.workspace_id = {workspace} AND p.concurrency_key IS NOT NULL AND {can_start}
       ) AS keyed
     WHERE nth <= room"""  # noqa: S608 -- interpolates constants and the caller's expression


_STARTABLE = startable("$1")


async def startable_demand(conn: Conn, workspace_id: UUID) -> list[DemandGroup]:
    """The workspace's demand groups of jobs that could start now (`_STARTABLE`)."""
    rows = await conn.fetch(
        f"""
        SELECT required_labels, count(*)::int AS count, min(created_at) AS at
          FROM ({_STARTABLE}) AS d GROUP BY required_labels
        """,  # noqa: S608 -- interpolates constants only: _STARTABLE
        workspace_id,
    )
    return [DemandGroup(tuple(r["required_labels"]), r["count"], r["at"]) for r in rows]


async def _demand_and_reservations(
    conn: Conn, workspace_id: UUID
) -> tuple[list[DemandGroup], list[Reservation]]:
    """The workspace's demand groups (jobs that could start now) and all its reservations, read
    by one statement."""
    rows = await conn.fetch(
        f"""
        SELECT 'demand' AS what, NULL::uuid AS id, NULL::uuid AS provisioner_id,
               required_labels, count(*)::int AS count, min(created_at) AS at, NULL::text AS kind
          FROM ({_STARTABLE}) AS d GROUP BY required_labels
        UNION ALL
        SELECT 'reservation', id, provisioner_id, required_labels, count, expires_at, kind
          FROM reservations WHERE workspace_id = $1
        """,  # noqa: S608 -- interpolates constants only: _STARTABLE
        workspace_id,
    )
    demand = [
        DemandGroup(tuple(r["required_labels"]), r["count"], r["at"])
        for r in rows
        if r["what"] == "demand"
    ]
    reservations = sorted(
        (
            Reservation(
                id=r["id"],
                workspace_id=workspace_id,
                provisioner_id=r["provisioner_id"],
                labels=tuple(r["required_labels"]),
                count=r["count"],
                kind=ReservationKind(r["kind"]),
                expires_at=r["at"],
            )
            for r in rows
            if r["what"] == "reservation"
        ),
        key=lambda r: r.id,
    )
    return demand, reservations


async def _own_live_reservations(
    conn: Conn, workspace_id: UUID, provisioner_id: UUID, now: datetime
) -> list[UUID]:
    """The ids of the provisioner's reservations in the workspace that are live at `now` (the
    round's time), in id order: the ones a round locks. Only the ids: the round reads every
    reservation of the workspace afresh once its locks are held."""
    rows = await conn.fetch(
        """
        SELECT id FROM reservations
         WHERE workspace_id = $1 AND provisioner_id = $2 AND expires_at > $3
         ORDER BY id
        """,
        workspace_id,
        provisioner_id,
        now,
    )
    return [r["id"] for r in rows]


async def reservations_by_id(conn: Conn, ids: Collection[UUID]) -> list[Reservation]:
    if not ids:
        return []
    rows = await conn.fetch(
        f"SELECT {RESERVATION_COLUMNS} FROM reservations WHERE id = ANY($1::uuid[])",  # noqa: S608 -- interpolates constants only: RESERVATION_COLUMNS
        list(ids),
    )
    return [reservation_from_row(r) for r in rows]


async def covering_labels(conn: Conn, workspace_id: UUID, window: timedelta) -> list[LabelSet]:
    """Label sets the workspace's own active provisioners advertised within `window`."""
    rows = await conn.fetch(
        """
        SELECT DISTINCT pt.labels
          FROM provisioner_templates pt
          JOIN provisioner_tokens t ON t.id = pt.provisioner_id
         WHERE pt.workspace_id = $1 AND t.scope = 'workspace' AND t.workspace_id = $1
           AND t.revoked_at IS NULL AND (t.expires_at IS NULL OR t.expires_at > now())
           AND pt.advertised_at > now() - $2::interval
        """,
        workspace_id,
        window,
    )
    return [tuple(r["labels"]) for r in rows]


async def read_inputs(
    conn: Conn,
    *,
    now: datetime,
    workspace_id: UUID,
    provisioner_id: UUID,
    scope: Scope,
    templates: Sequence[Template],
    max_reservations: int,
    launch_ttl: timedelta,
    activation_grace: timedelta,
    covering: Sequence[LabelSet],
) -> AllocationInputs:
    """Steps 3 to 5 of `domain.demand`: demand, the workspace's reservations with this
    provisioner's live ones locked (assignment keys, then rows in id order), its runners."""
    own = await _own_live_reservations(conn, workspace_id, provisioner_id, now)
    await lock_assignments(conn, provisioner_id, own)
    await hold_reservations(conn, own, provisioner_id=provisioner_id)
    # A fresh statement after the locks: the counts of this provisioner's rows are now stable.
    # Demand and reservations come from that one statement, so from one snapshot: a claim that
    # commits in between (taking a pending job and releasing its unit) is seen whole or not at
    # all, never as demand whose reservation is already gone (which would grant it again).
    demand, reservations = await _demand_and_reservations(conn, workspace_id)
    own_live = [r.id for r in reservations if r.provisioner_id == provisioner_id and r.is_live(now)]
    rows = await conn.fetch(
        f"""
        SELECT {RUNNER_COLUMNS} FROM runner_instances ri
         WHERE ri.provisioner_id = $1 AND ri.state IN {ACTIVE_SQL}
           AND ri.reservation_released_at IS NULL
           AND (ri.runner_session_id IS NULL OR ri.reservation_id = ANY($2::uuid[])
                OR ri.intended_reservation_id = ANY($2::uuid[]))
         ORDER BY ri.id
        """,  # noqa: S608 -- interpolates constants only: RUNNER_COLUMNS, ACTIVE_SQL
        provisioner_id,
        own_live,
    )
    runners = [runner_from_row(r) for r in rows]
    known = {r.id for r in reservations}
    referenced = {
        i for r in runners for i in (r.reservation_id, r.intended_reservation_id) if i is not None
    }
    reservations += await reservations_by_id(conn, referenced - known)
    return AllocationInputs(
        workspace_id=workspace_id,
        provisioner_id=provisioner_id,
        scope=scope,
        demand=demand,
        templates=templates,
        reservations=reservations,
        runners=runners,
        max_reservations=max_reservations,
        launch_ttl=launch_ttl,
        activation_grace=activation_grace,
        covering_labels=covering,
    )
