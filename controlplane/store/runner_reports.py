"""What happens to runner instances after launch: provider reports, reconcile, terminal release
and the stale runner reaper (spec 4.8-4.10, 4.12).

Every transaction here follows the global lock order of `store/reservations.py`:

1. the workspace advisory lock, one key (`workspace ?? provisioner`) or several in one sorted
   statement (the reaper);
2. assignment advisory locks, every (provisioner, reservation) pair in one sorted statement;
3. runner-instance rows `FOR UPDATE`, one per statement in id order;
4. writes, reservation rows last (`release_units`).

Steps 2 and 3 always go through `lock_linked_runners`: it reads the runners' reservation links,
locks their assignment keys, then the rows, and starts again from a savepoint if a link moved
in between, so no assignment lock is ever requested while one of our runner rows is held.
Reservation rows are never locked `FOR UPDATE` here: the assignment lock already serialises
every change of a reservation's count, and cleanup (which takes no advisory lock) locks runner
rows before reservation rows, as we do.

A runner's unit is released at most once: every release UPDATE re-checks
`reservation_released_at IS NULL` on a row we hold, and only the rows it updated give units back.
The workspace lock additionally serialises a terminal projection against the release of the same
runner by a report, reconcile or the reaper (P-48, P-49).

Step 3 of 4.8 (P-95) reads `store/ephemeral.py`'s tokens without a lock. Metrics are the
callers' job (they get the counts back).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING
from uuid import UUID

import msgspec

from controlplane.domain.jobs import EndedLease
from controlplane.domain.labels import LabelSet, canonicalise, strip_reserved
from controlplane.domain.runner_instances import (
    ProvisionedRunner,
    RunnerState,
    StaleRunnerRule,
    absent_and_stale,
    clamp_reported_at,
    report_supersedes,
)
from controlplane.errors import Conflict
from controlplane.store import ephemeral, locks
from controlplane.store.demand import CANCELLED_SQL, INTENT_ROWS_SQL, TIMED_OUT_SQL
from controlplane.store.pool import Conn
from controlplane.store.reservations import (
    db_now,
    load_runners,
    lock_runners,
    lock_workspace,
    lock_workspaces,
    release_units,
)

if TYPE_CHECKING:
    from controlplane.store.provisioners import Provisioner

_ACTIVE = "('starting', 'running', 'stopping')"
_TERMINAL = "('stopped', 'failed', 'terminated')"
_RANK = "array_position(ARRAY['starting','running','stopping','stopped','failed','terminated'], {})"
_MILESTONES = ("started_at", "stopping_at", "stopped_at", "failed_at", "terminated_at")
_MILESTONE_OF = {
    RunnerState.RUNNING: "started_at",
    RunnerState.STOPPING: "stopping_at",
    RunnerState.STOPPED: "stopped_at",
    RunnerState.FAILED: "failed_at",
    RunnerState.TERMINATED: "terminated_at",
}
_LINK_ATTEMPTS = 10


@dataclass(frozen=True, slots=True)
class RunnerEvent:
    """One provider report about one runner, as the provisioner sent it (times unclamped)."""

    provider_runner_id: str
    state: RunnerState
    reported_at: datetime
    reservation_id: UUID | None = None
    template_key: str | None = None
    labels: LabelSet = ()
    reason: str | None = None
    runner_session_id: UUID | None = None
    provider_kind: str | None = None


@dataclass(frozen=True, slots=True)
class HonoredIntent:
    provider_runner_id: str
    reason: str  # 'job-cancelled' or 'activation-timeout'


@dataclass(frozen=True, slots=True)
class ReportOutcome:
    accepted: int  # distinct provider runner ids
    reservations_released: int
    terminate_intents_honored: tuple[HonoredIntent, ...] = ()


@dataclass(frozen=True, slots=True)
class BoundJob:
    job_id: UUID
    job_execution_id: UUID
    workflow_run_attempt_id: UUID
    last_heartbeat_at: datetime
    cancellation_requested_at: datetime | None


@dataclass(frozen=True, slots=True)
class ObservedRunner:
    """Reconcile's answer for one observed id; `state` None: no row of ours in scope."""

    provider_runner_id: str
    state: RunnerState | None = None
    reservation_id: UUID | None = None
    intended_reservation_id: UUID | None = None  # only filled when asked for
    runner_session_id: UUID | None = None
    bound_job: BoundJob | None = None
    desired_intent: str = "keep"  # or 'terminate'
    intent_reason: str | None = None  # 'terminal-state' or 'job-cancelled'


@dataclass(frozen=True, slots=True)
class ReconcileOutcome:
    runners: tuple[ObservedRunner, ...]
    terminated_absent_provider_runner_ids: tuple[str, ...]
    reservations_released: int


@dataclass(frozen=True, slots=True)
class _Winner:
    """The event a batch settles on for one provider id, with every milestone it saw."""

    event: RunnerEvent
    milestones: dict[str, datetime] = field(default_factory=dict)


def _aggregate(
    events: Iterable[RunnerEvent], *, received_at: datetime, strip: LabelSet
) -> dict[str, _Winner]:
    """Step 1 of 4.8: one winner per provider id (highest rank, then latest clamped time). The
    winner keeps the reservation, template, session and provider kind of a losing event when it
    has none of its own (P-96), in whichever order the two arrived."""
    winners: dict[str, _Winner] = {}
    for raw in events:
        event = replace(
            raw,
            reported_at=clamp_reported_at(raw.reported_at, received_at),
            labels=strip_reserved(canonicalise(raw.labels), strip),
        )
        milestone = _MILESTONE_OF.get(event.state)
        found = winners.get(event.provider_runner_id)
        if found is None:
            winners[event.provider_runner_id] = _Winner(
                event, {milestone: event.reported_at} if milestone else {}
            )
            continue
        if milestone and (
            milestone not in found.milestones or event.reported_at < found.milestones[milestone]
        ):
            found.milestones[milestone] = event.reported_at
        current = found.event
        winner, loser = (
            (event, current)
            if report_supersedes(current.state, current.reported_at, event.state, event.reported_at)
            else (current, event)
        )
        merged = replace(
            winner,
            reservation_id=winner.reservation_id or loser.reservation_id,
            template_key=winner.template_key or loser.template_key,
            runner_session_id=winner.runner_session_id or loser.runner_session_id,
            provider_kind=winner.provider_kind or loser.provider_kind,
        )
        winners[event.provider_runner_id] = _Winner(merged, found.milestones)
    return winners


class _LinksMoved(Exception):
    pass


def _links(runners: Iterable[ProvisionedRunner]) -> set[tuple[UUID, UUID]]:
    return {
        (r.provisioner_id, link)
        for r in runners
        for link in (r.reservation_id, r.intended_reservation_id)
        if link is not None
    }


async def lock_linked_runners(
    conn: Conn, runner_ids: Iterable[UUID], *, extra: Iterable[tuple[UUID, UUID]] = ()
) -> list[ProvisionedRunner]:
    """Steps 2 and 3 of the lock order: the assignment locks of every (provisioner, reservation)
    the runners link to (plus `extra` pairs), in one sorted statement, then the runner rows in
    id order. If a row's links changed between the read and its lock, the savepoint is rolled
    back (dropping both kinds of lock) and the read starts again. Re-entrant within a
    transaction. Returns the locked rows as they are now, in id order."""
    ids = sorted(set(runner_ids))
    wanted = set(extra)
    for _ in range(_LINK_ATTEMPTS):
        pairs = wanted | _links(await load_runners(conn, ids))
        try:
            async with conn.transaction():
                keys = sorted({locks.assignment(p, r) for p, r in pairs})
                if keys:
                    await conn.execute(
                        "SELECT pg_advisory_xact_lock(k)"
                        " FROM unnest($1::bigint[]) WITH ORDINALITY AS t(k, n) ORDER BY n",
                        keys,
                    )
                locked = await lock_runners(conn, ids)
                if not _links(locked) <= pairs:
                    raise _LinksMoved
        except _LinksMoved:
            continue
        return locked
    raise Conflict("runner reservation links kept changing; retry", runner_ids=len(ids))


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
    winners = _aggregate(
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
            for pid, session_id in credited.items():
                w = winners[pid]
                winners[pid] = _Winner(replace(w.event, runner_session_id=session_id), w.milestones)
        stored: dict[str, ProvisionedRunner] = {}
        if any_terminal or any(w.event.reservation_id for w in winners.values()):
            stored = await _guard(conn, provisioner, winners)
        fresh = {
            pid: w.event.reported_at
            for pid, w in winners.items()
            if w.event.state.is_terminal
            and (pid not in stored or w.event.reported_at >= stored[pid].reported_at)
        }
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
    conn: Conn, provisioner: Provisioner, winners: dict[str, _Winner]
) -> dict[str, ProvisionedRunner]:
    """Step 4 of 4.8: lock what the reported ids touch and decide which reported reservation id
    each winner may carry (rewriting `winners`). Returns the locked existing rows by provider
    id. A reported id is adopted only by a live, launch, own (and, for workspace scope,
    same-workspace) reservation with a pending unit; first in batch order wins."""
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
    candidates: list[tuple[str, UUID]] = []
    for pid, winner in winners.items():
        wanted = winner.event.reservation_id
        if wanted is None:
            continue
        row = stored.get(pid)
        keep: bool
        if winner.event.state.is_terminal:
            keep = row is not None and wanted in (row.reservation_id, row.intended_reservation_id)
        elif row is not None and (
            row.released
            or not report_supersedes(
                row.state, row.reported_at, winner.event.state, winner.event.reported_at
            )
        ):
            keep = False  # released, or a report that will not be projected
        elif row is not None and row.intended_reservation_id is not None:
            keep = row.intended_reservation_id == wanted
        elif row is not None and row.reservation_id is not None:
            keep = row.reservation_id == wanted
        else:
            candidates.append((pid, wanted))
            continue
        if not keep:
            _set_reservation(winners, pid, None)
    if candidates:
        pending = await _pending_units(conn, provisioner, {r for _, r in candidates})
        for pid, wanted in candidates:
            if pending.get(wanted, 0) > 0:
                pending[wanted] -= 1
            else:
                _set_reservation(winners, pid, None)
    return stored


def _set_reservation(winners: dict[str, _Winner], pid: str, value: UUID | None) -> None:
    found = winners[pid]
    winners[pid] = _Winner(replace(found.event, reservation_id=value), found.milestones)


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
                    AND ri.reservation_released_at IS NULL AND ri.state IN {_ACTIVE}
                    AND (ri.reservation_id = r.id OR ri.intended_reservation_id = r.id)
               ) AS pending
          FROM reservations r
         WHERE r.id = ANY($1::uuid[]) AND r.provisioner_id = $2 AND r.kind = 'launch'
           AND r.expires_at > now() AND ($3::uuid IS NULL OR r.workspace_id = $3)
        """,
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
    terminate intent, i.e. which of these runners are still active and were told to stop."""
    rows = await conn.fetch(
        f"""
        SELECT ri.provider_runner_id, {TIMED_OUT_SQL} AS timed_out, {CANCELLED_SQL} AS cancelled
        {INTENT_ROWS_SQL} AND ri.provider_runner_id = ANY($4::text[])
         ORDER BY ri.provider_runner_id
        """,
        provisioner.workspace_id,
        provisioner.id,
        activation_timeout,
        provider_runner_ids,
    )
    return tuple(
        HonoredIntent(
            row["provider_runner_id"], "activation-timeout" if row["timed_out"] else "job-cancelled"
        )
        for row in rows
        if row["timed_out"] or row["cancelled"]
    )


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
"""  # noqa: E501


async def _upsert(conn: Conn, provisioner: Provisioner, winners: dict[str, _Winner]) -> None:
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


async def release_terminal(
    conn: Conn,
    *,
    workspace_id: UUID | None,
    provisioner_id: UUID,
    provider_runner_ids: Sequence[str] = (),
    runner_instance_ids: Sequence[UUID] = (),
    freshness: Mapping[str, datetime] | None = None,
    require_unlinked_session: bool = True,
    require_terminal_state: bool = True,
) -> int:
    """Give back the reservation unit of each matching finished runner, once (spec 4.10).

    A runner qualifies when it is terminal (checked after its row lock even when
    `require_terminal_state` is false: that flag only widens which rows are locked, so lease
    finalisation sees a terminal report that committed meanwhile), unreleased, linked to a
    reservation, has no uncancelled lease for (provisioner, provider id), has no runner session
    when `require_unlinked_session`, was not reported after its `freshness` time, and, when
    `workspace_id` is given, its reservation belongs to that workspace. The unit goes to the
    intended reservation when it exists, else the assigned one; an expired or deleted one
    credits 0 but the runner is still marked released. Returns the units given back.

    Locks: the assignment locks of the rows' links, then the rows (`lock_linked_runners`), then
    the reservation rows (`release_units`). Callers may already hold a workspace lock.
    """
    async with conn.transaction():
        found = await conn.fetch(
            f"""
            SELECT id FROM runner_instances
             WHERE provisioner_id = $1
               AND (provider_runner_id = ANY($2::text[]) OR id = ANY($3::uuid[]))
               AND reservation_released_at IS NULL
               AND (reservation_id IS NOT NULL OR intended_reservation_id IS NOT NULL)
               AND (NOT $4 OR state IN {_TERMINAL})
            """,
            provisioner_id,
            list(provider_runner_ids),
            list(runner_instance_ids),
            require_terminal_state,
        )
        if not found:
            return 0
        await lock_linked_runners(conn, [row["id"] for row in found])
        fresh_ids = sorted(freshness or {})
        eligible = await conn.fetch(
            f"""
            SELECT ri.id, coalesce(i.id, a.id) AS target, coalesce(i.workspace_id, a.workspace_id)
                   AS target_workspace
              FROM runner_instances ri
              LEFT JOIN reservations i ON i.id = ri.intended_reservation_id
                   AND i.provisioner_id = ri.provisioner_id
                   AND ($2::uuid IS NULL OR i.workspace_id = $2)
              LEFT JOIN reservations a ON a.id = ri.reservation_id
                   AND a.provisioner_id = ri.provisioner_id
                   AND ($2::uuid IS NULL OR a.workspace_id = $2)
              LEFT JOIN unnest($5::text[], $6::timestamptz[]) AS f(provider_runner_id, at)
                   ON f.provider_runner_id = ri.provider_runner_id
             WHERE ri.id = ANY($1::uuid[]) AND ri.provisioner_id = $3
               AND ri.state IN {_TERMINAL}
               AND ri.reservation_released_at IS NULL
               AND (ri.reservation_id IS NOT NULL OR ri.intended_reservation_id IS NOT NULL)
               AND (NOT $4 OR ri.runner_session_id IS NULL)
               AND (NOT $7 OR ri.reported_at <= f.at)
               AND NOT EXISTS (
                   SELECT 1 FROM running_jobs j
                    WHERE j.provisioner_id = ri.provisioner_id
                      AND j.provider_runner_id = ri.provider_runner_id
                      AND j.cancellation_requested_at IS NULL)
               AND ($2::uuid IS NULL
                    OR (ri.workspace_id = $2 AND (i.id IS NOT NULL OR a.id IS NOT NULL))
                    OR (ri.workspace_id IS NULL AND i.id IS NOT NULL))
            """,
            [row["id"] for row in found],
            workspace_id,
            provisioner_id,
            require_unlinked_session,
            fresh_ids,
            [(freshness or {})[pid] for pid in fresh_ids],
            freshness is not None,
        )
        if not eligible:
            return 0
        updated = {
            row["id"]
            for row in await conn.fetch(
                """
                UPDATE runner_instances
                   SET intended_reservation_id = NULL, reservation_released_at = now(),
                       updated_at = now()
                 WHERE id = ANY($1::uuid[]) AND reservation_released_at IS NULL
                RETURNING id
                """,
                [row["id"] for row in eligible],
            )
        }
        units: dict[UUID, Counter[UUID]] = defaultdict(Counter)
        for row in eligible:
            if row["id"] in updated and row["target"] is not None:
                units[row["target_workspace"]][row["target"]] += 1
        released = 0
        for target_workspace in sorted(units):
            released += await release_units(
                conn, target_workspace, provisioner_id, units[target_workspace]
            )
        return released


async def reconcile(
    conn: Conn,
    provisioner: Provisioner,
    observed_ids: Sequence[str],
    *,
    grace: timedelta,
    include_intended: bool = False,
) -> ReconcileOutcome:
    """Terminate the provisioner's active runners it no longer observes (once silent for
    `grace`) and describe the observed ones (spec 4.9). An empty observed set only reads.

    Scope: a workspace provisioner sees rows of its workspace, an installation one only
    workspace-neutral rows. Locks: the workspace lock (`workspace ?? provisioner`), then the
    absent candidates' assignment locks and rows (`lock_linked_runners`), then the release's
    reservation rows. A report that made a candidate fresh after it was selected wins: the
    staleness is checked again on the locked row and in the UPDATE (P-51).
    """
    observed = list(dict.fromkeys(observed_ids))
    workspace_id = provisioner.workspace_id
    terminated: list[str] = []
    released = 0
    async with conn.transaction():
        await lock_workspace(conn, workspace_id or provisioner.id)
        if observed:
            now = await db_now(conn)
            candidates = await conn.fetch(
                f"""
                SELECT id FROM runner_instances
                 WHERE provisioner_id = $1 AND workspace_id IS NOT DISTINCT FROM $2
                   AND state IN {_ACTIVE} AND provider_runner_id IS NOT NULL
                   AND provider_runner_id <> ALL($3::text[]) AND reported_at < $4
                """,
                provisioner.id,
                workspace_id,
                observed,
                now - grace,
            )
            locked = await lock_linked_runners(conn, [row["id"] for row in candidates])
            absent = [
                r.id
                for r in locked
                if r.workspace_id == workspace_id
                and absent_and_stale(r, set(observed), now=now, grace=grace)
            ]
            if absent:
                rows = await conn.fetch(
                    f"""
                    UPDATE runner_instances
                       SET state = 'terminated', terminated_at = coalesce(terminated_at, now()),
                           updated_at = now()
                     WHERE id = ANY($1::uuid[]) AND state IN {_ACTIVE} AND reported_at < $2
                    RETURNING id, provider_runner_id
                    """,
                    absent,
                    now - grace,
                )
                terminated = sorted(row["provider_runner_id"] for row in rows)
                released = await release_terminal(
                    conn,
                    workspace_id=workspace_id,
                    provisioner_id=provisioner.id,
                    runner_instance_ids=[row["id"] for row in rows],
                    require_unlinked_session=False,
                )
        runners = await _observed(conn, provisioner, observed, include_intended=include_intended)
    return ReconcileOutcome(runners, tuple(terminated), released)


async def _observed(
    conn: Conn, provisioner: Provisioner, observed: list[str], *, include_intended: bool
) -> tuple[ObservedRunner, ...]:
    """Steps 3-4 of 4.9: per observed id in request order, its row in scope (unknown ids get
    nulls, so no other scope's rows leak) and, for workspace scope, its newest lease."""
    rows = await conn.fetch(
        """
        SELECT provider_runner_id, state, reservation_id, intended_reservation_id,
               runner_session_id
          FROM runner_instances
         WHERE provisioner_id = $1 AND workspace_id IS NOT DISTINCT FROM $2
           AND provider_runner_id = ANY($3::text[])
        """,
        provisioner.id,
        provisioner.workspace_id,
        observed,
    )
    jobs: dict[str, BoundJob] = {}
    if provisioner.workspace_id is not None:
        for job in await conn.fetch(
            """
            SELECT DISTINCT ON (provider_runner_id) provider_runner_id, job_id, job_execution_id,
                   workflow_run_attempt_id, last_heartbeat_at, cancellation_requested_at
              FROM running_jobs
             WHERE workspace_id = $1 AND provisioner_id = $2
               AND provider_runner_id = ANY($3::text[])
             ORDER BY provider_runner_id, started_at DESC, job_execution_id DESC
            """,
            provisioner.workspace_id,
            provisioner.id,
            observed,
        ):
            jobs[job["provider_runner_id"]] = BoundJob(
                job_id=job["job_id"],
                job_execution_id=job["job_execution_id"],
                workflow_run_attempt_id=job["workflow_run_attempt_id"],
                last_heartbeat_at=job["last_heartbeat_at"],
                cancellation_requested_at=job["cancellation_requested_at"],
            )
    by_id = {row["provider_runner_id"]: row for row in rows}
    answers = []
    for pid in observed:
        row = by_id.get(pid)
        if row is None:
            answers.append(ObservedRunner(pid))
            continue
        state = RunnerState(row["state"])
        bound = jobs.get(pid)
        reason = (
            "terminal-state"
            if state.is_terminal
            else "job-cancelled"
            if bound is not None and bound.cancellation_requested_at is not None
            else None
        )
        answers.append(
            ObservedRunner(
                provider_runner_id=pid,
                state=state,
                reservation_id=row["reservation_id"],
                intended_reservation_id=row["intended_reservation_id"]
                if include_intended
                else None,
                runner_session_id=row["runner_session_id"],
                bound_job=bound,
                desired_intent="keep" if reason is None else "terminate",
                intent_reason=reason,
            )
        )
    return tuple(answers)


# Active, silent since the cutoff ($1), provisioner silent too, and no lease or recently active
# runner session for its provider identity. Leases and sessions are matched on (provisioner,
# provider id) alone: the reference also compared workspace_id with `=`, which never protected
# a workspace-neutral row (spec 9.15).
_STALE = f"""
    ri.state IN {_ACTIVE} AND ri.reported_at < $1 AND ri.updated_at < $1
    AND NOT EXISTS (SELECT 1 FROM provisioner_tokens pt
                     WHERE pt.id = ri.provisioner_id AND pt.last_seen_at >= $1)
    AND NOT EXISTS (SELECT 1 FROM running_jobs j
                     WHERE j.provisioner_id = ri.provisioner_id
                       AND j.provider_runner_id = ri.provider_runner_id)
    AND NOT EXISTS (SELECT 1 FROM runner_sessions s
                     WHERE s.provisioner_id = ri.provisioner_id
                       AND s.provider_runner_id = ri.provider_runner_id
                       AND s.updated_at >= $1)
"""
_DRAINABLE = f"""
    ri.state IN {_TERMINAL} AND ri.runner_session_id IS NOT NULL AND ri.updated_at < $1
    AND ri.reservation_released_at IS NULL
    AND (ri.reservation_id IS NOT NULL OR ri.intended_reservation_id IS NOT NULL)
"""


async def reap_stale_runners(conn: Conn, *, threshold: timedelta, limit: int) -> tuple[int, int]:
    """Fail (`stale-provisioner`) up to `limit` active runners that neither they nor their
    provisioner were heard from within `threshold`, oldest `updated_at` first, and release their
    units; when there are none, release up to `limit` finished session-linked runners that still
    hold a unit (spec 4.12). Returns (reaped, units released).

    Locks: the workspace locks of every picked row, both `workspace ?? provisioner` of the row
    and of its provisioner's scope (so reports and reconciles of either key are serialised), in
    one sorted statement; then the rows' assignment locks and rows (`lock_linked_runners`); then
    the release's reservation rows. The UPDATE re-applies the staleness predicate.
    """
    rule = StaleRunnerRule(threshold)
    async with conn.transaction():
        now = await db_now(conn)
        cutoff = rule.cutoff(now)
        pick = """
            SELECT ri.id, ri.provisioner_id, ri.workspace_id, pt.workspace_id AS scope_workspace
              FROM runner_instances ri JOIN provisioner_tokens pt ON pt.id = ri.provisioner_id
             WHERE {} ORDER BY ri.updated_at, ri.id LIMIT $2
        """
        picked = await conn.fetch(pick.format(_STALE), cutoff, limit)
        draining = not picked
        if draining:
            picked = await conn.fetch(pick.format(_DRAINABLE), cutoff, limit)
        if not picked:
            return 0, 0
        await lock_workspaces(
            conn,
            {row["workspace_id"] or row["provisioner_id"] for row in picked}
            | {row["scope_workspace"] or row["provisioner_id"] for row in picked},
        )
        locked = await lock_linked_runners(conn, [row["id"] for row in picked])
        if draining:
            chosen = [(r.id, r.provisioner_id) for r in locked if rule.is_drainable(r, now=now)]
            reaped = 0
        else:
            rows = await conn.fetch(
                f"""
                UPDATE runner_instances ri
                   SET state = 'failed', reason = 'stale-provisioner',
                       failed_at = coalesce(ri.failed_at, now()), updated_at = now()
                 WHERE ri.id = ANY($2::uuid[]) AND {_STALE}
                RETURNING ri.id, ri.provisioner_id
                """,
                cutoff,
                [r.id for r in locked],
            )
            chosen = [(row["id"], row["provisioner_id"]) for row in rows]
            reaped = len(chosen)
        by_provisioner: dict[UUID, list[UUID]] = defaultdict(list)
        for runner_id, provisioner_id in chosen:
            by_provisioner[provisioner_id].append(runner_id)
        released = 0
        for provisioner_id in sorted(by_provisioner):
            # No workspace filter: maintenance acts for nobody, and a dangling reservation must
            # still mark the runner released or the drain would pick it again every run.
            released += await release_terminal(
                conn,
                workspace_id=None,
                provisioner_id=provisioner_id,
                runner_instance_ids=by_provisioner[provisioner_id],
                require_unlinked_session=False,
            )
    return reaped, released


async def release_after_leases(conn: Conn, ended: Sequence[EndedLease]) -> int:
    """Lease finalisation (spec 4.14): when the lease of a provisioned runner ended (reaped,
    or ended by the orchestrator), release the runner's reservation unit if the runner is
    terminal by now and still holds it (`release_terminal` with `require_terminal_state=False`:
    lock, then re-check terminal; a unit released at first claim is not released again). Each
    lease in its own transaction, after the lease's own transaction committed: a crash in
    between leaves the unit to the stale reaper's drain or the reservation's expiry."""
    released = 0
    for lease in ended:
        if lease.provisioner_id is None or lease.provider_runner_id is None:
            continue
        released += await release_terminal(
            conn,
            workspace_id=lease.identity.workspace_id,
            provisioner_id=lease.provisioner_id,
            provider_runner_ids=[lease.provider_runner_id],
            require_unlinked_session=False,
            require_terminal_state=False,
        )
    return released
