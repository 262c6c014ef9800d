"""The admin view of provisioned runner instances: derived states and the list cursor.

Each derivation is a plain function of one instance's columns and `now` (spec 5.2, surface R9):

* lifecycle: unassigned (no workspace) -> assigned -> activated (has a runner session) ->
  claimed (claimed a job); an assigned instance in a terminal state is `completed`;
* enrollment: activated (has a runner session), enrolled (an open, unexpired control session),
  else pending;
* reconciliation: terminal; unknown (its provisioner was never seen); stale (its last report or
  its provisioner's last-seen is at or older than the stale threshold); else current.

The cursor is opaque to clients: base64url of a JSON object with the last row's `created_at`
(ISO 8601) and `id`. The list is ordered by (created_at, id) descending and the next page holds
the rows strictly before the cursor in that order. The admin token lists page with the same
cursor (web/paging.py).
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal
from uuid import UUID

from controlplane.domain.runner_instances import RunnerState
from controlplane.errors import InvalidInput

Lifecycle = Literal["unassigned", "assigned", "activated", "claimed", "completed"]
Enrollment = Literal["pending", "enrolled", "activated"]
Reconciliation = Literal["current", "stale", "terminal", "unknown"]


@dataclass(frozen=True, slots=True)
class InstanceFacts:
    """What the derivations read of one runner instance."""

    state: RunnerState
    workspace_id: UUID | None
    runner_session_id: UUID | None
    first_claimed_at: datetime | None
    control_session_live: bool
    reported_at: datetime
    provisioner_last_seen_at: datetime | None


def lifecycle_state(facts: InstanceFacts) -> Lifecycle:
    if facts.workspace_id is None:
        return "unassigned"
    if facts.state.is_terminal:
        return "completed"
    if facts.runner_session_id is None:
        return "assigned"
    if facts.first_claimed_at is None:
        return "activated"
    return "claimed"


def enrollment_state(facts: InstanceFacts) -> Enrollment:
    if facts.runner_session_id is not None:
        return "activated"
    if facts.control_session_live:
        return "enrolled"
    return "pending"


def reconciliation_status(
    facts: InstanceFacts, *, now: datetime, threshold: timedelta
) -> Reconciliation:
    if facts.state.is_terminal:
        return "terminal"
    seen = facts.provisioner_last_seen_at
    if seen is None:
        return "unknown"
    cutoff = now - threshold
    if facts.reported_at <= cutoff or seen <= cutoff:
        return "stale"
    return "current"


def encode_cursor(created_at: datetime, row_id: UUID) -> str:
    raw = json.dumps({"created_at": created_at.isoformat(), "id": str(row_id)})
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, UUID]:
    """The (created_at, id) a cursor names. Anything else, the empty string included, is
    `invalid-cursor`."""
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        decoded = json.loads(base64.urlsafe_b64decode(padded.encode()).decode())
        created_at = datetime.fromisoformat(decoded["created_at"])
        row_id = UUID(decoded["id"])
    except (ValueError, TypeError, KeyError, binascii.Error, UnicodeError) as error:
        raise InvalidInput(
            "cursor is not one this server gave", code="invalid-cursor", field="cursor"
        ) from error
    if not cursor or created_at.tzinfo is None:
        raise InvalidInput(
            "cursor is not one this server gave", code="invalid-cursor", field="cursor"
        )
    return created_at, row_id
