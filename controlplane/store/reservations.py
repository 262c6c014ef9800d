"""Reservations and runner-instance rows: the shared statements every provisioning path uses.

Global lock order (spec 3.8, kept by every transaction that touches provisioning rows):

0. for a write made on behalf of a provisioner's control session: its fencing row
   (`provisioner_sessions.hold_fence`, FOR SHARE), before anything else;
1. the workspace advisory lock (`locks.workspace(W)`), when the transaction allocates demand or
   projects terminal states for W;
2. assignment advisory locks (`locks.assignment(P, R)`), all of them in one statement, sorted by
   key and de-duplicated (`lock_assignments`);
3. reservation rows `FOR UPDATE`, in id order;
4. runner-instance rows `FOR UPDATE`, one statement per row, in id order (`lock_runners`);
5. writes.

Reservation cleanup (`reservation_cleanup.delete_reservations`) is the one path that does not
allocate: it locks runner rows before reservation rows, both in id order; allocation locks
runner rows only after its reservation rows, and it never locks a reservation row that cleanup
is deleting while holding one of that reservation's runners, so the two meet on runner rows in
the same id order and cannot deadlock (P-45 forces that interleaving).

The demand summary (`workspace_demand`, sql/0022, sql/0030) is outside this order. Only inserts
into pending_jobs (enqueue, put-back, the reaper's retry) take its rows and its
`cp_workspace_demand` keys (shared, at the end of their statement), and none of them holds or
waits for a lock of the order above; the summary's prune only try-locks the keys. No
transaction here inserts pending rows, so none holds a summary lock (docs/concurrency.md).

A reservation is live iff `expires_at > now()` on the database clock. Releasing the last unit of
a reservation deletes its row (`count > 0` is a CHECK). Expired reservations are never
decremented: their units are gone with them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from uuid import UUID

import asyncpg

from controlplane.domain.demand import Reservation, ReservationKind
from controlplane.domain.runner_instances import (
    ACTIVE_STATES,
    TERMINAL_STATES,
    LaunchKind,
    ProvisionedRunner,
    RunnerState,
)
from controlplane.store import locks
from controlplane.store.pool import Conn
from controlplane.store.records import from_row, row_mapper

# Every runner-instance column a domain ProvisionedRunner needs, for `FROM runner_instances ri`,
# with the expiry of its open control session (NULL when it has none).
RUNNER_COLUMNS = """
    ri.id, ri.provisioner_id, ri.created_at, ri.state, ri.labels, ri.reported_at, ri.updated_at,
    ri.launch_kind, ri.template_key, ri.provider_runner_id, ri.workspace_id, ri.reservation_id,
    ri.intended_reservation_id, ri.assigned_at, ri.runner_session_id, ri.reservation_released_at,
    ri.drained_at,
    (SELECT cs.expires_at FROM runner_control_sessions cs
      WHERE cs.runner_instance_id = ri.id AND cs.provisioner_id = ri.provisioner_id
        AND cs.closed_at IS NULL) AS control_session_expires_at
"""


def sql_states(states: Iterable[RunnerState]) -> str:
    """An SQL list literal of runner states, in rank order, made from the domain's enum: for
    fragments interpolated into statements, where a literal keeps the predicate (and any
    partial index it matches) visible to the planner as the hand-written lists did."""
    return "(" + ", ".join(f"'{s.value}'" for s in sorted(states, key=lambda s: s.rank)) + ")"


ACTIVE_SQL = sql_states(ACTIVE_STATES)  # ('starting', 'running', 'stopping')
TERMINAL_SQL = sql_states(TERMINAL_STATES)  # ('stopped', 'failed', 'terminated')
BOOTING_SQL = sql_states({RunnerState.STARTING, RunnerState.RUNNING})

RESERVATION_COLUMNS = "id, workspace_id, provisioner_id, required_labels, count, kind, expires_at"


# Made once (records.row_mapper): every allocation round reads many runner rows.
runner_from_row = row_mapper(
    ProvisionedRunner, state=RunnerState, labels=tuple, launch_kind=LaunchKind
)


def reservation_from_row(row: asyncpg.Record) -> Reservation:
    return from_row(
        Reservation, row, labels=tuple(row["required_labels"]), kind=ReservationKind(row["kind"])
    )


async def db_now(conn: Conn) -> datetime:
    value = await conn.fetchval("SELECT now()")
    assert isinstance(value, datetime)
    return value


async def lock_workspace(conn: Conn, workspace_id: UUID) -> None:
    """Blocking, transaction-scoped: step 1 of the lock order."""
    await conn.execute("SELECT pg_advisory_xact_lock($1)", locks.workspace(workspace_id))


async def try_lock_workspace(conn: Conn, workspace_id: UUID) -> bool:
    locked = await conn.fetchval(
        "SELECT pg_try_advisory_xact_lock($1)", locks.workspace(workspace_id)
    )
    return bool(locked)


async def lock_workspaces(conn: Conn, workspace_ids: Iterable[UUID]) -> None:
    """Several workspace locks, sorted by key in one statement (the reaper's many workspaces)."""
    keys = sorted({locks.workspace(w) for w in workspace_ids})
    if keys:
        await conn.execute(
            "SELECT pg_advisory_xact_lock(k) FROM unnest($1::bigint[]) WITH ORDINALITY AS t(k, n)"
            " ORDER BY n",
            keys,
        )


async def lock_assignments(
    conn: Conn, provisioner_id: UUID, reservation_ids: Iterable[UUID | None]
) -> None:
    """Step 2: the assignment locks of (provisioner, reservation) pairs, sorted and de-duplicated,
    in one statement."""
    keys = sorted({locks.assignment(provisioner_id, r) for r in reservation_ids if r is not None})
    if keys:
        await conn.execute(
            "SELECT pg_advisory_xact_lock(k) FROM unnest($1::bigint[]) WITH ORDINALITY AS t(k, n)"
            " ORDER BY n",
            keys,
        )


# Step 3's statement: the rows FOR UPDATE in id order, reading back `{columns}`.
_LOCK_RESERVATIONS = """
    SELECT {columns} FROM reservations
     WHERE id = ANY($1::uuid[]) AND ($2::uuid IS NULL OR provisioner_id = $2)
     ORDER BY id
       FOR UPDATE"""


async def lock_reservations(
    conn: Conn, reservation_ids: Iterable[UUID], *, provisioner_id: UUID | None = None
) -> list[Reservation]:
    """Step 3: reservation rows FOR UPDATE in id order (rows that no longer exist are absent)."""
    ids = sorted(set(reservation_ids))
    if not ids:
        return []
    rows = await conn.fetch(
        _LOCK_RESERVATIONS.format(columns=RESERVATION_COLUMNS), ids, provisioner_id
    )
    return [reservation_from_row(row) for row in rows]


async def hold_reservations(
    conn: Conn, reservation_ids: Iterable[UUID], *, provisioner_id: UUID | None = None
) -> None:
    """Step 3 for a caller that reads the rows afresh after its locks (an allocation round): the
    same locks, in the same order, as `lock_reservations`, with nothing read back but the ids."""
    ids = sorted(set(reservation_ids))
    if ids:
        await conn.execute(_LOCK_RESERVATIONS.format(columns="id"), ids, provisioner_id)


async def lock_runners(conn: Conn, runner_ids: Iterable[UUID]) -> list[ProvisionedRunner]:
    """Step 4: runner rows FOR UPDATE, one statement per row in ascending id, so two transactions
    locking overlapping sets always meet in the same order. Rows that vanished are absent."""
    locked = []
    for runner_id in sorted(set(runner_ids)):
        row = await conn.fetchrow(
            f"SELECT {RUNNER_COLUMNS} FROM runner_instances ri WHERE ri.id = $1 FOR UPDATE OF ri",  # noqa: S608 -- interpolates constants only: RUNNER_COLUMNS
            runner_id,
        )
        if row is not None:
            locked.append(runner_from_row(row))
    return locked


async def load_runners(conn: Conn, runner_ids: Sequence[UUID]) -> list[ProvisionedRunner]:
    """Fresh reads (no lock) of the given runners, in ascending id."""
    rows = await conn.fetch(
        f"SELECT {RUNNER_COLUMNS} FROM runner_instances ri WHERE ri.id = ANY($1::uuid[])"  # noqa: S608 -- interpolates constants only: RUNNER_COLUMNS
        " ORDER BY ri.id",
        list(runner_ids),
    )
    return [runner_from_row(row) for row in rows]


async def release_units(
    conn: Conn, workspace_id: UUID, provisioner_id: UUID, units: Mapping[UUID, int] | Iterable[UUID]
) -> int:
    """Give back `units[R]` units of each live reservation R of (workspace, provisioner); the
    caller holds the assignment locks of those reservations. A reservation left with no unit is
    deleted. Returns the units actually given back: the requested count for a decremented row,
    what was left for a deleted one, 0 for an expired, missing or foreign reservation (spec 2.8).
    """
    wanted = Counter(units) if not isinstance(units, Mapping) else Counter(dict(units))
    wanted = Counter({r: n for r, n in wanted.items() if n > 0})
    if not wanted:
        return 0
    ids = sorted(wanted)
    counts = [wanted[r] for r in ids]
    rows = await conn.fetch(
        """
        WITH wanted AS (
            SELECT * FROM unnest($3::uuid[], $4::int[]) AS w(id, n)
        ), decremented AS (
            UPDATE reservations r SET count = r.count - w.n
              FROM wanted w
             WHERE r.id = w.id AND r.workspace_id = $1 AND r.provisioner_id = $2
               AND r.expires_at > now() AND r.count > w.n
            RETURNING r.id, w.n AS released
        ), deleted AS (
            DELETE FROM reservations r
             USING wanted w
             WHERE r.id = w.id AND r.workspace_id = $1 AND r.provisioner_id = $2
               AND r.expires_at > now() AND r.count <= w.n
               AND r.id NOT IN (SELECT id FROM decremented)
            RETURNING r.id, r.count AS released
        )
        SELECT released FROM decremented UNION ALL SELECT released FROM deleted
        """,
        workspace_id,
        provisioner_id,
        ids,
        counts,
    )
    return sum(row["released"] for row in rows)


# A runner instance was assigned or bound (payload: its id). The replica parking that runner's
# assignment long-poll wakes it; a lost notification only costs the poll's re-check interval.
ASSIGNED_CHANNEL = "cp_assigned"


async def notify_assigned(conn: Conn, runner_ids: Iterable[UUID]) -> None:
    """NOTIFY (delivered at commit) that these runners have an assignment to pick up."""
    ids = sorted({str(i) for i in runner_ids})
    if ids:
        await conn.execute(
            "SELECT pg_notify($1, i) FROM unnest($2::text[]) AS t(i)", ASSIGNED_CHANNEL, ids
        )


async def idle_candidates(
    conn: Conn, provisioner_id: UUID
) -> tuple[list[ProvisionedRunner], frozenset[UUID], datetime]:
    """For the warm pool: the provisioner's active, unreleased runners without a runner session,
    the ids of the live reservations they reference, and the database clock. No locks: the warm
    pool is a target the next round corrects, not a unit count."""
    rows = await conn.fetch(
        f"""
        SELECT {RUNNER_COLUMNS} FROM runner_instances ri
         WHERE ri.provisioner_id = $1 AND ri.state IN {BOOTING_SQL}
           AND ri.runner_session_id IS NULL AND ri.reservation_released_at IS NULL
        """,  # noqa: S608 -- RUNNER_COLUMNS and BOOTING_SQL are constants
        provisioner_id,
    )
    runners = [runner_from_row(row) for row in rows]
    referenced = {r.reservation_id for r in runners} | {r.intended_reservation_id for r in runners}
    live = await conn.fetch(
        "SELECT id FROM reservations WHERE id = ANY($1::uuid[]) AND expires_at > now()",
        [i for i in referenced if i is not None],
    )
    return runners, frozenset(row["id"] for row in live), await db_now(conn)


async def outstanding_grants(conn: Conn, provisioner_id: UUID) -> list[tuple[Reservation, int]]:
    """The provisioner's live launch reservations with units not yet taken by an instance, and
    how many: what a reconnecting provisioner still has to launch."""
    rows = await conn.fetch(
        f"""
        SELECT {RESERVATION_COLUMNS},
               r.count - (SELECT count(*) FROM runner_instances ri
                           WHERE ri.provisioner_id = r.provisioner_id
                             AND ri.reservation_released_at IS NULL
                             AND ri.state NOT IN {TERMINAL_SQL}
                             AND (ri.reservation_id = r.id OR ri.intended_reservation_id = r.id)
                         )::int AS pending
          FROM reservations r
         WHERE r.provisioner_id = $1 AND r.kind = 'launch' AND r.expires_at > now()
         ORDER BY r.created_at, r.id
        """,  # noqa: S608 -- interpolates constants only: RESERVATION_COLUMNS, TERMINAL_SQL
        provisioner_id,
    )
    return [(reservation_from_row(row), row["pending"]) for row in rows if row["pending"] > 0]
