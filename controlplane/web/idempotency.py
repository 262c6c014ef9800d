"""Idempotency-Key on admin creates and revokes: a replay answers what the first request did.

The header is optional: without it a create is a plain create and a revoke a plain revoke (which
is idempotent anyway). With it (1-256 characters, not blank; else 400 idempotency-key-invalid),
the request's fingerprint is the SHA-256 of the command, its target and its body, remembered per
(admin key, Idempotency-Key) under that pair's advisory lock (store/admin_commands.py). The same
key with another command, target or body: 409 idempotency-key-reused.

* Create: the new token's random part is derived from the admin key, the Idempotency-Key and the
  fingerprint with the current signing key, so a replay re-derives the same token without it
  ever being stored. A replay after the signing key rotated (the derived token no longer matches
  what was created): 409 idempotency-replay-unavailable.
* Revoke: the answer's JSON is remembered and a replay answers it again, byte for byte (the
  original `revoked_at` and reason), without revoking a second time. An unknown target is 404
  and nothing is remembered, so a retry with the same key is 404 again.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar
from uuid import UUID

import asyncpg
import msgspec
from starlette.requests import Request
from starlette.responses import Response

from controlplane.domain import tokens
from controlplane.domain.credential_rules import NewCredential
from controlplane.domain.credentials import Credential
from controlplane.errors import Conflict, InvalidInput
from controlplane.settings import Settings
from controlplane.store import admin_commands
from controlplane.store.admin_commands import Remembered
from controlplane.store.credentials import KeyRing
from controlplane.store.pool import Conn
from controlplane.web.edge import path_uuid, read_json
from controlplane.wire.admin import Revoke


class _Created(Protocol):
    @property
    def id(self) -> UUID: ...


C = TypeVar("C", bound=_Created)

MAX_KEY_LENGTH = 256

log = logging.getLogger("controlplane.admin")
_encoder = msgspec.json.Encoder()


class Deps(Protocol):
    """What a create or revoke made once needs: the database, the signing key a replayed create
    derives its token with, and the settings."""

    @property
    def pool(self) -> asyncpg.Pool: ...

    @property
    def keys(self) -> KeyRing: ...

    @property
    def settings(self) -> Settings: ...  # a revoke's body limit


def _sha256(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


def idempotency_key(request: Request) -> str | None:
    """The header's value (its first, if repeated); None without one."""
    key = request.headers.get("idempotency-key")
    if key is not None and (not 1 <= len(key) <= MAX_KEY_LENGTH or not key.strip()):
        raise InvalidInput(
            f"Idempotency-Key is 1 to {MAX_KEY_LENGTH} characters and not blank",
            code="idempotency-key-invalid",
        )
    return key


async def create_once(
    request: Request,
    svc: Deps,
    actor: Credential,
    command: str,
    body: msgspec.Struct,
    new: NewCredential,
    issue: Callable[[Conn, NewCredential, tokens.Opaque | None], Awaitable[tuple[C, str]]],
    load: Callable[[Conn, UUID], Awaitable[C | None]],
) -> tuple[C, str]:
    """The credential `issue` creates for `new` and its raw token; with a known Idempotency-Key
    the one the first request created, loaded by its id, and the same token derived again."""
    key = idempotency_key(request)
    async with svc.pool.acquire() as conn:
        if key is None:
            return await issue(conn, new, None)
        key_sha256 = _sha256(key)
        request_sha256 = _sha256(command.encode() + b":" + msgspec.json.encode(body))
        token = tokens.derived_opaque(
            new.family.token_kind, svc.keys.current.secret, f"{actor.id}:{key}:{request_sha256}"
        )
        async with conn.transaction():
            found = await admin_commands.lock_and_find(conn, actor.id, key_sha256)
            if found is None:
                created, raw = await issue(conn, new, token)
                done = Remembered(command, request_sha256, created.id, token.sha256)
                await admin_commands.remember(conn, actor.id, key_sha256, done)
                return created, raw
            if (found.command, found.request_sha256) != (command, request_sha256):
                raise Conflict(
                    "this Idempotency-Key was used for another request",
                    code="idempotency-key-reused",
                )
            existing = await load(conn, found.target_id)
            if found.token_sha256 != token.sha256 or existing is None:
                raise Conflict(
                    "this request can no longer be replayed (the signing key rotated)",
                    code="idempotency-replay-unavailable",
                )
            return existing, token.raw


async def revoke_once(
    request: Request,
    svc: Deps,
    actor: Credential,
    command: str,
    revoke: Callable[[Conn, UUID, str | None], Awaitable[msgspec.Struct]],
) -> Response:
    """A revoke route's answer once `actor` passed its check: the target is the path's `id`, the
    body an optional `Revoke` (its reason), and the answer `revoke`'s, or with a known
    Idempotency-Key the one remembered. Logged either way, with the reason as text (never a
    token: logs mask any)."""
    target_id = path_uuid(request, "id")
    body = await read_json(request, Revoke, svc.settings.server.max_body_bytes, optional=True)
    key = idempotency_key(request)
    async with svc.pool.acquire() as conn:
        if key is None:
            answer, replayed = _encoder.encode(await revoke(conn, target_id, body.reason)), False
        else:
            key_sha256 = _sha256(key)
            request_sha256 = _sha256(f"{command}:{target_id}:".encode() + msgspec.json.encode(body))
            # Locks: the key's admin_command lock first, then whatever `revoke` takes (a
            # provisioner revoke's, store/provisioners.py); see store/admin_commands.py.
            async with conn.transaction():
                found = await admin_commands.lock_and_find(conn, actor.id, key_sha256)
                if found is None:
                    revoked = await revoke(conn, target_id, body.reason)
                    answer, replayed = _encoder.encode(revoked), False
                    done = Remembered(command, request_sha256, target_id, answer=answer.decode())
                    await admin_commands.remember(conn, actor.id, key_sha256, done)
                elif (found.command, found.request_sha256) != (command, request_sha256) or (
                    found.answer is None
                ):
                    raise Conflict(
                        "this Idempotency-Key was used for another request",
                        code="idempotency-key-reused",
                    )
                else:
                    answer, replayed = found.answer.encode(), True
    extra: dict[str, object] = {
        "command": command,
        "target_id": str(target_id),
        "actor_id": str(actor.id),
        "replayed": replayed,
    }
    if body.reason is not None:
        extra["reason"] = body.reason
    log.info("admin.revoked", extra=extra)
    return Response(answer, 200, media_type="application/json")
