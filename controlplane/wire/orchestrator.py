"""Orchestrator routes: enqueue, report outcomes, read execution state and the event feed."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, ClassVar, Literal
from uuid import UUID

import msgspec

from controlplane.domain.ordering import (
    MAX_CONCURRENCY_KEY_LENGTH,
    MAX_CONCURRENCY_LIMIT,
    PRIORITY_BOUND,
)
from controlplane.wire.admin import WorkspaceQueue
from controlplane.wire.common import EffectiveCapabilities, Labels, Reason, Strict, whole
from controlplane.wire.jobs import WaitingOut

AwareDatetime = Annotated[datetime, msgspec.Meta(tz=True)]
# A whole number of seconds, 1 or more (a float that is a multiple of 1: see `whole`); each field
# adds its description, and its route checks the setting that bounds it.
WholeSeconds = Annotated[float, msgspec.Meta(ge=1, le=2**31 - 1, multiple_of=1)]
ConcurrencyKey = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        max_length=MAX_CONCURRENCY_KEY_LENGTH,
        pattern=r"^[^\x00-\x1f\x7f]*$",
        description="Jobs of one workspace with the same key share its concurrency_limit. "
        "Given with concurrency_limit, or neither.",
    ),
]


class EnqueueJob(Strict):
    job_execution_id: UUID
    job_id: UUID
    workflow_run_id: UUID
    workflow_run_attempt_id: UUID
    workspace_id: UUID
    project_id: UUID
    required_labels: Labels
    queued_at: AwareDatetime
    # Decoded as a JSON object by the route (web/orchestrator.py), which also checks its size.
    payload: Annotated[
        msgspec.Raw,
        msgspec.Meta(
            extra_json_schema={"type": "object"},
            description="A JSON object of at most queue.max_payload_bytes bytes.",
        ),
    ] = msgspec.field(default_factory=lambda: msgspec.Raw(b"{}"))
    # Whole numbers: floats that are a multiple of 1, so that 5.0 is accepted like 5, as JSON
    # Schema's `integer` says (wire/common.py `whole`).
    priority: Annotated[
        float,
        msgspec.Meta(
            ge=-PRIORITY_BOUND,
            le=PRIORITY_BOUND,
            multiple_of=1,
            description="Higher first; within queue.priority_min..queue.priority_max "
            "(the schema's range by default).",
        ),
    ] = 0
    concurrency_key: ConcurrencyKey | None = None
    concurrency_limit: (
        Annotated[
            float,
            msgspec.Meta(
                ge=1,
                le=MAX_CONCURRENCY_LIMIT,
                multiple_of=1,
                description="At most this many executions of the key run at once in the "
                "workspace; at most queue.max_concurrency_limit (the schema's maximum by "
                "default). Given with concurrency_key, or neither.",
            ),
        ]
        | None
    ) = None
    # The life of an execution (docs/policies.md); each within the bounds its setting names,
    # checked by the route (web/orchestrator.py; the published maxima are those settings). Whole
    # numbers, also written as 5.0, as JSON Schema's `integer` admits.
    timeout_seconds: (
        Annotated[
            WholeSeconds,
            msgspec.Meta(
                description="Run timeout, whole seconds: 1..queue.max_timeout_seconds; absent: "
                "queue.default_timeout_seconds."
            ),
        ]
        | None
    ) = None
    queue_timeout_seconds: (
        Annotated[
            WholeSeconds,
            msgspec.Meta(
                description="Queue timeout, whole seconds: 1..queue.max_queue_timeout_seconds; "
                "absent: queue.default_queue_timeout_seconds."
            ),
        ]
        | None
    ) = None
    retries_on_lost: Annotated[
        float,
        msgspec.Meta(
            ge=0,
            le=2**31 - 1,
            multiple_of=1,
            description="Retries of a lease lost with its runner: 0..queue.max_retries_on_lost.",
        ),
    ] = 0

    # A key and its limit go together (the route answers 400 concurrency-key-incomplete).
    json_schema_extra: ClassVar[dict[str, Any]] = {
        "anyOf": [
            {
                "properties": {
                    "concurrency_key": {"type": "null"},
                    "concurrency_limit": {"type": "null"},
                }
            },
            {
                "required": ["concurrency_key", "concurrency_limit"],
                "properties": {
                    "concurrency_key": {"type": "string"},
                    "concurrency_limit": {"type": "number"},
                },
            },
        ]
    }

    def __post_init__(self) -> None:
        self.priority = int(self.priority)
        self.concurrency_limit = whole(self.concurrency_limit)


class EnqueueRequest(Strict):
    jobs: Annotated[list[EnqueueJob], msgspec.Meta(min_length=1)]


class EnqueueResult(Strict):
    job_execution_id: UUID
    result: Literal["enqueued", "duplicate", "running", "ended"]


class EnqueueResponse(Strict):
    results: list[EnqueueResult]


class OutcomeRequest(Strict):
    status: Literal["cancelled", "succeeded", "failed"]
    reason: Reason | None = None


class OutcomeResponse(Strict):
    was_pending: bool
    was_running: bool
    newly_ended: bool


class ExecutionState(Strict):
    job_execution_id: UUID
    state: Literal["pending", "running", "ended"]
    workspace_id: UUID | None = None
    outcome: str | None = None
    ended_by: str | None = None
    runner_session_id: UUID | None = None
    cancel_requested: bool = False
    exit_code: int | None = None  # as the runner reported it
    output_tail: str | None = None  # the end of the job's output, as the runner reported it
    waiting: WaitingOut | None = None  # while pending: who could take it, and whether anyone can
    attempt: int | None = None  # while pending or running: 1, or n + 1 after n retries
    lost_attempts: list[LostAttemptOut] = msgspec.field(default_factory=list)


class LostAttemptOut(Strict):
    """An earlier attempt whose lease was lost with its runner and retried."""

    attempt: int
    outcome: Literal["lost"]
    runner_session_id: UUID
    started_at: datetime
    ended_at: datetime


class EventOut(Strict):
    cursor: str
    type: str
    workspace_id: UUID | None
    job_execution_id: UUID | None
    payload: dict[str, Any]
    created_at: datetime


class EventsResponse(Strict):
    events: list[EventOut]
    next_cursor: str


class LeaseState(Strict):
    """Whether the execution is leased to that runner session (and is that job, when one was
    named); cancellation is not considered. `capabilities`: the session's, while active."""

    active: bool
    capabilities: EffectiveCapabilities | None


class JobCountsRequest(Strict):
    workspace_ids: Annotated[
        list[UUID],
        msgspec.Meta(min_length=1, max_length=100, extra_json_schema={"uniqueItems": True}),
    ]


class JobCountsResponse(Strict):
    counts: list[WorkspaceQueue]
