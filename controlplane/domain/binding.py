"""Idle-runner binding: which enrolled runners a demand group may adopt, and in what order.

An idle runner (enrolled, running, never activated) can take demand without new compute. The
allocation binds the oldest bindable runners to a `bound` reservation; the store then locks them
one by one in ascending id (the order reservation cleanup locks runner rows in, so the two
cannot deadlock) and re-checks `is_bindable` on freshly read rows before writing `bind_runner`'s
fields. A live reservation, assigned or intended, protects a runner still booting or inside its
activation grace; once it expires or is deleted the runner can be bound again, unless its unit
was released (released is forever) or it has activated.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Set
from dataclasses import dataclass, replace
from datetime import datetime
from uuid import UUID

from controlplane.domain.labels import LabelSet, matches
from controlplane.domain.runner_instances import ProvisionedRunner, RunnerState


class Scope(enum.StrEnum):
    WORKSPACE = "workspace"  # a provisioner owned by one workspace
    INSTALLATION = "installation"  # a fallback provisioner serving every eligible workspace


@dataclass(frozen=True, slots=True)
class BindTarget:
    """Who is binding idle runners, for which workspace and labels."""

    provisioner_id: UUID
    workspace_id: UUID
    scope: Scope
    labels: LabelSet


def is_idle(runner: ProvisionedRunner, *, live: Set[UUID], now: datetime) -> bool:
    """Enrolled, running, not activated, not released, not drained, and protected by no live
    reservation (assigned or intended): a live one means it is booting or inside its activation
    grace."""
    protected = (runner.reservation_id in live) or (runner.intended_reservation_id in live)
    return (
        runner.state is RunnerState.RUNNING
        and runner.provider_runner_id is not None
        and runner.control_session_expires_at is not None
        and runner.control_session_expires_at > now
        and runner.runner_session_id is None
        and not runner.released
        and runner.drained_at is None  # drained by an operator (store/pauses.py)
        and not protected
        # A workspace without a reservation is an assignment nobody can release: never idle.
        and (runner.workspace_id is None or runner.reservation_id is not None)
    )


def is_bindable(
    runner: ProvisionedRunner, target: BindTarget, *, live: Set[UUID], now: datetime
) -> bool:
    """The full binding predicate of spec 3.4; the store re-checks it under the row lock."""
    return (
        runner.provisioner_id == target.provisioner_id
        and matches(target.labels, runner.labels)
        and is_idle(runner, live=live, now=now)
        and (
            target.scope is Scope.INSTALLATION
            or runner.workspace_id is None
            or runner.workspace_id == target.workspace_id
        )
    )


def select_idle_runners(
    runners: Iterable[ProvisionedRunner],
    target: BindTarget,
    *,
    count: int,
    live: Set[UUID],
    now: datetime,
    exclude: Set[UUID] = frozenset(),
) -> tuple[ProvisionedRunner, ...]:
    """The `count` oldest bindable runners (created_at, then id), returned in ascending id."""
    if count <= 0:
        return ()
    candidates = sorted(
        (r for r in runners if r.id not in exclude and is_bindable(r, target, live=live, now=now)),
        key=lambda r: (r.created_at, r.id),
    )
    return tuple(sorted(candidates[:count], key=lambda r: r.id))


def bind_runner(
    runner: ProvisionedRunner, *, reservation_id: UUID, workspace_id: UUID, now: datetime
) -> ProvisionedRunner:
    """The runner as binding leaves it: assigned to the bound reservation, intent cleared."""
    return replace(
        runner,
        workspace_id=workspace_id,
        reservation_id=reservation_id,
        intended_reservation_id=None,
        assigned_at=now,
    )
