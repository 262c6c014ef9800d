"""Operator pauses and drains: what can be paused, the events that audit it, and the one
payload format the replicas tell each other about it with (docs/policies.md, "Pause, resume,
drain").

* A paused workspace hands out no job (enqueue is still accepted); its parked runners stay
  parked and get work the moment it is resumed.
* A paused runner session takes no new job; its lease, if any, runs to the end; its parked job
  request is answered "paused" at once, and so is every later one until it is resumed.
* A drained runner instance (a provisioner's runner) is never bound to new demand; if it has a
  runner session, that session is paused too.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime
from uuid import UUID


class PauseKind(enum.StrEnum):
    WORKSPACE = "workspace"
    RUNNER = "runner"  # a runner session
    RUNNER_INSTANCE = "runner_instance"  # a provisioner's runner (drain)


class PauseEvent(enum.StrEnum):
    """Event-feed types of the audit trail; the payload names who (`by`: the admin key's id,
    `by_name`), why (`reason`, or null) and the target."""

    WORKSPACE_PAUSED = "workspace.paused"
    WORKSPACE_RESUMED = "workspace.resumed"
    RUNNER_PAUSED = "runner.paused"
    RUNNER_RESUMED = "runner.resumed"
    RUNNER_INSTANCE_DRAINED = "runner_instance.drained"
    RUNNER_INSTANCE_UNDRAINED = "runner_instance.undrained"


@dataclass(frozen=True, slots=True)
class Operator:
    """Who asked, as the audit trail records it."""

    key_id: UUID
    name: str | None


@dataclass(frozen=True, slots=True)
class PauseState:
    """A target's state after a pause, resume, drain or undrain. `changed` is False when the
    request found it already so (the call is idempotent: no event, the first pause's time and
    reason are kept)."""

    kind: PauseKind
    target_id: UUID
    workspace_id: UUID | None
    paused: bool
    since: datetime | None
    reason: str | None
    changed: bool


# The NOTIFY payload of a pause change: "<kind>|<paused 0/1>|<workspace>|<target>".
def change_payload(state: PauseState) -> str:
    workspace = "" if state.workspace_id is None else str(state.workspace_id)
    return f"{state.kind}|{int(state.paused)}|{workspace}|{state.target_id}"


@dataclass(frozen=True, slots=True)
class PauseChange:
    kind: PauseKind
    paused: bool
    workspace_id: UUID | None
    target_id: UUID


def parse_change(payload: str) -> PauseChange | None:
    """The change a NOTIFY payload announces, or None when it is not one of ours."""
    parts = payload.split("|")
    if len(parts) != 4 or parts[1] not in ("0", "1"):
        return None
    try:
        kind = PauseKind(parts[0])
        workspace = UUID(parts[2]) if parts[2] else None
        target = UUID(parts[3])
    except ValueError:
        return None
    return PauseChange(kind, parts[1] == "1", workspace, target)
