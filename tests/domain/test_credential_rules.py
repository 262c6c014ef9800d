"""The credential rules the admin API and the `tokens` command share, and the refusal ladder of
a presented credential, without a database."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pytest

from controlplane.domain import credential_rules as rules
from controlplane.domain import tokens
from controlplane.domain.credential_rules import Family, NewCredential
from controlplane.domain.credentials import Role
from controlplane.errors import InvalidInput, Unauthorized

NOW = datetime(2026, 1, 1, tzinfo=UTC)
WORKSPACE = uuid.uuid4()


@dataclass(frozen=True)
class Found:
    revoked_at: datetime | None = None
    expires_at: datetime | None = None


def refusal(check: rules.Refusals, found: Found) -> tuple[str, str] | None:
    try:
        check.check(found, NOW)
    except Unauthorized as error:
        return error.code, error.message
    return None


def test_each_family_issues_its_own_token_kind() -> None:
    assert {family: family.token_kind for family in Family} == {
        Family.ORCHESTRATOR: tokens.Kind.ORCHESTRATOR_KEY,
        Family.ADMIN: tokens.Kind.ADMIN_KEY,
        Family.WORKSPACE_ADMIN: tokens.Kind.WORKSPACE_ADMIN_KEY,
        Family.REGISTRATION: tokens.Kind.MANUAL_REGISTRATION,
        Family.PROVISIONER: tokens.Kind.PROVISIONER,
    }


@pytest.mark.parametrize(
    ("family", "workspace", "problem"),
    [
        (Family.ADMIN, WORKSPACE, "admin keys are installation-wide: omit --workspace"),
        (Family.ADMIN, None, None),
        (Family.REGISTRATION, None, "registration tokens need --workspace"),
        (Family.REGISTRATION, WORKSPACE, None),
        (Family.ORCHESTRATOR, None, None),
        (Family.ORCHESTRATOR, WORKSPACE, None),
        (Family.PROVISIONER, None, None),
        (Family.PROVISIONER, WORKSPACE, None),
    ],
)
def test_the_scope_rule_names_the_callers_field(
    family: Family, workspace: uuid.UUID | None, problem: str | None
) -> None:
    assert rules.scope_problem(family, workspace, field="--workspace") == problem


def test_a_new_credential_cannot_break_the_scope_rule() -> None:
    with pytest.raises(InvalidInput, match="admin keys are installation-wide: omit workspace_id"):
        NewCredential(Family.ADMIN, "ops", WORKSPACE)
    with pytest.raises(InvalidInput, match="registration tokens need workspace_id"):
        NewCredential(Family.REGISTRATION, "pool")
    made = NewCredential(Family.REGISTRATION, "pool", WORKSPACE, rules.lifetime(60.0))
    assert made.ttl == timedelta(seconds=60)
    assert rules.lifetime(None) is None


def test_revocation_is_reported_before_expiry_for_keys_and_provisioner_tokens() -> None:
    both = Found(revoked_at=NOW - timedelta(days=1), expires_at=NOW - timedelta(days=1))
    assert refusal(rules.API_KEY, both) == ("api-key-revoked", "the API key was revoked")
    assert refusal(rules.PROVISIONER_TOKEN, both) == (
        "provisioner-token-revoked",
        "the provisioner token was revoked",
    )


def test_expiry_is_reported_before_revocation_for_registration_tokens() -> None:
    both = Found(revoked_at=NOW - timedelta(days=1), expires_at=NOW - timedelta(days=1))
    assert refusal(rules.REGISTRATION_TOKEN, both) == (
        "registration-token-expired",
        "the registration token expired",
    )
    revoked = Found(revoked_at=NOW - timedelta(days=1))
    assert refusal(rules.REGISTRATION_TOKEN, revoked) == (
        "manual-registration-token-revoked",
        "the registration token was revoked",
    )


@pytest.mark.parametrize(
    "check", [rules.API_KEY, rules.REGISTRATION_TOKEN, rules.PROVISIONER_TOKEN]
)
def test_expiring_at_this_very_instant_is_expired_and_later_is_not(
    check: rules.Refusals,
) -> None:
    assert refusal(check, Found(expires_at=NOW)) == (check.expired_code, f"{check.noun} expired")
    assert refusal(check, Found(expires_at=NOW + timedelta(microseconds=1))) is None
    assert refusal(check, Found()) is None


def test_a_workspace_admin_key_needs_its_workspace() -> None:
    problem = rules.scope_problem(Family.WORKSPACE_ADMIN, None, field="--workspace")
    assert problem == "workspace admin keys need --workspace"
    assert rules.scope_problem(Family.WORKSPACE_ADMIN, uuid.uuid4(), field="x") is None


@pytest.mark.parametrize("family", list(Family))
def test_only_admin_keys_take_the_observer_role(family: Family) -> None:
    observer = rules.role_problem(family, Role.OBSERVER, field="role")
    assert (observer is None) is (family in (Family.ADMIN, Family.WORKSPACE_ADMIN))
    assert rules.role_problem(family, Role.OWNER, field="role") is None


@pytest.mark.parametrize(
    ("role", "method", "allowed"),
    [
        (Role.OWNER, "POST", True),
        (Role.OWNER, "GET", True),
        (Role.OBSERVER, "GET", True),
        (Role.OBSERVER, "HEAD", True),
        (Role.OBSERVER, "POST", False),
        (Role.OBSERVER, "PUT", False),
        (Role.OBSERVER, "DELETE", False),
    ],
)
def test_an_observer_may_only_read(role: Role, method: str, allowed: bool) -> None:
    assert rules.may_change(role, method) is allowed
