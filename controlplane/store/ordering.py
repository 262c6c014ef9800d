"""Ordering of the queue (issue 14): priority, concurrency keys and fair share, as the SQL the
claims (store/claiming.py) are built from, and the per-workspace `ordering` setting.

Order. Plain (`fifo`, the default): higher `priority` first, then the FIFO key (created_at, id),
walked on the index `pending_jobs (workspace_id, priority DESC, created_at, id)`; with every
priority 0 that walk is the one the old FIFO index gave. `fair`: a job's share is the running
executions of its project plus its place among its project's claimable jobs (1 for the head), so
the project with the fewest running goes first and the next of the same project is weighed as if
its head already ran; ties by priority, then age. Fair reads every claimable row of the workspace
(a window over them, not an index walk), which is why it is a setting and not the default.

Concurrency keys. A keyed job is claimable only while its key's `running` count
(`concurrency_keys`, kept by triggers on `running_jobs`, sql/0012_ordering.sql) is below its
limit: the claim's filter skips a full key's jobs without stopping at them. The filter reads a
snapshot, so the admission locks the key rows (FOR UPDATE SKIP LOCKED, in key order), which
reads their newest committed count, before the lease is written, and its lease's insert raises
the count (trigger) under that row lock, held to the claim's commit (the statement's end for an
uncapped claim). Two claims admitting a
key's last slot at once: one holds the key row, the other skips it and admits nothing (its
candidate is stepped over, as a busy head is); once the first commits the count is full. A key
row that a lease's end is updating is skipped the same way; that end wakes the key's waiters.

Locks, added to the claim's (store/claiming.py), in order: the pending row (FOR UPDATE SKIP
LOCKED), a try of its execution lock, then, for a keyed job only, its key row (SKIP LOCKED:
never waited for). After the key row a claim waits for nothing but, for a provisioned runner's
first claim, the reservation rows whose assignment locks it took before everything else (any
transaction that wants those rows takes the same locks first), so it closes no cycle. Whatever
ends a lease (complete, cancel, reaper, put-back, release) updates the key row from the trigger
after its execution lock and its running-row delete: it may wait for a claim to commit.
Enqueue inserts a key's row once (ON CONFLICT DO NOTHING, after its execution locks).
"""

from __future__ import annotations

import enum
from uuid import UUID

from controlplane.store import locks
from controlplane.store.events import EVENTS_CHANNEL
from controlplane.store.pool import Conn


class Ordering(enum.StrEnum):
    FIFO = "fifo"
    FAIR = "fair"


def try_execution_lock(column: str) -> str:
    """A try of the execution lock of `column` (an execution id), never waiting."""
    return f"pg_try_advisory_xact_lock({locks.sql_key(locks.EXECUTION, column)})"


# Whether the claim's workspace ($1) orders fairly: one primary-key probe, as an InitPlan.
FAIR = """(SELECT EXISTS (SELECT 1 FROM workspace_settings
                        WHERE workspace_id = $1 AND ordering = 'fair'))"""

# A pending row ($1 workspace, $2 session labels, $3 rows stepped over) a claim may take: labels
# match, not stepped over, its key (if any) below the limit in the statement's snapshot, its
# queue deadline not passed (store/deadlines.py removes it later; a late leader never lets it
# run), and its workspace not paused (store/pauses.py). Other policies' filters go here.
CLAIMABLE = """workspace_id = $1 AND required_labels <@ $2::text[]
            AND NOT (id = ANY($3::uuid[]))
            AND (concurrency_key IS NULL
                 OR EXISTS (SELECT 1 FROM concurrency_keys k
                            WHERE k.workspace_id = $1
                              AND k.concurrency_key = pending_jobs.concurrency_key
                              AND k.running < pending_jobs.concurrency_limit))
            AND (expires_at IS NULL OR expires_at > now())
            AND NOT EXISTS (SELECT 1 FROM paused_workspaces WHERE workspace_id = $1)"""

# The plain claim's order, walked on the index.
PLAIN_ORDER = "priority DESC, created_at, id"

_PICK_COLUMNS = "id, job_execution_id, concurrency_key, concurrency_limit, priority, created_at"


def fifo_pick(limit: str, also: str) -> str:
    """The first `limit` claimable rows in plain order, locked (SKIP LOCKED: a row another claim
    holds is not seen), for a workspace that does not order fairly."""
    return f"""SELECT {_PICK_COLUMNS} FROM pending_jobs
          WHERE {CLAIMABLE} AND NOT {FAIR}{also}
          ORDER BY {PLAIN_ORDER}
          LIMIT {limit}
          FOR UPDATE SKIP LOCKED"""  # noqa: S608 -- constants and the caller's constant limit


def fair_pick(limit: str, also: str) -> str:
    """The first `limit` claimable rows in fair order, not locked (the caller tries each row's
    lock, so a row another claim holds is stepped over, not silently replaced), for a workspace
    that orders fairly; `share` ranks them."""
    return f"""SELECT {_PICK_COLUMNS}, share FROM (
              SELECT {_PICK_COLUMNS},
                     coalesce((SELECT count(*) FROM running_jobs r
                               WHERE r.workspace_id = $1
                                 AND r.project_id = pending_jobs.project_id), 0)
                     + row_number() OVER (PARTITION BY project_id ORDER BY {PLAIN_ORDER}) AS share
              FROM pending_jobs
              WHERE {CLAIMABLE} AND {FAIR}{also}) AS ranked
          ORDER BY share, {PLAIN_ORDER}
          LIMIT {limit}"""  # noqa: S608 -- constants and the caller's constant limit


def candidates(limit: str, *, also: str = "") -> str:
    """The claim's candidates: up to `limit` rows with `locked` (the row and a try of its
    execution lock) and `rank` (1 is served first). Exactly one of the two picks runs, by the
    workspace's ordering; the plain one is the claim's index walk as it was before ordering.
    `also`: one more condition that does not depend on the row (a one-time filter)."""
    also = f" AND {also}" if also else ""
    return f"""SELECT p.id, p.concurrency_key, p.concurrency_limit,
           row_number() OVER (ORDER BY p.priority DESC, p.created_at, p.id) AS rank,
           {try_execution_lock("p.job_execution_id")} AS locked
    FROM ({fifo_pick(limit, also)}) AS p
    UNION ALL
    SELECT f.id, f.concurrency_key, f.concurrency_limit,
           row_number() OVER (ORDER BY f.share, f.priority DESC, f.created_at, f.id),
           EXISTS (SELECT 1 FROM pending_jobs l WHERE l.id = f.id FOR UPDATE SKIP LOCKED)
           AND {try_execution_lock("f.job_execution_id")}
    FROM ({fair_pick(limit, also)}) AS f"""  # noqa: S608 -- constants and the caller's constant limit


# Admission of the locked candidates ($1 workspace): the key rows of the keyed ones, locked in
# key order (SKIP LOCKED; a locked row reads its newest committed count), then each key admits
# its first `limit - running` candidates by rank; a key whose row is held admits none. Unkeyed
# candidates are admitted as they are.
ADMISSION = """key_room AS (
    SELECT k.concurrency_key, k.running FROM concurrency_keys k
    WHERE k.workspace_id = $1
      AND k.concurrency_key IN (SELECT concurrency_key FROM candidate
                                WHERE locked AND concurrency_key IS NOT NULL)
    ORDER BY k.concurrency_key
    FOR UPDATE SKIP LOCKED
), admitted AS (
    SELECT c.id, row_number() OVER (ORDER BY c.rank) AS ord
    FROM (SELECT id, rank, concurrency_key, concurrency_limit,
                 row_number() OVER (PARTITION BY concurrency_key ORDER BY rank) AS nth
          FROM candidate WHERE locked) AS c
    LEFT JOIN key_room k ON k.concurrency_key = c.concurrency_key
    WHERE c.concurrency_key IS NULL OR c.nth <= c.concurrency_limit - k.running
)"""


async def workspace_ordering(conn: Conn, workspace_id: UUID) -> Ordering:
    value = await conn.fetchval(
        "SELECT ordering FROM workspace_settings WHERE workspace_id = $1", workspace_id
    )
    return Ordering(value) if value is not None else Ordering.FIFO


SETTINGS_CHANGED = "workspace.settings_changed"


async def set_workspace_ordering(
    conn: Conn, workspace_id: UUID, ordering: Ordering, *, actor_id: UUID | None = None
) -> bool:
    """Store the workspace's ordering; True when it changed, and then one `SETTINGS_CHANGED`
    event (naming `actor_id`, the admin key) in the same transaction.

    Locks: the settings row (inserted with the defaults if missing, then FOR UPDATE, so two
    changes at once are serialised and each compares with what the other committed), then the
    event row. Claims read the row without a lock."""
    async with conn.transaction():
        # The default row first (a no-op when there is one), so the lock below always has a
        # row to take and two first changes at once are serialised too.
        await conn.execute(
            "INSERT INTO workspace_settings (workspace_id) VALUES ($1) ON CONFLICT DO NOTHING",
            workspace_id,
        )
        previous = Ordering(
            await conn.fetchval(
                "SELECT ordering FROM workspace_settings WHERE workspace_id = $1 FOR UPDATE",
                workspace_id,
            )
        )
        if previous is ordering:
            return False  # set already: no change, no event
        await conn.execute(
            "UPDATE workspace_settings SET ordering = $2, updated_at = now()"
            " WHERE workspace_id = $1",
            workspace_id,
            ordering.value,
        )
        await conn.execute(
            """
            INSERT INTO events (event_type, workspace_id, payload)
            SELECT $1, $2, jsonb_build_object('ordering', $3::text, 'previous', $4::text,
                                              'changed_by', $5::uuid)
            FROM (SELECT pg_notify($6, '')) AS wake
            """,
            SETTINGS_CHANGED,
            workspace_id,
            ordering.value,
            previous.value,
            actor_id,
            EVENTS_CHANNEL,
        )
    return True
