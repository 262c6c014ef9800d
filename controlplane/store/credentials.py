"""Credentials: signing keys and the replica's cache of them (`KeyRing`), API keys
(orchestrator, admin and workspace admin, with their role) and manual registration tokens; and
issuing, listing and revoking any family an operator manages (provisioner tokens too, through
store/provisioners.py), for the admin API and the `tokens` command alike, under the rules of
domain/credential_rules.py.

No statement here takes an explicit lock; each is a single-row insert, update or lookup by a
unique key (a provisioner token's revocation takes its own, store/provisioners.py). Raw tokens
never reach this module except to be hashed by domain.tokens first, or returned once by a create.
"""

from __future__ import annotations

import secrets
from datetime import timedelta
from uuid import UUID

import anyio
import asyncpg

from controlplane.domain import tokens
from controlplane.domain.credential_rules import Family, NewCredential
from controlplane.domain.credentials import Credential, Role
from controlplane.domain.provisioners import Provisioner
from controlplane.errors import NotFound
from controlplane.store import pages, provisioners
from controlplane.store.pool import Conn
from controlplane.store.records import TokenTable, found_by_digest, from_row, row_mapper


def _manual_token(row: asyncpg.Record) -> Credential:
    return from_row(Credential, row, kind="manual-registration", role=Role.OWNER)


_COLUMNS = (
    "id, name, workspace_id, display_prefix, created_at, expires_at, revoked_at, revocation_reason"
)
_KEY_COLUMNS = f"kind, role, {_COLUMNS}"  # an API key's
# The API key of a row holding its columns (made once: every request with a key reads one).
api_key = row_mapper(Credential, role=Role)
_API_KEYS = TokenTable("api_keys", _KEY_COLUMNS, api_key)
_MANUAL_TOKENS = TokenTable("manual_registration_tokens", _COLUMNS, _manual_token)
# For a read elsewhere that joins the key in (store/ui_sessions.py `by_secret`).
API_KEY_COLUMNS = _KEY_COLUMNS


# A manual registration token still usable: neither revoked nor expired (by the database's clock).
_USABLE = "revoked_at IS NULL AND (expires_at IS NULL OR expires_at > now())"


async def _revoke(
    conn: Conn,
    family: TokenTable[Credential],
    token_id: UUID,
    reason: str | None,
    workspace_id: UUID | None,
    missing: str,
) -> Credential:
    """Revoke one token of `family` (with `workspace_id`, only that workspace's): the first
    revocation sets the time and the reason, later ones change neither. NotFound (`missing`)
    when there is no such token."""
    row = await conn.fetchrow(
        f"""
        UPDATE {family.table}
           SET revoked_at = COALESCE(revoked_at, now()),
               revocation_reason = CASE WHEN revoked_at IS NULL THEN $2::text
                                        ELSE revocation_reason END
         WHERE id = $1 AND ($3::uuid IS NULL OR workspace_id = $3)
        RETURNING {family.columns}
        """,  # noqa: S608 -- interpolates constants only: a family's table and columns
        token_id,
        reason,
        workspace_id,
    )
    if row is None:
        raise NotFound(missing, id=str(token_id))
    return family.into(row)


# Signing keys ---------------------------------------------------------------------------------


async def signing_keys(conn: Conn) -> dict[str, tokens.SigningKey]:
    rows = await conn.fetch("SELECT kid, secret FROM signing_keys WHERE retired_at IS NULL")
    return {row["kid"]: tokens.SigningKey(row["kid"], bytes(row["secret"])) for row in rows}


async def current_signing_key(conn: Conn) -> tokens.SigningKey:
    """The newest active key, creating the first one if there is none."""
    row = await conn.fetchrow(
        """
        SELECT kid, secret FROM signing_keys WHERE retired_at IS NULL
        ORDER BY created_at DESC, kid LIMIT 1
        """
    )
    if row is None:
        return await rotate_signing_key(conn)
    return tokens.SigningKey(row["kid"], bytes(row["secret"]))


async def rotate_signing_key(conn: Conn) -> tokens.SigningKey:
    """Add a new key; it signs from now on. Older keys still verify until retired."""
    key = tokens.SigningKey(secrets.token_hex(8), secrets.token_bytes(32))
    await conn.execute(
        "INSERT INTO signing_keys (kid, secret) VALUES ($1, $2)", key.kid, key.secret
    )
    return key


class KeyRing:
    """The signing keys, cached in memory; an unknown key id triggers at most one reload a
    second."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool
        self._keys: dict[str, tokens.SigningKey] = {}
        self._current: tokens.SigningKey | None = None
        self._loaded_at = -1.0

    async def load(self) -> None:
        async with self._pool.acquire() as conn:
            self._current = await current_signing_key(conn)
            self._keys = await signing_keys(conn)
        self._loaded_at = anyio.current_time()

    @property
    def current(self) -> tokens.SigningKey:
        assert self._current is not None, "KeyRing.load() first"
        return self._current

    async def keys_for(self, token: str) -> dict[str, tokens.SigningKey]:
        kid = token.split("_", 2)[-1].split(".", 1)[0]
        if kid not in self._keys and anyio.current_time() - self._loaded_at > 1.0:
            await self.load()
        return self._keys


# API keys -------------------------------------------------------------------------------------


async def create_api_key(
    conn: Conn,
    *,
    kind: str,
    name: str,
    workspace_id: UUID | None = None,
    ttl: timedelta | None = None,
    token: tokens.Opaque | None = None,
    role: Role = Role.OWNER,
) -> tuple[Credential, str]:
    token = token or tokens.new_opaque(Family(kind).token_kind)
    fields = {"kind": kind, "name": name, "workspace_id": workspace_id, "role": role.value}
    return await _API_KEYS.insert(conn, fields, token, ttl), token.raw


async def api_key_by_digest(conn: Conn, kind: str, sha256: str) -> Credential | None:
    return await found_by_digest(
        conn,
        api_key,
        f"""
        SELECT token_sha256, {_KEY_COLUMNS} FROM api_keys
        WHERE token_sha256 = $1 AND kind = $2
        """,  # noqa: S608 -- interpolates constants only: _KEY_COLUMNS
        sha256,
        kind,
    )


async def api_key_by_id(conn: Conn, key_id: UUID) -> Credential | None:
    return await _API_KEYS.by_id(conn, key_id)


async def list_api_keys(
    conn: Conn, kind: str | None = None, *, before: pages.Before = None, limit: int | None = None
) -> list[Credential]:
    rows = await conn.fetch(
        f"""
        SELECT {_KEY_COLUMNS} FROM api_keys
        WHERE ($4::text IS NULL OR kind = $4) AND {pages.BEFORE}
        ORDER BY {pages.NEWEST_FIRST}
        """,  # noqa: S608 -- interpolates constants only: _KEY_COLUMNS, pages.BEFORE, pages.NEWEST_FIRST
        *pages.args(before, limit),
        kind,
    )
    return [api_key(row) for row in rows]


async def revoke_api_key(conn: Conn, key_id: UUID, *, reason: str | None = None) -> Credential:
    """Idempotent: revoking twice keeps the first revocation time and reason."""
    return await _revoke(conn, _API_KEYS, key_id, reason, None, "no such API key")


# Manual registration tokens ---------------------------------------------------------------------


async def create_manual_token(
    conn: Conn,
    *,
    workspace_id: UUID,
    name: str,
    ttl: timedelta | None = None,
    token: tokens.Opaque | None = None,
) -> tuple[Credential, str]:
    token = token or tokens.new_opaque(tokens.Kind.MANUAL_REGISTRATION)
    fields = {"workspace_id": workspace_id, "name": name}
    return await _MANUAL_TOKENS.insert(conn, fields, token, ttl), token.raw


async def manual_token_by_digest(conn: Conn, sha256: str) -> Credential | None:
    return await _MANUAL_TOKENS.by_digest(conn, sha256)


async def manual_token_by_id(conn: Conn, token_id: UUID) -> Credential | None:
    return await _MANUAL_TOKENS.by_id(conn, token_id)


async def list_manual_tokens(
    conn: Conn,
    workspace_id: UUID | None = None,
    *,
    before: pages.Before = None,
    limit: int | None = None,
    usable_only: bool = False,
) -> list[Credential]:
    """Newest first; `usable_only`: without the revoked and the expired (a workspace's own
    listing, spec S-49)."""
    rows = await conn.fetch(
        f"""
        SELECT {_COLUMNS} FROM manual_registration_tokens
        WHERE ($4::uuid IS NULL OR workspace_id = $4) AND {pages.BEFORE}
          AND (NOT $5::boolean OR ({_USABLE}))
        ORDER BY {pages.NEWEST_FIRST}
        """,  # noqa: S608 -- interpolates constants only: _COLUMNS, pages.BEFORE, _USABLE, pages.NEWEST_FIRST
        *pages.args(before, limit),
        workspace_id,
        usable_only,
    )
    return [_manual_token(row) for row in rows]


async def revoke_manual_token(
    conn: Conn, token_id: UUID, workspace_id: UUID | None = None, *, reason: str | None = None
) -> Credential:
    """Idempotent, keeping the first time and reason. With `workspace_id`, a token of another
    workspace is not found."""
    return await _revoke(
        conn, _MANUAL_TOKENS, token_id, reason, workspace_id, "no such registration token"
    )


# Any family, for the admin API and the `tokens` command ------------------------------------------


async def issue_key(
    conn: Conn, new: NewCredential, token: tokens.Opaque | None = None
) -> tuple[Credential, str]:
    """Create an API key or a manual registration token; the raw token is in this answer only.
    `token`: the one to store (an idempotent replay derives it), else a new random one."""
    if new.family is Family.PROVISIONER:
        raise ValueError("a provisioner token is issued by issue_provisioner")
    if new.family is Family.REGISTRATION:
        assert new.workspace_id is not None  # NewCredential's scope rule
        return await create_manual_token(
            conn, workspace_id=new.workspace_id, name=new.name, ttl=new.ttl, token=token
        )
    return await create_api_key(
        conn,
        kind=new.family.value,
        name=new.name,
        workspace_id=new.workspace_id,
        ttl=new.ttl,
        token=token,
        role=new.role,
    )


async def issue_provisioner(
    conn: Conn, new: NewCredential, token: tokens.Opaque | None = None
) -> tuple[Provisioner, str]:
    """Create a provisioner token (no workspace: installation scope), as `issue_key` does."""
    if new.family is not Family.PROVISIONER:
        raise ValueError(f"a {new.family} credential is issued by issue_key")
    return await provisioners.create(
        conn, name=new.name, workspace_id=new.workspace_id, ttl=new.ttl, token=token
    )


async def issue(conn: Conn, new: NewCredential) -> tuple[Credential | Provisioner, str]:
    if new.family is Family.PROVISIONER:
        return await issue_provisioner(conn, new)
    return await issue_key(conn, new)


async def listed(
    conn: Conn, family: Family, workspace_id: UUID | None = None
) -> list[Credential] | list[Provisioner]:
    """Every credential of `family`, newest first. `workspace_id` filters registration and
    provisioner tokens; API keys are listed by kind alone."""
    if family is Family.REGISTRATION:
        return await list_manual_tokens(conn, workspace_id)
    if family is Family.PROVISIONER:
        return await provisioners.list_all(conn, workspace_id)
    return await list_api_keys(conn, family.value)


async def revoke(
    conn: Conn, family: Family, target_id: UUID, *, reason: str | None = None
) -> Credential | Provisioner:
    """Revoke one credential of `family` by id (either API key kind revokes any API key);
    idempotent, keeping the first time and reason."""
    if family is Family.REGISTRATION:
        return await revoke_manual_token(conn, target_id, reason=reason)
    if family is Family.PROVISIONER:
        return await provisioners.revoke(conn, target_id, reason=reason)
    return await revoke_api_key(conn, target_id, reason=reason)
