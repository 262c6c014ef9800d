"""Giving reservation units back when runners finish: terminal release (spec 4.10), lease
finalisation (4.14) and the stale runner reaper (4.12), with the lock helper reports, reconcile
and revocation share (`lock_linked_runners`).

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
runner by a report, reconcile or the reaper (P-48, P-49). Metrics are the callers' job (they get
the counts back).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from uuid import UUID

from controlplane.domain.jobs import EndedLease
from controlplane.domain.runner_instances import ProvisionedRunner, StaleRunnerRule
from controlplane.errors import Conflict
from controlplane.store import locks
from controlplane.store.pool import Conn
from controlplane.store.reservations import (
    ACTIVE_SQL,
    TERMINAL_SQL,
    db_now,
    load_runners,
    lock_runners,
    lock_workspaces,
    release_units,
)

_LINK_ATTEMPTS = 10


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
               AND (NOT $4 OR state IN {TERMINAL_SQL})
            """,  # noqa: S608 -- interpolates constants only: TERMINAL_SQL
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
               AND ri.state IN {TERMINAL_SQL}
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
            """,  # noqa: S608 -- interpolates constants only: TERMINAL_SQL
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


# Active, silent since the cutoff ($1), provisioner silent too, and no lease or recently active
# runner session for its provider identity. Leases and sessions are matched on (provisioner,
# provider id) alone: the reference also compared workspace_id with `=`, which never protected
# a workspace-neutral row (spec 9.15).
_STALE = f"""
    ri.state IN {ACTIVE_SQL} AND ri.reported_at < $1 AND ri.updated_at < $1
    AND NOT EXISTS (SELECT 1 FROM provisioner_tokens pt
                     WHERE pt.id = ri.provisioner_id AND pt.last_seen_at >= $1)
    AND NOT EXISTS (SELECT 1 FROM running_jobs j
                     WHERE j.provisioner_id = ri.provisioner_id
                       AND j.provider_runner_id = ri.provider_runner_id)
    AND NOT EXISTS (SELECT 1 FROM runner_sessions s
                     WHERE s.provisioner_id = ri.provisioner_id
                       AND s.provider_runner_id = ri.provider_runner_id
                       AND s.updated_at >= $1)
"""  # noqa: S608 -- interpolates constants only: ACTIVE_SQL
_DRAINABLE = f"""
    ri.state IN {TERMINAL_SQL} AND ri.runner_session_id IS NOT NULL AND ri.updated_at < $1
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
                """,  # noqa: S608 -- interpolates constants only: _STALE
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


async def with_units_released(conn: Conn, ended: list[EndedLease]) -> tuple[list[EndedLease], int]:
    """`ended`, leases a maintenance batch just ended (reaped, timed out), with the units
    `release_after_leases` gave back for them."""
    return ended, await release_after_leases(conn, ended)
