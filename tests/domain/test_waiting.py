"""Why a pending job waits."""

from __future__ import annotations

from controlplane.domain.waiting import Takers, why_waiting


def takers(live: int = 0, busy: int = 0, templates: int = 0, offered: str = "") -> Takers:
    return Takers(live, busy, templates, frozenset(filter(None, offered.split(","))))


def test_labels_nobody_offers_make_a_job_stuck_and_are_named() -> None:
    waiting = why_waiting(["linux", "gpu"], takers(offered="linux,x64"))
    assert waiting.stuck and waiting.missing_labels == ("gpu",)
    assert waiting.reason == "no live runner or connected provisioner offers gpu"


def test_labels_offered_only_apart_are_stuck_too() -> None:
    waiting = why_waiting(["arm", "gpu"], takers(offered="arm,gpu"))
    assert waiting.stuck and waiting.missing_labels == ()
    assert "no single live runner" in waiting.reason


def test_an_idle_matching_runner_means_it_is_about_to_run() -> None:
    waiting = why_waiting(["linux"], takers(live=2, busy=1, offered="linux"))
    assert not waiting.stuck and "idle" in waiting.reason


def test_busy_runners_and_a_provisioner_are_named() -> None:
    assert why_waiting(["linux"], takers(live=3, busy=3, offered="linux")).reason == (
        "all 3 matching runners are busy"
    )
    assert why_waiting(["linux"], takers(live=1, busy=1, templates=1, offered="linux")).reason == (
        "all 1 matching runners are busy (a provisioner can launch more)"
    )
    launching = why_waiting(["linux"], takers(templates=1, offered="linux"))
    assert not launching.stuck and "provisioner" in launching.reason
