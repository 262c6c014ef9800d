"""Retention: old events and old tombstones are deleted in bounded batches.

Neither takes an explicit lock. Deleting events never breaks a cursor (it only means a reader
whose cursor is older than the retention misses what was pruned). A tombstone is kept while its
execution still has a lease (a cancelled lease draining), and a pruned tombstone no longer stops
a replayed enqueue, so `tombstone_retention_days` bounds how late a replay may arrive.
"""

from __future__ import annotations

from datetime import timedelta

from controlplane.store.pool import Conn


async def _count_deleted(conn: Conn, delete: str, older_than: timedelta, limit: int) -> int:
    """Run one bounded DELETE (`$1` the age, `$2` the batch size) and count what it removed."""
    deleted: int = await conn.fetchval(
        f"WITH gone AS ({delete} RETURNING 1) SELECT count(*) FROM gone",  # noqa: S608 -- `delete` is one of this module's statements
        older_than,
        limit,
    )
    return deleted


async def prune_events(conn: Conn, older_than: timedelta, limit: int) -> int:
    return await _count_deleted(
        conn,
        """
        DELETE FROM events WHERE seq IN (
            SELECT seq FROM events WHERE created_at < now() - $1::interval
            ORDER BY seq LIMIT $2)
        """,
        older_than,
        limit,
    )


async def prune_tombstones(conn: Conn, older_than: timedelta, limit: int) -> int:
    """Delete up to `limit` old tombstones whose execution has no lease left, with the lost
    attempts of those executions (store/retries.py), which live as long as their tombstone."""
    deleted: int = await conn.fetchval(
        """
        WITH gone AS (
            DELETE FROM ended_executions WHERE job_execution_id IN (
                SELECT e.job_execution_id FROM ended_executions e
                WHERE e.ended_at < now() - $1::interval
                  AND NOT EXISTS (SELECT 1 FROM running_jobs r
                                  WHERE r.job_execution_id = e.job_execution_id)
                ORDER BY e.ended_at LIMIT $2)
            RETURNING job_execution_id
        ), attempts AS (
            DELETE FROM execution_attempts a USING gone
            WHERE a.job_execution_id = gone.job_execution_id
        )
        SELECT count(*) FROM gone
        """,
        older_than,
        limit,
    )
    return deleted


async def prune_runner_credentials(conn: Conn, older_than: timedelta, limit: int) -> int:
    """Delete bootstrap tokens, control sessions and activation tokens that stopped being usable
    (spent, revoked, closed or expired) more than `older_than` ago, up to `limit` of each. No
    lock: a credential no longer usable is read by nothing but audit."""
    deleted = 0
    for table, dead in (
        ("runner_bootstrap_tokens", "coalesce(consumed_at, revoked_at, expires_at)"),
        ("runner_control_sessions", "coalesce(closed_at, expires_at)"),
        ("runner_activation_tokens", "coalesce(consumed_at, revoked_at, expires_at)"),
    ):
        deleted += await _count_deleted(
            conn,
            f"""
            DELETE FROM {table} WHERE id IN (
                SELECT id FROM {table} WHERE {dead} < now() - $1::interval
                 ORDER BY id LIMIT $2)
            """,  # noqa: S608 -- table names and expressions from the literal tuple above
            older_than,
            limit,
        )
    return deleted
