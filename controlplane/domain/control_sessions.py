"""The provisioned runner's boot path as values (spec 4.3-4.7): its control session, what
enrollment answered, the activation token it trades for a runner session, and when such a token
may be issued."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

from controlplane.domain.runner_instances import ProvisionedRunner, RunnerState


@dataclass(frozen=True, slots=True)
class ControlSession:
    """An authenticated, live control session, with its provisioner's scope."""

    id: UUID
    runner_instance_id: UUID
    provisioner_id: UUID
    provisioner_scope: str | None  # None: the provisioner token row is gone
    expires_at: datetime


@dataclass(frozen=True, slots=True)
class Exchanged:
    """A bootstrap token traded for a control session (the raw session token, returned once)."""

    runner_instance_id: UUID
    control_session_token: str
    expires_at: datetime


@dataclass(frozen=True, slots=True)
class Enrollment:
    activation_token: str | None
    # Why the intended reservation was not promoted (an assignment rejection reason, or
    # `unexpected`), or why no token was issued after a promotion; None when neither applies.
    promotion_failure: str | None = None
    not_issued: str | None = None


@dataclass(frozen=True, slots=True)
class ActivationGrant:
    """A usable activation token, with what registration needs to know of its runner."""

    token_id: UUID
    runner_instance_id: UUID
    provisioner_id: UUID
    provisioner_scope: str | None
    workspace_id: UUID


def activation_refusal(runner: ProvisionedRunner | None) -> str | None:
    """Why no activation token may be issued for this runner (None: its row is gone), or None
    when one may: it must be assigned (have a workspace), not activated yet, and running."""
    if runner is None:
        return "runner-not-found"
    if runner.workspace_id is None:
        return "missing-workspace"
    if runner.runner_session_id is not None:
        return "existing-session"
    if runner.state is not RunnerState.RUNNING:
        return "not-running"
    return None


def may_activate(runner: ProvisionedRunner | None) -> bool:
    """Whether registration may trade an activation token for this runner's one-claim session:
    it is assigned, has its provider identity, and has no runner session yet."""
    return (
        runner is not None
        and runner.workspace_id is not None
        and runner.provider_runner_id is not None
        and runner.runner_session_id is None
    )
