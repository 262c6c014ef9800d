"""Provisioner tokens: create, authenticate, touch last-seen, list, revoke with its cascade.

The token id is the provisioner id. Revocation runs in one transaction and, on the first
revocation only, cascades to everything the provisioner launched (spec 4.13): its bootstrap
tokens are revoked, its open control sessions closed (`provisioner-revoked`), the unconsumed
activation tokens of its instances revoked, every instance without a runner session terminated
(finished ones keep their own end state) and their reservation units released, and its unused
capped runner sessions revoked. Sessions that already claimed keep working; an unused one gets
`runner-session-exhausted` on its claim.

Locks, in the global order of `store/reservations.py` (the reference updated runner rows before
taking any advisory lock, spec 9.5): first its provisioner-session (fencing) row, whose
generation is bumped and NOTIFYed so the live session closes at once on any replica (a session's
writes hold this row FOR SHARE before their workspace lock, so it must come first here too);
then the workspace lock (`workspace ?? provisioner`, the key its reports and reconciles take,
and what makes a concurrent second revoke wait and then see the first); the assignment locks of
its sessionless instances' reservations, then those instance rows in id order
(`runner_release.lock_linked_runners`); then the writes: the token row, token and control-session
rows, the instance rows, the reservation rows of the release, and last the unused runner
sessions in id order. Nothing that holds one of those rows waits for an advisory lock or for the
token row (auth's last-seen touch is a single statement).
An admin revoke with an Idempotency-Key takes its `admin_command` lock before all of these
(store/admin_commands.py): only admin commands take it, always first.
"""

from __future__ import annotations

from datetime import timedelta
from uuid import UUID

from controlplane.domain import tokens
from controlplane.domain.binding import Scope
from controlplane.domain.provisioners import Provisioner
from controlplane.errors import NotFound
from controlplane.store import pages
from controlplane.store.pool import Conn
from controlplane.store.provisioner_sessions import TAKEOVER_CHANNEL
from controlplane.store.records import TokenTable, row_mapper
from controlplane.store.reservations import ACTIVE_SQL, lock_workspace
from controlplane.store.runner_release import lock_linked_runners, release_terminal

# A provisioner was last seen when its token last authenticated or its control session last
# proved itself live (every request and allocation round stamps the session), whichever is later:
# the token is stamped only when a session opens, and a session can stay open for days.
_LAST_SEEN = (
    "greatest(provisioner_tokens.last_seen_at, (SELECT s.last_seen_at FROM provisioner_sessions s"
    " WHERE s.provisioner_id = provisioner_tokens.id))"
)
_COLUMNS = (
    "id, scope, workspace_id, name, display_prefix, created_at, expires_at, revoked_at, "
    f"revocation_reason, {_LAST_SEEN} AS last_seen_at"
)

# Made once: every request of a provisioner reads its token's row.
_provisioner = row_mapper(Provisioner)
_TOKENS = TokenTable("provisioner_tokens", _COLUMNS, _provisioner)


async def create(
    conn: Conn,
    *,
    name: str,
    workspace_id: UUID | None,
    ttl: timedelta | None = None,
    token: tokens.Opaque | None = None,
) -> tuple[Provisioner, str]:
    """A workspace token when `workspace_id` is given, an installation token otherwise."""
    token = token or tokens.new_opaque(tokens.Kind.PROVISIONER)
    scope = Scope.INSTALLATION if workspace_id is None else Scope.WORKSPACE
    fields = {"scope": scope.value, "workspace_id": workspace_id, "name": name}
    return await _TOKENS.insert(conn, fields, token, ttl), token.raw


async def by_digest(conn: Conn, sha256: str) -> Provisioner | None:
    return await _TOKENS.by_digest(conn, sha256)


async def by_id(conn: Conn, provisioner_id: UUID) -> Provisioner | None:
    return await _TOKENS.by_id(conn, provisioner_id)


async def touch(conn: Conn, provisioner_id: UUID, throttle: timedelta) -> None:
    """Stamp last-seen, at most once per throttle window."""
    await conn.execute(
        """
        UPDATE provisioner_tokens SET last_seen_at = now()
        WHERE id = $1 AND (last_seen_at IS NULL OR last_seen_at < now() - $2::interval)
        """,
        provisioner_id,
        throttle,
    )


async def list_all(
    conn: Conn,
    workspace_id: UUID | None = None,
    *,
    seen_within: timedelta | None = None,
    before: pages.Before = None,
    limit: int | None = None,
) -> list[Provisioner]:
    """Newest first, a page at a time (store/pages.py). With `seen_within`, only live ones: seen
    that recently, not revoked, not expired (the admin "active provisioners" view)."""
    rows = await conn.fetch(
        f"""
        SELECT {_COLUMNS} FROM provisioner_tokens
        WHERE ($4::uuid IS NULL OR workspace_id = $4)
          AND ($5::interval IS NULL OR ({_LAST_SEEN} > now() - $5::interval
                                        AND revoked_at IS NULL
                                        AND (expires_at IS NULL OR expires_at > now())))
          AND {pages.BEFORE}
        ORDER BY {pages.NEWEST_FIRST}
        """,  # noqa: S608 -- interpolates constants only: _COLUMNS, _LAST_SEEN, pages.BEFORE, pages.NEWEST_FIRST
        *pages.args(before, limit),
        workspace_id,
        seen_within,
    )
    return [_provisioner(row) for row in rows]


async def revoke(conn: Conn, provisioner_id: UUID, *, reason: str | None = None) -> Provisioner:
    """Idempotent: a second revoke keeps the first time and reason, and cascades nothing again."""
    async with conn.transaction():
        found = await by_id(conn, provisioner_id)
        if found is None:
            raise NotFound("no such provisioner token", id=str(provisioner_id))
        # First lock: the control session's fencing row (a session's writes hold it FOR SHARE
        # before any workspace lock, so taking it after ours would deadlock with them). Its live
        # session, on whichever replica, is superseded at commit and finds the token revoked
        # when it asks why.
        await conn.execute(
            """
            WITH bumped AS (
                UPDATE provisioner_sessions SET generation = generation + 1
                WHERE provisioner_id = $1 RETURNING generation
            )
            SELECT pg_notify($2, $1::text || ':' || generation) FROM bumped
            """,
            provisioner_id,
            TAKEOVER_CHANNEL,
        )
        await lock_workspace(conn, found.workspace_id or found.id)
        # Read again under the lock: a revoke that held it before us has committed by now.
        found = await by_id(conn, provisioner_id)
        assert found is not None  # tokens are never deleted
        first = found.revoked_at is None
        sessionless: list[UUID] = []
        if first:
            sessionless = [
                row["id"]
                for row in await conn.fetch(
                    f"""
                    SELECT id FROM runner_instances
                     WHERE provisioner_id = $1 AND runner_session_id IS NULL
                       AND (state IN {ACTIVE_SQL}
                            OR (reservation_released_at IS NULL
                                AND (reservation_id IS NOT NULL
                                     OR intended_reservation_id IS NOT NULL)))
                    """,  # noqa: S608 -- interpolates constants only: ACTIVE_SQL
                    provisioner_id,
                )
            ]
            await lock_linked_runners(conn, sessionless)
        row = await conn.fetchrow(
            f"""
            UPDATE provisioner_tokens
            SET revoked_at = COALESCE(revoked_at, now()), updated_at = now(),
                revocation_reason = CASE WHEN revoked_at IS NULL THEN $2::text
                                         ELSE revocation_reason END
            WHERE id = $1
            RETURNING {_COLUMNS}
            """,  # noqa: S608 -- interpolates constants only: _COLUMNS
            provisioner_id,
            reason,
        )
        assert row is not None
        if first:
            await _cascade(conn, provisioner_id, sessionless)
        await conn.execute(
            """
            UPDATE runner_sessions SET revoked_at = now()
            WHERE id IN (SELECT id FROM runner_sessions
                         WHERE provisioner_id = $1 AND claims_used = 0 AND revoked_at IS NULL
                         ORDER BY id FOR UPDATE)
            """,
            provisioner_id,
        )
    return _provisioner(row)


async def _cascade(conn: Conn, provisioner_id: UUID, sessionless: list[UUID]) -> None:
    """The boot-path credentials and the sessionless instances of a newly revoked provisioner;
    the caller holds the instance rows and their assignment locks."""
    await conn.execute(
        "UPDATE runner_bootstrap_tokens SET revoked_at = now()"
        " WHERE provisioner_id = $1 AND revoked_at IS NULL",
        provisioner_id,
    )
    await conn.execute(
        """
        UPDATE runner_control_sessions SET closed_at = now(), close_reason = 'provisioner-revoked'
         WHERE provisioner_id = $1 AND closed_at IS NULL
        """,
        provisioner_id,
    )
    await conn.execute(
        """
        UPDATE runner_activation_tokens SET revoked_at = now()
         WHERE runner_instance_id IN (SELECT id FROM runner_instances WHERE provisioner_id = $1)
           AND consumed_at IS NULL AND revoked_at IS NULL
        """,
        provisioner_id,
    )
    await conn.execute(
        f"""
        UPDATE runner_instances SET state = 'terminated', terminated_at = now(), updated_at = now()
         WHERE id = ANY($1::uuid[]) AND runner_session_id IS NULL
           AND state IN {ACTIVE_SQL}
        """,  # noqa: S608 -- interpolates constants only: ACTIVE_SQL
        sessionless,
    )
    await release_terminal(
        conn,
        workspace_id=None,
        provisioner_id=provisioner_id,
        runner_instance_ids=sessionless,
        require_unlinked_session=False,
    )
