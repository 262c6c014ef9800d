"""The provisioner actor (one per live control session) and the board that wakes it."""

from controlplane.actors.provisioning.actor import (
    Advertisement,
    DemandPush,
    Limits,
    ProvisionerActor,
)
from controlplane.actors.provisioning.board import DemandBoard
from controlplane.actors.provisioning.rounds import ProvisioningStore, WorkspaceDemand

__all__ = [
    "Advertisement",
    "DemandBoard",
    "DemandPush",
    "Limits",
    "ProvisionerActor",
    "ProvisioningStore",
    "WorkspaceDemand",
]
