"""Installation-scope eligibility of provisioner tokens (domain/eligibility.py): read by the
provisioner actor at the start of every allocation walk, set by the admin API and the CLI.

The walk itself reads it inside the statement that lists the workspaces with demand
(store/demand_list.py `demand_workspaces`), once per round before its first workspace
transaction, so a change applies from the provisioner's next round on (at the latest one and a
half `provisioners.demand_safety_tick_seconds` later), without reconnecting; grants already made
stay until they are used or expire.
"""

from __future__ import annotations

from datetime import datetime
from uuid import UUID

from controlplane.domain.eligibility import EVERY_WORKSPACE, Eligibility, Mode
from controlplane.errors import Conflict, NotFound
from controlplane.store.pool import Conn


async def read(conn: Conn, provisioner_id: UUID) -> tuple[Eligibility, datetime | None]:
    """The provisioner's eligibility and when it was last set (None: never, every workspace)."""
    row = await conn.fetchrow(
        "SELECT mode, workspace_ids, updated_at FROM provisioner_eligibility"
        " WHERE provisioner_id = $1",
        provisioner_id,
    )
    if row is None:
        return EVERY_WORKSPACE, None
    return Eligibility(Mode(row["mode"]), frozenset(row["workspace_ids"])), row["updated_at"]


async def replace(
    conn: Conn, provisioner_id: UUID, eligibility: Eligibility
) -> tuple[Eligibility, datetime | None]:
    """Set the eligibility of an installation provisioner token (`all` removes the row). An
    unknown token is NotFound; a workspace token is a Conflict (it serves its own workspace).

    Locks: none taken explicitly. The upsert (or delete) locks the token's own eligibility row
    and, through the foreign key, takes KEY SHARE on its token row, which a revoke's update
    (no key change) does not conflict with; nothing else writes these rows, and a walk only
    reads them, so this cannot wait in a cycle."""
    async with conn.transaction():
        scope = await conn.fetchval(
            "SELECT scope FROM provisioner_tokens WHERE id = $1", provisioner_id
        )
        if scope is None:
            raise NotFound("no such provisioner token", id=str(provisioner_id))
        if scope != "installation":
            raise Conflict(
                "eligibility applies to installation-scope provisioner tokens only",
                id=str(provisioner_id),
            )
        if eligibility.mode is Mode.ALL:
            await conn.execute(
                "DELETE FROM provisioner_eligibility WHERE provisioner_id = $1", provisioner_id
            )
            return EVERY_WORKSPACE, None
        updated_at = await conn.fetchval(
            """
            INSERT INTO provisioner_eligibility (provisioner_id, mode, workspace_ids)
            VALUES ($1, $2, $3)
            ON CONFLICT (provisioner_id) DO UPDATE
               SET mode = excluded.mode, workspace_ids = excluded.workspace_ids,
                   updated_at = now()
            RETURNING updated_at
            """,
            provisioner_id,
            eligibility.mode.value,
            sorted(eligibility.workspaces),
        )
    return eligibility, updated_at
