"""Plain records for the provisioning domain tests: one workspace W, one provisioner P."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

from controlplane.domain.binding import Scope
from controlplane.domain.demand import (
    AllocationInputs,
    DemandGroup,
    Reservation,
    ReservationKind,
    Template,
)
from controlplane.domain.labels import LabelSet
from controlplane.domain.runner_instances import LaunchKind, ProvisionedRunner, RunnerState

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
W = UUID(int=0xA1)
W2 = UUID(int=0xA2)
P = UUID(int=0xB1)
P2 = UUID(int=0xB2)
LINUX: LabelSet = ("linux",)
GPU_LINUX: LabelSet = ("gpu", "linux")


def ago(seconds: float) -> datetime:
    return NOW - timedelta(seconds=seconds)


def later(seconds: float) -> datetime:
    return NOW + timedelta(seconds=seconds)


def uid(n: int) -> UUID:
    return UUID(int=n)


def runner(n: int, **overrides: Any) -> ProvisionedRunner:
    """An idle enrolled runner of P (bindable for `linux`), created `1000 - n` seconds ago."""
    fields: dict[str, Any] = {
        "id": uid(n),
        "provisioner_id": P,
        "created_at": ago(1000 - n),
        "state": RunnerState.RUNNING,
        "labels": LINUX,
        "reported_at": ago(5),
        "updated_at": ago(5),
        "launch_kind": LaunchKind.WARM,
        "template_key": "small",
        "provider_runner_id": f"provider-{n}",
        "control_session_expires_at": later(3000),
    }
    fields.update(overrides)
    return ProvisionedRunner(**fields)


def reservation(
    n: int,
    labels: LabelSet = LINUX,
    count: int = 1,
    *,
    kind: ReservationKind = ReservationKind.LAUNCH,
    expires_in: float = 60,
    workspace_id: UUID = W,
    provisioner_id: UUID = P,
) -> Reservation:
    return Reservation(uid(n), workspace_id, provisioner_id, labels, count, kind, later(expires_in))


def template(
    key: str = "small", labels: LabelSet = LINUX, slots: int = 10, idle_target: int = 0
) -> Template:
    return Template(key, labels, slots, idle_target=idle_target)


def group(labels: LabelSet = LINUX, queued: int = 1, oldest: float = 60) -> DemandGroup:
    return DemandGroup(labels, queued, ago(oldest))


def inputs(**overrides: Any) -> AllocationInputs:
    fields: dict[str, Any] = {
        "workspace_id": W,
        "provisioner_id": P,
        "scope": Scope.WORKSPACE,
        "demand": (),
        "templates": (template(),),
        "reservations": (),
        "runners": (),
        "max_reservations": 100,
        "launch_ttl": timedelta(seconds=120),
        "activation_grace": timedelta(seconds=60),
    }
    fields.update(overrides)
    return AllocationInputs(**fields)
