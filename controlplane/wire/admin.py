"""Admin routes: API keys, manual registration tokens, the queue."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal
from uuid import UUID

import msgspec

from controlplane.wire.common import Name, Strict

TtlSeconds = Annotated[int, msgspec.Meta(ge=1, le=31_536_000)]


class CreateApiKey(Strict):
    kind: Literal["orchestrator", "admin"]
    name: Name
    workspace_id: UUID | None = None
    ttl_seconds: TtlSeconds | None = None


class CreateRegistrationToken(Strict):
    workspace_id: UUID
    name: Name
    ttl_seconds: TtlSeconds | None = None


class CredentialOut(Strict):
    id: UUID
    kind: str
    name: str
    workspace_id: UUID | None
    display_prefix: str
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None


class CreatedCredential(Strict):
    credential: CredentialOut
    token: str  # shown once; only its SHA-256 is stored


class CredentialList(Strict):
    items: list[CredentialOut]


class WorkspaceQueue(Strict):
    workspace_id: UUID
    queued: int
    running: int


class QueueOut(Strict):
    pending: int
    running: int
    workspaces: list[WorkspaceQueue]


class ActiveRunnerOut(Strict):
    runner_session_id: UUID
    workspace_id: UUID
    mode: str
    labels: list[str]
    last_seen_at: datetime
    running: int


class ActiveRunners(Strict):
    items: list[ActiveRunnerOut]
