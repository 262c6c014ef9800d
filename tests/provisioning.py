"""Rows for provisioning tests, written straight into a real database.

Each factory inserts exactly what a scenario names and nothing else, so a test reads as its
spec scenario: a provisioner, a runner instance in some state, a reservation, a control session.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from uuid import UUID

from controlplane.domain import tokens
from controlplane.domain.provisioners import Provisioner
from controlplane.store import provisioners, queue
from controlplane.store.pool import Conn
from tests.factories import new_job


async def provisioner(conn: Conn, workspace_id: UUID | None = None) -> Provisioner:
    """A workspace-scope provisioner when `workspace_id` is given, else installation scope."""
    created, _raw = await provisioners.create(
        conn, name=f"p-{uuid.uuid4().hex[:8]}", workspace_id=workspace_id
    )
    return created


async def reservation(
    conn: Conn,
    *,
    workspace_id: UUID,
    provisioner_id: UUID,
    labels: tuple[str, ...] = ("linux",),
    count: int = 1,
    kind: str = "launch",
    ttl: timedelta = timedelta(seconds=60),
) -> UUID:
    """A reservation expiring `ttl` from now on the database clock (negative: already expired)."""
    value = await conn.fetchval(
        """
        INSERT INTO reservations (workspace_id, provisioner_id, required_labels, count, kind,
                                  expires_at)
        VALUES ($1, $2, $3, $4, $5, now() + $6::interval)
        RETURNING id
        """,
        workspace_id,
        provisioner_id,
        list(labels),
        count,
        kind,
        ttl,
    )
    assert isinstance(value, UUID)
    return value


async def runner(
    conn: Conn,
    provisioner_id: UUID,
    *,
    state: str = "running",
    labels: tuple[str, ...] = ("linux",),
    provider_runner_id: str | None = "auto",
    workspace_id: UUID | None = None,
    reservation_id: UUID | None = None,
    intended_reservation_id: UUID | None = None,
    assigned: bool = False,
    launch_kind: str = "demand",
    template_key: str | None = "small",
    runner_session_id: UUID | None = None,
    released: bool = False,
    age: timedelta = timedelta(0),
    reported_age: timedelta | None = None,
    control_session: str | None = "live",
) -> UUID:
    """A runner instance. `provider_runner_id="auto"` gives it a fresh identity. `age` backdates
    created_at (and updated_at); `reported_age` backdates reported_at (default: `age`).
    `control_session`: "live", "expired", "closed" or None (none at all)."""
    if provider_runner_id == "auto":
        provider_runner_id = f"pr-{uuid.uuid4().hex[:12]}"
    reported = age if reported_age is None else reported_age
    runner_id = await conn.fetchval(
        """
        INSERT INTO runner_instances
            (provisioner_id, state, labels, provider_runner_id, workspace_id, reservation_id,
             intended_reservation_id, assigned_at, launch_kind, template_key, runner_session_id,
             reservation_released_at, created_at, updated_at, reported_at)
        VALUES ($1, $2, $3, $4, $5, $6, $7, CASE WHEN $8 THEN now() END, $9, $10, $11,
                CASE WHEN $12 THEN now() END, now() - $13::interval, now() - $13::interval,
                now() - $14::interval)
        RETURNING id
        """,
        provisioner_id,
        state,
        list(labels),
        provider_runner_id,
        workspace_id,
        reservation_id,
        intended_reservation_id,
        assigned,
        launch_kind,
        template_key,
        runner_session_id,
        released,
        age,
        reported,
    )
    assert isinstance(runner_id, UUID)
    if control_session is not None:
        await open_control_session(conn, runner_id, provisioner_id, control_session)
    return runner_id


async def open_control_session(
    conn: Conn, runner_id: UUID, provisioner_id: UUID, how: str = "live"
) -> str:
    """A control session for the runner; returns its raw token."""
    token = tokens.new_opaque(tokens.Kind.CONTROL_SESSION)
    hour = timedelta(hours=1)
    expires = {"live": hour, "expired": timedelta(seconds=-1), "closed": hour}[how]
    await conn.execute(
        """
        INSERT INTO runner_control_sessions
            (runner_instance_id, provisioner_id, token_sha256, display_prefix, expires_at,
             closed_at, close_reason)
        VALUES ($1, $2, $3, $4, now() + $5::interval,
                CASE WHEN $6 THEN now() END, CASE WHEN $6 THEN 'activated' END)
        """,
        runner_id,
        provisioner_id,
        token.sha256,
        token.display_prefix,
        expires,
        how == "closed",
    )
    return token.raw


async def pending_jobs(
    conn: Conn, workspace_id: UUID, labels: tuple[str, ...], count: int = 1
) -> list[UUID]:
    """`count` pending jobs of the workspace with canonical `labels`; returns their ids."""
    ids = []
    for _ in range(count):
        job = new_job(workspace_id, labels=list(labels))
        await queue.enqueue(conn, [job])
        ids.append(job.identity.job_execution_id)
    return ids
