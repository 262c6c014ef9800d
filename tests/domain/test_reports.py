"""Settling a batch of provider reports (spec 4.8), without a database."""

from __future__ import annotations

from controlplane.domain.reports import (
    ReportWinner,
    RunnerEvent,
    Verdict,
    adopt_pending,
    aggregate,
    fresh_terminal,
    reservation_verdict,
    reservation_verdicts,
    with_sessions,
    without_reservation,
)
from controlplane.domain.runner_instances import RunnerState
from tests.domain.provisioning_factories import NOW, ago, later, runner, uid

S = RunnerState
R1, R2 = uid(0x501), uid(0x502)


def ev(pid: str, state: RunnerState, at: float, **fields: object) -> RunnerEvent:
    return RunnerEvent(pid, state, ago(at), **fields)  # type: ignore[arg-type]


def test_the_highest_rank_wins_and_keeps_what_a_loser_knew() -> None:
    session = uid(0x601)
    events = [
        ev("a", S.RUNNING, 30, reservation_id=R1, template_key="small"),
        ev("a", S.STOPPED, 40, runner_session_id=session, labels=("Linux", "x")),
        ev("b", S.STARTING, 10),
    ]
    winners = aggregate(events, received_at=NOW, strip=("x",))
    assert list(winners) == ["a", "b"]
    won = winners["a"].event
    assert (won.state, won.reported_at) == (S.STOPPED, ago(40))
    assert (won.reservation_id, won.template_key, won.runner_session_id) == (R1, "small", session)
    assert won.labels == ("linux",)
    assert winners["a"].milestones == {"started_at": ago(30), "stopped_at": ago(40)}


def test_report_times_are_clamped_and_each_milestone_keeps_its_earliest_time() -> None:
    events = [
        RunnerEvent("a", S.RUNNING, later(60)),
        RunnerEvent("a", S.RUNNING, ago(5)),
    ]
    winner = aggregate(events, received_at=NOW, strip=())["a"]
    # Of two reports of one rank the later (clamped) one wins, and started_at is the earliest.
    assert winner.event.reported_at == NOW
    assert winner.milestones == {"started_at": ago(5)}


def test_arrival_order_does_not_change_the_winner() -> None:
    events = [ev("a", S.RUNNING, 5, provider_kind="vm"), ev("a", S.FAILED, 20)]
    forward = aggregate(events, received_at=NOW, strip=())
    backward = aggregate(list(reversed(events)), received_at=NOW, strip=())
    assert forward == backward
    assert forward["a"].event.provider_kind == "vm"


def test_credited_sessions_replace_the_reported_one_without_touching_the_input() -> None:
    winners = aggregate([ev("a", S.RUNNING, 5), ev("b", S.RUNNING, 5)], received_at=NOW, strip=())
    credited = with_sessions(winners, {"a": uid(0x601)})
    assert credited["a"].event.runner_session_id == uid(0x601)
    assert credited["b"] is winners["b"]
    assert winners["a"].event.runner_session_id is None


def test_terminal_reports_keep_only_a_reservation_the_row_already_links() -> None:
    linked = runner(1, reservation_id=R1, reported_at=ago(100))
    assert reservation_verdict(ev("a", S.FAILED, 5, reservation_id=R1), linked) is Verdict.KEEP
    assert reservation_verdict(ev("a", S.FAILED, 5, reservation_id=R2), linked) is Verdict.DROP
    assert reservation_verdict(ev("a", S.FAILED, 5, reservation_id=R1), None) is Verdict.DROP


def test_active_reports_follow_the_row_or_ask_for_a_pending_unit() -> None:
    event = ev("a", S.RUNNING, 5, reservation_id=R1)
    assert reservation_verdict(event, None) is Verdict.ADOPT_IF_PENDING
    assert reservation_verdict(event, runner(1, reported_at=ago(100))) is Verdict.ADOPT_IF_PENDING
    intended = runner(1, intended_reservation_id=R2, reservation_id=R1, reported_at=ago(100))
    assert reservation_verdict(event, intended) is Verdict.DROP  # the intended one decides
    assert reservation_verdict(event, runner(1, reservation_id=R1, reported_at=ago(100))) is (
        Verdict.KEEP
    )
    released = runner(1, reservation_id=R1, reported_at=ago(100), reservation_released_at=ago(1))
    assert reservation_verdict(event, released) is Verdict.DROP
    newer = runner(1, reservation_id=R1, state=S.STOPPED, reported_at=ago(1))
    assert reservation_verdict(event, newer) is Verdict.DROP  # it will not be projected


def test_pending_units_go_to_the_first_candidates_in_batch_order() -> None:
    winners = aggregate(
        [ev(p, S.RUNNING, 5, reservation_id=R1) for p in ("a", "b", "c")]
        + [ev("d", S.RUNNING, 5, reservation_id=R2), ev("e", S.RUNNING, 5)],
        received_at=NOW,
        strip=(),
    )
    dropped, candidates = reservation_verdicts(winners, {})
    assert dropped == set()
    assert candidates == [("a", R1), ("b", R1), ("c", R1), ("d", R2)]
    pending = {R1: 2}
    assert adopt_pending(candidates, pending) == {"c", "d"}
    assert pending == {R1: 2}  # the caller's counts are not consumed
    settled = without_reservation(winners, {"c", "d"})
    assert [settled[p].event.reservation_id for p in "abcde"] == [R1, R1, None, None, None]
    assert winners["c"].event.reservation_id == R1


def test_a_terminal_report_releases_unless_the_stored_row_is_newer() -> None:
    winners = {
        "new": ReportWinner(ev("new", S.FAILED, 5)),
        "stale": ReportWinner(ev("stale", S.FAILED, 50)),
        "unknown": ReportWinner(ev("unknown", S.TERMINATED, 5)),
        "alive": ReportWinner(ev("alive", S.RUNNING, 5)),
    }
    stored = {
        "new": runner(1, reported_at=ago(10)),
        "stale": runner(2, reported_at=ago(10)),
        "alive": runner(3, reported_at=ago(10)),
    }
    assert fresh_terminal(winners, stored) == {"new": ago(5), "unknown": ago(5)}
    same_time = {"new": runner(1, reported_at=ago(5))}
    assert fresh_terminal({"new": winners["new"]}, same_time) == {"new": ago(5)}
