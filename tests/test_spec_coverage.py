"""Every J-, S- and P- scenario of the spec is a test named by its id, or is listed in
docs/spec-coverage.md with the reason it is not (yet) one. This keeps that document true.

A P- (provisioning) scenario counts as tested only by a test against real PostgreSQL (tests/store,
tests/web, tests/system): the pure tests of tests/domain carry P- ids too, but they do not count.

A waiver must stay true: one whose id a test already carries is refused, and so is one whose reason
points at a file or a test that is not there, or says "not yet built" of a metric that is
declared. The spec is read from `../shared/spec/`, or from `$SPEC_DIR` (a worktree elsewhere)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPEC = Path(os.environ.get("SPEC_DIR") or ROOT.parent / "shared" / "spec")
DOC = ROOT / "docs" / "spec-coverage.md"
SCENARIO = re.compile(r"^[*-] ([JSP])-(\d+):", re.MULTILINE)
TEST_NAME = re.compile(r"def (test_\w+)")
ID_PART = re.compile(r"([jsp])(\d+)")
LISTED = re.compile(r"^\| ([JSP])-(\d+) \| (.+?) \|", re.MULTILINE)
REAL_PARTS = ("store", "web", "system")
NAMED_PATH = re.compile(r"\b((?:controlplane|tests|docs|bench|sql)/[\w./-]*\w)")
NAMED_TEST = re.compile(r"`(test_\w+)`")
NAMED_METRIC = re.compile(r"\b(controlplane_\w+)")
NOT_BUILT = "not yet built"


def _scenarios() -> set[str]:
    found: set[str] = set()
    for name in ("jobs.md", "surface.md", "provisioning.md"):
        for kind, number in SCENARIO.findall((SPEC / name).read_text()):
            found.add(f"{kind}-{int(number)}")
    return found


def _test_names() -> list[tuple[str, Path]]:
    return [
        (name, path)
        for path in (ROOT / "tests").rglob("test_*.py")
        for name in TEST_NAME.findall(path.read_text())
    ]


def _tested() -> set[str]:
    found: set[str] = set()
    for name, path in _test_names():
        real = path.parent.name in REAL_PARTS
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


def _declared_metrics() -> set[str]:
    from controlplane import metrics

    return {family.name for family in metrics.REGISTRY.collect()}


def test_waivers_name_only_what_exists_and_call_nothing_declared_unbuilt() -> None:
    names, metrics = {name for name, _ in _test_names()}, _declared_metrics()
    stale: list[str] = []
    for scenario, reason in _listed().items():
        stale += [f"{scenario}: no file {p}" for p in NAMED_PATH.findall(reason)
                  if not (ROOT / p).exists()]  # fmt: skip
        stale += [f"{scenario}: no test {t}" for t in NAMED_TEST.findall(reason) if t not in names]
        if NOT_BUILT in reason:
            stale += [f"{scenario}: {m} is declared" for m in NAMED_METRIC.findall(reason)
                      if m in metrics or m.removesuffix("_total") in metrics]  # fmt: skip
    assert not stale, f"waivers in {DOC.name} that are no longer true: {stale}"
