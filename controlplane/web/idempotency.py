"""Idempotency-Key on admin creates: a replay answers what the first request created.

Without the header a create is a plain create. With it (1-256 characters, not blank), the
request's fingerprint is the SHA-256 of the command and its body; the new token's random part is
derived from the admin key, the Idempotency-Key and that fingerprint with the current signing
key, so a replay re-derives the same token without it ever being stored. Same key with another
body or command: 409 idempotency-key-reused. A replay after the signing key rotated (the derived
token no longer matches what was created): 409 idempotency-replay-unavailable.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from typing import TypeVar
from uuid import UUID

import msgspec
from starlette.requests import Request

from controlplane.domain import tokens
from controlplane.errors import Conflict, InvalidInput
from controlplane.store import admin_commands
from controlplane.store.admin_commands import Remembered
from controlplane.store.credentials import Credential
from controlplane.store.pool import Conn
from controlplane.web.services import Services

T = TypeVar("T")

MAX_KEY_LENGTH = 256


def _sha256(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


async def create_once(
    request: Request,
    svc: Services,
    actor: Credential,
    command: str,
    body: msgspec.Struct,
    kind: tokens.Kind,
    create: Callable[[Conn, tokens.Opaque | None], Awaitable[tuple[T, str]]],
    load: Callable[[Conn, UUID], Awaitable[T | None]],
    target_id: Callable[[T], UUID],
) -> tuple[T, str]:
    key = request.headers.get("idempotency-key")
    async with svc.pool.acquire() as conn:
        if key is None:
            return await create(conn, None)
        if not 1 <= len(key) <= MAX_KEY_LENGTH or not key.strip():
            raise InvalidInput(
                f"Idempotency-Key is 1 to {MAX_KEY_LENGTH} characters and not blank",
                code="idempotency-key-invalid",
            )
        key_sha256 = _sha256(key)
        request_sha256 = _sha256(command.encode() + b":" + msgspec.json.encode(body))
        token = tokens.derived_opaque(
            kind, svc.keys.current.secret, f"{actor.id}:{key}:{request_sha256}"
        )
        async with conn.transaction():
            found = await admin_commands.lock_and_find(conn, actor.id, key_sha256)
            if found is None:
                created, raw = await create(conn, token)
                done = Remembered(command, request_sha256, target_id(created), token.sha256)
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
