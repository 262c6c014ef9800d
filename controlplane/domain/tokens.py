"""Token formats: opaque credentials and signed session/lease tokens. Pure; `now` is a parameter.

Opaque tokens look like `cp_<kind>_<43 base64url chars>` (256 random bits). The kind prefix says
what the token is for, so a token of one kind is refused by every other route before any lookup.
Only the SHA-256 hex of an opaque token is stored, with its first 12 characters for display.

Signed tokens (runner sessions, job leases) look like `cp_<kind>_<kid>.<claims>.<mac>`: the claims
are base64url JSON, the MAC is HMAC-SHA256 over `<kind>.<kid>.<claims>` with the key named by
`kid`, so keys can be rotated. They are checked in constant time and carry their own expiry, so the
hot path (job request, heartbeat) needs no token lookup.
"""

from __future__ import annotations

import base64
import binascii
import enum
import hashlib
import hmac
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import msgspec

PREFIX = "cp"
DISPLAY_PREFIX_LENGTH = 12
_RANDOM_BYTES = 32  # 256 bits: 43 base64url characters
_MAX_SIGNED_LENGTH = 4096


class Kind(enum.StrEnum):
    ORCHESTRATOR_KEY = "oak"
    ADMIN_KEY = "adm"
    WORKSPACE_ADMIN_KEY = "wak"
    MANUAL_REGISTRATION = "mrt"
    EPHEMERAL_REGISTRATION = "ert"
    ACTIVATION = "rat"
    BOOTSTRAP = "rbt"
    CONTROL_SESSION = "rcs"
    PROVISIONER = "pt"
    RUNNER_SESSION = "rs"  # signed
    JOB_LEASE = "jl"  # signed


SIGNED_KINDS = frozenset({Kind.RUNNER_SESSION, Kind.JOB_LEASE})


class TokenError(Exception):
    """The token is malformed, of the wrong kind, forged or expired. Never says which secret."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def kind_of(token: str) -> Kind | None:
    """The kind named by a token's prefix, or None when it is not one of ours."""
    parts = token.split("_", 2)
    if len(parts) != 3 or parts[0] != PREFIX:
        return None
    try:
        return Kind(parts[1])
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class Opaque:
    raw: str
    sha256: str
    display_prefix: str


def digest(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


def new_opaque(kind: Kind) -> Opaque:
    if kind in SIGNED_KINDS:
        raise ValueError(f"{kind} tokens are signed, not opaque")
    raw = f"{PREFIX}_{kind}_{_b64(secrets.token_bytes(_RANDOM_BYTES))}"
    return Opaque(raw=raw, sha256=digest(raw), display_prefix=raw[:DISPLAY_PREFIX_LENGTH])


def derived_opaque(kind: Kind, secret: bytes, material: str) -> Opaque:
    """An opaque token whose random part is HMAC-SHA256(secret, material): the same request
    derives the same token, so an idempotent create can answer a replay without storing it."""
    if kind in SIGNED_KINDS:
        raise ValueError(f"{kind} tokens are signed, not opaque")
    tail = _b64(hmac.new(secret, material.encode(), hashlib.sha256).digest())
    raw = f"{PREFIX}_{kind}_{tail}"
    return Opaque(raw=raw, sha256=digest(raw), display_prefix=raw[:DISPLAY_PREFIX_LENGTH])


def parse_opaque(token: str, kind: Kind) -> str:
    """Check shape and kind; return the SHA-256 hex to look up."""
    if kind_of(token) != kind:
        raise TokenError("wrong token kind")
    body = token.split("_", 2)[2]
    if len(body) != 43:
        raise TokenError("malformed token")
    try:
        if len(_unb64(body)) != _RANDOM_BYTES:
            raise TokenError("malformed token")
    except (binascii.Error, ValueError) as error:
        raise TokenError("malformed token") from error
    return digest(token)


def same_digest(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


@dataclass(frozen=True, slots=True)
class SigningKey:
    kid: str
    secret: bytes


def sign(kind: Kind, claims: Mapping[str, Any], key: SigningKey, expires_at: datetime) -> str:
    if kind not in SIGNED_KINDS:
        raise ValueError(f"{kind} tokens are opaque")
    body = _b64(msgspec.json.encode({**claims, "exp": int(expires_at.timestamp())}))
    signed = f"{kind}.{key.kid}.{body}"
    mac = _b64(hmac.new(key.secret, signed.encode(), hashlib.sha256).digest())
    return f"{PREFIX}_{kind}_{key.kid}.{body}.{mac}"


def verify(token: str, kind: Kind, keys: Mapping[str, SigningKey], now: datetime) -> dict[str, Any]:
    """Return the claims of a valid, unexpired token of `kind`; raise TokenError otherwise."""
    if len(token) > _MAX_SIGNED_LENGTH or kind_of(token) != kind:
        raise TokenError("wrong token kind")
    parts = token.split("_", 2)[2].split(".")
    if len(parts) != 3:
        raise TokenError("malformed token")
    kid, body, mac = parts
    key = keys.get(kid)
    if key is None:
        raise TokenError("unknown signing key")
    expected = hmac.new(key.secret, f"{kind}.{kid}.{body}".encode(), hashlib.sha256).digest()
    try:
        given = _unb64(mac)
    except (binascii.Error, ValueError) as error:
        raise TokenError("malformed token") from error
    if not hmac.compare_digest(expected, given):
        raise TokenError("bad signature")
    # Only claims we signed are parsed: a forged body (nested 1,000 deep, say) never reaches
    # the JSON parser.
    try:
        claims = msgspec.json.decode(_unb64(body))
    except (binascii.Error, ValueError, msgspec.DecodeError) as error:
        raise TokenError("malformed token") from error
    if not isinstance(claims, dict) or not isinstance(claims.get("exp"), int):
        raise TokenError("malformed claims")
    if claims["exp"] <= now.timestamp():
        raise TokenError("expired")
    return claims
