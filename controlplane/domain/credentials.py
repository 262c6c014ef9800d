"""Credentials as stored: API keys and manual registration tokens, never their raw value."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from uuid import UUID


@dataclass(frozen=True, slots=True)
class Credential:
    """An API key or a manual registration token, as stored (never the raw value)."""

    id: UUID
    kind: str  # 'orchestrator', 'admin' or 'manual-registration'
    name: str
    workspace_id: UUID | None
    display_prefix: str
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    revocation_reason: str | None  # what the admin who revoked it gave, if anything
