"""Demand allocation over PostgreSQL: advertised templates, one allocation round per workspace,
one workspace of an installation walk, terminate intents, and reservation cleanup.

The decisions are `domain.demand.allocate` and `domain.binding.is_bindable`; this module reads
their inputs under the locks that make them true, and writes their outputs. The lock order of
every transaction here is the global one of `store/reservations.py`; each function says which
locks it takes. Reservation cleanup is the one exception the global order allows (runner rows
before reservation rows), and the reason the two cannot deadlock is in its docstring.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from uuid import UUID

from controlplane.domain.binding import BindTarget, Scope, is_bindable
from controlplane.domain.demand import (
    Allocation,
    AllocationInputs,
    DemandGroup,
    Reservation,
    ReservationKind,
    Template,
    allocate,
    live_reservation_ids,
    without_pending,
)
from controlplane.domain.labels import LabelSet, canonicalise
from controlplane.domain.runner_instances import activation_timed_out
from controlplane.errors import Conflict
from controlplane.store.pool import Conn
from controlplane.store.reservations import (
    RESERVATION_COLUMNS,
    RUNNER_COLUMNS,
    db_now,
    load_runners,
    lock_assignments,
    lock_reservations,
    lock_runners,
    lock_workspace,
    notify_assigned,
    outstanding_grants,
    reservation_from_row,
    runner_from_row,
    try_lock_workspace,
)

_ACTIVE = "('starting', 'running', 'stopping')"


class TerminateReason(enum.StrEnum):
    JOB_CANCELLED = "job-cancelled"
    ACTIVATION_TIMEOUT = "activation-timeout"


@dataclass(frozen=True, slots=True)
class TerminateIntent:
    provider_runner_id: str
    reason: TerminateReason
    retry: bool  # an activation timeout already delivered (its unit was released then)


@dataclass(frozen=True, slots=True)
class Grant:
    """A launch reservation as the provisioner is told of it."""

    reservation_id: UUID
    workspace_id: UUID
    labels: LabelSet
    count: int
    expires_at: datetime


@dataclass(frozen=True, slots=True)
class WorkspaceRound:
    """What one allocation transaction for one workspace committed."""

    workspace_id: UUID
    allocation: Allocation
    grants: tuple[Grant, ...]
    bound: int  # runners bound to bound reservations
    rebound: int  # of those, runners launched for demand (activation outcome metric)
    terminate_intents: tuple[TerminateIntent, ...] = ()
    terminate_truncated: bool = False


class BindingMismatch(Conflict):
    """The bind UPDATE matched fewer runners than were locked and re-checked: a bug, not a race
    (the locks exclude every writer), so the whole round rolls back."""

    code = "binding-mismatch"


class _StaleCandidate(Exception):
    """A locked idle runner failed the fresh re-check: roll back the savepoint and reallocate."""


# --- templates ----------------------------------------------------------------------------------


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


async def _demand_and_reservations(
    conn: Conn, workspace_id: UUID
) -> tuple[list[DemandGroup], list[Reservation]]:
    """The workspace's demand groups and all its reservations, read by one statement."""
    rows = await conn.fetch(
        """
        SELECT 'demand' AS what, NULL::uuid AS id, NULL::uuid AS provisioner_id,
               required_labels, count(*)::int AS count, min(created_at) AS at, NULL::text AS kind
          FROM pending_jobs WHERE workspace_id = $1 GROUP BY required_labels
        UNION ALL
        SELECT 'reservation', id, provisioner_id, required_labels, count, expires_at, kind
          FROM reservations WHERE workspace_id = $1
        """,
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


async def _workspace_reservations(conn: Conn, workspace_id: UUID) -> list[Reservation]:
    rows = await conn.fetch(
        f"SELECT {RESERVATION_COLUMNS} FROM reservations WHERE workspace_id = $1 ORDER BY id",
        workspace_id,
    )
    return [reservation_from_row(r) for r in rows]


async def _reservations_by_id(conn: Conn, ids: Collection[UUID]) -> list[Reservation]:
    if not ids:
        return []
    rows = await conn.fetch(
        f"SELECT {RESERVATION_COLUMNS} FROM reservations WHERE id = ANY($1::uuid[])", list(ids)
    )
    return [reservation_from_row(r) for r in rows]


async def _covering_labels(conn: Conn, workspace_id: UUID, window: timedelta) -> list[LabelSet]:
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


async def _inputs(
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
    seen = await _workspace_reservations(conn, workspace_id)
    own = [r.id for r in seen if r.provisioner_id == provisioner_id and r.is_live(now)]
    await lock_assignments(conn, provisioner_id, own)
    await lock_reservations(conn, own, provisioner_id=provisioner_id)
    # A fresh statement after the locks: the counts of this provisioner's rows are now stable.
    # Demand and reservations come from that one statement, so from one snapshot: a claim that
    # commits in between (taking a pending job and releasing its unit) is seen whole or not at
    # all, never as demand whose reservation is already gone (which would grant it again).
    demand, reservations = await _demand_and_reservations(conn, workspace_id)
    own_live = [r.id for r in reservations if r.provisioner_id == provisioner_id and r.is_live(now)]
    rows = await conn.fetch(
        f"""
        SELECT {RUNNER_COLUMNS} FROM runner_instances ri
         WHERE ri.provisioner_id = $1 AND ri.state IN {_ACTIVE}
           AND ri.reservation_released_at IS NULL
           AND (ri.runner_session_id IS NULL OR ri.reservation_id = ANY($2::uuid[])
                OR ri.intended_reservation_id = ANY($2::uuid[]))
         ORDER BY ri.id
        """,
        provisioner_id,
        own_live,
    )
    runners = [runner_from_row(r) for r in rows]
    known = {r.id for r in reservations}
    referenced = {
        i for r in runners for i in (r.reservation_id, r.intended_reservation_id) if i is not None
    }
    reservations += await _reservations_by_id(conn, referenced - known)
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


# --- binding -------------------------------------------------------------------------------------


async def _lock_and_recheck(
    conn: Conn,
    allocation: Allocation,
    inputs: AllocationInputs,
    extra: Collection[UUID],
    now: datetime,
) -> None:
    """Lock the runners to bind (and `extra`, the activation-timeout candidates) one by one in
    ascending id, then re-check the bound ones on a fresh read. Raises _StaleCandidate."""
    await lock_runners(conn, set(allocation.bound_runner_ids) | set(extra))
    labels_of = {i: r.labels for r in allocation.reservations for i in r.runner_ids}
    if not labels_of:
        return
    # A row lock that waited re-reads the row, not what the row refers to: read both afresh.
    fresh = await load_runners(conn, sorted(labels_of))
    referenced = {
        i for r in fresh for i in (r.reservation_id, r.intended_reservation_id) if i is not None
    }
    live = live_reservation_ids(await _reservations_by_id(conn, referenced), now)
    if len(fresh) != len(labels_of):
        raise _StaleCandidate
    for runner in fresh:
        target = BindTarget(
            inputs.provisioner_id, inputs.workspace_id, inputs.scope, labels_of[runner.id]
        )
        if not is_bindable(runner, target, live=live, now=now):
            raise _StaleCandidate


async def _bind(
    conn: Conn,
    *,
    workspace_id: UUID,
    provisioner_id: UUID,
    scope: Scope,
    labels: LabelSet,
    count: int,
    grace: timedelta,
    runner_ids: Sequence[UUID],
) -> None:
    reservation_id = await conn.fetchval(
        """
        INSERT INTO reservations (workspace_id, provisioner_id, required_labels, count, kind,
                                  expires_at)
        VALUES ($1, $2, $3, $4, 'bound', now() + $5::interval) RETURNING id
        """,
        workspace_id,
        provisioner_id,
        list(labels),
        count,
        grace,
    )
    await conn.execute(
        """
        UPDATE runner_activation_tokens SET revoked_at = now()
         WHERE runner_instance_id = ANY($1::uuid[]) AND consumed_at IS NULL AND revoked_at IS NULL
        """,
        list(runner_ids),
    )
    # The binding predicate of spec 3.4, repeated: the rows are locked, so it must still hold.
    status = await conn.execute(
        """
        UPDATE runner_instances ri
           SET workspace_id = $2, reservation_id = $3, intended_reservation_id = NULL,
               assigned_at = now(), updated_at = now()
         WHERE ri.id = ANY($1::uuid[]) AND ri.provisioner_id = $4 AND ri.state = 'running'
           AND ri.provider_runner_id IS NOT NULL AND ri.labels @> $5::text[]
           AND ri.runner_session_id IS NULL AND ri.reservation_released_at IS NULL
           AND EXISTS (SELECT 1 FROM runner_control_sessions cs
                        WHERE cs.runner_instance_id = ri.id
                          AND cs.provisioner_id = ri.provisioner_id
                          AND cs.closed_at IS NULL AND cs.expires_at > now())
           AND ((ri.workspace_id IS NULL AND ri.reservation_id IS NULL)
                OR (ri.reservation_id IS NOT NULL
                    AND NOT EXISTS (SELECT 1 FROM reservations r
                                     WHERE r.id = ri.reservation_id AND r.expires_at > now())
                    AND ($6 OR ri.workspace_id IS NULL OR ri.workspace_id = $2)))
           AND (ri.intended_reservation_id IS NULL
                OR NOT EXISTS (SELECT 1 FROM reservations r
                                WHERE r.id = ri.intended_reservation_id AND r.expires_at > now()))
        """,
        list(runner_ids),
        workspace_id,
        reservation_id,
        provisioner_id,
        list(labels),
        scope is Scope.INSTALLATION,
    )
    if int(status.split()[-1]) != len(runner_ids):
        raise BindingMismatch(
            "a locked idle runner no longer matched the binding predicate",
            runner_ids=[str(i) for i in runner_ids],
        )


# --- terminate intents -------------------------------------------------------------------------

# Terminate intents (spec 3.6), shared with the honored-intent check of reports
# (store/runner_reports.py): $1 workspace, $2 provisioner, $3 activation timeout (interval).
CANCELLED_SQL = """
    COALESCE((SELECT rj.cancellation_requested_at IS NOT NULL FROM running_jobs rj
               WHERE rj.workspace_id = ri.workspace_id AND rj.provisioner_id = ri.provisioner_id
                 AND rj.provider_runner_id = ri.provider_runner_id
               ORDER BY rj.started_at DESC, rj.job_execution_id DESC LIMIT 1), false)
"""
TIMED_OUT_SQL = """
    ($3::interval IS NOT NULL AND ri.launch_kind = 'demand' AND ri.runner_session_id IS NULL
     AND ri.created_at < now() - $3::interval
     AND NOT EXISTS (SELECT 1 FROM reservations r
                      WHERE r.workspace_id = $1 AND r.provisioner_id = $2 AND r.expires_at > now()
                        AND r.id IN (ri.reservation_id, ri.intended_reservation_id)))
"""
INTENT_ROWS_SQL = f"""
    FROM runner_instances ri
   WHERE ri.workspace_id = $1 AND ri.provisioner_id = $2 AND ri.provider_runner_id IS NOT NULL
     AND ri.state IN {_ACTIVE}
"""


async def _timeout_candidates(
    conn: Conn, workspace_id: UUID, provisioner_id: UUID, activation_timeout: timedelta | None
) -> list[UUID]:
    """Unlocked read of the runners an activation-timeout intent may mark released, so they can
    be locked in id order together with the runners to bind."""
    if activation_timeout is None:
        return []
    rows = await conn.fetch(
        f"SELECT ri.id {INTENT_ROWS_SQL}"
        f" AND ri.reservation_released_at IS NULL AND {TIMED_OUT_SQL}",
        workspace_id,
        provisioner_id,
        activation_timeout,
    )
    return [r["id"] for r in rows]


async def _terminate_intents(
    conn: Conn,
    *,
    now: datetime,
    workspace_id: UUID,
    provisioner_id: UUID,
    activation_timeout: timedelta | None,
    limit: int,
) -> tuple[tuple[TerminateIntent, ...], bool]:
    """Spec 3.6: runners to terminate, sorted by provider id, at most `limit` (and whether more
    existed). First deliveries of an activation timeout are marked released here."""
    rows = await conn.fetch(
        f"""
        SELECT {RUNNER_COLUMNS}, {CANCELLED_SQL} AS cancelled {INTENT_ROWS_SQL}
           AND ({CANCELLED_SQL} OR {TIMED_OUT_SQL})
         ORDER BY ri.provider_runner_id LIMIT $4
        """,
        workspace_id,
        provisioner_id,
        activation_timeout,
        limit + 1,
    )
    live = {
        r["id"]
        for r in await conn.fetch(
            "SELECT id FROM reservations WHERE workspace_id = $1 AND provisioner_id = $2"
            " AND expires_at > now()",
            workspace_id,
            provisioner_id,
        )
    }
    intents: list[TerminateIntent] = []
    first_timeouts: list[UUID] = []
    for row in rows[:limit]:
        runner = runner_from_row(row)
        assert runner.provider_runner_id is not None
        timed_out = activation_timeout is not None and activation_timed_out(
            runner, live_reservation_ids=live, now=now, timeout=activation_timeout
        )
        if timed_out:
            if not runner.released:
                first_timeouts.append(runner.id)
            intents.append(
                TerminateIntent(
                    runner.provider_runner_id, TerminateReason.ACTIVATION_TIMEOUT, runner.released
                )
            )
        elif row["cancelled"]:
            intents.append(
                TerminateIntent(runner.provider_runner_id, TerminateReason.JOB_CANCELLED, False)
            )
    if first_timeouts:
        await conn.execute(
            """
            UPDATE runner_instances SET reservation_released_at = now(), updated_at = now()
             WHERE id = ANY($1::uuid[]) AND reservation_released_at IS NULL
            """,
            first_timeouts,
        )
    return tuple(intents), len(rows) > limit


# --- one workspace ---------------------------------------------------------------------------


async def allocate_workspace(
    conn: Conn,
    *,
    provisioner_id: UUID,
    scope: Scope,
    workspace_id: UUID,
    templates: Sequence[Template],
    max_reservations: int,
    launch_ttl: timedelta,
    activation_grace: timedelta,
    covering_window: timedelta | None = None,
    try_lock: bool = False,
    terminate_limit: int = 1000,
    activation_timeout: timedelta | None = None,
) -> WorkspaceRound | None:
    """One allocation round for one workspace, in one transaction (the steps of
    `domain.demand`). Returns None when `try_lock` finds the workspace busy.

    Locks, in this order: the workspace advisory lock (blocking, or try with `try_lock`); the
    assignment locks of the provisioner's live reservations in the workspace, in one statement
    sorted by key; those reservation rows FOR UPDATE in id order; in a savepoint, the runners to
    bind plus the activation-timeout candidates, one row at a time in ascending id; then writes
    (the bind UPDATE and the activation-timeout UPDATE touch only rows already locked, except a
    runner that became timed out during the round, locked last by its UPDATE). A binding
    candidate that fails its fresh re-check rolls the savepoint back, dropping every runner lock
    taken in it, and the round reads and allocates again under the locks it still holds.

    `covering_window` (installation scope): demand the workspace's own provisioners advertised
    labels for within the window is left to them. Terminate intents are computed for workspace
    scope only; `activation_timeout` None leaves activation timeouts out.
    """
    templates = tuple(replace(t, labels=canonicalise(t.labels)) for t in templates)
    async with conn.transaction():
        now = await db_now(conn)
        if try_lock:
            if not await try_lock_workspace(conn, workspace_id):
                return None
        else:
            await lock_workspace(conn, workspace_id)
        covering = (
            await _covering_labels(conn, workspace_id, covering_window)
            if covering_window is not None
            else []
        )
        intents_wanted = scope is Scope.WORKSPACE
        while True:
            inputs = await _inputs(
                conn,
                now=now,
                workspace_id=workspace_id,
                provisioner_id=provisioner_id,
                scope=scope,
                templates=templates,
                max_reservations=max_reservations,
                launch_ttl=launch_ttl,
                activation_grace=activation_grace,
                covering=covering,
            )
            allocation = allocate(inputs, now=now)
            if max_reservations == 0:
                break
            candidates = (
                await _timeout_candidates(conn, workspace_id, provisioner_id, activation_timeout)
                if intents_wanted
                else []
            )
            try:
                async with conn.transaction():  # the savepoint of spec 3.4
                    await _lock_and_recheck(conn, allocation, inputs, candidates, now)
            except _StaleCandidate:
                continue
            break

        bound_ids: list[UUID] = []
        grants: list[Grant] = []
        for new in allocation.reservations:
            if new.kind is ReservationKind.BOUND:
                await _bind(
                    conn,
                    workspace_id=workspace_id,
                    provisioner_id=provisioner_id,
                    scope=scope,
                    labels=new.labels,
                    count=new.count,
                    grace=activation_grace,
                    runner_ids=new.runner_ids,
                )
                bound_ids.extend(new.runner_ids)
        await notify_assigned(conn, bound_ids)
        for new in allocation.grants:
            row = await conn.fetchrow(
                """
                INSERT INTO reservations (workspace_id, provisioner_id, required_labels, count,
                                          kind, expires_at)
                VALUES ($1, $2, $3, $4, 'launch', now() + $5::interval)
                RETURNING id, expires_at
                """,
                workspace_id,
                provisioner_id,
                list(new.labels),
                new.count,
                launch_ttl,
            )
            assert row is not None
            grants.append(Grant(row["id"], workspace_id, new.labels, new.count, row["expires_at"]))

        intents: tuple[TerminateIntent, ...] = ()
        truncated = False
        if intents_wanted:
            intents, truncated = await _terminate_intents(
                conn,
                now=now,
                workspace_id=workspace_id,
                provisioner_id=provisioner_id,
                activation_timeout=activation_timeout,
                limit=terminate_limit,
            )
        return WorkspaceRound(
            workspace_id=workspace_id,
            allocation=allocation,
            grants=tuple(grants),
            bound=len(bound_ids),
            rebound=allocation.rebound,
            terminate_intents=intents,
            terminate_truncated=truncated,
        )


# --- installation scope --------------------------------------------------------------------------


async def demand_workspaces(
    conn: Conn, eligible: Collection[UUID] | None = None, *, limit: int = 1000
) -> list[UUID]:
    """Workspaces with pending jobs, oldest demand first (then id), at most `limit` (one walk
    serves the oldest; the rest wait for a later round); `eligible` None is all."""
    rows = await conn.fetch(
        """
        SELECT workspace_id FROM pending_jobs
         WHERE $1::uuid[] IS NULL OR workspace_id = ANY($1::uuid[])
         GROUP BY workspace_id ORDER BY min(created_at), workspace_id LIMIT $2
        """,
        None if eligible is None else list(eligible),
        limit,
    )
    return [r["workspace_id"] for r in rows]


async def allocate_in_walk(
    conn: Conn,
    *,
    provisioner_id: UUID,
    workspace_id: UUID,
    templates: Sequence[Template],
    max_reservations: int,
    launch_ttl: timedelta,
    activation_grace: timedelta,
    covering_window: timedelta | None,
    activation_timeout: timedelta | None = None,
) -> WorkspaceRound | None:
    """One workspace of an installation provisioner's walk (spec 3.5; the walk itself, oldest
    demand first and carrying the budget, is the provisioner actor's): `allocate_workspace`
    with a try-lock, so a busy workspace is skipped (None), never waited for.
    `max_reservations` is what is left of the walk's budget.

    The slots offered are the advertised ones minus this provisioner's launch units still to be
    launched in every *other* workspace, read fresh in this transaction (allocation itself
    charges the ones of the workspace it serves): grants made earlier in the walk, and those of
    a workspace skipped as busy, hold their slots. The reference carried only the walk's launch
    grants, which let a skipped workspace's slots be granted again elsewhere. Bound runners take
    no slot (they already run).

    Locks: runs in the caller's transaction, after the session's fencing row
    (store/provisioning.py opens it), then those of `allocate_workspace`; a walk holds no lock
    from one workspace to the next.
    """
    advertised = tuple(replace(t, labels=canonicalise(t.labels)) for t in templates)
    pending = await outstanding_grants(conn, provisioner_id)
    elsewhere = [(r, n) for r, n in pending if r.workspace_id != workspace_id]
    return await allocate_workspace(
        conn,
        provisioner_id=provisioner_id,
        scope=Scope.INSTALLATION,
        workspace_id=workspace_id,
        templates=without_pending(advertised, elsewhere),
        max_reservations=max_reservations,
        launch_ttl=launch_ttl,
        activation_grace=activation_grace,
        covering_window=covering_window,
        try_lock=True,
        activation_timeout=activation_timeout,
    )


# --- reservation cleanup -----------------------------------------------------------------------


async def delete_reservations(conn: Conn, ids: Collection[UUID]) -> int:
    """Delete these reservations (launch grants a provisioner never received, or any other),
    unbinding their unactivated runners (spec 4.11). Returns the rows deleted. Locks: see
    `_delete`."""
    async with conn.transaction():
        return await _delete(conn, sorted(set(ids)), expired_only=False)


async def delete_expired_reservations(conn: Conn, limit: int = 1000) -> int:
    """Delete up to `limit` expired reservations, oldest expiry first (maintenance). Locks: see
    `_delete`."""
    async with conn.transaction():
        rows = await conn.fetch(
            "SELECT id FROM reservations WHERE expires_at < now() ORDER BY expires_at, id LIMIT $1",
            limit,
        )
        return await _delete(conn, [r["id"] for r in rows], expired_only=True)


async def _delete(conn: Conn, ids: Sequence[UUID], *, expired_only: bool) -> int:
    """Locks: the affected runner rows one at a time in ascending id, then the reservation rows
    FOR UPDATE in id order; no advisory lock.

    This reverses the global order (runner rows before reservation rows). It cannot deadlock
    with allocation: allocation locks reservation rows only of live reservations of its own
    provisioner, and runner rows in the same ascending id order one at a time, so the two meet
    on runner rows in one order, and only cleanup then waits on a reservation row. With an
    assignment (reservation row, then runner rows) it meets only on live reservations, which
    maintenance does not delete; a disconnect deletes grants nobody has assigned against yet.
    """
    if not ids:
        return 0
    affected = await conn.fetch(
        """
        SELECT id FROM runner_instances
         WHERE (reservation_id = ANY($1::uuid[]) AND runner_session_id IS NULL
                AND reservation_released_at IS NULL)
            OR intended_reservation_id = ANY($1::uuid[])
         ORDER BY id
        """,
        list(ids),
    )
    runner_ids = [r.id for r in await lock_runners(conn, [r["id"] for r in affected])]
    locked = await lock_reservations(conn, ids)
    if expired_only:
        now = await db_now(conn)
        locked = [r for r in locked if r.expires_at < now]
    if not locked:
        return 0
    reservation_ids = [r.id for r in locked]
    unbind = """
        FROM runner_instances ri
       WHERE ri.id = ANY($1::uuid[]) AND ri.reservation_id = ANY($2::uuid[])
         AND ri.runner_session_id IS NULL AND ri.reservation_released_at IS NULL
    """
    await conn.execute(
        f"""
        UPDATE runner_activation_tokens SET revoked_at = now()
         WHERE consumed_at IS NULL AND revoked_at IS NULL
           AND runner_instance_id IN (SELECT ri.id {unbind})
        """,
        runner_ids,
        reservation_ids,
    )
    await conn.execute(
        f"""
        UPDATE runner_instances SET workspace_id = NULL, reservation_id = NULL, assigned_at = NULL,
                                    updated_at = now()
         WHERE id IN (SELECT ri.id {unbind})
        """,
        runner_ids,
        reservation_ids,
    )
    await conn.execute(
        """
        UPDATE runner_instances SET intended_reservation_id = NULL, updated_at = now()
         WHERE id = ANY($1::uuid[]) AND intended_reservation_id = ANY($2::uuid[])
        """,
        runner_ids,
        reservation_ids,
    )
    status = await conn.execute(
        "DELETE FROM reservations WHERE id = ANY($1::uuid[])", reservation_ids
    )
    return int(status.split()[-1])
