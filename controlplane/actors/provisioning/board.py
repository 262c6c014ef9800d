"""The provisioner actors on this replica, woken when a workspace's demand may have grown."""

from __future__ import annotations

from uuid import UUID

from controlplane.actors.provisioning.actor import ProvisionerActor
from controlplane.domain.labels import LabelSet


class DemandBoard:
    """Synchronous: the listener's callbacks run on the same event loop as the actors."""

    def __init__(self) -> None:
        self._actors: set[ProvisionerActor] = set()

    def add(self, actor: ProvisionerActor) -> None:
        self._actors.add(actor)

    def remove(self, actor: ProvisionerActor) -> None:
        self._actors.discard(actor)

    def __len__(self) -> int:
        return len(self._actors)

    def wake_workspace(self, workspace_id: UUID, labels: LabelSet | None = None) -> None:
        del labels  # every template may match some label set; the round decides
        for actor in self._actors:
            if actor.serves(workspace_id):
                actor.wake()

    def wake_all(self) -> None:
        for actor in self._actors:
            actor.wake()
