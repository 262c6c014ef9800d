"""Query strings, as msgspec Structs: one per route that takes parameters.

web/queries.py decodes a request's query into one, applying each field's type and constraints
with the input rules of docs/api.md (an empty value or one with NUL is 400, a number in its
range, a UUID, one of a Literal's or an enum's values) and, for a Struct that forbids unknown
fields, refusing an unknown parameter; the same fields describe the parameters in the OpenAPI
document.

What a field's `Meta(extra=...)` adds: `maximum`, the setting whose value bounds a number (the
serving daemon's); `code`, the error code of a malformed value (default `validation-error`);
`refusal`, the message for a value outside a Literal (then the empty value is refused with it
too). A string field's pattern and lengths describe what its handler's own parser enforces
(labels, cursors), with that parser's messages.
"""

from __future__ import annotations

from typing import Annotated, Literal
from uuid import UUID

import msgspec
from msgspec import Meta

from controlplane.domain.labels import MAX_LABEL_LENGTH
from controlplane.domain.runner_instances import RunnerState
from controlplane.settings import Settings
from controlplane.wire.common import LABEL_PATTERN

_KNOBS = Settings()  # the built-in defaults, which descriptions name
_P = _KNOBS.provisioners


def _wait(default: str, maximum: str) -> Meta:
    section, _, name = maximum.partition(".")
    high = getattr(getattr(_KNOBS, section), name)
    return Meta(
        ge=0,
        description=f"Seconds to hold the request; 0 answers at once. Default {default}, at most "
        f"{maximum} (default {high:g}).",
        extra={"maximum": maximum},
    )


PageLimit = Annotated[int, Meta(ge=1, le=100, description="Page size.")]
PageCursor = Annotated[
    str,
    Meta(
        min_length=1,
        pattern="^[A-Za-z0-9_-]+$",
        description="Opaque; the `next_cursor` of the previous page (another is 400).",
        extra={"code": "invalid-cursor"},
    ),
]
TokensOf = Annotated[UUID, Meta(description="Only this workspace's tokens.")]
# 1 to 20 labels, comma-separated, each as the label grammar says (web/jobs.py checks the same).
_ONE_LABEL = f"[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_LABEL_LENGTH - 1}}}"
_LABEL_LIST = f"^{_ONE_LABEL}(,{_ONE_LABEL}){{0,19}}$"


class Strict(msgspec.Struct, forbid_unknown_fields=True):
    """A query whose unknown parameters are 400."""


class Lenient(msgspec.Struct):
    """A query whose unknown parameters are ignored."""


class JobRequestQuery(Lenient):
    wait: Annotated[float, _wait("the maximum", "runners.long_poll_max_seconds")] | None = None


class HeartbeatQuery(Lenient):
    wait: Annotated[float, _wait("0", "runners.cancel_wait_max_seconds")] = 0


class EventsQuery(Lenient):
    # Each part fits the column it is compared with (xid8, bigint) with digits to spare. Empty
    # is refused (400 invalid-cursor), like every empty query value.
    after: (
        Annotated[
            str,
            Meta(
                pattern="^[0-9]{1,18}[.][0-9]{1,18}$",
                description="Cursor `<xid>.<seq>` (a `next_cursor`); omitted: from the start; "
                "empty: 400.",
                extra={"code": "invalid-cursor"},
            ),
        ]
        | None
    ) = None
    limit: Annotated[int, Meta(ge=1, le=1000, description="The most events to return.")] = 100
    wait: Annotated[float, _wait("0", "runners.long_poll_max_seconds")] = 0
    workspace_id: (
        Annotated[UUID, Meta(description="Only this workspace (scoped key: its own).")] | None
    ) = None


ActiveOnly = Annotated[
    Literal["true", "false"],
    Meta(
        description="true: only provisioners seen within 120 s, not revoked, not expired.",
        extra={"refusal": "query active must be true or false"},
    ),
]


class PageQuery(Strict):
    limit: PageLimit = 50
    cursor: PageCursor | None = None


class TokenPageQuery(Strict):
    workspace_id: TokensOf | None = None
    limit: PageLimit = 50
    cursor: PageCursor | None = None


class ProvisionerTokenPageQuery(Strict):
    workspace_id: TokensOf | None = None
    active: ActiveOnly | None = None
    limit: PageLimit = 50
    cursor: PageCursor | None = None


class JobPageQuery(Strict):
    workspace_id: Annotated[UUID, Meta(description="Only this workspace's executions.")] | None = (
        None
    )
    status: (
        Annotated[
            Literal["pending", "running", "ended"],
            Meta(
                description="Only executions in this state.",
                extra={"refusal": "query status must be pending, running or ended"},
            ),
        ]
        | None
    ) = None
    labels: (
        Annotated[
            str,
            Meta(
                pattern=_LABEL_LIST,
                description="Comma-separated labels (1-20); only pending and running executions "
                "that require all of them (an ended execution keeps no labels).",
                extra={"raw": True},
            ),
        ]
        | None
    ) = None
    limit: PageLimit = 50
    cursor: PageCursor | None = None


class WorkspaceProvisionerTokenQuery(Strict):
    """A workspace's provisioner tokens: the workspace is the path's."""

    active: ActiveOnly | None = None
    limit: PageLimit = 50
    cursor: PageCursor | None = None


class WorkspaceRunnersQuery(Strict):
    window_seconds: Annotated[
        int, Meta(ge=1, le=86400, description="Seen within this many seconds.")
    ] = 60  # as the reference's RUNNER_ACTIVE_WINDOW_SECONDS


class ActiveRunnersQuery(Lenient):
    workspace_id: TokensOf | None = None
    window_seconds: Annotated[
        int, Meta(ge=1, le=86400, description="Seen within this many seconds.")
    ] = 60  # as the reference's RUNNER_ACTIVE_WINDOW_SECONDS


class RunnerInstancesQuery(Strict):
    state: Annotated[RunnerState, Meta(description="Only instances in this state.")] | None = None
    assignment: (
        Annotated[
            Literal["assigned", "unassigned"],
            Meta(description="assigned: instances with a workspace; unassigned: without one."),
        ]
        | None
    ) = None
    label: (
        Annotated[
            str,
            Meta(
                min_length=1,
                max_length=MAX_LABEL_LENGTH,
                pattern=LABEL_PATTERN,
                description="Only instances with this label (matched canonicalised).",
            ),
        ]
        | None
    ) = None
    provisioner_id: (
        Annotated[UUID, Meta(description="Only this provisioner's instances.")] | None
    ) = None
    workspace_id: TokensOf | None = None
    limit: PageLimit = 50
    cursor: PageCursor | None = None


class ActiveInstancesQuery(Strict):
    workspace_id: Annotated[UUID, Meta(description="The workspace.")]


class ReservationsQuery(Strict):
    workspace_id: (
        Annotated[UUID, Meta(description="Only this workspace's reservations.")] | None
    ) = None


class AssignmentQuery(Strict):
    wait_seconds: (
        Annotated[
            int,
            Meta(
                ge=1,
                le=2**31 - 1,
                description="Seconds to hold the request (at least 1); more than "
                "provisioners.assignment_poll_max_wait_seconds (default "
                f"{_P.assignment_poll_max_wait_seconds}, also the default) holds that long.",
            ),
        ]
        | None
    ) = None


class LeaseQuery(Strict):
    runner_session_id: Annotated[UUID, Meta(description="The session the lease should be of.")]
    job_id: Annotated[UUID, Meta(description="Also require this job id.")] | None = None
