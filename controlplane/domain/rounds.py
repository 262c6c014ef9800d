"""What an allocation round committed (spec 3.3-3.6): the launch grants a provisioner is told
of, one workspace's round, and an installation provisioner's walk over workspaces."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

from controlplane.domain.demand import Allocation, Template
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


@dataclass(frozen=True, slots=True)
class InstallationRound:
    rounds: tuple[WorkspaceRound, ...]
    skipped: tuple[UUID, ...]  # workspaces whose lock was busy this round
    remaining_templates: tuple[Template, ...]
    remaining_max: int

    @property
    def grants(self) -> tuple[Grant, ...]:
        return tuple(g for r in self.rounds for g in r.grants)

    @property
    def newly_reserved(self) -> int:
        return sum(r.allocation.newly_reserved for r in self.rounds)
