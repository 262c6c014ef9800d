"""Claims: a runner session takes the first claimable pending execution (`claim`), the
dispatcher hands one to each of many parked sessions at once (`claim_batch`), and a runner's
poll stamps its session's liveness (`touch_session`; parked ones are stamped together by
store/parked.py).

The lock order is the queue's (store/queue.py): a claim takes the pending row FOR UPDATE SKIP
LOCKED before the execution lock, but only *tries* that lock and never waits for it, so it
cannot close a cycle with the transactions that wait for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from uuid import UUID

from controlplane.domain.jobs import (
    ClaimedJob,
    EventType,
    SessionClaims,
)
from controlplane.domain.labels import LabelSet
from controlplane.errors import RunnerSessionExhausted
from controlplane.metrics import claims_key_full
from controlplane.store import activations, ordering
from controlplane.store.ordering import KnownOrderings
from controlplane.store.pool import Conn
from controlplane.store.records import (
    IDENTITY_COLUMNS,
    POLICY_COLUMNS,
    identity,
    json_value,
    qualified,
)

# How many busy FIFO heads a claim steps over before it gives up for this attempt. A head is busy
# when another transaction holds its execution lock (an enqueue replay, a reconcile, the reaper).
MAX_BUSY_HEADS = 16

# How many rows in all a batch claim steps over (busy heads, orphans, and keyed rows beyond
# their key's free slots) before it gives up for this attempt.
MAX_STEPPED_OVER = 1000


# Pauses (store/pauses.py): nothing is handed out in a paused workspace (store/ordering.py's
# CLAIMABLE), nor to a paused session: primary-key probes of tables holding one row per paused
# thing, in the statement's snapshot, so a claim statement that starts after a pause committed
# hands out nothing. A batch serves only its sessions that are not paused (`wanted`), the k-th
# admitted row to the k-th of them.
_SESSION_NOT_PAUSED = "NOT EXISTS (SELECT 1 FROM paused_runners WHERE runner_session_id = $4)"

# The batch's sessions ($4, in the order they are served) that are not paused, as one array in
# that order: the k-th admitted row goes to its k-th element. One probe of paused_runners for
# them all; only when one of them is paused is each probed, to leave it out. (Each was probed,
# and the others numbered by a window and joined to the leases, at every batch claim, found or
# empty.)
_NOT_PAUSED = """CASE WHEN NOT EXISTS (SELECT 1 FROM paused_runners
                              WHERE runner_session_id = ANY($4::uuid[]))
         THEN $4::uuid[]
         ELSE ARRAY(SELECT t.session_id
                    FROM unnest($4::uuid[]) WITH ORDINALITY AS t(session_id, given)
                    WHERE NOT EXISTS (SELECT 1 FROM paused_runners p
                                      WHERE p.runner_session_id = t.session_id)
                    ORDER BY t.given) END"""


@dataclass(frozen=True, slots=True)
class ProvisionedClaim(ClaimedJob):
    """A claim by a capped session of a provisioner's runner, with what the queue-time and
    first-claim metrics label it by (the caller records them: it knows the delivery)."""

    provider_kind: str | None = None
    launch_kind: str | None = None  # None: no runner instance links this session
    activated_at: datetime | None = None  # the session's creation, on its first claim only


async def touch_session(conn: Conn, session: SessionClaims, throttle: timedelta) -> None:
    """Liveness: stamp `updated_at`, at most once per throttle window (autocommit)."""
    await conn.execute(
        """
        UPDATE runner_sessions SET updated_at = now()
        WHERE id = $1 AND workspace_id = $2 AND updated_at < now() - $3::interval
        """,
        session.runner_session_id,
        session.workspace_id,
        throttle,
    )


async def claim(
    conn: Conn,
    session: SessionClaims,
    *,
    liveness_throttle: timedelta = timedelta(seconds=10),
    orderings: KnownOrderings | None = None,
) -> ClaimedJob | None:
    """Claim the first claimable pending execution for `session` in its workspace's order
    (store/ordering.py: priority, then FIFO; or fair share), or return None. `orderings`: the
    replica's belief of the workspace's ordering, which picks the statement and learns from it
    (a claim without one believes plain and learns for itself only).

    Locks, in order: for a provisioned runner's session not yet claimed with, the assignment
    locks of its reservations (see `activations.lock_first_claim`); the session row FOR
    UPDATE (capped sessions only; serialises claims by one session so the cap holds), then per
    candidate: the pending row FOR UPDATE SKIP LOCKED (a row
    another claim holds is skipped), then a *try* of its execution lock, then for a keyed job
    its key row FOR UPDATE SKIP LOCKED (store/ordering.py; a key found full or held once the
    row is locked steps over the candidate, as a busy head). When the try fails the
    head is busy (enqueue, reconcile, complete or reaper hold it): we step to the next compatible
    row, unlike the reference, which returned nothing. We never wait on an execution lock while
    holding a pending row, so no cycle with the transactions that wait for it (they take the
    execution lock first, then the pending row).

    An orphan (a pending row whose execution already has a lease) is deleted and stepped over;
    it spends no claim and writes no event. A paused workspace or session finds nothing
    (`_SESSION_NOT_PAUSED`, and store/ordering.py's CLAIMABLE).
    """
    if not session.labels:
        await touch_session(conn, session, liveness_throttle)
        return None
    if session.max_claims is None:
        # Uncapped: each attempt is one autocommitted statement, one round trip.
        return await _claim_attempts(conn, session, liveness_throttle, orderings, None, None)
    async with conn.transaction():
        # A provisioned runner's first claim releases its reservation unit: its assignment locks
        # come first, before the session row, as in every transaction that takes both (the
        # provisioner revocation cascade revokes unused sessions under those locks).
        await activations.lock_first_claim(conn, session.runner_session_id)
        row = await conn.fetchrow(
            """
            UPDATE runner_sessions
            SET updated_at = CASE WHEN updated_at < now() - $3::interval THEN now()
                                  ELSE updated_at END
            WHERE id = $1 AND workspace_id = $2
            RETURNING max_claims, claims_used, revoked_at, provisioner_id, provider_runner_id,
                      created_at,
                      CASE WHEN provisioner_id IS NOT NULL THEN
                          (SELECT ARRAY[ri.provider_kind, ri.launch_kind] FROM runner_instances ri
                            WHERE ri.runner_session_id = $1 LIMIT 1) END AS origin
            """,
            session.runner_session_id,
            session.workspace_id,
            liveness_throttle,
        )
        exhausted = (
            row is None
            or row["revoked_at"] is not None
            or row["max_claims"] is None
            or row["claims_used"] >= row["max_claims"]
        )
        if not exhausted:
            assert row is not None
            claimed = await _claim_attempts(
                conn,
                session,
                liveness_throttle,
                orderings,
                row["provisioner_id"],
                row["provider_runner_id"],
            )
            if claimed is not None and row["provisioner_id"] is not None:
                # A provisioned runner's first claim gives its reservation unit back (4.14).
                await activations.release_on_first_claim(conn, session.runner_session_id)
                provider_kind, launch_kind = row["origin"] or (None, None)
                return ProvisionedClaim(
                    claimed.identity, claimed.required_labels, claimed.payload,
                    claimed.queued_at, claimed.started_at, provider_kind, launch_kind,
                    row["created_at"] if row["claims_used"] == 0 else None,
                )  # fmt: skip
            return claimed
    # Raised after commit, so the liveness touch of an exhausted session's poll is kept.
    raise RunnerSessionExhausted()


# The `job.claimed` event of each new lease, as a CTE of the claim statements: `leased` returns
# the identity columns, runner_session_id and started_at.
_LOGGED = f"""logged AS (
    INSERT INTO events (event_type, workspace_id, job_execution_id, payload)
    SELECT '{EventType.CLAIMED}', workspace_id, job_execution_id,
           jsonb_build_object('workflow_run_id', workflow_run_id,
                              'workflow_run_attempt_id', workflow_run_attempt_id,
                              'job_id', job_id, 'job_execution_id', job_execution_id,
                              'runner_session_id', runner_session_id, 'claimed_at', started_at)
    FROM leased
    RETURNING 1
)"""  # noqa: S608 -- interpolates an enum value only (EventType.CLAIMED)


# One claim attempt in one statement. $1 workspace, $2 session labels, $3 rows stepped over,
# $4 session, $5/$6 provisioned link, $7 liveness throttle, $8 capped. The candidate and its
# admission are store/ordering.py's (priority, concurrency keys, fair share); the statement for a
# workspace believed to order fairly (`fair`) carries the fair pick only, the other the plain pick
# only, and each returns `fair`, the setting its pick's guard read (store/ordering.py). A claim has
# one candidate, so it admits it by `ordering.ADMISSION_ONE` (no sort, window or join) and reads
# the setting once: when the pick found a row, its guard held in the statement's snapshot, so
# `fair` is the statement's own ordering; only an empty pick probes the setting again. What this
# spares is paid at every claim, and again in planning the first claims of each connection
# (store/ordering.py, "Plans").
def _claim_statement(fair: bool) -> str:
    return f"""
WITH candidate AS MATERIALIZED (
    {ordering.candidates(fair, "1", also=_SESSION_NOT_PAUSED)}
), {ordering.ADMISSION_ONE}, taken AS (
    DELETE FROM pending_jobs WHERE id = (SELECT id FROM admitted)
    RETURNING id, {IDENTITY_COLUMNS}, required_labels, payload, created_at,
              {POLICY_COLUMNS}
), leased AS (
    INSERT INTO running_jobs (pending_id, {IDENTITY_COLUMNS}, runner_session_id, provisioner_id,
        provider_runner_id, required_labels, runner_labels, payload, queued_at,
        {POLICY_COLUMNS})
    SELECT id, {IDENTITY_COLUMNS}, $4, $5, $6, required_labels, $2::text[], payload, created_at,
           {POLICY_COLUMNS}
    FROM taken
    ON CONFLICT (job_execution_id) DO NOTHING
    RETURNING {IDENTITY_COLUMNS}, runner_session_id, required_labels, payload, queued_at,
              started_at
), {_LOGGED}, touched AS (
    UPDATE runner_sessions
    SET updated_at = now(),
        claims_used = claims_used + CASE WHEN $8 THEN (SELECT count(*) FROM leased)::int ELSE 0 END
    WHERE id = $4 AND workspace_id = $1
      AND (updated_at < now() - $7::interval OR ($8 AND EXISTS (SELECT 1 FROM leased)))
    RETURNING 1
)
SELECT CASE WHEN c.id IS NULL THEN {ordering.FAIR} ELSE {str(fair).lower()} END AS fair,
       c.id AS candidate, c.locked,
       c.locked AND c.concurrency_key IS NOT NULL AND NOT EXISTS (SELECT 1 FROM taken) AS key_full,
       (SELECT count(*) FROM logged) AS logged,
       (SELECT count(*) FROM touched) AS touched, l.workspace_id, l.workflow_run_id,
       l.workflow_run_attempt_id, l.job_id, l.job_execution_id, l.project_id, l.required_labels,
       l.payload::text AS payload, l.queued_at, l.started_at
FROM (SELECT 1) AS one LEFT JOIN candidate c ON true LEFT JOIN leased l ON true
"""  # noqa: S608 -- constants only: store/ordering.py's SQL, IDENTITY_COLUMNS, POLICY_COLUMNS, _LOGGED, the pause probe


# By the workspace's ordering as the claim believes it: plain (False) or fair (True).
_CLAIM = {fair: _claim_statement(fair) for fair in (False, True)}


async def _claim_attempts(
    conn: Conn,
    session: SessionClaims,
    liveness_throttle: timedelta,
    orderings: KnownOrderings | None,
    provisioner_id: UUID | None,
    provider_runner_id: str | None,
) -> ClaimedJob | None:
    if orderings is None:
        orderings = KnownOrderings()
    fair = orderings.fair(session.workspace_id)
    switched = False  # the other statement runs at most once per claim
    stepped_over: list[UUID] = []
    while len(stepped_over) <= MAX_BUSY_HEADS:
        row = await conn.fetchrow(
            _CLAIM[fair],
            session.workspace_id,
            list(session.labels),
            stepped_over,
            session.runner_session_id,
            provisioner_id,
            provider_runner_id,
            liveness_throttle,
            session.max_claims is not None,
        )
        assert row is not None
        orderings.learn(session.workspace_id, row["fair"])
        if row["candidate"] is None:
            if row["fair"] != fair and not switched:
                # The belief was stale, so the guarded pick took nothing: the other statement.
                fair, switched = row["fair"], True
                continue
            return None
        if row["job_execution_id"] is None:
            # Busy (its execution lock is held), an orphan (deleted just now), or its key had no
            # free slot at admission: step over it.
            stepped_over.append(row["candidate"])
            if row["key_full"]:
                claims_key_full.inc()
            continue
        return ClaimedJob(
            identity=identity(row),
            required_labels=tuple(row["required_labels"]),
            payload=json_value(row["payload"]),
            queued_at=row["queued_at"],
            started_at=row["started_at"],
        )
    return None


# The most sessions one batch claim serves (bounds the statement and the locks it holds).
MAX_BATCH = 100


# Claims for several uncapped sessions with the same labels in one statement: the batch form of
# _CLAIM, pairing the k-th admitted candidate (in the workspace's order) with the k-th session.
# $1 workspace, $2 the sessions' labels, $3 rows stepped over, $4 the sessions in the order they
# are served. Rows whose execution lock is busy are skipped (not taken), a keyed row beyond its
# key's free slots is not admitted, and an orphan row is deleted without a lease; each leaves a
# session of the batch unserved, and the caller tries again with those rows stepped over. No
# liveness touch: the dispatcher stamps parked sessions in batches. One statement per ordering,
# as _CLAIM; every row has `fair`, and one row with no candidate says the pick found nothing.
def _claim_batch_statement(fair: bool) -> str:
    return f"""
WITH wanted AS MATERIALIZED (
    SELECT {_NOT_PAUSED} AS ids
), candidate AS MATERIALIZED (
    {ordering.candidates(fair, "(SELECT cardinality(ids) FROM wanted)")}
), {ordering.ADMISSION}, taken AS (
    DELETE FROM pending_jobs AS p USING admitted c WHERE p.id = c.id
    RETURNING p.id, {qualified("p", IDENTITY_COLUMNS)},
              p.required_labels, p.payload, p.created_at,
              {qualified("p", POLICY_COLUMNS)}, c.ord
), leased AS (
    INSERT INTO running_jobs (pending_id, {IDENTITY_COLUMNS}, runner_session_id,
        required_labels, runner_labels, payload, queued_at, {POLICY_COLUMNS})
    SELECT t.id, {qualified("t", IDENTITY_COLUMNS)}, w.ids[t.ord],
           t.required_labels, $2::text[], t.payload, t.created_at,
           {qualified("t", POLICY_COLUMNS)}
    FROM taken t, wanted w
    -- ord <= cardinality(ids): no more candidates than the pick's limit
    ORDER BY t.ord  -- the leases, and so their events, in the order they are given
    ON CONFLICT (job_execution_id) DO NOTHING
    RETURNING {IDENTITY_COLUMNS}, runner_session_id, required_labels, payload, queued_at,
              started_at
), {_LOGGED}
SELECT o.fair, c.id AS candidate, c.locked, t.id IS NOT NULL AS admitted, l.workspace_id,
       l.workflow_run_id, l.workflow_run_attempt_id,
       l.job_id, l.job_execution_id, l.project_id, l.runner_session_id, l.required_labels,
       l.payload::text AS payload, l.queued_at, l.started_at,
       (SELECT count(*) FROM logged) AS logged
FROM (SELECT {ordering.FAIR} AS fair) AS o
     LEFT JOIN (candidate c LEFT JOIN taken t ON t.id = c.id
                LEFT JOIN leased l ON l.job_execution_id = t.job_execution_id) ON true
"""  # noqa: S608 -- interpolates module constants only (store/ordering.py, IDENTITY_COLUMNS, POLICY_COLUMNS, _LOGGED)


_CLAIM_BATCH = {fair: _claim_batch_statement(fair) for fair in (False, True)}


async def claim_batch(
    conn: Conn,
    workspace_id: UUID,
    labels: LabelSet,
    session_ids: Sequence[UUID],
    orderings: KnownOrderings | None = None,
) -> dict[UUID, ClaimedJob]:
    """Claim for several uncapped sessions of one workspace with the same `labels`: the first
    claimable rows in the workspace's order, the k-th to the k-th session. Returns the claims by
    session; a session without one found nothing (the queue has fewer claimable rows than
    sessions).

    Same locks and order as `claim`'s attempt, for up to `MAX_BATCH` rows at once: the pending
    rows FOR UPDATE SKIP LOCKED, then a try of each one's execution lock, then the key rows of
    the keyed ones in key order, SKIP LOCKED (store/ordering.py). A row whose lock is busy (or
    an orphan) is stepped over and the unserved sessions try again, at most `MAX_BUSY_HEADS`
    such rows, as for one session; a keyed row its key could not admit is stepped over too,
    against the larger `MAX_STEPPED_OVER`, so a run of one key's jobs never hides the jobs
    behind it. Each round is one autocommitted statement, so when a retry round fails the
    claims of the rounds before it (committed) are returned rather than lost to an exception.
    Capped and provisioned sessions must use `claim` (their cap and reservation unit are per
    session). `orderings` picks the statement and learns from it, as in `claim`.
    """
    waiting = list(session_ids)
    if len(waiting) > MAX_BATCH or len(set(waiting)) != len(waiting):
        # One session twice could not tell its claims apart (one would be leased, never
        # delivered); more than MAX_BATCH would be silently cut short.
        raise ValueError("claim_batch takes at most MAX_BATCH distinct sessions")
    if not labels:
        return {}
    if orderings is None:
        orderings = KnownOrderings()
    fair = orderings.fair(workspace_id)
    switched = False  # the other statement runs at most once per batch
    claimed: dict[UUID, ClaimedJob] = {}
    stepped_over: list[UUID] = []
    busy = 0  # rows stepped over because their lock was busy or they were orphans
    while waiting and busy <= MAX_BUSY_HEADS and len(stepped_over) <= MAX_STEPPED_OVER:
        try:
            found = await conn.fetch(
                _CLAIM_BATCH[fair], workspace_id, list(labels), stepped_over, waiting
            )
        except Exception:
            if claimed:
                break  # earlier rounds committed: their claims must still reach their sessions
            raise
        orderings.learn(workspace_id, found[0]["fair"])
        rows = [row for row in found if row["candidate"] is not None]
        if not rows and found[0]["fair"] != fair and not switched:
            # The belief was stale, so the guarded pick took nothing: the other statement.
            fair, switched = found[0]["fair"], True
            continue
        for row in rows:
            if row["job_execution_id"] is None:
                stepped_over.append(row["candidate"])
                # A row its key did not admit (the key had fewer free slots than the batch had
                # rows of it) is no busy head: the budget for those is MAX_STEPPED_OVER.
                busy += row["admitted"] or not row["locked"]
                if row["locked"] and not row["admitted"]:
                    claims_key_full.inc()  # only a key refuses a locked candidate
                continue
            claimed[row["runner_session_id"]] = ClaimedJob(
                identity=identity(row),
                required_labels=tuple(row["required_labels"]),
                payload=json_value(row["payload"]),
                queued_at=row["queued_at"],
                started_at=row["started_at"],
            )
        if len(rows) < len(waiting):
            break  # fewer compatible rows than sessions: the rest find nothing
        waiting = [session for session in waiting if session not in claimed]
    return claimed
