"""The event feed: writes (inside the caller's transaction) and cursor reads.

Ordering. `seq` comes from a sequence, so it is allocated in start order, not commit order: a
reader that simply asked for `seq > cursor` could skip an event whose transaction committed after
a later one. Each row therefore carries its transaction id, and a reader only returns rows whose
xid is below the xmin of its own snapshot: every transaction that could still add a row in that
range has finished. Within that stable prefix rows are read in (xid, seq) order, and the cursor is
the (xid, seq) pair of the last row returned.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from controlplane.domain.jobs import EventType, JobIdentity
from controlplane.store.pool import Conn
from controlplane.store.records import from_row, json_text, json_value

# Wakes event-feed long-polls on every replica. Claims and completions, two of the three commits
# of every job, do not notify: a NOTIFY takes a database-wide lock held through the commit's WAL
# flush, so notifying commits run one at a time (on the benchmark machine about 4,300 a second
# however many clients, against 17,000 plain commits). The replica that ran them wakes its own
# feed readers in-process; readers on other replicas see them at their replica's next safety
# re-check (`events.recheck_seconds`; actors/feed.py). Rarer events (cancel, expiry, requeue)
# still notify.
EVENTS_CHANNEL = "cp_events"


@dataclass(frozen=True, slots=True)
class Event:
    xid: int
    seq: int
    event_type: str
    workspace_id: UUID | None
    job_execution_id: UUID | None
    payload: dict[str, Any]
    created_at: datetime

    @property
    def cursor(self) -> str:
        return f"{self.xid}.{self.seq}"


def identity_payload(job: JobIdentity, **extra: Any) -> dict[str, Any]:
    return {
        "workflow_run_id": str(job.workflow_run_id),
        "workflow_run_attempt_id": str(job.workflow_run_attempt_id),
        "job_id": str(job.job_id),
        "job_execution_id": str(job.job_execution_id),
        **extra,
    }


async def write(
    conn: Conn, events: Iterable[tuple[EventType, JobIdentity, dict[str, Any]]]
) -> None:
    """Insert events in one statement, in the caller's transaction."""
    rows = [
        (str(kind), job.workspace_id, job.job_execution_id, json_text(p)) for kind, job, p in events
    ]
    if not rows:
        return
    # The notify wakes event-feed long-polls on every replica at commit; repeats are folded.
    await conn.execute(
        """
        INSERT INTO events (event_type, workspace_id, job_execution_id, payload)
        SELECT kind, ws, ex, body::jsonb
        FROM unnest($1::text[], $2::uuid[], $3::uuid[], $4::text[]) AS t(kind, ws, ex, body),
             (SELECT pg_notify($5, '')) AS wake
        """,
        [row[0] for row in rows],
        [row[1] for row in rows],
        [row[2] for row in rows],
        [row[3] for row in rows],
        EVENTS_CHANNEL,
    )


async def write_unknown(
    conn: Conn, kind: EventType, job_execution_id: UUID, payload: dict[str, Any]
) -> None:
    """An event about an execution we know only by id (no workspace, no run)."""
    await conn.execute(
        """
        INSERT INTO events (event_type, job_execution_id, payload)
        SELECT $1, $2, $3::jsonb FROM (SELECT pg_notify($4, '')) AS wake
        """,
        str(kind),
        job_execution_id,
        json_text({"job_execution_id": str(job_execution_id), **payload}),
        EVENTS_CHANNEL,
    )


def parse_cursor(cursor: str | None) -> tuple[int, int]:
    if not cursor:
        return (0, 0)
    xid, _, seq = cursor.partition(".")
    if not (xid.isdigit() and seq.isdigit()):
        raise ValueError("a cursor looks like '<xid>.<seq>'")
    return (int(xid), int(seq))


async def read(
    conn: Conn,
    *,
    after: tuple[int, int] = (0, 0),
    workspace_id: UUID | None = None,
    limit: int = 100,
) -> Sequence[Event]:
    """Events after the cursor, oldest first, only from the committed, stable prefix."""
    rows = await conn.fetch(
        """
        SELECT xid::text::bigint AS xid, seq, event_type, workspace_id, job_execution_id,
               payload::text AS payload, created_at
        FROM events
        WHERE (xid, seq) > ($1::text::xid8, $2::bigint)
          AND xid < pg_snapshot_xmin(pg_current_snapshot())
          AND ($3::uuid IS NULL OR workspace_id = $3)
        ORDER BY xid, seq
        LIMIT $4
        """,
        str(after[0]),
        after[1],
        workspace_id,
        limit,
    )
    return [from_row(Event, row, payload=json_value(row["payload"])) for row in rows]


async def stable_mark(conn: Conn) -> tuple[int, int]:
    """The cursor of the newest event in the stable prefix; (0, 0) when there is none.

    The stable prefix only grows at its end: an event that becomes readable later has an xid at
    or above the xmin this read used, so it sorts after the mark returned here."""
    row = await conn.fetchrow(
        """
        SELECT xid::text::bigint AS xid, seq
        FROM events
        WHERE xid < pg_snapshot_xmin(pg_current_snapshot())
        ORDER BY xid DESC, seq DESC
        LIMIT 1
        """
    )
    return (0, 0) if row is None else (row["xid"], row["seq"])


async def grown_since(
    conn: Conn, mark: tuple[int, int]
) -> tuple[tuple[int, int], set[UUID | None]]:
    """The stable prefix past `mark`: its new mark, and the workspaces that have events in it
    (None for events of no workspace). Reads only what was added since `mark`."""
    rows = await conn.fetch(
        """
        SELECT DISTINCT ON (workspace_id) workspace_id, xid::text::bigint AS xid, seq
        FROM events
        WHERE (xid, seq) > ($1::text::xid8, $2::bigint)
          AND xid < pg_snapshot_xmin(pg_current_snapshot())
        ORDER BY workspace_id, xid DESC, seq DESC
        """,
        str(mark[0]),
        mark[1],
    )
    newest = max(((row["xid"], row["seq"]) for row in rows), default=mark)
    return newest, {row["workspace_id"] for row in rows}
