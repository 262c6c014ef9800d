"""Terminate intents (spec 3.6), the intents a report honors (4.8) and reconcile's (4.9)."""

from __future__ import annotations

from datetime import timedelta

from controlplane.domain.runner_instances import LaunchKind, RunnerState
from controlplane.domain.terminate_intents import (
    TerminateIntent,
    TerminateReason,
    honored_reason,
    observed_intent,
    terminate_intent,
)
from tests.domain.provisioning_factories import NOW, ago, runner, uid

TIMEOUT = timedelta(seconds=300)


def test_a_demand_runner_past_its_timeout_is_told_to_stop_and_releases_once() -> None:
    first = terminate_intent(
        runner(1, launch_kind=LaunchKind.DEMAND, created_at=ago(600)),
        job_cancelled=False,
        live_reservation_ids=set(),
        now=NOW,
        activation_timeout=TIMEOUT,
    )
    assert first == TerminateIntent("provider-1", TerminateReason.ACTIVATION_TIMEOUT, False)
    assert first.releases_unit
    again = terminate_intent(
        runner(
            1, launch_kind=LaunchKind.DEMAND, created_at=ago(600), reservation_released_at=ago(9)
        ),
        job_cancelled=False,
        live_reservation_ids=set(),
        now=NOW,
        activation_timeout=TIMEOUT,
    )
    assert again == TerminateIntent("provider-1", TerminateReason.ACTIVATION_TIMEOUT, True)
    assert not again.releases_unit


def test_the_activation_timeout_wins_over_a_cancelled_job_and_none_leaves_it_out() -> None:
    late = runner(1, launch_kind=LaunchKind.DEMAND, created_at=ago(600))
    both = terminate_intent(
        late, job_cancelled=True, live_reservation_ids=set(), now=NOW, activation_timeout=TIMEOUT
    )
    assert both is not None and both.reason is TerminateReason.ACTIVATION_TIMEOUT
    cancelled = terminate_intent(
        late, job_cancelled=True, live_reservation_ids=set(), now=NOW, activation_timeout=None
    )
    assert cancelled == TerminateIntent("provider-1", TerminateReason.JOB_CANCELLED, False)
    assert not cancelled.releases_unit


def test_a_live_reservation_or_a_warm_launch_keeps_the_runner() -> None:
    r = uid(0x501)
    protected = runner(1, launch_kind=LaunchKind.DEMAND, created_at=ago(600), reservation_id=r)
    warm = runner(2, launch_kind=LaunchKind.WARM, created_at=ago(600))
    for kept in (protected, warm):
        intent = terminate_intent(
            kept, job_cancelled=False, live_reservation_ids={r}, now=NOW, activation_timeout=TIMEOUT
        )
        assert intent is None


def test_honored_reasons_follow_the_same_precedence() -> None:
    assert honored_reason(timed_out=True, cancelled=True) is TerminateReason.ACTIVATION_TIMEOUT
    assert honored_reason(timed_out=False, cancelled=True) is TerminateReason.JOB_CANCELLED
    assert honored_reason(timed_out=False, cancelled=False) is None


def test_reconcile_terminates_finished_runners_and_those_whose_job_was_cancelled() -> None:
    assert observed_intent(RunnerState.STOPPED, job_cancelled=True) == "terminal-state"
    assert observed_intent(RunnerState.RUNNING, job_cancelled=True) == "job-cancelled"
    assert observed_intent(RunnerState.RUNNING, job_cancelled=False) is None
