"""bench/installation.py's pure parts: its sizes and flags, the backlog's skew, the profile
summary, and installation_timeline's stages of a probe. (The bench itself runs against daemons:
`python -m bench.installation --smoke`.)"""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path

import pytest

from bench import installation, installation_timeline, profiling


def test_defaults_are_the_issue_sizes() -> None:
    sizes, tree, smoke, profile = installation.parse([])
    assert (tree, smoke, profile) == (None, False, False)
    assert sizes.parts == installation.PARTS
    assert (sizes.workspaces, sizes.pending, sizes.slots) == (10_000, 1_000_000, 1000)
    assert (sizes.sessions, sizes.installation_sessions, sizes.session_replicas) == (1000, 10, 3)
    assert sizes.enqueue_rate == 100
    assert (sizes.parked, sizes.parked_workspaces, sizes.parked_replicas) == (20_000, 2000, 2)
    assert (sizes.fanout_rate, sizes.fanout_workspaces) == (1000, 10_000)


def test_smoke_sizes_and_flags_over_them() -> None:
    sizes, tree, smoke, profile = installation.parse(
        ["--smoke", "--workspaces", "7", "--round-slots", "0,3", "--parts", "fanout", "--tree", "x"]
    )
    assert (smoke, profile, tree) == (True, False, Path("x"))
    assert (sizes.workspaces, sizes.round_slots, sizes.parts) == (7, (0, 3), ("fanout",))
    assert sizes.pending == installation.SMOKE.pending  # the rest stay the smoke sizes


def test_an_unknown_part_is_refused() -> None:
    with pytest.raises(SystemExit):
        installation.parse(["--parts", "allocation,nonsense"])


def test_nine_of_ten_backlog_jobs_go_to_the_hot_workspaces() -> None:
    hot = [uuid.uuid4() for _ in range(2)]
    cold = [uuid.uuid4() for _ in range(5)]
    counts = Counter(installation.skewed(index, hot, cold) for index in range(1000))
    assert sum(counts[w] for w in hot) == 900
    assert [counts[w] for w in cold] == [20] * 5
    assert {installation.skewed(index, hot, []) for index in range(10)} == set(hot)


def test_profile_summary_shares_and_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "profile.txt"
    main = "main (controlplane/cli/__init__.py:10)"
    walk = "installation_walk (controlplane/actors/provisioning/rounds.py:40)"
    path.write_text(
        f"{main};{walk};fetch (asyncpg/connection.py:7) 3\n"
        f"{main};{walk};fetch (asyncpg/connection.py:9) 1\n"
        f"{main};run (asyncio/runners.py:1) 4\n"
    )
    found = profiling.profile_summary(path)
    assert found["samples"] == 8
    assert found["self_percent"][0] == ("fetch (asyncpg/connection.py)", 50.0)
    # Our own functions, inclusive; main() is on every stack and says nothing.
    assert found["controlplane_inclusive_percent"] == [
        ("installation_walk (controlplane/actors/provisioning/rounds.py)", 50.0)
    ]
    assert profiling.profile_summary(tmp_path / "absent.txt")["file"] is None


def test_the_grant_probes_profile_lies_beside_the_rounds_one(tmp_path: Path) -> None:
    rounds = tmp_path / "installation_profile.txt"
    assert installation.grant_profile(rounds) == tmp_path / "installation_profile_grants.txt"


def test_a_probe_s_stages_come_from_the_replica_s_stamps_between_enqueue_and_grant() -> None:
    stamp = {"start": 100.0, "answered": 100.004, "granted": 100.050}
    events = [
        {"t": 99.0, "what": "round_start"},  # an earlier round: not this probe's
        {"t": 100.003, "what": "notify"},
        {"t": 100.0032, "what": "round_start"},
        {"t": 100.021, "what": "walk_workspaces", "dur_ms": "17.5", "start": 100.0035},
        {"t": 100.022, "what": "outstanding_grants", "dur_ms": "0.5", "start": 100.0215},
        {"t": 100.040, "what": "allocate_in_walk", "dur_ms": "15.0", "start": 100.025},
        {"t": 100.045, "what": "round_end"},
    ]
    found = installation_timeline.stages(stamp, events)
    assert found is not None
    assert (found["rounds"], found["transactions"], found["figure_reads"]) == (1, 1, 0)
    assert round(found["total"], 1) == 50.0 and round(found["round_started"], 1) == 3.2
    assert round(found["replica_python_ms"], 1) == round(41.8 - 33.0, 1)
    assert round(found["round_end_to_received_ms"], 1) == 5.0
    assert installation_timeline.stages({**stamp, "granted": None}, events) is None
