"""The admin fleet view's pure rules: derived states and the list cursor."""

from __future__ import annotations

import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from controlplane.domain import fleet
from controlplane.domain.runner_instances import RunnerState
from controlplane.errors import InvalidInput

NOW = datetime(2026, 1, 1, 12, tzinfo=UTC)
THRESHOLD = timedelta(seconds=300)
FACTS = fleet.InstanceFacts(
    state=RunnerState.RUNNING,
    workspace_id=None,
    runner_session_id=None,
    first_claimed_at=None,
    control_session_live=False,
    reported_at=NOW,
    provisioner_last_seen_at=NOW,
)


def test_lifecycle_moves_from_unassigned_to_claimed_and_ends_completed() -> None:
    assigned = replace(FACTS, workspace_id=uuid.uuid4())
    activated = replace(assigned, runner_session_id=uuid.uuid4())
    claimed = replace(activated, first_claimed_at=NOW)
    assert [fleet.lifecycle_state(f) for f in (FACTS, assigned, activated, claimed)] == [
        "unassigned", "assigned", "activated", "claimed",
    ]  # fmt: skip
    assert fleet.lifecycle_state(replace(claimed, state=RunnerState.STOPPED)) == "completed"
    assert fleet.lifecycle_state(replace(FACTS, state=RunnerState.FAILED)) == "unassigned"


def test_enrollment_prefers_the_runner_session_over_the_control_session() -> None:
    live = replace(FACTS, control_session_live=True)
    assert fleet.enrollment_state(FACTS) == "pending"
    assert fleet.enrollment_state(live) == "enrolled"
    assert fleet.enrollment_state(replace(live, runner_session_id=uuid.uuid4())) == "activated"


def test_reconciliation_is_stale_at_the_threshold_exactly() -> None:
    def status(facts: fleet.InstanceFacts) -> str:
        return fleet.reconciliation_status(facts, now=NOW, threshold=THRESHOLD)

    edge = NOW - THRESHOLD
    assert status(FACTS) == "current"
    assert status(replace(FACTS, reported_at=edge)) == "stale"
    assert status(replace(FACTS, provisioner_last_seen_at=edge)) == "stale"
    assert status(replace(FACTS, reported_at=edge + timedelta(microseconds=1))) == "current"
    assert status(replace(FACTS, provisioner_last_seen_at=None)) == "unknown"
    assert status(replace(FACTS, state=RunnerState.TERMINATED, provisioner_last_seen_at=None)) == (
        "terminal"
    )


def test_a_cursor_round_trips_and_anything_else_is_invalid() -> None:
    instance_id = uuid.uuid4()
    assert fleet.decode_cursor(fleet.encode_cursor(NOW, instance_id)) == (NOW, instance_id)
    naive = fleet.encode_cursor(NOW.replace(tzinfo=None), instance_id)
    for bad in ("", "not-a-cursor", "e30", "W10", naive):
        with pytest.raises(InvalidInput) as refused:
            fleet.decode_cursor(bad)
        assert refused.value.code == "invalid-cursor"
