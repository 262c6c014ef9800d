"""Demand allocation over PostgreSQL: one allocation round per workspace, with the binding of
idle runners it decides, and one workspace of an installation provisioner's walk (the walk
itself is the provisioner actor's; its list is `store/demand_list.py`'s).

The decisions are `domain.demand.allocate` and `domain.binding.is_bindable`; this module reads
their inputs under the locks that make them true (`store/demand_inputs.py`), and writes their
outputs. Terminate intents are `store/terminate_intents.py`'s, reservation cleanup
`store/reservation_cleanup.py`'s. The lock order of every transaction here is the global one of
`store/reservations.py`; each function says which locks it takes.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from uuid import UUID

from controlplane.domain.binding import BindTarget, Scope, is_bindable
from controlplane.domain.demand import (
    Allocation,
    AllocationInputs,
    ReservationKind,
    Template,
    allocate,
    covers,
    live_reservation_ids,
    without_pending,
)
from controlplane.domain.labels import LabelSet, canonicalise, matches
from controlplane.domain.rounds import Grant, WorkspaceRound
from controlplane.domain.terminate_intents import TerminateIntent
from controlplane.errors import BindingMismatch
from controlplane.store.demand_inputs import covering_labels, read_inputs, reservations_by_id
from controlplane.store.demand_list import FINGERPRINT
from controlplane.store.pool import Conn
from controlplane.store.reservations import (
    db_now,
    load_runners,
    lock_runners,
    lock_workspace,
    notify_assigned,
    outstanding_grants,
    try_lock_workspace,
)
from controlplane.store.terminate_intents import terminate_intents, timeout_candidates


class _StaleCandidate(Exception):
    """A locked idle runner failed the fresh re-check: roll back the savepoint and reallocate."""


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
    live = live_reservation_ids(await reservations_by_id(conn, referenced), now)
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
           AND ri.drained_at IS NULL
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
    fingerprint: bool = False,
) -> WorkspaceRound | None:
    """One allocation round for one workspace, in one transaction (the steps of
    `domain.demand`). Returns None when `try_lock` finds the workspace busy.

    With `fingerprint` (a walk's round), the round carries the fingerprint of the workspace's
    live reservations as it leaves them (`WorkspaceRound.reservations`, read after its writes),
    except when it left demand that a template takes to the workspace's own provisioners
    (`covering_window`): those figures change with time alone, so no walk may carry them.

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
            await covering_labels(conn, workspace_id, covering_window)
            if covering_window is not None
            else []
        )
        intents_wanted = scope is Scope.WORKSPACE
        while True:
            inputs = await read_inputs(
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
                await timeout_candidates(conn, workspace_id, provisioner_id, activation_timeout)
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
            intents, truncated = await terminate_intents(
                conn,
                now=now,
                workspace_id=workspace_id,
                provisioner_id=provisioner_id,
                activation_timeout=activation_timeout,
                limit=terminate_limit,
            )
        kept = None
        if fingerprint and not _left_to_own(inputs, allocation):
            kept = int(await conn.fetchval(FINGERPRINT.format(workspace="$1"), workspace_id))
        return WorkspaceRound(
            workspace_id=workspace_id,
            allocation=allocation,
            grants=tuple(grants),
            bound=len(bound_ids),
            rebound=allocation.rebound,
            terminate_intents=intents,
            terminate_truncated=truncated,
            covered=covers(inputs, allocation),
            reservations=kept,
        )


def _left_to_own(inputs: AllocationInputs, allocation: Allocation) -> bool:
    """Whether the round left a demand group that one of its templates takes to the
    workspace's own provisioners (`covering_labels`): such a group has no figure."""
    figured = {s.labels for s in allocation.stats}
    return any(
        group.labels not in figured
        and any(matches(group.labels, t.labels) for t in inputs.templates)
        for group in inputs.demand
    )


# --- installation scope --------------------------------------------------------------------------


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

    The round carries the fingerprint of the workspace's live reservations as it leaves them
    (`WorkspaceRound.reservations`, read after its writes under the workspace lock; None when it
    left demand to the workspace's own provisioners), so a walk can tell next time that nothing
    changed since and carry the round's figures (actors/provisioning/changes.py).

    Locks: runs in the caller's transaction, after the session's fencing row
    (store/provisioning.py opens it), then those of `allocate_workspace`; the fingerprint's read
    takes none. A walk holds no lock from one workspace to the next.
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
        fingerprint=True,
    )
