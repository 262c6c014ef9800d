"""The rules about credentials that the admin API and the `tokens` command share. Pure.

Issuing: the five families an operator creates (orchestrator, admin and workspace admin API
keys, manual registration tokens, provisioner tokens), the workspace each may or must name, the
role of an admin key, and the lifetime asked for. The raw token exists once, in the answer to
its creation; only its SHA-256 is kept.

Presenting: once a presented token is found, whether it is refused, with which code and message,
and in which order revocation and expiry are reported (each kind as the reference does).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Protocol
from uuid import UUID

from controlplane.domain import tokens
from controlplane.domain.credentials import Role
from controlplane.errors import InvalidInput, Unauthorized


class Family(enum.StrEnum):
    """What an operator issues; the names the `tokens` command and the audit log use."""

    ORCHESTRATOR = "orchestrator"
    ADMIN = "admin"
    WORKSPACE_ADMIN = "workspace-admin"
    REGISTRATION = "registration"
    PROVISIONER = "provisioner"

    @property
    def token_kind(self) -> tokens.Kind:
        return _TOKEN_KINDS[self]


_TOKEN_KINDS = {
    Family.ORCHESTRATOR: tokens.Kind.ORCHESTRATOR_KEY,
    Family.ADMIN: tokens.Kind.ADMIN_KEY,
    Family.WORKSPACE_ADMIN: tokens.Kind.WORKSPACE_ADMIN_KEY,
    Family.REGISTRATION: tokens.Kind.MANUAL_REGISTRATION,
    Family.PROVISIONER: tokens.Kind.PROVISIONER,
}


def scope_problem(family: Family, workspace_id: UUID | None, *, field: str) -> str | None:
    """Why `workspace_id` cannot scope a credential of `family`, naming the caller's `field`
    (`workspace_id` in a body, `--workspace` on the command line); None when it can. Admin keys
    are installation-wide; a workspace admin key administers one workspace and a registration
    token registers runners of one; orchestrator keys and provisioner tokens are either."""
    if family is Family.ADMIN and workspace_id is not None:
        return f"admin keys are installation-wide: omit {field}"
    if family is Family.WORKSPACE_ADMIN and workspace_id is None:
        return f"workspace admin keys need {field}"
    if family is Family.REGISTRATION and workspace_id is None:
        return f"registration tokens need {field}"
    return None


ROLE_FAMILIES = frozenset({Family.ADMIN, Family.WORKSPACE_ADMIN})


def role_problem(family: Family, role: Role, *, field: str) -> str | None:
    """Why `role` cannot be given to a credential of `family` (only admin keys of either kind
    have one; every other credential is an owner); None when it can."""
    if role is not Role.OWNER and family not in ROLE_FAMILIES:
        return f"only admin and workspace-admin keys take {field}"
    return None


def may_change(role: Role, method: str) -> bool:
    """Whether a key of `role` may make a request with this HTTP method: an observer reads."""
    return role is Role.OWNER or method in ("GET", "HEAD")


def lifetime(seconds: float | None) -> timedelta | None:
    """The lifetime asked for, in whole seconds; None: the credential does not expire."""
    return None if seconds is None else timedelta(seconds=seconds)


@dataclass(frozen=True, slots=True)
class NewCredential:
    """A credential to issue, its request already decoded (a body, or the command's options)."""

    family: Family
    name: str
    workspace_id: UUID | None = None
    ttl: timedelta | None = None
    role: Role = Role.OWNER

    def __post_init__(self) -> None:
        if problem := scope_problem(self.family, self.workspace_id, field="workspace_id"):
            raise InvalidInput(problem, field="workspace_id")
        if problem := role_problem(self.family, self.role, field="role"):
            raise InvalidInput(problem, field="role")


class Revocable(Protocol):
    """A stored credential as far as presenting it goes."""

    @property
    def revoked_at(self) -> datetime | None: ...

    @property
    def expires_at(self) -> datetime | None: ...


@dataclass(frozen=True, slots=True)
class Refusals:
    """How a found credential of one kind is refused: `<noun> was revoked` with `revoked_code`,
    `<noun> expired` with `expired_code`, revocation reported first unless `expiry_first`."""

    noun: str
    revoked_code: str
    expired_code: str
    expiry_first: bool = False

    def check(self, found: Revocable, now: datetime) -> None:
        """Raise the refusal for `found` at `now`, if any. Expiring at this very instant is
        expired."""
        expired = found.expires_at is not None and found.expires_at <= now
        if expired and self.expiry_first:
            raise Unauthorized(f"{self.noun} expired", code=self.expired_code)
        if found.revoked_at is not None:
            raise Unauthorized(f"{self.noun} was revoked", code=self.revoked_code)
        if expired:
            raise Unauthorized(f"{self.noun} expired", code=self.expired_code)


API_KEY = Refusals("the API key", "api-key-revoked", "api-key-expired")
# Expiry before revocation, as the reference does for registration tokens.
REGISTRATION_TOKEN = Refusals(
    "the registration token",
    "manual-registration-token-revoked",
    "registration-token-expired",
    expiry_first=True,
)
PROVISIONER_TOKEN = Refusals(
    "the provisioner token", "provisioner-token-revoked", "provisioner-token-expired"
)
