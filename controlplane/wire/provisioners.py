"""Provisioner routes. The WebSocket control session's messages join these with issue 4."""

from __future__ import annotations

from datetime import datetime
from typing import Literal
from uuid import UUID

import msgspec

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
