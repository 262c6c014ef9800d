"""What an allocation round committed (spec 3.3-3.6): the launch grants a provisioner is told
of and one workspace's round (the walk over an installation's workspaces is the provisioning
actor's, in actors/provisioning/rounds.py)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

from controlplane.domain.demand import Allocation
from controlplane.domain.labels import LabelSet
from controlplane.domain.terminate_intents import TerminateIntent


@dataclass(frozen=True, slots=True)
class Grant:
    """A launch reservation as the provisioner is told of it."""

    reservation_id: UUID
    workspace_id: UUID
    labels: LabelSet
    count: int
    expires_at: datetime


@dataclass(frozen=True, slots=True)
class WorkspaceRound:
    """What one allocation transaction for one workspace committed."""

    workspace_id: UUID
    allocation: Allocation
    grants: tuple[Grant, ...]
    bound: int  # runners bound to bound reservations
    rebound: int  # of those, runners launched for demand (activation outcome metric)
    terminate_intents: tuple[TerminateIntent, ...] = ()
    terminate_truncated: bool = False
    covered: bool = False  # nothing of this provisioner's left to do (`demand.covers`)
    # A walk's round: the fingerprint of the workspace's live reservations as it left them
    # (`WalkEntry.reservations`, read in its transaction).
    reservations: int | None = None


@dataclass(frozen=True, slots=True)
class WalkEntry:
    """One workspace an installation walk lists, with a fingerprint of its live reservations
    (their ids and counts): equal fingerprints, the same live reservations."""

    workspace_id: UUID
    reservations: int
