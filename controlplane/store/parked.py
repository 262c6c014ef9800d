"""What a replica asks of the database for all its parked runners at once, one statement each:
which of its workspace actors have claimable work (`claimable`, the dispatch safety tick) and
the parked sessions' liveness (`touch_sessions`).

The safety tick (actors/ticks.py) covers notifications lost while the listener reconnected. It
used to be one empty claim per actor and label set every tick; it is now one read per replica:
given the (workspace, label set) pairs of every actor with parked runners, which have at least
one pending row a claim for those labels could take. Only those actors are woken, and the woken
actor makes the real claim, so the claim alone decides what is handed out and in which order
(priority, fair share, concurrency-key admission, pauses of sessions): this read only has to
never miss a row the claim would take. It reads the claim's own filter (store/ordering.py's
`CLAIMABLE`: labels, concurrency keys below their limit in the snapshot, queue deadline, the
workspace's pause), so a filter added there is read here too. It may answer "yes" where the
claim then takes nothing (a row another claim holds, a busy head, an orphan, a key filled since
the snapshot, every parked session paused); that costs one claim, as every tick did before.

Locks: none. `claimable` is one read-only statement in its own snapshot (no FOR UPDATE), so it
waits for nobody and holds nothing a claim, an enqueue or a completion waits for. A row committed
after its snapshot was taken is not seen by it; that row's NOTIFY, or the next tick's read, does.

Cost: per pair, one probe of the workspace's rows on the claim's index in plain order, stopping at
the first claimable row (`LIMIT 1` in a lateral subquery, so the plan stays one probe per pair
and never a join over all of `pending_jobs`): an index lookup for a workspace with nothing pending,
and at worst a walk of the rows the pair's labels cannot take, as the empty claim it replaces did.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from uuid import UUID

from controlplane.domain.labels import LabelSet
from controlplane.store.ordering import CLAIMABLE
from controlplane.store.pool import Conn

# The claim's filter, for the pair being probed: its workspace and labels in place of the claim's
# parameters, nothing stepped over.
_PAIR_CLAIMABLE = (
    CLAIMABLE.replace("$1", "pair.workspace_id")
    .replace("$2::text[]", "pair.labels")
    .replace("$3::uuid[]", "'{}'::uuid[]")
)
assert "$" not in _PAIR_CLAIMABLE, "the claim's filter reads a parameter the tick cannot give"

# $1 each pair's workspace, in order; $2 and $3 the pairs' labels flattened: the pair's place
# (from 1) and one label, for each label of each pair. Returns the places of the pairs with work.
_CLAIMABLE_PAIRS = f"""
WITH sets AS (
    SELECT f.place, array_agg(f.label) AS labels
    FROM unnest($2::bigint[], $3::text[]) AS f(place, label)
    GROUP BY f.place
), pair AS (
    SELECT p.place, p.workspace_id, s.labels
    FROM unnest($1::uuid[]) WITH ORDINALITY AS p(workspace_id, place)
    JOIN sets s ON s.place = p.place
)
SELECT pair.place
FROM pair CROSS JOIN LATERAL (
    SELECT 1 FROM pending_jobs
    WHERE {_PAIR_CLAIMABLE}
    LIMIT 1
) AS found
"""  # noqa: S608 -- interpolates store/ordering.py's constant filter only

# The most pairs one statement probes (or sessions one statement stamps); more take several
# statements, one after another.
MAX_PAIRS = 1000


async def claimable(conn: Conn, pairs: Sequence[tuple[UUID, LabelSet]]) -> list[bool]:
    """For each (workspace, label set), in order: whether a claim for those labels in that
    workspace could take a pending row now (module docstring). A pair with no labels has
    nothing (a claim with no labels takes nothing)."""
    found: list[bool] = []
    for start in range(0, len(pairs), MAX_PAIRS):
        chunk = pairs[start : start + MAX_PAIRS]
        places = [place for place, (_, labels) in enumerate(chunk, 1) for _ in labels]
        labels = [label for _, each in chunk for label in each]
        rows = await conn.fetch(
            _CLAIMABLE_PAIRS, [workspace for workspace, _ in chunk], places, labels
        )
        with_work = {row["place"] for row in rows}
        found.extend(place in with_work for place in range(1, len(chunk) + 1))
    return found


async def touch_sessions(
    conn: Conn, sessions: Sequence[tuple[UUID, UUID]], throttle: timedelta
) -> None:
    """Liveness of many parked runners, (workspace, session) each: each session's
    `updated_at`, at most once per throttle window; a session not of the workspace given is left
    alone. One autocommitted statement per `MAX_PAIRS` sessions, in id order, so no statement
    holds more than that many row locks (a claim stamping its own session, or a capped claim
    locking it, waits for at most one such statement). Locks: the due session rows in id order,
    skipping any a claim or a revocation holds (liveness is best effort; the next window stamps
    it), so it never waits and never meets another multi-row locker in a different order."""
    ordered = sorted(sessions, key=lambda pair: pair[1])
    for start in range(0, len(ordered), MAX_PAIRS):
        await _touch(conn, ordered[start : start + MAX_PAIRS], throttle)


async def _touch(conn: Conn, sessions: Sequence[tuple[UUID, UUID]], throttle: timedelta) -> None:
    await conn.execute(
        """
        UPDATE runner_sessions SET updated_at = now()
        WHERE id IN (SELECT s.id FROM runner_sessions s
                     JOIN unnest($1::uuid[], $2::uuid[]) AS t(workspace_id, id)
                       ON s.id = t.id AND s.workspace_id = t.workspace_id
                     WHERE s.updated_at < now() - $3::interval
                     ORDER BY s.id FOR UPDATE OF s SKIP LOCKED)
        """,
        [workspace for workspace, _ in sessions],
        [session for _, session in sessions],
        throttle,
    )
