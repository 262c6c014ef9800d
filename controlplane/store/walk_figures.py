"""The demand figures of an installation walk's workspaces, many in one statement: what their
allocation rounds would report (spec 3.3 step 7) when the walk can give them nothing.

An installation walk (actors/provisioning/rounds.py) runs one transaction per workspace while a
workspace may be granted or bound something. Once a template of the provisioner has no slot
left (or the fair share leaves nothing), it reads the figures of the rest of its list here, in
one statement, and runs a transaction only for a workspace whose figures show a demand group
with unreserved units that a template with a slot left could take; the others report these
figures. They are `domain.demand.allocate` over the same inputs a round reads (startable
demand, the workspace's live reservations, the labels its own provisioners cover) with no
budget, so they are the stats the round would have reported, as of this statement's snapshot.

Takes no lock: a read of one snapshot, demand and reservations together (as the round's own
read, `store/demand_inputs.py`), so a claim that commits meanwhile is seen whole or not at all.
"""

from __future__ import annotations

from collections.abc import Sequence
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
    allocate,
)
from controlplane.domain.labels import LabelSet, canonicalise
from controlplane.domain.rounds import WorkspaceRound
from controlplane.store.demand_inputs import startable
from controlplane.store.demand_list import FINGERPRINT
from controlplane.store.pool import Conn

# One statement for workspaces $1: their startable demand groups (the round's own `startable`,
# its workspace the lateral's), their live reservations, the label sets their own active
# workspace provisioners advertised within window $2 (NULL: none; `covering_labels`), the
# fingerprint of their live reservations (`WalkEntry.reservations`), and the database's clock.
_FIGURES = f"""
SELECT 'demand' AS what, w.workspace_id, d.required_labels AS labels, count(*)::int AS count,
       min(d.created_at) AS at, NULL::uuid AS id, NULL::uuid AS provisioner_id, NULL::text AS kind
  FROM unnest($1::uuid[]) AS w(workspace_id)
 CROSS JOIN LATERAL ({startable("w.workspace_id")}) AS d
 GROUP BY w.workspace_id, d.required_labels
UNION ALL
SELECT 'reservation', r.workspace_id, r.required_labels, r.count, r.expires_at, r.id,
       r.provisioner_id, r.kind::text
  FROM reservations r
 WHERE r.workspace_id = ANY($1::uuid[]) AND r.expires_at > now()
UNION ALL
SELECT DISTINCT 'covering', pt.workspace_id, pt.labels, NULL::int, NULL::timestamptz, NULL::uuid,
       NULL::uuid, NULL::text
  FROM provisioner_templates pt
  JOIN provisioner_tokens t ON t.id = pt.provisioner_id
 WHERE $2::interval IS NOT NULL AND pt.workspace_id = ANY($1::uuid[])
   AND t.scope = 'workspace' AND t.workspace_id = pt.workspace_id
   AND t.revoked_at IS NULL AND (t.expires_at IS NULL OR t.expires_at > now())
   AND pt.advertised_at > now() - $2::interval
UNION ALL
SELECT 'fingerprint', w.workspace_id, NULL, NULL, NULL, NULL, NULL,
       ({FINGERPRINT.format(workspace="w.workspace_id")})
  FROM unnest($1::uuid[]) AS w(workspace_id)
UNION ALL
SELECT 'now', NULL, NULL, NULL, now(), NULL, NULL, NULL
"""  # noqa: S608 -- interpolates constants only: startable(), FINGERPRINT


async def walk_figures(
    conn: Conn,
    *,
    provisioner_id: UUID,
    workspace_ids: Sequence[UUID],
    templates: Sequence[Template],
    launch_ttl: timedelta,
    activation_grace: timedelta,
    covering_window: timedelta | None,
) -> list[WorkspaceRound]:
    """The figures of `workspace_ids`, in their order, as rounds that granted and bound nothing
    (`covered` False). Each carries the fingerprint of the workspace's live reservations in the
    same snapshot (`reservations`), so the walk may carry the figures to a later round while
    the fingerprint and the workspace's notifications say nothing changed
    (actors/provisioning/changes.py); None where the workspace's own provisioners cover some
    of its demand, which changes with time alone. Takes no lock."""
    if not workspace_ids:
        return []
    rows = await conn.fetch(_FIGURES, list(workspace_ids), covering_window)
    now: datetime | None = None
    demand: dict[UUID, list[DemandGroup]] = {w: [] for w in workspace_ids}
    reservations: dict[UUID, list[Reservation]] = {w: [] for w in workspace_ids}
    covering: dict[UUID, list[LabelSet]] = {w: [] for w in workspace_ids}
    fingerprints: dict[UUID, int] = {}
    for r in rows:
        what, workspace_id, labels = r["what"], r["workspace_id"], tuple(r["labels"] or ())
        if what == "now":
            now = r["at"]
        elif what == "fingerprint":
            fingerprints[workspace_id] = int(r["kind"])
        elif what == "demand":
            demand[workspace_id].append(DemandGroup(labels, r["count"], r["at"]))
        elif what == "reservation":
            reservations[workspace_id].append(
                Reservation(
                    id=r["id"],
                    workspace_id=workspace_id,
                    provisioner_id=r["provisioner_id"],
                    labels=labels,
                    count=r["count"],
                    kind=ReservationKind(r["kind"]),
                    expires_at=r["at"],
                )
            )
        else:
            covering[workspace_id].append(labels)
    assert now is not None
    canonical = tuple(replace(t, labels=canonicalise(t.labels)) for t in templates)
    figures = []
    for workspace_id in workspace_ids:
        inputs = AllocationInputs(
            workspace_id=workspace_id,
            provisioner_id=provisioner_id,
            scope=Scope.INSTALLATION,
            demand=demand[workspace_id],
            templates=canonical,
            reservations=sorted(reservations[workspace_id], key=lambda r: r.id),
            runners=(),
            max_reservations=0,
            launch_ttl=launch_ttl,
            activation_grace=activation_grace,
            covering_labels=covering[workspace_id],
        )
        allocation = allocate(inputs, now=now)
        fingerprint = None if covering[workspace_id] else fingerprints[workspace_id]
        figures.append(
            WorkspaceRound(
                workspace_id, allocation, grants=(), bound=0, rebound=0, reservations=fingerprint
            )
        )
    return figures
