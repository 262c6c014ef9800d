"""Installation-scope eligibility: which workspaces a provisioner admits, and which rules an
operator may set. Pure."""

from __future__ import annotations

import uuid

import pytest

from controlplane.domain.eligibility import (
    EVERY_WORKSPACE,
    Eligibility,
    Mode,
    eligibility_problem,
)

LISTED, OTHER = uuid.uuid4(), uuid.uuid4()


@pytest.mark.parametrize(
    ("rule", "listed", "other"),
    [
        (EVERY_WORKSPACE, True, True),
        (Eligibility(Mode.ALLOW, frozenset({LISTED})), True, False),
        (Eligibility(Mode.DENY, frozenset({LISTED})), False, True),
        (Eligibility(Mode.ALLOW), False, False),
        (Eligibility(Mode.DENY), True, True),
    ],
    ids=["all", "allow", "deny", "empty-allow", "empty-deny"],
)
def test_a_rule_admits_what_its_mode_says(rule: Eligibility, listed: bool, other: bool) -> None:
    assert rule.admits(LISTED) is listed
    assert rule.admits(OTHER) is other


def test_the_rules_an_operator_may_set() -> None:
    assert eligibility_problem(Mode.ALL, [], limit=2) is None
    assert eligibility_problem(Mode.ALLOW, [LISTED, OTHER], limit=2) is None
    assert eligibility_problem(Mode.ALLOW, [], limit=2) is None
    assert eligibility_problem(Mode.ALL, [LISTED], limit=2) == "mode all takes no workspace_ids"
    assert "repeat" in (eligibility_problem(Mode.DENY, [LISTED, LISTED], limit=5) or "")
    assert "at most 1" in (eligibility_problem(Mode.DENY, [LISTED, OTHER], limit=1) or "")
