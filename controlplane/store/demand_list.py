"""The installation walk's list of workspaces with demand, read from the `workspace_demand`
summary (sql/0022, sql/0030), and the summary's prune.

Each summary row keeps `oldest`, a lower bound of its workspace's oldest pending job: every
insert into pending_jobs lowers it (the trigger of sql/0030), nothing on the way out of the
queue touches it (a claim, cancel or expiry only makes the true oldest later, so the bound goes
stale, never wrong), and the prune raises a stale bound to the true oldest. The list reads the
rows in the order of their bounds, a page at a time from the index on `(oldest, workspace_id)`,
and probes pending_jobs for each row's true oldest startable job; it stops once the `limit`-th
oldest found sorts before the page's last bound, since no unread row's true oldest can come
earlier than its bound. So a round reads about the rows it lists, not one per workspace with
demand (issue 16: 10,000 probes, 20 ms), and the rows it read in vain (a bound too low, or no
job left) are handed to the prune, which raises or deletes them, so the next walk does not
read them again.
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime
from uuid import UUID

from controlplane.domain.rounds import WalkEntry
from controlplane.store import locks
from controlplane.store.pool import Conn

# A fingerprint of one workspace's live reservations (ids and counts; text, a numeric sum): equal
# fingerprints, the same live reservations, for `WalkEntry` and a walk's `WorkspaceRound`.
FINGERPRINT = """SELECT coalesce(sum(hashtextextended(r.id::text || ':' || r.count, 0)), 0)::text
          FROM reservations r WHERE r.workspace_id = {workspace} AND r.expires_at > now()"""

# The summary rows a walk may list: $1 the workspaces to consider (NULL: all), not paused, and
# admitted by the eligibility of provisioner $3 (NULL: none; `Eligibility.admits` in SQL).
_ADMITTED = """
      FROM workspace_demand d
      LEFT JOIN provisioner_eligibility e ON e.provisioner_id = $3
     WHERE ($1::uuid[] IS NULL OR d.workspace_id = ANY($1::uuid[]))
       AND NOT EXISTS (SELECT 1 FROM paused_workspaces pw WHERE pw.workspace_id = d.workspace_id)
       AND (e.provisioner_id IS NULL
            OR (e.mode = 'allow') = (d.workspace_id = ANY(e.workspace_ids)))"""

# One page of the walk's list: the next $2 admitted rows after ($4, $5) (NULL: from the first;
# $7 the nil uuid) in the order of their bounds (an index range of workspace_demand_oldest_idx),
# and the rows of workspaces $6 whatever their bound (those notified since the walk last visited
# them); for each, its oldest pending job not past its queue deadline, one probe of
# pending_jobs_workspace_oldest_idx (NULL: none, so no demand: every job is gone or past its
# deadline), and for those with one, the fingerprint of the workspace's live reservations.
_PAGE = f"""
WITH page AS MATERIALIZED (
    (SELECT d.workspace_id, d.oldest AS bound, true AS paged {_ADMITTED}
        AND (d.oldest, d.workspace_id)
            > (coalesce($4::timestamptz, '-infinity'), coalesce($5::uuid, $7::uuid))
      ORDER BY d.oldest, d.workspace_id LIMIT $2)
    UNION ALL
    SELECT d.workspace_id, d.oldest, false {_ADMITTED} AND d.workspace_id = ANY($6::uuid[])
), probed AS MATERIALIZED (
    SELECT g.workspace_id, g.bound, g.paged, o.oldest
      FROM page g
      LEFT JOIN LATERAL (
          SELECT p.created_at AS oldest FROM pending_jobs p
           WHERE p.workspace_id = g.workspace_id
             AND (p.expires_at IS NULL OR p.expires_at > now())
           ORDER BY p.created_at LIMIT 1) o ON true
)
SELECT workspace_id, bound, paged, oldest,
       CASE WHEN oldest IS NOT NULL
            THEN ({FINGERPRINT.format(workspace="probed.workspace_id")}) END AS reserved
  FROM probed
"""  # noqa: S608 -- interpolates constants only: _ADMITTED, FINGERPRINT

_NIL = UUID(int=0)


async def walk_list(
    conn: Conn,
    eligible: Collection[UUID] | None = None,
    *,
    provisioner_id: UUID | None = None,
    limit: int = 1000,
    changed: Collection[UUID] = (),
    page: int | None = None,
) -> tuple[list[WalkEntry], list[UUID]]:
    """The workspaces with pending jobs that could start (their workspace not paused, their
    queue deadline not passed), oldest demand first (then id): the `limit` oldest (one walk
    serves the oldest; the rest wait for a later round), and with them, whatever their age, those
    of `changed` (the walk's memory of workspaces notified since it last visited them, so new
    demand in a young workspace is walked the round it arrives); `eligible` None is all. With
    `provisioner_id`, only those its eligibility admits (store/eligibility.py; no row: all),
    read with the list, so every walk sees the eligibility as it stands and the limit counts
    admitted workspaces only.

    Each entry carries a fingerprint of the workspace's live reservations (ids and counts), so
    the walk can tell a workspace whose reservations changed or expired since it was last
    walked (actors/provisioning/changes.py). Also returns the rows the list read in vain, for
    `prune_demand`: those with no job that could start, and those whose bound let them be read
    though their oldest job comes after the listed ones.

    Reads the summary a page at a time in the order of its bounds (the module docstring says
    why it may stop); the result is the one the GROUP BY over pending_jobs gave
    (tests/store/test_workspace_demand.py compares them after random operations). A list that
    needs a second page reads it in a later snapshot: a row the prune raised meanwhile may be
    read twice (kept once), and one an insert lowered below the first page is missed, as a list
    read a moment earlier would have missed it; that insert notified, so the walk lists it
    anyway (`changed`), or its next round does. `page` is the rows a page reads (default a little
    over `limit`, so a walk whose bounds are fresh reads one page). Takes no lock."""
    size = page or limit + limit // 8 + 8
    after: tuple[datetime, UUID] | None = None  # the last page row read
    marked = list(changed)
    found: dict[UUID, tuple[datetime, UUID, int]] = {}  # page rows with a job that could start
    extra: dict[UUID, tuple[datetime, UUID, int]] = {}  # rows of `changed` with one
    probed: dict[UUID, tuple[datetime, datetime | None]] = {}  # every row read: bound, oldest
    while True:
        rows = await conn.fetch(
            _PAGE,
            None if eligible is None else list(eligible),
            size,
            provisioner_id,
            None if after is None else after[0],
            None if after is None else after[1],
            marked,
            _NIL,
        )
        marked = []
        paged = 0
        for r in rows:
            workspace_id, oldest = r["workspace_id"], r["oldest"]
            probed.setdefault(workspace_id, (r["bound"], oldest))
            entry = None if oldest is None else (oldest, workspace_id, int(r["reserved"]))
            if not r["paged"]:
                if entry is not None:
                    extra[workspace_id] = entry
                continue
            paged += 1
            after = (r["bound"], workspace_id)
            if entry is not None:
                found.setdefault(workspace_id, entry)
        if paged < size:
            break  # the whole summary is read
        oldest_first = sorted(found.values())
        if len(oldest_first) >= limit and after and oldest_first[limit - 1][:2] <= after:
            break  # no unread row's oldest job sorts before the last one listed
    oldest_first = sorted(found.values())
    listed = {e[1]: e for e in oldest_first[:limit]}
    listed.update(extra)
    # Read in vain: no job that could start, or a bound below a later oldest job; a row whose
    # bound is its oldest job (or one past its queue deadline) would be read again all the same.
    in_vain = [
        workspace_id
        for workspace_id, (bound, oldest) in probed.items()
        if workspace_id not in listed and (oldest is None or bound < oldest)
    ]
    entries = [WalkEntry(w, reserved) for _, w, reserved in sorted(listed.values())]
    return entries, in_vain


async def demand_workspaces(
    conn: Conn,
    eligible: Collection[UUID] | None = None,
    *,
    provisioner_id: UUID | None = None,
    limit: int = 1000,
) -> list[UUID]:
    """The workspaces of `walk_list`, in its order."""
    entries, _ = await walk_list(conn, eligible, provisioner_id=provisioner_id, limit=limit)
    return [e.workspace_id for e in entries]


async def prune_demand(conn: Conn, candidates: Collection[UUID]) -> int:
    """Delete the `workspace_demand` rows of `candidates` that have no pending row, and raise
    the bound of the others to their oldest pending row (the bound a claim, cancel or expiry
    left stale); the number deleted. A candidate whose key is busy (an insert into pending_jobs
    of that workspace has not committed) is left for a later prune.

    Locks: try-locks the `cp_workspace_demand` advisory keys of the candidates, exclusive, in
    one statement (never waits, so no order matters); then, in new statements whose snapshots
    see every insert that held the key before, deletes the rows still without a pending row and
    updates the bounds that moved (row locks in workspace order). The insert trigger holds the
    key shared to its commit, so a row is never deleted under a pending row that is not visible
    yet, and a bound is never raised above a row that is not visible yet; an insert that comes
    after waits for this transaction at its trigger, and lowers the bound if its row is older.
    Runs in its own transaction."""
    if not candidates:
        return 0
    async with conn.transaction():
        locked = await conn.fetchval(
            f"""
            SELECT coalesce(array_agg(w), '{{}}') FROM unnest($1::uuid[]) AS w
             WHERE pg_try_advisory_xact_lock({locks.sql_key(locks.WORKSPACE_DEMAND, "w")})
            """,  # noqa: S608 -- interpolates a constant expression only: locks.sql_key
            sorted(candidates),
        )
        if not locked:
            return 0
        status = await conn.execute(
            """
            DELETE FROM workspace_demand d
             WHERE d.workspace_id = ANY($1::uuid[])
               AND NOT EXISTS (SELECT 1 FROM pending_jobs p WHERE p.workspace_id = d.workspace_id)
            """,
            locked,
        )
        await conn.execute(
            """
            UPDATE workspace_demand d SET oldest = o.oldest
              FROM (SELECT s.workspace_id, m.oldest
                      FROM workspace_demand s
                      CROSS JOIN LATERAL (
                          SELECT p.created_at AS oldest FROM pending_jobs p
                           WHERE p.workspace_id = s.workspace_id
                           ORDER BY p.created_at LIMIT 1) m
                     WHERE s.workspace_id = ANY($1::uuid[]) AND s.oldest < m.oldest
                     ORDER BY s.workspace_id
                       FOR UPDATE OF s) AS o
             WHERE d.workspace_id = o.workspace_id
            """,
            locked,
        )
    return int(status.split()[-1])
