"""Provisioner routes. The WebSocket control session's messages join these with issue 4."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, ClassVar, Literal
from uuid import UUID

import msgspec

from controlplane.domain.eligibility import Mode, eligibility_problem
from controlplane.wire.admin import TtlSeconds
from controlplane.wire.common import Name, Strict, whole


class ProvisionerIdentity(Strict):
    id: UUID
    scope: Literal["workspace", "installation"]
    workspace_id: UUID | msgspec.UnsetType = msgspec.UNSET  # absent for installation scope


class CreateProvisionerToken(Strict):
    name: Name
    workspace_id: UUID | None = None  # omitted: an installation-wide provisioner
    ttl_seconds: TtlSeconds | None = None

    def __post_init__(self) -> None:
        self.ttl_seconds = whole(self.ttl_seconds)


class ProvisionerTokenOut(Strict):
    id: UUID
    scope: Literal["workspace", "installation"]
    workspace_id: UUID | None
    name: str
    display_prefix: str
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    revocation_reason: str | None
    last_seen_at: datetime | None


class CreatedProvisionerToken(Strict):
    provisioner: ProvisionerTokenOut
    token: str  # shown once; only its SHA-256 is stored


class ProvisionerTokenList(Strict):
    items: list[ProvisionerTokenOut]
    next_cursor: str | None  # null on the last page


# The schema's bound; the server's is provisioners.eligibility_max_workspaces (at most this),
# which the served document puts in its place.
MAX_ELIGIBILITY_WORKSPACES = 10_000


class SetEligibility(Strict):
    """Which workspaces an installation provisioner may serve: `all` (no `workspace_ids`),
    `allow` (only those) or `deny` (all but those)."""

    mode: Literal["all", "allow", "deny"]
    workspace_ids: Annotated[
        list[UUID],
        msgspec.Meta(
            max_length=MAX_ELIGIBILITY_WORKSPACES, extra_json_schema={"uniqueItems": True}
        ),
    ] = msgspec.field(default_factory=list)

    json_schema_extra: ClassVar[dict[str, Any]] = {
        "anyOf": [
            {"properties": {"mode": {"enum": ["allow", "deny"]}}},
            {"properties": {"workspace_ids": {"maxItems": 0}}},
        ]
    }

    def __post_init__(self) -> None:
        limit = MAX_ELIGIBILITY_WORKSPACES
        if problem := eligibility_problem(Mode(self.mode), self.workspace_ids, limit=limit):
            raise ValueError(problem)


class EligibilityOut(Strict):
    provisioner_id: UUID
    mode: Literal["all", "allow", "deny"]
    workspace_ids: list[UUID]  # sorted
    updated_at: datetime | None  # null: never set (every workspace)
