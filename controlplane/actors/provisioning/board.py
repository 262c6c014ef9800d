"""The provisioner actors on this replica, woken when a workspace's demand may have grown."""

from __future__ import annotations

from uuid import UUID

from controlplane.actors.provisioning.actor import ProvisionerActor
from controlplane.domain.binding import Scope
from controlplane.domain.labels import LabelSet


class DemandBoard:
    """Synchronous: the listener's callbacks run on the same event loop as the actors.

    Workspace actors are kept by the workspace they serve, so an enqueue's notification wakes
    its workspace's actors and the installation ones without looking at any other (a replica
    holding many sessions pays per notification for the actors it wakes, not for all of them).
    """

    def __init__(self) -> None:
        self._actors: set[ProvisionerActor] = set()
        self._installation: set[ProvisionerActor] = set()
        self._by_workspace: dict[UUID | None, set[ProvisionerActor]] = {}

    def add(self, actor: ProvisionerActor) -> None:
        self._actors.add(actor)
        if actor.scope is Scope.INSTALLATION:
            self._installation.add(actor)
        else:
            self._by_workspace.setdefault(actor.provisioner.workspace_id, set()).add(actor)

    def remove(self, actor: ProvisionerActor) -> None:
        self._actors.discard(actor)
        self._installation.discard(actor)
        workspace_id = actor.provisioner.workspace_id
        serving = self._by_workspace.get(workspace_id)
        if serving is not None:
            serving.discard(actor)
            if not serving:
                del self._by_workspace[workspace_id]

    def __len__(self) -> int:
        return len(self._actors)

    def actors(self) -> list[ProvisionerActor]:
        """Every actor on this replica (the demand sweep reads their figures)."""
        return list(self._actors)

    def wake_workspace(self, workspace_id: UUID, labels: LabelSet | None = None) -> None:
        del labels  # every template may match some label set; the round decides
        for actor in self._by_workspace.get(workspace_id, ()):
            actor.wake()
        for actor in self._installation:
            actor.demand_changed(workspace_id)

    def wake_all(self) -> None:
        for actor in self._actors:
            actor.wake()

    def resync(self) -> None:
        """Notifications may have been lost (the listener reconnected): every actor runs a
        round, and installation walks visit every workspace."""
        for actor in self._actors:
            actor.resync()
