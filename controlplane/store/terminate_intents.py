"""Terminate intents of an allocation round (spec 3.6): which of a workspace provisioner's active
runners it is told to stop. The candidates come from the SQL function `cp_terminate_candidates`
(sql/0011, which provider reports ask too); `domain.terminate_intents` classifies them.

Locks: none of their own. The round locks the activation-timeout candidates
(`timeout_candidates`) with its runners to bind, in id order, before `terminate_intents` marks
the first deliveries released.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from uuid import UUID

from controlplane.domain.terminate_intents import TerminateIntent, terminate_intent
from controlplane.store.pool import Conn
from controlplane.store.reservations import RUNNER_COLUMNS, runner_from_row


async def timeout_candidates(
    conn: Conn, workspace_id: UUID, provisioner_id: UUID, activation_timeout: timedelta | None
) -> list[UUID]:
    """Unlocked read of the runners an activation-timeout intent may mark released, so they can
    be locked in id order together with the runners to bind."""
    if activation_timeout is None:
        return []
    rows = await conn.fetch(
        """
        SELECT t.id FROM cp_terminate_candidates($1, $2, $3) AS t
         WHERE t.reservation_released_at IS NULL AND t.timed_out
        """,
        workspace_id,
        provisioner_id,
        activation_timeout,
    )
    return [r["id"] for r in rows]


async def terminate_intents(
    conn: Conn,
    *,
    now: datetime,
    workspace_id: UUID,
    provisioner_id: UUID,
    activation_timeout: timedelta | None,
    limit: int,
) -> tuple[tuple[TerminateIntent, ...], bool]:
    """Spec 3.6: runners to terminate, sorted by provider id, at most `limit` (and whether more
    existed). First deliveries of an activation timeout are marked released here."""
    rows = await conn.fetch(
        f"""
        SELECT {RUNNER_COLUMNS}, t.cancelled
          FROM cp_terminate_candidates($1, $2, $3) AS t
          JOIN runner_instances ri ON ri.id = t.id
         WHERE t.cancelled OR t.timed_out
         ORDER BY ri.provider_runner_id LIMIT $4
        """,  # noqa: S608 -- RUNNER_COLUMNS is a constant column list
        workspace_id,
        provisioner_id,
        activation_timeout,
        limit + 1,
    )
    live = {
        r["id"]
        for r in await conn.fetch(
            "SELECT id FROM reservations WHERE workspace_id = $1 AND provisioner_id = $2"
            " AND expires_at > now()",
            workspace_id,
            provisioner_id,
        )
    }
    intents: list[TerminateIntent] = []
    first_timeouts: list[UUID] = []
    for row in rows[:limit]:
        intent = terminate_intent(
            runner_from_row(row),
            job_cancelled=row["cancelled"],
            live_reservation_ids=live,
            now=now,
            activation_timeout=activation_timeout,
        )
        if intent is None:
            continue
        intents.append(intent)
        if intent.releases_unit:
            first_timeouts.append(row["id"])
    if first_timeouts:
        await conn.execute(
            """
            UPDATE runner_instances SET reservation_released_at = now(), updated_at = now()
             WHERE id = ANY($1::uuid[]) AND reservation_released_at IS NULL
            """,
            first_timeouts,
        )
    return tuple(intents), len(rows) > limit
