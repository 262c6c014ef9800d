from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from controlplane.domain.runner_instances import (
    ACTIVE_STATES,
    TERMINAL_STATES,
    Cause,
    IllegalTransition,
    LaunchKind,
    RunnerState,
    StaleRunnerRule,
    absent_and_stale,
    activation_timed_out,
    clamp_reported_at,
    report_supersedes,
    transition,
)
from tests.domain.provisioning_factories import NOW, ago, later, runner, uid

S = RunnerState


def test_active_and_terminal_partition_the_states_in_rank_order() -> None:
    assert set(RunnerState) == ACTIVE_STATES | TERMINAL_STATES
    assert not ACTIVE_STATES & TERMINAL_STATES
    assert [s.rank for s in RunnerState] == [1, 2, 3, 4, 5, 6]
    assert max(s.rank for s in ACTIVE_STATES) < min(s.rank for s in TERMINAL_STATES)


def test_creation_starts_and_a_first_report_may_say_anything() -> None:
    assert transition(None, S.STARTING, Cause.CREATE) is S.STARTING
    assert transition(None, S.FAILED, Cause.FIRST_REPORT) is S.FAILED
    with pytest.raises(IllegalTransition):
        transition(None, S.RUNNING, Cause.CREATE)
    with pytest.raises(IllegalTransition):
        transition(S.STARTING, S.STARTING, Cause.CREATE)
    with pytest.raises(IllegalTransition):
        transition(S.RUNNING, S.RUNNING, Cause.FIRST_REPORT)


def test_reports_move_forward_by_rank_and_terminal_states_still_progress() -> None:
    assert transition(S.RUNNING, S.RUNNING, Cause.REPORT) is S.RUNNING
    assert transition(S.STOPPED, S.FAILED, Cause.REPORT) is S.FAILED
    assert transition(S.FAILED, S.TERMINATED, Cause.REPORT) is S.TERMINATED
    with pytest.raises(IllegalTransition, match=r"report cannot move .* from failed to running"):
        transition(S.FAILED, S.RUNNING, Cause.REPORT)


def test_p122_enrollment_of_a_finished_instance_is_refused_with_the_session_code() -> None:
    for state in TERMINAL_STATES:
        with pytest.raises(IllegalTransition) as refused:
            transition(state, S.RUNNING, Cause.ENROLLMENT)
        assert refused.value.code == "runner-control-session-invalid"
        assert refused.value.details == {
            "current": state.value,
            "target": "running",
            "cause": "enrollment",
        }


def test_enrollment_runs_a_starting_instance_but_never_revives_a_stopping_one() -> None:
    assert transition(S.STARTING, S.RUNNING, Cause.ENROLLMENT) is S.RUNNING
    assert transition(S.RUNNING, S.RUNNING, Cause.ENROLLMENT) is S.RUNNING
    with pytest.raises(IllegalTransition):
        transition(S.STOPPING, S.RUNNING, Cause.ENROLLMENT)
    with pytest.raises(IllegalTransition):
        transition(S.STARTING, S.STOPPED, Cause.ENROLLMENT)


@pytest.mark.parametrize(
    ("cause", "target"),
    [
        (Cause.RECONCILE_ABSENT, S.TERMINATED),
        (Cause.STALE_REAPER, S.FAILED),
        (Cause.REVOCATION, S.TERMINATED),
    ],
)
def test_server_side_ends_apply_to_active_instances_only(cause: Cause, target: RunnerState) -> None:
    for state in ACTIVE_STATES:
        assert transition(state, target, cause) is target
    for state in TERMINAL_STATES:
        with pytest.raises(IllegalTransition) as refused:
            transition(state, target, cause)
        assert refused.value.code == "runner-instance-illegal-transition"
    other = S.STOPPED if target is not S.STOPPED else S.FAILED
    with pytest.raises(IllegalTransition):
        transition(S.RUNNING, other, cause)


def test_p78_equal_timestamps_resolve_by_rank_whatever_the_order() -> None:
    assert report_supersedes(S.RUNNING, NOW, S.FAILED, NOW)
    assert not report_supersedes(S.FAILED, NOW, S.RUNNING, NOW)


def test_p79_a_delayed_higher_rank_event_applies_a_delayed_same_rank_one_does_not() -> None:
    assert report_supersedes(S.RUNNING, NOW, S.STOPPED, ago(60))
    assert not report_supersedes(S.RUNNING, NOW, S.RUNNING, ago(60))
    assert report_supersedes(S.RUNNING, ago(60), S.RUNNING, NOW)


def test_p84_p103_a_failed_or_terminated_state_is_never_revived() -> None:
    for terminal in (S.FAILED, S.TERMINATED):
        assert not report_supersedes(terminal, ago(60), S.RUNNING, ago(60))
        assert not report_supersedes(terminal, ago(60), S.RUNNING, NOW)


def test_p85_future_report_times_are_clamped_to_the_receive_time() -> None:
    assert clamp_reported_at(later(3600), NOW) == NOW
    assert clamp_reported_at(ago(3), NOW) == ago(3)


def test_p73_demand_runner_that_never_activated_times_out() -> None:
    live = frozenset({uid(10)})
    timeout = timedelta(seconds=300)

    def timed_out(**overrides: object) -> bool:
        fields: dict[str, object] = {"launch_kind": LaunchKind.DEMAND, "created_at": ago(301)}
        return activation_timed_out(
            runner(1, **(fields | overrides)), live_reservation_ids=live, now=NOW, timeout=timeout
        )

    assert timed_out()
    assert timed_out(reservation_id=uid(11), intended_reservation_id=uid(12))  # lapsed
    assert not timed_out(created_at=ago(299))
    assert not timed_out(launch_kind=LaunchKind.WARM)
    assert not timed_out(launch_kind=LaunchKind.MANUAL)
    assert not timed_out(reservation_id=uid(10))
    assert not timed_out(intended_reservation_id=uid(10))
    assert not timed_out(runner_session_id=uid(40))
    assert not timed_out(state=S.TERMINATED)


def test_p99_reconcile_terminates_only_absent_runners_past_the_grace() -> None:
    grace = timedelta(seconds=120)
    observed = {"provider-2"}
    stale = runner(1, reported_at=ago(121))
    assert absent_and_stale(stale, observed, now=NOW, grace=grace)
    assert not absent_and_stale(runner(2, reported_at=ago(121)), observed, now=NOW, grace=grace)
    assert not absent_and_stale(runner(1, reported_at=ago(119)), observed, now=NOW, grace=grace)
    assert not absent_and_stale(stale, set(), now=NOW, grace=grace)  # empty set: read-only
    no_identity = runner(1, reported_at=ago(121), provider_runner_id=None)
    assert not absent_and_stale(no_identity, observed, now=NOW, grace=grace)
    finished = runner(1, reported_at=ago(121), state=S.STOPPED)
    assert not absent_and_stale(finished, observed, now=NOW, grace=grace)


RULE = StaleRunnerRule()
QUIET = runner(1, reported_at=ago(301), updated_at=ago(301), provider_runner_id=None)


def test_p106_a_quiet_runner_of_a_quiet_provisioner_is_stale() -> None:
    assert RULE.is_stale(
        QUIET,
        now=NOW,
        provisioner_last_seen_at=ago(400),
        has_running_job=False,
        runner_session_seen_at=None,
    )
    assert RULE.is_stale(
        QUIET,
        now=NOW,
        provisioner_last_seen_at=None,
        has_running_job=False,
        runner_session_seen_at=ago(900),
    )


@pytest.mark.parametrize(
    ("overrides", "last_seen", "running_job", "session_seen"),
    [
        ({"reported_at": ago(10)}, None, False, None),  # the runner reported
        ({"updated_at": ago(10)}, None, False, None),  # the server wrote it lately
        ({}, ago(10), False, None),  # its provisioner is alive
        ({"state": RunnerState.STOPPED}, None, False, None),  # already finished
        ({}, None, True, None),  # it holds a lease
        ({}, None, False, ago(10)),  # its runner session is in use
    ],
)
def test_p107_fresh_live_finished_busy_or_in_session_runners_are_not_stale(
    overrides: dict[str, object],
    last_seen: datetime | None,
    running_job: bool,
    session_seen: datetime | None,
) -> None:
    fields = {"reported_at": ago(301), "updated_at": ago(301)} | overrides
    assert not RULE.is_stale(
        runner(1, **fields),
        now=NOW,
        provisioner_last_seen_at=last_seen,
        has_running_job=running_job,
        runner_session_seen_at=session_seen,
    )


def test_p108_finished_activated_runners_still_holding_a_unit_are_drained() -> None:
    def drainable(**overrides: object) -> bool:
        fields: dict[str, object] = {
            "state": S.STOPPED,
            "runner_session_id": uid(40),
            "reservation_id": uid(10),
            "updated_at": ago(301),
        }
        return RULE.is_drainable(runner(1, **(fields | overrides)), now=NOW)

    assert drainable()
    assert drainable(reservation_id=None, intended_reservation_id=uid(10))
    assert not drainable(state=S.RUNNING)
    assert not drainable(runner_session_id=None)
    assert not drainable(updated_at=ago(10))
    assert not drainable(reservation_released_at=ago(400))
    assert not drainable(reservation_id=None)


def test_the_stale_threshold_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1 s"):
        StaleRunnerRule(timedelta(0))
