"""Ordering of the queue (issue 14): priority, concurrency keys and fair share, as the SQL the
claims (store/claiming.py) are built from, and the per-workspace `ordering` setting.

Order. Plain (`fifo`, the default): higher `priority` first, then the FIFO key (created_at, id),
walked on the index `pending_jobs (workspace_id, priority DESC, created_at, id)`; with every
priority 0 that walk is the one the old FIFO index gave. `fair`: a job's share is the running
executions of its project plus its place among its project's claimable jobs (1 for the head), so
the project with the fewest running goes first and the next of the same project is weighed as if
its head already ran; ties by priority, then age.

The fair pick (`fair_pick`). A row's fair key is (share, -priority, created_at, id); the rows of
share 1 are exactly the heads (first claimable rows) of the projects with no lease. The plain
walk, with the plain claim's filter and on its index, meets each project's head before the
project's other rows, so the first `limit` rows of projects with no lease, one per project, in
walk order, are the best `limit` rows of share 1: when there are that many, they are the pick
(`_free_heads`). A single claim stops at the first such row, which is its project's head since
every row before it is of a leased project: where the walk's first row has no lease on its
project (the plain pick; no project can have a share below 1), the fair claim costs the plain
walk and one probe of `running_jobs (workspace_id, project_id)`. The walk is bounded (FAIR_WALK
rows beyond the claim's), so a leased project owning the front of the queue costs at most that
many rows stepped over, never its backlog. When the heads found are too few: a walk that ended
before its bound holds every claimable row, and ranking it (each row's share counted) is the full
ranking; otherwise every project with pending rows is probed (`_every_project`: a skip scan of
`pending_jobs (workspace_id, project_id, priority DESC, created_at, id)`, sql/0024, each one's
leases counted and its first rows walked), which costs the workspace's projects. A batch takes
its rows by the same three ways: the k-th row of a project has share running + k, so the first
rows of the ranking are those found, in the same order (tests/store/test_fair_pick.py compares
all three ways with the full ranking, row for row). One statement holds all three; one-time
filters (InitPlans, evaluated when first read, `AND` stopping at the first false) run only the
ways a claim needs. It is SQL built here rather than a plpgsql function (which would need a
migration): it stays one statement of the claim, the tests call it with any walk bound, and its
plans are the planner's like every other claim's.

One statement per ordering. A claim runs the plain statement (`fifo_candidates`: the index walk
alone) or the fair one (`fair_candidates`: the fair pick alone), never one carrying both:
a statement with both picks made every plain claim plan and start the fair one too (planning
0.58 -> 1.1 ms, execution 0.3 -> 0.6 ms per claim). The claim picks the statement by the
replica's `KnownOrderings` (plain unless it has seen the workspace order fairly). Each pick keeps
its guard (`NOT FAIR` / `FAIR`, one probe of workspace_settings in the statement's snapshot), so
a stale belief picks nothing rather than a row in the wrong order; the statement also returns
the `FAIR` it read, the claim learns it, and when its pick was empty because the belief was
wrong it runs the other statement, once (store/claiming.py). So no notification is needed to
keep the belief: a change of the setting, made on any replica, costs each replica one extra
statement at its next claim in the workspace, and no claim is ever ordered by the old setting
once the change has committed.

Plans. asyncpg prepares a statement once per connection; after five custom plans PostgreSQL keeps
a generic one when its estimate is below the custom plans' (plus a planning charge). A custom
plan of the plain pick sees the session's labels (the statistics say nearly every row matches),
a generic one does not (`<@` an unknown array: 0.5% of the rows), so the plain statement alone
estimated its generic plan twenty times dearer and was planned at every claim (0.4 ms). The plain
pick reads the labels and the stepped-over rows as one-time subqueries (`PLAIN_CLAIMABLE`), so
every plan estimates them alike and the generic plan, the same index walk, is kept. (The statement
carrying both picks kept its generic plan only because its fair arm's custom estimate was the
larger.) That generic plan must be the walk whatever the statistics: it guesses the workspace's
rows, and `<@` a one-time subquery matches 0.5% of them by the planner's default, so with many
small workspaces (a guess of one or two rows) it expected the walk to read every row anyway, and
reading them all through a bitmap scan and sorting them cost it a few percent less; an ANALYZE
could flip the plan, and the sort then read the whole workspace at every claim (1,300 to 1,450
rows a job at 3,000 pending; docs/benchmarks.md, "The SQL lifecycle's slow runs"). So the label
test is wrapped in `coalesce(..., false)`, which the planner estimates at one row in two (labels
are never NULL, so it decides the same), and sql/0028 has it guess a workspace at 1% of the
pending rows; with both, stopping at the first claimable row costs a small fraction of the sort
(tests/store/test_ordering_choice.py forces the statistics of such installations).

Before a connection keeps the generic plan it plans its first five claims for their parameters,
so a pool of new connections plans the claim statement five times per connection: at 200 runners
of 15 claims each a third of the claims were planned, and the statement's size cost there as
much as at each execution. So the single claim carries no more than it needs: its one candidate
has rank 1 (`_rank`, no window), is admitted by `ADMISSION_ONE` (no sort, window or join), and
the claim reads the ordering setting once when its pick found a row (store/claiming.py).

The fair pick reads the same `PLAIN_CLAIMABLE`, so it keeps a generic plan too, and its walks'
bounds are one-time subqueries (a LIMIT of unknown value is planned as 10% of the rows): with a
constant bound above the few claimable rows the planner expected, its plans sorted every row of
the workspace (10,000 for one claim) or of each project instead of walking them in index order.
Its reads of running_jobs (whether a walked row's project holds a lease, the leases by project
when every project is probed) are planned against a small table as reads of all of it, and the
kept plan goes on reading it whole as its dead rows grow until autovacuum: with every project
leased (200 leases) that was measured to slow fair claims where a plan made at each claim did
not (docs/benchmarks.md, notes on the fair pick from the plain walk; not fixed).

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
from controlplane.store.records import qualified


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
_CLAIMABLE = """workspace_id = $1 AND required_labels <@ LABELS
            AND NOT (id = ANY(STEPPED_OVER))
            AND (concurrency_key IS NULL
                 OR EXISTS (SELECT 1 FROM concurrency_keys k
                            WHERE k.workspace_id = $1
                              AND k.concurrency_key = pending_jobs.concurrency_key
                              AND k.running < pending_jobs.concurrency_limit))
            AND (expires_at IS NULL OR expires_at > now())
            AND NOT EXISTS (SELECT 1 FROM paused_workspaces WHERE workspace_id = $1)"""

# With the labels and the rows stepped over as plain parameters, for statements planned each
# time (tests/store/test_fair_pick.py's full ranking); the claims read `PLAIN_CLAIMABLE`.
CLAIMABLE = _CLAIMABLE.replace("LABELS", "$2::text[]").replace("STEPPED_OVER", "$3::uuid[]")

# As the plain and the fair pick read it: the labels and the rows stepped over as one-time
# subqueries, so the planner estimates them as it would in a generic plan and keeps one (module
# docstring).
PLAIN_CLAIMABLE = _CLAIMABLE.replace(
    "required_labels <@ LABELS", "coalesce(required_labels <@ (SELECT $2::text[]), false)"
).replace("STEPPED_OVER", "(SELECT $3::uuid[])::uuid[]")

# The plain claim's order, walked on the index.
PLAIN_ORDER = "priority DESC, created_at, id"

_PICK_COLUMNS = "id, job_execution_id, concurrency_key, concurrency_limit, priority, created_at"


def fifo_pick(limit: str, also: str) -> str:
    """The first `limit` claimable rows in plain order, locked (SKIP LOCKED: a row another claim
    holds is not seen), for a workspace that does not order fairly."""
    return f"""SELECT {_PICK_COLUMNS} FROM pending_jobs
          WHERE {PLAIN_CLAIMABLE} AND NOT {FAIR}{also}
          ORDER BY {PLAIN_ORDER}
          LIMIT {limit}
          FOR UPDATE SKIP LOCKED"""  # noqa: S608 -- constants and the caller's constant limit


# How many claimable rows beyond the claim's own the fair pick walks in plain order, looking for
# the heads of projects with no lease, before it probes every project (module docstring).
FAIR_WALK = 16


def _leases(row: str) -> str:
    """The leases of `row`'s project: a probe of `running_jobs (workspace_id, project_id)`."""
    return f"""(SELECT count(*) FROM running_jobs r
                 WHERE r.workspace_id = $1 AND r.project_id = {row}.project_id)"""  # noqa: S608


def _unleased(row: str) -> str:
    """Whether `row`'s project holds no lease: a probe of `running_jobs (workspace_id,
    project_id)` that stops at its first entry."""
    return f"""NOT EXISTS (SELECT 1 FROM running_jobs r
                           WHERE r.workspace_id = $1 AND r.project_id = {row}.project_id)"""  # noqa: S608


def _walk(limit: str, also: str, bound: int) -> str:
    """The first `bound` + `limit` claimable rows in plain order, on the plain claim's index."""
    return f"""SELECT {_PICK_COLUMNS}, project_id FROM pending_jobs
               WHERE {PLAIN_CLAIMABLE} AND {FAIR}{also}
               ORDER BY {PLAIN_ORDER}
               LIMIT (SELECT {bound} + {limit})"""  # noqa: S608 -- constants and the caller's limit


def _free_heads(limit: str, bound: int) -> str:
    """The first `limit` heads (first claimable rows) of projects with no lease found on the
    walk (the statement's `walk`, `_walk`'s rows, read as far as needed and no further), in
    plain order, each of share 1 and `head`. More than one needs each project's first
    row on the walk (`nth`), so the walk is read whole. One is taken lazily: the walk stops at
    the first row of a project with no lease, which is that project's head (every row before it
    is of a leased project), or else at its last row, returned as no `head`: so no row at all
    says the walk ended before its bound (it holds every claimable row)."""
    if limit == "1":
        return f"""SELECT {_PICK_COLUMNS}, 1::bigint AS share, head FROM (
                       SELECT *, row_number() OVER (ORDER BY {PLAIN_ORDER}) AS step,
                              {_unleased("w")} AS head
                       FROM walk AS w) AS w
                   WHERE head OR step = {bound} + 1
                   ORDER BY {PLAIN_ORDER}
                   LIMIT 1"""  # noqa: S608 -- constants
    return f"""SELECT {_PICK_COLUMNS}, 1::bigint AS share, true AS head FROM (
                   SELECT *, row_number() OVER (PARTITION BY project_id ORDER BY {PLAIN_ORDER})
                          AS nth
                   FROM walk AS w) AS w
               WHERE nth = 1 AND {_unleased("w")}
               ORDER BY {PLAIN_ORDER}
               LIMIT {limit}"""  # noqa: S608 -- constants and the caller's limit


def _every_project(limit: str, also: str) -> str:
    """The first `limit` rows of the full ranking found by probing every project with pending
    rows: a skip scan of `pending_jobs (workspace_id, project_id, priority DESC, created_at,
    id)` finds them, and each one's first `limit` claimable rows are walked on that index
    (sql/0024); the workspace's leases are counted by project in one read of running_jobs (a
    generic plan may read that small table whole, so once rather than once a project). Each
    project's rows have shares running + 1, running + 2, ..., so the first `limit` rows overall
    hold at most each project's first `limit`."""
    return f"""WITH RECURSIVE projects (project_id) AS (
                  (SELECT project_id FROM pending_jobs
                   WHERE workspace_id = $1 AND {FAIR}{also}
                   ORDER BY project_id LIMIT 1)
                  UNION ALL
                  SELECT (SELECT n.project_id FROM pending_jobs n
                          WHERE n.workspace_id = $1 AND n.project_id > projects.project_id
                          ORDER BY n.project_id LIMIT 1)
                  FROM projects WHERE projects.project_id IS NOT NULL
              )
              SELECT {qualified("heads", _PICK_COLUMNS)},
                     coalesce(leased.running, 0) + row_number() OVER (
                         PARTITION BY projects.project_id ORDER BY {PLAIN_ORDER}) AS share
              FROM projects
              LEFT JOIN (SELECT project_id, count(*) AS running FROM running_jobs
                         WHERE workspace_id = $1 GROUP BY project_id) AS leased
                     ON leased.project_id = projects.project_id
              CROSS JOIN LATERAL (
                  SELECT {_PICK_COLUMNS}
                  FROM pending_jobs
                  WHERE {PLAIN_CLAIMABLE} AND project_id = projects.project_id
                  ORDER BY {PLAIN_ORDER}
                  LIMIT (SELECT {limit})) AS heads
              WHERE projects.project_id IS NOT NULL"""  # noqa: S608 -- constants


def fair_pick(limit: str, also: str, bound: int = FAIR_WALK) -> str:
    """The first `limit` claimable rows in fair order, not locked (the caller tries each row's
    lock, so a row another claim holds is stepped over, not silently replaced), for a workspace
    that orders fairly; `share` ranks them. The first of the three ways (module docstring, "The
    fair pick") that decides is chosen by one-time filters, so only the ways needed run; `bound`
    bounds the walk (FAIR_WALK rows beyond the claim's)."""
    heads = "(SELECT count(*) FROM free WHERE head)"
    if limit == "1":  # the walk for the heads ended before its bound: no row (`_free_heads`)
        whole = "NOT EXISTS (SELECT 1 FROM free)"
    else:
        whole = f"(SELECT count(*) FROM walk) < {bound} + {limit}"  # noqa: S608
    return f"""WITH walk AS MATERIALIZED ({_walk(limit, also, bound)}),
          free AS MATERIALIZED ({_free_heads(limit, bound)})
          SELECT {_PICK_COLUMNS}, share FROM (
              SELECT {_PICK_COLUMNS}, share FROM free WHERE {heads} >= {limit}
              UNION ALL
              SELECT {_PICK_COLUMNS}, {_leases("walk")}
                     + row_number() OVER (PARTITION BY project_id ORDER BY {PLAIN_ORDER})
              FROM walk WHERE {heads} < {limit} AND {whole}
              UNION ALL
              SELECT * FROM ({_every_project(limit, also)}) AS probed
              WHERE {heads} < {limit} AND NOT {whole}) AS ranked
          ORDER BY share, {PLAIN_ORDER}
          LIMIT {limit}"""  # noqa: S608 -- constants and the caller's constant limit


def _rank(limit: str, order: str) -> str:
    """The candidates' rank (1 is served first) in `order`: a constant for one candidate, which
    spares every single claim a sort and a window over its one row."""
    return "1::bigint" if limit == "1" else f"row_number() OVER (ORDER BY {order})"


def fifo_candidates(limit: str, *, also: str = "") -> str:
    """The plain claim's candidates: up to `limit` rows with `locked` (the row and a try of its
    execution lock) and `rank` (1 is served first); the claim's index walk as it was before
    ordering, and nothing of the fair pick. None in a workspace that orders fairly (its guard).
    `also`: one more condition that does not depend on the row (a one-time filter)."""
    also = f" AND {also}" if also else ""
    return f"""SELECT p.id, p.concurrency_key, p.concurrency_limit,
           {_rank(limit, "p.priority DESC, p.created_at, p.id")} AS rank,
           {try_execution_lock("p.job_execution_id")} AS locked
    FROM ({fifo_pick(limit, also)}) AS p"""  # noqa: S608 -- constants and the caller's constant limit


def fair_candidates(limit: str, *, also: str = "") -> str:
    """The fair claim's candidates, as `fifo_candidates` gives them (`locked`, `rank`), from the
    fair pick alone; none in a workspace that does not order fairly (its guard)."""
    also = f" AND {also}" if also else ""
    return f"""SELECT f.id, f.concurrency_key, f.concurrency_limit,
           {_rank(limit, "f.share, f.priority DESC, f.created_at, f.id")} AS rank,
           EXISTS (SELECT 1 FROM pending_jobs l WHERE l.id = f.id FOR UPDATE SKIP LOCKED)
           AND {try_execution_lock("f.job_execution_id")} AS locked
    FROM ({fair_pick(limit, also)}) AS f"""  # noqa: S608 -- constants and the caller's constant limit


def candidates(fair: bool, limit: str, *, also: str = "") -> str:
    """The candidates of the claim statement for a workspace believed to order fairly (`fair`)
    or not: one pick, guarded, so a wrong belief picks nothing (module docstring)."""
    return (fair_candidates if fair else fifo_candidates)(limit, also=also)


class KnownOrderings:
    """A replica's belief of which workspaces order fairly, to pick the claim statement by: the
    fair workspaces its claims have seen; any other is believed plain. Each claim statement
    returns the setting its guard read (`FAIR`, in the statement's snapshot) and the claim
    `learn`s it, so a change made on any replica corrects this at the next claim in the
    workspace. It holds one entry per fair workspace, so it never outgrows the settings table."""

    def __init__(self) -> None:
        self._fair: set[UUID] = set()

    def fair(self, workspace_id: UUID) -> bool:
        return workspace_id in self._fair

    def learn(self, workspace_id: UUID, fair: bool) -> None:
        if fair:
            self._fair.add(workspace_id)
        else:
            self._fair.discard(workspace_id)


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

# `ADMISSION` for a single claim's one candidate, with the same locks and the same answer: its key
# row (if it has a key) locked SKIP LOCKED, and the candidate admitted while that key's newest
# committed count is below its limit (a held key row admits nothing). No window, sort or join: an
# unkeyed candidate, the only kind when no job uses a key, never reads `key_room` (the OR stops at
# its first true arm; were `key_room` read anyway, a NULL key matches no row and locks none).
ADMISSION_ONE = """key_room AS (
    SELECT k.running FROM concurrency_keys k
    WHERE k.workspace_id = $1
      AND k.concurrency_key = (SELECT concurrency_key FROM candidate WHERE locked)
    FOR UPDATE SKIP LOCKED
), admitted AS (
    SELECT id FROM candidate
    WHERE locked AND (concurrency_key IS NULL OR concurrency_limit > (SELECT running FROM key_room))
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
