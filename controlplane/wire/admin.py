"""Admin routes: API keys, manual registration tokens, the queue, the provisioned fleet."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, ClassVar, Literal
from uuid import UUID

import msgspec

from controlplane.domain.credential_rules import Family, role_problem, scope_problem
from controlplane.domain.credentials import Role
from controlplane.wire.common import (
    PLAIN_TEXT_PATTERN,
    EffectiveCapabilities,
    Name,
    Strict,
    whole,
)

# A float that is a whole number: JSON Schema's `integer` admits 5.0 as well as 5.
TtlSeconds = Annotated[
    float, msgspec.Meta(ge=1, le=31_536_000, multiple_of=1, description="Whole seconds.")
]
_PLAIN_TEXT = re.compile(PLAIN_TEXT_PATTERN)
RevocationReason = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        max_length=512,
        description="Not blank; no control (Unicode Cc) or format (Cf) characters.",
        # Enforced by Revoke.__post_init__ with the same pattern, for a readable message.
        extra_json_schema={"pattern": PLAIN_TEXT_PATTERN},
    ),
]


class Revoke(Strict):
    """The optional body of a revoke. The reason is kept with the first revocation, answered,
    and logged."""

    reason: RevocationReason | None = None

    def __post_init__(self) -> None:
        # msgspec reports a ValueError raised here as a validation error of the body.
        if self.reason is None:
            return
        if not self.reason.strip():
            raise ValueError("reason must not be blank")
        if _PLAIN_TEXT.search(self.reason) is None:
            raise ValueError("reason must not contain control or format characters")


KeyRole = Annotated[
    Literal["owner", "observer"],
    msgspec.Meta(description="owner: everything its routes allow; observer: GET only."),
]


class PauseRequest(Revoke):
    """The optional body of a pause, resume, drain or undrain: why, recorded in the audit
    event (`reason`), and answered with the state while it is paused or drained."""


class PauseOut(Strict):
    """A workspace's, runner session's or runner instance's pause state after the request.
    `changed` is false when it was already so (nothing was written, no event)."""

    kind: Literal["workspace", "runner", "runner_instance"]
    id: UUID
    workspace_id: UUID | None
    paused: bool  # for a runner instance: drained
    since: datetime | None
    reason: str | None
    changed: bool


class CreateApiKey(Strict):
    kind: Literal["orchestrator", "admin", "workspace-admin"]
    name: Name
    workspace_id: UUID | None = None
    ttl_seconds: TtlSeconds | None = None
    role: KeyRole = "owner"  # admin and workspace-admin keys only

    # What __post_init__ refuses, in JSON Schema (web/openapi/ adds it to the component): an
    # admin key names no workspace, a workspace admin key names one, an orchestrator key has
    # no role but owner.
    json_schema_extra: ClassVar[dict[str, Any]] = {
        "allOf": [
            {
                "anyOf": [
                    {"properties": {"kind": {"enum": ["orchestrator", "workspace-admin"]}}},
                    {"properties": {"workspace_id": {"type": "null"}}},
                ]
            },
            {
                "anyOf": [
                    {"properties": {"kind": {"enum": ["orchestrator", "admin"]}}},
                    {
                        "required": ["workspace_id"],
                        "properties": {"workspace_id": {"type": "string"}},
                    },
                ]
            },
            {
                "anyOf": [
                    {"properties": {"kind": {"enum": ["admin", "workspace-admin"]}}},
                    {"properties": {"role": {"const": "owner"}}},
                ]
            },
        ]
    }

    def __post_init__(self) -> None:
        family = Family(self.kind)
        if problem := scope_problem(family, self.workspace_id, field="workspace_id"):
            raise ValueError(problem)
        if problem := role_problem(family, Role(self.role), field="role"):
            raise ValueError(problem)
        self.ttl_seconds = whole(self.ttl_seconds)


class CreateRegistrationToken(Strict):
    workspace_id: UUID
    name: Name
    ttl_seconds: TtlSeconds | None = None

    def __post_init__(self) -> None:
        self.ttl_seconds = whole(self.ttl_seconds)


class CreateWorkspaceToken(Strict):
    """A registration or provisioner token of the workspace the path names: the admin create
    bodies' rules, without the workspace."""

    name: Name
    ttl_seconds: TtlSeconds | None = None

    def __post_init__(self) -> None:
        self.ttl_seconds = whole(self.ttl_seconds)


class CredentialOut(Strict):
    id: UUID
    kind: str
    name: str
    workspace_id: UUID | None
    display_prefix: str
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    revocation_reason: str | None
    role: Literal["owner", "observer"] = "owner"  # an admin key's; every other is an owner


class CreatedCredential(Strict):
    credential: CredentialOut
    token: str  # shown once; only its SHA-256 is stored


class CredentialList(Strict):
    items: list[CredentialOut]
    next_cursor: str | None  # null on the last page


class LabelQueue(Strict):
    labels: list[str]
    queued: int
    running: int
    oldest_queued_at: datetime | None


class WorkspaceQueue(Strict):
    workspace_id: UUID
    queued: int
    running: int
    labels: list[LabelQueue] = msgspec.field(default_factory=list)


class QueueOut(Strict):
    pending: int
    running: int
    workspaces: list[WorkspaceQueue]


class ActiveRunnerOut(Strict):
    runner_session_id: UUID
    workspace_id: UUID
    mode: str
    labels: list[str]
    last_seen_at: datetime
    running: int
    capabilities: EffectiveCapabilities


class ActiveRunners(Strict):
    items: list[ActiveRunnerOut]


class InstanceProvisioner(Strict):
    id: UUID
    scope: Literal["workspace", "installation"]
    name: str


class RunnerInstanceOut(Strict):
    id: UUID
    provisioner: InstanceProvisioner
    workspace_id: UUID | None  # the assigned workspace
    provider_runner_id: str | None
    provider_kind: str | None
    launch_kind: Literal["demand", "warm", "manual"]
    template_key: str | None
    labels: list[str]
    state: Literal["starting", "running", "stopping", "stopped", "failed", "terminated"]
    lifecycle_state: Literal["unassigned", "assigned", "activated", "claimed", "completed"]
    enrollment_state: Literal["pending", "enrolled", "activated"]
    reconciliation_status: Literal["current", "stale", "terminal", "unknown"]
    reason: str | None
    created_at: datetime
    updated_at: datetime
    reported_at: datetime
    assigned_at: datetime | None
    first_claimed_at: datetime | None
    closed_at: datetime | None


class RunnerInstanceList(Strict):
    items: list[RunnerInstanceOut]
    next_cursor: str | None


class ActiveRunnerInstances(Strict):
    items: list[RunnerInstanceOut]


class StateCount(Strict):
    state: str
    count: int


class RunnerInstanceCounts(Strict):
    states: list[StateCount]


class ReservationGroup(Strict):
    workspace_id: UUID
    labels: list[str]
    kind: Literal["launch", "bound"]
    reservations: int
    units: int
    next_expiry: datetime


class ReservationList(Strict):
    items: list[ReservationGroup]


class WorkspaceSettingsIn(Strict):
    ordering: Literal["fifo", "fair"]


class WorkspaceSettingsOut(Strict):
    workspace_id: UUID
    ordering: Literal["fifo", "fair"]
    changed: bool  # false when the workspace already had these settings (no event written)
