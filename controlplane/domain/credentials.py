"""Credentials as stored: API keys and manual registration tokens, never their raw value."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime
from uuid import UUID


class Role(enum.StrEnum):
    """What an admin key (installation or workspace) may do on its routes: an owner everything
    they allow, an observer only read (GET). Orchestrator keys and tokens are owners."""

    OWNER = "owner"
    OBSERVER = "observer"


@dataclass(frozen=True, slots=True)
class Credential:
    """An API key or a manual registration token, as stored (never the raw value)."""

    id: UUID
    kind: str  # 'orchestrator', 'admin', 'workspace-admin' or 'manual-registration'
    name: str
    workspace_id: UUID | None
    display_prefix: str
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    revocation_reason: str | None  # what the admin who revoked it gave, if anything
    role: Role = Role.OWNER
