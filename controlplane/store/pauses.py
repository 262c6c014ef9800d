"""Operator pauses and drains (domain/pauses.py): set and clear them, each change audited in the
event feed and announced to every replica.

A pause is a row (`paused_workspaces`, `paused_runners`); a drain is `runner_instances.drained_at`.
The claim statements (store/claiming.py) and the idle-runner binding (store/demand.py) read them,
so the database is the authority on every replica. Each change commits, in one transaction, the
row, one event (`workspace.paused`, ...) and `NOTIFY cp_paused '<kind>|<0/1>|<workspace>|<id>'`,
which every replica's listener turns into wake-ups (actors/dispatch.py): a paused runner's parked
poll is answered, a resumed workspace's parked runners claim at once.

Idempotent: a second pause (resume, drain, undrain) finds the state already so, changes nothing,
writes no event and answers the state as it is (the first pause's time and reason).

Locks, each transaction: the one target row (insert with ON CONFLICT, delete or update; a second
pause of the same target waits for the first to commit, then finds it) -> one event insert. A
runner pause's insert also takes KEY SHARE on its session row (the foreign key), which no claim,
heartbeat or revocation conflicts with (they take the weaker NO KEY UPDATE). A drain updates one
runner-instance row, as the binding does after locking it (store/demand.py), so the two
serialise on that row: a binding that locks the runner after the drain committed re-checks it and
drops it. No transaction here takes a second row lock, so none can close a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from uuid import UUID

import asyncpg

from controlplane.domain.pauses import (
    Operator,
    PauseEvent,
    PauseKind,
    PauseState,
    change_payload,
)
from controlplane.errors import Conflict, NotFound
from controlplane.store.events import EVENTS_CHANNEL
from controlplane.store.pool import Conn
from controlplane.store.records import json_text

PAUSED_CHANNEL = "cp_paused"

# A set or clear that keeps finding the opposite state (a pause and a resume racing each other
# over and over) gives up after this many reads and answers 409.
_ATTEMPTS = 3


@dataclass(frozen=True, slots=True)
class _Statements:
    """Per kind: set (returns the new row), clear (returns the old one), read (one row for a
    known target, with `since` NULL when it is not paused; no row for an unknown one). Every
    statement returns workspace_id, target_id, since, reason; $1 is the target's id."""

    set: str
    clear: str
    read: str
    events: tuple[PauseEvent, PauseEvent]  # (set, cleared)
    unknown: str  # the 404's message


_STATEMENTS = {
    PauseKind.WORKSPACE: _Statements(
        set="""
            INSERT INTO paused_workspaces (workspace_id, paused_by, reason) VALUES ($1, $2, $3)
            ON CONFLICT (workspace_id) DO NOTHING
            RETURNING workspace_id, workspace_id AS target_id, paused_at AS since, reason
        """,
        clear="""
            DELETE FROM paused_workspaces WHERE workspace_id = $1
            RETURNING workspace_id, workspace_id AS target_id, paused_at AS since, reason
        """,
        # Workspaces are not registered anywhere: every id is known, and may be paused ahead.
        read="""
            SELECT $1::uuid AS workspace_id, $1::uuid AS target_id, p.paused_at AS since, p.reason
            FROM (SELECT 1) AS one
            LEFT JOIN paused_workspaces p ON p.workspace_id = $1
        """,
        events=(PauseEvent.WORKSPACE_PAUSED, PauseEvent.WORKSPACE_RESUMED),
        unknown="no such workspace",
    ),
    PauseKind.RUNNER: _Statements(
        set="""
            INSERT INTO paused_runners (runner_session_id, workspace_id, paused_by, reason)
            SELECT id, workspace_id, $2, $3 FROM runner_sessions WHERE id = $1
            ON CONFLICT (runner_session_id) DO NOTHING
            RETURNING workspace_id, runner_session_id AS target_id, paused_at AS since, reason
        """,
        clear="""
            DELETE FROM paused_runners WHERE runner_session_id = $1
            RETURNING workspace_id, runner_session_id AS target_id, paused_at AS since, reason
        """,
        read="""
            SELECT s.workspace_id, s.id AS target_id, p.paused_at AS since, p.reason
            FROM runner_sessions s LEFT JOIN paused_runners p ON p.runner_session_id = s.id
            WHERE s.id = $1
        """,
        events=(PauseEvent.RUNNER_PAUSED, PauseEvent.RUNNER_RESUMED),
        unknown="no such runner session",
    ),
    PauseKind.RUNNER_INSTANCE: _Statements(
        set="""
            UPDATE runner_instances SET drained_at = now(), drained_by = $2, drain_reason = $3
            WHERE id = $1 AND drained_at IS NULL
            RETURNING workspace_id, id AS target_id, drained_at AS since, drain_reason AS reason
        """,
        clear="""
            UPDATE runner_instances SET drained_at = NULL, drained_by = NULL, drain_reason = NULL
            WHERE id = $1 AND drained_at IS NOT NULL
            RETURNING workspace_id, id AS target_id, NULL::timestamptz AS since, NULL AS reason
        """,
        read="""
            SELECT workspace_id, id AS target_id, drained_at AS since, drain_reason AS reason
            FROM runner_instances WHERE id = $1
        """,
        events=(PauseEvent.RUNNER_INSTANCE_DRAINED, PauseEvent.RUNNER_INSTANCE_UNDRAINED),
        unknown="no such runner instance",
    ),
}


_TARGET_KEY = {
    PauseKind.WORKSPACE: "workspace_id",
    PauseKind.RUNNER: "runner_session_id",
    PauseKind.RUNNER_INSTANCE: "runner_instance_id",
}


def _state(kind: PauseKind, row: asyncpg.Record, *, paused: bool, changed: bool) -> PauseState:
    return PauseState(
        kind=kind,
        target_id=row["target_id"],
        workspace_id=row["workspace_id"],
        paused=paused,
        since=row["since"] if paused else None,
        reason=row["reason"] if paused else None,
        changed=changed,
    )


async def change(
    conn: Conn,
    kind: PauseKind,
    target_id: UUID,
    *,
    paused: bool,
    operator: Operator,
    reason: str | None,
) -> PauseState:
    """Pause (`paused=True`) or resume a workspace or runner session, drain or undrain a runner
    instance. Raises NotFound for an unknown runner session or instance. Locks: see the module."""
    statements = _STATEMENTS[kind]
    async with conn.transaction():
        for _ in range(_ATTEMPTS):
            if paused:
                row = await conn.fetchrow(statements.set, target_id, operator.key_id, reason)
            else:
                row = await conn.fetchrow(statements.clear, target_id)
            if row is not None:
                state = _state(kind, row, paused=paused, changed=True)
                event = statements.events[0 if paused else 1]
                await _announce(conn, event, state, operator, reason)
                return state
            # Nothing to change, or a concurrent change committed between our statements: a
            # fresh statement (READ COMMITTED) reads what is there now.
            row = await conn.fetchrow(statements.read, target_id)
            if row is None:
                raise NotFound(statements.unknown, id=str(target_id))
            if (row["since"] is not None) == paused:
                return _state(kind, row, paused=paused, changed=False)
    raise Conflict("the pause state kept changing while it was being set; retry")


async def _announce(
    conn: Conn,
    event: PauseEvent,
    state: PauseState,
    operator: Operator,
    reason: str | None,
) -> None:
    """The audit event and both notifications (the feed's and the replicas'), in the caller's
    transaction: delivered at its commit."""
    payload = {
        _TARGET_KEY[state.kind]: str(state.target_id),
        "by": str(operator.key_id),
        "by_name": operator.name,
        "reason": reason,
    }
    await conn.execute(
        """
        INSERT INTO events (event_type, workspace_id, payload)
        SELECT $1, $2, $3::jsonb FROM (SELECT pg_notify($4, ''), pg_notify($5, $6)) AS wake
        """,
        str(event),
        state.workspace_id,
        json_text(payload),
        EVENTS_CHANNEL,
        PAUSED_CHANNEL,
        change_payload(state),
    )


async def paused_among(
    conn: Conn, workspace_ids: list[UUID], runner_session_ids: list[UUID]
) -> tuple[set[UUID], set[UUID]]:
    """Which of these workspaces and runner sessions are paused now (the operator pages' view).
    One read, no lock."""
    row = await conn.fetchrow(
        """
        SELECT ARRAY(SELECT workspace_id FROM paused_workspaces
                     WHERE workspace_id = ANY($1::uuid[])) AS workspaces,
               ARRAY(SELECT runner_session_id FROM paused_runners
                     WHERE runner_session_id = ANY($2::uuid[])) AS runners
        """,
        workspace_ids,
        runner_session_ids,
    )
    assert row is not None
    return set(row["workspaces"]), set(row["runners"])
