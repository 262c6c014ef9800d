"""Provisioners as the rest of the code sees them, and the fencing verdict of a control session.

A provisioner is the holder of a provisioner token (the token id is the provisioner id), scoped
to one workspace or to the whole installation. Each provisioner has at most one live control
session; a session proves it is still the live one by its generation (`Fence`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime
from uuid import UUID


@dataclass(frozen=True, slots=True)
class Provisioner:
    id: UUID
    scope: str  # 'workspace' or 'installation'
    workspace_id: UUID | None
    name: str
    display_prefix: str
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    revocation_reason: str | None  # what the admin who revoked it gave, if anything
    last_seen_at: datetime | None


class Fence(enum.Enum):
    """Whether a control session still speaks for its provisioner."""

    CURRENT = "current"
    SUPERSEDED = "superseded"
    REVOKED = "revoked"
    EXPIRED = "expired"


def lost_fence(
    *, current_generation: int | None, generation: int, revoked: bool | None, expired: bool
) -> Fence:
    """Why a session holding `generation` failed its fence, from the provisioner's token row
    (`revoked` None: the token row is gone) and the generation now current (None: no session
    row). A revoked or missing token wins; then a newer generation; then the token's expiry."""
    if revoked is None or revoked:
        return Fence.REVOKED
    if current_generation != generation:
        return Fence.SUPERSEDED
    return Fence.EXPIRED if expired else Fence.SUPERSEDED
