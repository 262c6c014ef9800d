"""The provisioner actor (one per live control session), the board that wakes it, and the
replica's demand sweep."""

from controlplane.actors.provisioning.actor import (
    Advertisement,
    DemandPush,
    Limits,
    ProvisionerActor,
)
from controlplane.actors.provisioning.board import DemandBoard
from controlplane.actors.provisioning.rounds import ProvisioningStore, WorkspaceDemand
from controlplane.actors.provisioning.sweep import DemandSweep, SweepStore

__all__ = [
    "Advertisement",
    "DemandBoard",
    "DemandPush",
    "DemandSweep",
    "Limits",
    "ProvisionerActor",
    "ProvisioningStore",
    "SweepStore",
    "WorkspaceDemand",
]
