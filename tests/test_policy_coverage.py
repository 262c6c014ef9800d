"""Every Q- scenario of docs/policies.md is a test named by its id, against real parts.

A scenario is a line `- Q-nn: ...` in docs/policies.md; it counts as tested only by a test in
tests/store, tests/web or tests/system whose name carries `qnn` (`test_q07_a_key_at_its_limit_...`),
as the spec's scenarios do (tests/test_spec_coverage.py)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "policies.md"
SCENARIO = re.compile(r"^[*-] Q-(\d+):", re.MULTILINE)
TEST_NAME = re.compile(r"def (test_\w+)")
ID_PART = re.compile(r"q(\d+)")
REAL_PARTS = ("store", "web", "system")


def _scenarios() -> set[int]:
    return {int(number) for number in SCENARIO.findall(DOC.read_text())}


def _tested() -> set[int]:
    found: set[int] = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        if path.parent.name not in REAL_PARTS:
            continue
        for name in TEST_NAME.findall(path.read_text()):
            for part in name.split("_")[1:]:
                if (match := ID_PART.fullmatch(part)) is not None:
                    found.add(int(match.group(1)))
    return found


def test_every_policy_scenario_has_a_test_against_real_parts() -> None:
    missing = sorted(_scenarios() - _tested())
    assert not missing, f"scenarios of {DOC.name} without a test: {[f'Q-{n:02d}' for n in missing]}"


def test_no_test_claims_a_scenario_that_is_not_written() -> None:
    unknown = sorted(_tested() - _scenarios())
    assert not unknown, f"tests name scenarios {DOC.name} does not have: {unknown}"
