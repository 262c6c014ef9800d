"""A control session's fencing verdict and the activation rules of the boot path."""

from __future__ import annotations

import pytest

from controlplane.domain.control_sessions import activation_refusal, may_activate
from controlplane.domain.provisioners import Fence, lost_fence
from controlplane.domain.runner_instances import RunnerState
from tests.domain.provisioning_factories import W, ago, runner, uid


@pytest.mark.parametrize(
    ("current", "revoked", "expired", "verdict"),
    [
        (3, None, False, Fence.REVOKED),  # the token row is gone
        (3, True, True, Fence.REVOKED),  # revocation wins over everything
        (4, False, True, Fence.SUPERSEDED),  # a newer session wins over expiry
        (None, False, False, Fence.SUPERSEDED),  # no session row at all
        (3, False, True, Fence.EXPIRED),
        (3, False, False, Fence.SUPERSEDED),  # the fence failed for no reason we can see
    ],
)
def test_why_a_fence_was_lost(
    current: int | None, revoked: bool | None, expired: bool, verdict: Fence
) -> None:
    assert (
        lost_fence(current_generation=current, generation=3, revoked=revoked, expired=expired)
        is verdict
    )


def test_an_activation_token_needs_an_assigned_running_unactivated_runner() -> None:
    assigned = runner(1, workspace_id=W)
    assert activation_refusal(assigned) is None
    assert activation_refusal(None) == "runner-not-found"
    assert activation_refusal(runner(1)) == "missing-workspace"
    assert activation_refusal(runner(1, workspace_id=W, runner_session_id=uid(9))) == (
        "existing-session"
    )
    assert activation_refusal(runner(1, workspace_id=W, state=RunnerState.STARTING)) == (
        "not-running"
    )


def test_registration_needs_an_assigned_identified_runner_without_a_session() -> None:
    assert may_activate(runner(1, workspace_id=W))
    assert not may_activate(None)
    assert not may_activate(runner(1))
    assert not may_activate(runner(1, workspace_id=W, provider_runner_id=None))
    assert not may_activate(runner(1, workspace_id=W, runner_session_id=uid(9)))
    # Registration does not look at the state: a runner that stopped after its token was issued
    # may still trade it (the claim is what a finished runner can no longer make).
    assert may_activate(runner(1, workspace_id=W, state=RunnerState.STOPPED, reported_at=ago(1)))
