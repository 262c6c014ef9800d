"""Provider reports about runner instances (spec 4.8): one batch projected onto the rows.

The rules are `domain.reports` (which event wins, which reported reservation id a winner may
carry, which terminal winners release) and `domain.terminate_intents` (which `terminated`
reports answer a terminate intent); this module locks, reads their inputs and writes.

Every transaction here follows the global lock order of `store/reservations.py`, through
`store/runner_release.py`'s `lock_linked_runners` (assignment locks, then runner rows, never an
assignment lock while a runner row is held): the workspace lock, assignment locks, runner rows,
writes with reservation rows last. Step 3 of 4.8 (P-95) reads `store/ephemeral.py`'s tokens
without a lock. Metrics are the callers' job (they get the counts back).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from uuid import UUID

import msgspec

from controlplane.domain.labels import LabelSet
from controlplane.domain.provisioners import Provisioner
from controlplane.domain.reports import (
    MILESTONES,
    HonoredIntent,
    ReportOutcome,
    ReportWinner,
    RunnerEvent,
    adopt_pending,
    aggregate,
    fresh_terminal,
    reservation_verdicts,
    with_sessions,
    without_reservation,
)
from controlplane.domain.runner_instances import ProvisionedRunner, RunnerState
from controlplane.domain.terminate_intents import honored_reason
from controlplane.store import ephemeral
from controlplane.store.pool import Conn
from controlplane.store.reservations import ACTIVE_SQL, lock_workspace
from controlplane.store.runner_release import lock_linked_runners, release_terminal

# A state's rank in SQL (`RunnerState.rank`, from 1), for the upsert's projection rule.
_RANK = (
    "array_position(ARRAY["
    + ",".join(f"'{s.value}'" for s in sorted(RunnerState, key=lambda s: s.rank))
    + "], {})"
)
_MILESTONES = MILESTONES


async def report(
    conn: Conn,
    provisioner: Provisioner,
    events: Sequence[RunnerEvent],
    *,
    received_at: datetime,
    reserved_labels: LabelSet,
    activation_timeout: timedelta = timedelta(seconds=300),
) -> ReportOutcome:
    """Project a batch of provider reports onto runner instances (spec 4.8).

    Locks, in order: the workspace lock (`workspace ?? provisioner`) when any winner is terminal;
    the assignment locks of reported and stored reservation ids, then the existing rows, when any
    event carries a reservation id or is terminal (`lock_linked_runners`); the upsert's rows in
    provider-id order; the release's reservation rows. Step 3 (a workspace provisioner's
    runner is credited with the session of its latest consumed ephemeral token) takes no lock.
    `activation_timeout` only decides which honored terminate intents are reported as
    `activation-timeout`.
    """
    workspace_scope = provisioner.scope == "workspace"
    winners = aggregate(
        events, received_at=received_at, strip=reserved_labels if workspace_scope else ()
    )
    if not winners:
        return ReportOutcome(0, 0)
    any_terminal = any(w.event.state.is_terminal for w in winners.values())
    async with conn.transaction():
        if any_terminal:
            await lock_workspace(conn, provisioner.workspace_id or provisioner.id)
        if workspace_scope and provisioner.workspace_id is not None:  # step 3 (P-95)
            credited = await ephemeral.consumed_sessions(
                conn, provisioner.workspace_id, provisioner.id, list(winners)
            )
            winners = with_sessions(winners, credited)
        stored: dict[str, ProvisionedRunner] = {}
        if any_terminal or any(w.event.reservation_id for w in winners.values()):
            stored, winners = await _guard(conn, provisioner, winners)
        fresh = fresh_terminal(winners, stored)
        honored: tuple[HonoredIntent, ...] = ()
        terminated = [pid for pid, w in winners.items() if w.event.state is RunnerState.TERMINATED]
        if workspace_scope and terminated:
            honored = await _terminate_intents(conn, provisioner, terminated, activation_timeout)
        await _upsert(conn, provisioner, winners)
        released = 0
        if fresh:
            released = await release_terminal(
                conn,
                workspace_id=provisioner.workspace_id,
                provisioner_id=provisioner.id,
                provider_runner_ids=sorted(fresh),
                freshness=fresh,
                require_unlinked_session=False,
            )
    return ReportOutcome(len(winners), released, honored)


async def _guard(
    conn: Conn, provisioner: Provisioner, winners: Mapping[str, ReportWinner]
) -> tuple[dict[str, ProvisionedRunner], dict[str, ReportWinner]]:
    """Step 4 of 4.8: lock what the reported ids touch, then let `domain.reports` decide which
    reported reservation id each winner may carry. Returns the locked existing rows by provider
    id, and the winners with the refused ids dropped. A reported id is adopted only by a live,
    launch, own (and, for workspace scope, same-workspace) reservation with a pending unit;
    first in batch order wins."""
    reported = {w.event.reservation_id for w in winners.values()} - {None}
    existing = await conn.fetch(
        "SELECT id FROM runner_instances WHERE provisioner_id = $1"
        " AND provider_runner_id = ANY($2::text[])",
        provisioner.id,
        list(winners),
    )
    locked = await lock_linked_runners(
        conn,
        [row["id"] for row in existing],
        extra=[(provisioner.id, r) for r in reported if r is not None],
    )
    stored = {r.provider_runner_id: r for r in locked if r.provider_runner_id is not None}
    dropped, candidates = reservation_verdicts(winners, stored)
    if candidates:
        pending = await _pending_units(conn, provisioner, {r for _, r in candidates})
        dropped |= adopt_pending(candidates, pending)
    return stored, without_reservation(winners, dropped)


async def _pending_units(
    conn: Conn, provisioner: Provisioner, reservation_ids: set[UUID]
) -> dict[UUID, int]:
    """Pending units (spec 2.7) of the adoptable reservations among `reservation_ids`; the
    caller holds their assignment locks, so no concurrent change of links or counts."""
    rows = await conn.fetch(
        f"""
        SELECT r.id, r.count - (
                 SELECT count(*) FROM runner_instances ri
                  WHERE ri.provisioner_id = r.provisioner_id
                    AND ri.reservation_released_at IS NULL AND ri.state IN {ACTIVE_SQL}
                    AND (ri.reservation_id = r.id OR ri.intended_reservation_id = r.id)
               ) AS pending
          FROM reservations r
         WHERE r.id = ANY($1::uuid[]) AND r.provisioner_id = $2 AND r.kind = 'launch'
           AND r.expires_at > now() AND ($3::uuid IS NULL OR r.workspace_id = $3)
        """,  # noqa: S608 -- ACTIVE_SQL is a constant made from the domain's states
        sorted(reservation_ids),
        provisioner.id,
        provisioner.workspace_id,
    )
    return {row["id"]: max(0, row["pending"]) for row in rows}


async def _terminate_intents(
    conn: Conn,
    provisioner: Provisioner,
    provider_runner_ids: list[str],
    activation_timeout: timedelta,
) -> tuple[HonoredIntent, ...]:
    """Step 6 of 4.8 (rule of 3.6), read before the upsert: which `terminated` reports answer a
    terminate intent, i.e. which of these runners are still active and were told to stop (the
    candidates of `cp_terminate_candidates`, sql/0011, classified by `honored_reason`)."""
    rows = await conn.fetch(
        """
        SELECT t.provider_runner_id, t.timed_out, t.cancelled
          FROM cp_terminate_candidates($1, $2, $3) AS t
         WHERE t.provider_runner_id = ANY($4::text[])
         ORDER BY t.provider_runner_id
        """,
        provisioner.workspace_id,
        provisioner.id,
        activation_timeout,
        provider_runner_ids,
    )
    honored = []
    for row in rows:
        reason = honored_reason(timed_out=row["timed_out"], cancelled=row["cancelled"])
        if reason is not None:
            honored.append(HonoredIntent(row["provider_runner_id"], reason.value))
    return tuple(honored)


_PROJECTS = (
    f"({_RANK.format('excluded.state')} > {_RANK.format('ri.state')}"
    f" OR ({_RANK.format('excluded.state')} = {_RANK.format('ri.state')}"
    " AND excluded.reported_at >= ri.reported_at))"
)
_EARLIER_MILESTONE = " OR ".join(
    f"(excluded.{m} IS NOT NULL AND (ri.{m} IS NULL OR excluded.{m} < ri.{m}))" for m in _MILESTONES
)


def _projected(column: str, value: str) -> str:
    return f"{column} = CASE WHEN {_PROJECTS} THEN {value} ELSE ri.{column} END"


# A report without labels keeps the labels the runner declared at enrollment (ours: the spec
# overwrites them with the empty set, which makes an enrolled idle runner unbindable).
_LABELS_OR_KEPT = (
    "CASE WHEN cardinality(excluded.labels) > 0 THEN excluded.labels ELSE ri.labels END"
)

_UPSERT = f"""
    INSERT INTO runner_instances AS ri
        (provisioner_id, workspace_id, provider_runner_id, state, reported_at, reservation_id,
         template_key, labels, reason, runner_session_id, provider_kind, {", ".join(_MILESTONES)})
    SELECT $1, $2, e.provider_runner_id, e.state, e.reported_at, e.reservation_id,
           e.template_key, e.labels, e.reason, e.runner_session_id, e.provider_kind,
           {", ".join(f"e.{m}" for m in _MILESTONES)}
      FROM jsonb_to_recordset($3::jsonb) AS e(
           provider_runner_id text, state text, reported_at timestamptz, reservation_id uuid,
           template_key text, labels text[], reason text, runner_session_id uuid,
           provider_kind text, {", ".join(f"{m} timestamptz" for m in _MILESTONES)})
     ORDER BY e.provider_runner_id
    ON CONFLICT (provisioner_id, provider_runner_id) WHERE provider_runner_id IS NOT NULL
    DO UPDATE SET
        {_projected("reservation_id", "coalesce(ri.reservation_id, excluded.reservation_id)")},
        {_projected("template_key", "coalesce(excluded.template_key, ri.template_key)")},
        {_projected("labels", _LABELS_OR_KEPT)},
        {_projected("state", "excluded.state")},
        {_projected("reason", "excluded.reason")},
        {_projected("reported_at", "excluded.reported_at")},
        {_projected("runner_session_id", "coalesce(ri.runner_session_id, excluded.runner_session_id)")},
        {_projected("provider_kind", "coalesce(excluded.provider_kind, ri.provider_kind)")},
        {", ".join(f"{m} = least(ri.{m}, excluded.{m})" for m in _MILESTONES)},
        updated_at = now()
    WHERE {_PROJECTS} OR {_EARLIER_MILESTONE}
"""  # noqa: E501, S608 -- interpolates constants only: column lists and the rank expression


async def _upsert(
    conn: Conn, provisioner: Provisioner, winners: Mapping[str, ReportWinner]
) -> None:
    """Step 7 of 4.8. A row moves only to an equal-or-higher rank (same rank: not older), or
    learns an earlier milestone; workspace, launch kind, intended and assignment never change."""
    records = [
        {
            "provider_runner_id": pid,
            "state": w.event.state.value,
            "reported_at": w.event.reported_at,
            "reservation_id": w.event.reservation_id,
            "template_key": w.event.template_key,
            "labels": list(w.event.labels),
            "reason": w.event.reason,
            "runner_session_id": w.event.runner_session_id,
            "provider_kind": w.event.provider_kind,
            **w.milestones,
        }
        for pid, w in winners.items()
    ]
    await conn.execute(
        _UPSERT,
        provisioner.id,
        provisioner.workspace_id,
        msgspec.json.encode(records).decode(),
    )
