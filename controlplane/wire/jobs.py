"""Operators' views of job executions (admin key): the list, one execution in full with why it
waits, its cancel, and the pending label sets with who could take them."""

from __future__ import annotations

from datetime import datetime
from typing import Literal
from uuid import UUID

import msgspec

from controlplane.domain.waiting import ReasonCode
from controlplane.wire.common import Strict

Status = Literal["pending", "running", "ended"]


class JobOut(Strict):
    job_execution_id: UUID
    status: Status
    workspace_id: UUID | None
    job_id: UUID | None
    required_labels: list[str] | None  # null once ended: the tombstone keeps none
    enqueued_at: datetime | None
    started_at: datetime | None
    ended_at: datetime | None
    runner_session_id: UUID | None
    cancel_requested: bool
    outcome: str | None
    ended_by: str | None
    exit_code: int | None


class JobList(Strict):
    items: list[JobOut]
    next_cursor: str | None


class WaitingReasonOut(Strict):
    code: ReasonCode
    message: str


class WaitingOut(Strict):
    stuck: bool  # nothing can take it until a runner or provisioner with its labels appears
    missing_labels: list[str]
    reason: str
    live_runners: int
    busy_runners: int
    templates: int
    paused_runners: int = 0  # of the live ones, those an operator paused
    # One job only (not a label set): 1 when a runner with its labels would take it next; the
    # jobs ahead are counted up to 10,000 (a position of 10,001 means "that many or more").
    position: int | None = None
    reasons: list[WaitingReasonOut] = msgspec.field(default_factory=list)


class JobDetail(Strict):
    job: JobOut
    output_tail: str | None
    waiting: WaitingOut | None  # pending executions only


class JobCancelled(Strict):
    was_pending: bool
    was_running: bool
    newly_ended: bool


class PendingGroupOut(Strict):
    workspace_id: UUID
    labels: list[str]
    pending: int
    oldest_enqueued_at: datetime
    waiting: WaitingOut


class PendingGroupList(Strict):
    items: list[PendingGroupOut]
