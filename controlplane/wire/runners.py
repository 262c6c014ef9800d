"""Runner routes: register, request a job, heartbeat (optionally held for cancel), complete."""

from __future__ import annotations

from typing import Annotated, Any, Literal
from uuid import UUID

import msgspec

from controlplane.wire.common import Capabilities, Labels, Strict, whole

# The header of a job request's "paused" answer (204): the runner session is paused
# (docs/policies.md, "Pause, resume, drain"); ask again after its Retry-After.
PAUSED_HEADER = "Controlplane-Paused"


class RegisterRequest(Strict):
    labels: Labels
    capabilities: Capabilities | None = None


class RegisterResponse(Strict):
    session_token: str
    session_id: UUID
    mode: Literal["manual", "ephemeral", "activation"]
    max_claims: int | None
    labels: list[str]
    heartbeat_interval_seconds: float
    long_poll_max_seconds: float


class JobResponse(Strict):
    job_execution_id: UUID
    job_id: UUID
    workflow_run_id: UUID
    workflow_run_attempt_id: UUID
    required_labels: list[str]
    payload: dict[str, Any]
    lease_token: str
    heartbeat_interval_seconds: float
    # How many bytes of the job's output the server keeps with its outcome (0: none).
    output_tail_bytes: int = 0


class HeartbeatRequest(Strict):
    # Omitted: the stored report is kept. null: the stored report is cleared.
    capabilities: Capabilities | msgspec.UnsetType | None = msgspec.UNSET


class HeartbeatResponse(Strict):
    cancel: bool
    lease_token: str


class CompleteRequest(Strict):
    outcome: Literal["succeeded", "failed", "cancelled"]
    # A whole number; a float so that -1.0 is accepted like -1, as JSON Schema's `integer` says.
    exit_code: Annotated[float, msgspec.Meta(ge=-255, le=255, multiple_of=1)] | None = None
    # The end of the job's output; the server keeps its last `output_tail_bytes` bytes.
    output_tail: Annotated[str, msgspec.Meta(max_length=1_048_576)] | None = None

    def __post_init__(self) -> None:
        self.exit_code = whole(self.exit_code)

    @property
    def exit_status(self) -> int | None:
        return whole(self.exit_code)


class CompleteResponse(Strict):
    recorded: bool  # False when the execution had already ended (cancelled by the orchestrator)
