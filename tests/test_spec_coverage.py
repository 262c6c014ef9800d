"""Every J-, S- and P- scenario of the spec is a test named by its id, or is listed in
docs/spec-coverage.md with the reason it is not (yet) one. This keeps that document true.

A P- (provisioning) scenario counts as tested only by a test against real PostgreSQL (tests/store,
tests/web, tests/system): the pure tests of tests/domain carry P- ids too, but they do not count."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT.parent / "shared" / "spec"
DOC = ROOT / "docs" / "spec-coverage.md"
SCENARIO = re.compile(r"^[*-] ([JSP])-(\d+):", re.MULTILINE)
TEST_NAME = re.compile(r"def (test_\w+)")
ID_PART = re.compile(r"([jsp])(\d+)")
LISTED = re.compile(r"^\| ([JSP])-(\d+) \| (.+?) \|", re.MULTILINE)
REAL_PARTS = ("store", "web", "system")


def _scenarios() -> set[str]:
    found: set[str] = set()
    for name in ("jobs.md", "surface.md", "provisioning.md"):
        for kind, number in SCENARIO.findall((SPEC / name).read_text()):
            found.add(f"{kind}-{int(number)}")
    return found


def _tested() -> set[str]:
    found: set[str] = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        real = path.parent.name in REAL_PARTS
        for name in TEST_NAME.findall(path.read_text()):
            # A test may name several scenarios: test_j104_s81_reserved_labels_...
            for part in name.split("_")[1:]:
                if (match := ID_PART.fullmatch(part)) is not None:
                    kind = match.group(1).upper()
                    if kind != "P" or real:
                        found.add(f"{kind}-{int(match.group(2))}")
    return found


def _listed() -> dict[str, str]:
    listed = LISTED.findall(DOC.read_text())
    return {f"{kind}-{int(number)}": reason for kind, number, reason in listed}


@pytest.mark.skipif(not SPEC.is_dir(), reason="the spec folder is not beside this checkout")
def test_every_scenario_is_tested_or_explained() -> None:
    missing = sorted(_scenarios() - _tested() - set(_listed()), key=lambda s: (s[0], int(s[2:])))
    assert not missing, f"scenarios neither tested nor listed in {DOC.name}: {missing}"


@pytest.mark.skipif(not SPEC.is_dir(), reason="the spec folder is not beside this checkout")
def test_listed_scenarios_are_not_also_claimed_as_tested() -> None:
    both = sorted(set(_listed()) & _tested())
    assert not both, f"listed as untested in {DOC.name} but a test carries the id: {both}"
    assert all(reason.strip() for reason in _listed().values())
