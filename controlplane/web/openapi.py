"""The OpenAPI 3.1 document, built from the app's route list and the wire Structs.

Each route has one row in OPERATIONS; `document()` refuses a route without a row and a row without
a route, so the table cannot drift from the app. Bodies are the msgspec Structs the routes decode
and encode (schemas under components/schemas); error statuses come from web/errors.py's table.
The error codes of a row are completed from what it declares: its token kind's auth codes, a body's
`validation-error` and `payload-too-large`, a path or query parameter's `validation-error`.

The document says what the server enforces, so that a request valid by it is not refused: body
schemas are msgspec's own (the constraints the decoder applies), query parameters carry the ranges
and patterns their parsers apply, and the limits that are settings (long-poll maxima, the batch
size) are the serving daemon's. Descriptions name each knob with its built-in default.
`python -m controlplane.web.openapi > docs/openapi.json` writes the document of the default
settings; tests/web/test_openapi.py checks that file, and what a running daemon serves.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib.metadata import version
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route, WebSocketRoute

from controlplane import errors
from controlplane.domain.labels import MAX_LABEL_LENGTH
from controlplane.settings import Settings
from controlplane.web.edge import json_response
from controlplane.web.errors import STATUS
from controlplane.wire import admin, jobs, orchestrator, provisioners, runner_control, runners
from controlplane.wire.common import LABEL_PATTERN, ErrorEnvelope

_REF = "#/components/schemas/{name}"
_TEXT = "text/plain"
_KNOBS = Settings()
_OPAQUE = "opaque `cp_{}_<43 base64url chars>` (256 random bits; only its SHA-256 is stored)"
_SIGNED = "signed `cp_{}_<kid>.<base64url claims>.<HMAC-SHA256>` (kid names the signing key)"
_API_KEY_CODES = ("unauthorized", "api-key-revoked", "api-key-expired")

OAK, ADM, MRT = "orchestratorKey", "adminKey", "manualRegistrationToken"
RS, JL, PT = "runnerSession", "jobLease", "provisionerToken"
RAT, RCS, ERT = "activationToken", "controlSession", "ephemeralRegistrationToken"
_P = _KNOBS.provisioners
_R = _KNOBS.runners
_MRT_CODES = ("unauthorized", "registration-token-expired", "manual-registration-token-revoked")
_PT_CODES = ("unauthorized", "provisioner-token-revoked", "provisioner-token-expired")

# Security scheme -> (tag of its routes, auth error codes, description).
# fmt: off
SECURITY: dict[str, tuple[str, tuple[str, ...], str]] = {
    OAK: ("orchestrator", _API_KEY_CODES, f"Orchestrator API key, {_OPAQUE.format('oak')}."),
    ADM: ("admin", _API_KEY_CODES, f"Admin API key, {_OPAQUE.format('adm')}."),
    MRT: ("runners", _MRT_CODES, f"Manual registration token, {_OPAQUE.format('mrt')}."),
    RS: ("runners", ("unauthorized",), f"Runner session token, {_SIGNED.format('rs')}; lives "
         f"runners.session_token_ttl_seconds (default {_R.session_token_ttl_seconds})."),
    JL: ("runners", ("unauthorized",), f"Job lease token, {_SIGNED.format('jl')}; lives "
         f"runners.lease_token_ttl_seconds (default {_R.lease_token_ttl_seconds})."),
    PT: ("provisioners", _PT_CODES, f"Provisioner token, {_OPAQUE.format('pt')}."),
    RAT: ("runners", ("unauthorized",), f"Activation token of a provisioned runner, "
          f"{_OPAQUE.format('rat')}; one use, lives provisioners.activation_token_ttl_seconds "
          f"(default {_P.activation_token_ttl_seconds})."),
    ERT: ("runners", ("unauthorized", "registration-token-expired"), f"Ephemeral registration "
          f"token a provisioner minted for one of its runners (`mint_ephemeral` on its control "
          f"session), {_OPAQUE.format('ert')}; one use, lives "
          f"provisioners.ephemeral_token_ttl_seconds (default {_P.ephemeral_token_ttl_seconds})."),
    RCS: ("provisioned-runners", ("unauthorized",), f"Control session of a provisioned runner, "
          f"{_OPAQUE.format('rcs')}; lives provisioners.control_session_ttl_seconds (default "
          f"{_P.control_session_ttl_seconds}), never extended, closed at activation."),
}
# fmt: on

# Every wire error code: the class that raises it (which fixes the status) and when.
# fmt: off
ERRORS: dict[str, tuple[type[errors.ControlPlaneError], str]] = {
    "validation-error": (errors.InvalidInput, "a body, path or query value is invalid"),
    "invalid-cursor": (errors.InvalidInput,
                       "`after` is not a `<xid>.<seq>` cursor, or `cursor` is not one we gave"),
    "runner-labels-reserved": (errors.InvalidInput, "every supplied label is reserved"),
    "runner-bootstrap-token-invalid": (errors.Unauthorized,
                                       "the bootstrap token is unknown, used, revoked or expired"),
    "unauthorized": (errors.Unauthorized, "missing, malformed, wrong-kind, unknown or expired"),
    "api-key-revoked": (errors.Unauthorized, "the API key was revoked"),
    "api-key-expired": (errors.Unauthorized, "the API key expired"),
    "registration-token-expired": (errors.Unauthorized, "the registration token expired"),
    "manual-registration-token-revoked": (errors.Unauthorized, "the token was revoked"),
    "provisioner-token-revoked": (errors.Unauthorized, "the provisioner token was revoked"),
    "provisioner-token-expired": (errors.Unauthorized, "the provisioner token expired"),
    "forbidden": (errors.Forbidden, "the key is scoped to another workspace"),
    "idempotency-key-invalid": (errors.InvalidInput, "Idempotency-Key is empty or too long"),
    "idempotency-key-reused": (errors.Conflict, "the Idempotency-Key was used for another request"),
    "idempotency-replay-unavailable": (errors.Conflict, "the signing key rotated since the create"),
    "not-found": (errors.NotFound, "no such execution, key or token (visible to this key)"),
    "runner-control-session-invalid": (errors.Conflict,
                                       "the runner instance is gone, finished or stopping"),
    "provider-runner-id-taken": (errors.Conflict,
                                 "another instance of the provisioner has that provider id"),
    "registration-token-consumed": (errors.RegistrationTokenConsumed,
                                    "the ephemeral registration token was already used"),
    "lease-job-mismatch": (errors.LeaseJobMismatch, "the lease is for another execution"),
    "running-job-execution-not-found": (errors.RunningJobExecutionNotFound,
                                        "this session holds no lease on the execution"),
    "runner-session-exhausted": (errors.RunnerSessionExhausted, "a capped session is used up"),
    "payload-too-large": (errors.PayloadTooLarge, "body or job payload over its limit"),
    "rate-limited": (errors.RateLimited,
                     "too many attempts with this ephemeral token in its window, or too many "
                     "held event-feed reads by this key on this replica "
                     "(`details.retry_after_seconds`, also in Retry-After)"),
    "database-unavailable": (errors.DatabaseUnavailable,
                             "the database did not answer within a deadline, or refused; retry"),
    "unavailable": (errors.Unavailable, "too many runners waiting, or a claim failed; retry"),
    "runners-rate-limit-unavailable": (errors.RateLimitUnavailable,
                                       "the registration rate limiter failed or timed out"),
    "server-error": (errors.ControlPlaneError, "an unexpected error"),
}
# fmt: on


# 1 to 20 labels, comma-separated, each as the label grammar says (web/jobs.py checks the same).
_ONE_LABEL = f"[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_LABEL_LENGTH - 1}}}"
_LABEL_LIST = f"^{_ONE_LABEL}(,{_ONE_LABEL}){{0,19}}$"


def _query(name: str, schema: dict[str, Any], text: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": text}


def knob(settings: Settings, name: str) -> Any:
    section, _, field_name = name.partition(".")
    return getattr(getattr(settings, section), field_name)


# Query parameters whose maximum is a setting: parameter key -> knob.
MAXIMA = {
    "wait:job": "runners.long_poll_max_seconds",
    "wait:cancel": "runners.cancel_wait_max_seconds",
    "wait:events": "runners.long_poll_max_seconds",
}


def _wait(default: str, key: str) -> dict[str, Any]:
    """The `wait` parameter; its maximum is the serving daemon's (`_Build.parameter`)."""
    high = knob(_KNOBS, MAXIMA[key])
    text = (
        f"Seconds to hold the request; 0 answers at once. Default {default}, at most "
        f"{MAXIMA[key]} (default {high:g})."
    )
    return _query("wait", {"type": "number", "minimum": 0, "maximum": high}, text)


_UUID = {"type": "string", "format": "uuid"}
_LIMIT = {"type": "integer", "minimum": 1, "maximum": 1000, "default": 100}
# Each part fits the column it is compared with (xid8, bigint) with digits to spare. Empty is
# refused (400 invalid-cursor), like every empty query value.
_EVENT_CURSOR = {"type": "string", "pattern": "^[0-9]{1,18}[.][0-9]{1,18}$"}
_PAGE_CURSOR = {"type": "string", "minLength": 1, "pattern": "^[A-Za-z0-9_-]+$"}
QUERY: dict[str, dict[str, Any]] = {
    "wait:job": _wait("the maximum", "wait:job"),
    "wait:cancel": _wait("0", "wait:cancel"),
    "wait:events": _wait("0", "wait:events"),
    "after": _query(
        "after",
        _EVENT_CURSOR,
        "Cursor `<xid>.<seq>` (a `next_cursor`); omitted: from the start; empty: 400.",
    ),
    "limit": _query("limit", _LIMIT, "The most events to return."),
    "workspace_id": _query("workspace_id", _UUID, "Only this workspace (scoped key: its own)."),
    "workspace_id:tokens": _query("workspace_id", _UUID, "Only this workspace's tokens."),
    "window_seconds": _query(
        "window_seconds",
        {"type": "integer", "minimum": 1, "maximum": 86400, "default": 60},
        "Seen within this many seconds.",
    ),
    "wait_seconds": _query(
        "wait_seconds",
        {"type": "integer", "minimum": 1, "maximum": 2**31 - 1},
        "Seconds to hold the request (at least 1); more than "
        f"provisioners.assignment_poll_max_wait_seconds (default "
        f"{_P.assignment_poll_max_wait_seconds}, also the default) holds that long.",
    ),
    "state": _query(
        "state",
        {
            "type": "string",
            "enum": ["starting", "running", "stopping", "stopped", "failed", "terminated"],
        },
        "Only instances in this state.",
    ),
    "assignment": _query(
        "assignment",
        {"type": "string", "enum": ["assigned", "unassigned"]},
        "assigned: instances with a workspace; unassigned: without one.",
    ),
    "label": _query(
        "label",
        {"type": "string", "minLength": 1, "maxLength": MAX_LABEL_LENGTH, "pattern": LABEL_PATTERN},
        "Only instances with this label (matched canonicalised).",
    ),
    "provisioner_id": _query("provisioner_id", _UUID, "Only this provisioner's instances."),
    "limit:page": _query(
        "limit", {"type": "integer", "minimum": 1, "maximum": 100, "default": 50}, "Page size."
    ),
    "cursor": _query(
        "cursor", _PAGE_CURSOR, "Opaque; the `next_cursor` of the previous page (another is 400)."
    ),
    "idempotency-key": {
        "name": "Idempotency-Key",
        "in": "header",
        "required": False,
        "schema": {"type": "string", "minLength": 1, "maxLength": 256, "pattern": "\\S"},
        "description": "Optional; 1-256 characters, not blank. A replay answers the first answer.",
    },
    "workspace_id:required": {
        **_query("workspace_id", _UUID, "The workspace."),
        "required": True,
    },
    "workspace_id:reservations": _query(
        "workspace_id", _UUID, "Only this workspace's reservations."
    ),
    "status:jobs": _query(
        "status",
        {"type": "string", "enum": ["pending", "running", "ended"]},
        "Only executions in this state.",
    ),
    "labels:jobs": _query(
        "labels",
        {"type": "string", "pattern": _LABEL_LIST},
        "Comma-separated labels (1-20); only pending and running executions that require all "
        "of them (an ended execution keeps no labels).",
    ),
    "workspace_id:jobs": _query("workspace_id", _UUID, "Only this workspace's executions."),
    "active": _query(
        "active",
        {"type": "string", "enum": ["true", "false"]},
        "true: only provisioners seen within 120 s, not revoked, not expired.",
    ),
}


@dataclass(frozen=True)
class Op:
    """One route: summary, token kind, request and success bodies, its own error codes."""

    summary: str
    auth: str | None = None  # a SECURITY key; None: no auth
    body: type | None = None
    answer: Any = None  # a Struct type, an inline JSON schema, or _TEXT
    errors: str = ""  # codes beyond those implied by auth, body and parameters
    query: tuple[str, ...] = ()
    ok: int = 200
    also: dict[str, Any] = field(default_factory=dict)  # other non-error responses
    optional_body: bool = False
    alternative_auth: tuple[str, ...] = ()  # other SECURITY keys the route also accepts
    tag: str | None = None  # default: the tag of its token kind ("health" without one)


_READY = {
    "type": "object",
    "properties": {"ready": {"type": "boolean"}, "checks": {"type": "object"}},
    "required": ["ready", "checks"],
}
_RETRY = {"Retry-After": {"schema": {"type": "string"}, "description": "seconds"}}
_NOT_READY = {"description": "Not ready", "content": {"application/json": {"schema": _READY}}}
_NO_JOB = {
    "description": "No job within `wait` (Retry-After: 0), or shutting down (Retry-After: 1)",
    "headers": _RETRY,
}
_LEASE = "lease-job-mismatch running-job-execution-not-found"
_IDEMPOTENT = "idempotency-key-invalid idempotency-key-reused idempotency-replay-unavailable"
_IDEMPOTENT_REVOKE = "not-found idempotency-key-invalid idempotency-key-reused"
_KEY = ("idempotency-key",)
_PAGE = ("limit:page", "cursor")

# fmt: off
OPERATIONS: dict[str, Op] = {
    "GET /healthz": Op("Liveness", answer={"type": "object", "required": ["status"]}),
    "GET /readyz": Op("Readiness", answer=_READY, also={"503": _NOT_READY}),
    "GET /metrics": Op("Prometheus metrics", answer=_TEXT),
    "GET /openapi.json": Op("This document", answer={"type": "object"}),
    "POST /v1/runners/register": Op(
        "Register a runner session (manual, or a provisioned runner's activation or ephemeral "
        "token)", MRT, runners.RegisterRequest, runners.RegisterResponse,
        "runner-labels-reserved registration-token-consumed rate-limited "
        "runners-rate-limit-unavailable", alternative_auth=(RAT, ERT)),
    "POST /v1/runners/jobs/request": Op(
        "Long-poll for a job", RS, None, runners.JobResponse,
        "runner-session-exhausted unavailable", ("wait:job",), also={"204": _NO_JOB}),
    "POST /v1/runners/jobs/{job_execution_id}/heartbeat": Op(
        "Refresh the lease; with wait, hold until cancelled", JL, runners.HeartbeatRequest,
        runners.HeartbeatResponse, _LEASE, ("wait:cancel",), optional_body=True),
    "POST /v1/runners/jobs/{job_execution_id}/complete": Op(
        "Report the outcome; the lease is removed", JL, runners.CompleteRequest,
        runners.CompleteResponse, _LEASE),
    "POST /v1/jobs": Op(
        "Enqueue job executions (idempotent)", OAK, orchestrator.EnqueueRequest,
        orchestrator.EnqueueResponse, "forbidden"),
    "GET /v1/jobs/{job_execution_id}": Op(
        "Read an execution's state", OAK, None, orchestrator.ExecutionState, "not-found"),
    "POST /v1/jobs/{job_execution_id}/outcome": Op(
        "End an execution (idempotent)", OAK, orchestrator.OutcomeRequest,
        orchestrator.OutcomeResponse, "not-found"),
    "GET /v1/events": Op(
        "Read the event feed", OAK, None, orchestrator.EventsResponse,
        "invalid-cursor forbidden rate-limited", ("after", "limit", "wait:events", "workspace_id")),
    "POST /v1/admin/api-keys": Op(
        "Create an API key", ADM, admin.CreateApiKey, admin.CreatedCredential, _IDEMPOTENT,
        _KEY, ok=201),
    "GET /v1/admin/api-keys": Op(
        "List API keys, newest first, a page at a time", ADM, None, admin.CredentialList,
        "invalid-cursor", _PAGE),
    "POST /v1/admin/api-keys/{id}/revoke": Op(
        "Revoke an API key (idempotent)", ADM, admin.Revoke, admin.CredentialOut,
        _IDEMPOTENT_REVOKE, _KEY, optional_body=True),
    "POST /v1/admin/registration-tokens": Op(
        "Create a manual registration token", ADM, admin.CreateRegistrationToken,
        admin.CreatedCredential, _IDEMPOTENT, _KEY, ok=201),
    "GET /v1/admin/registration-tokens": Op(
        "List manual registration tokens, newest first, a page at a time", ADM, None,
        admin.CredentialList, "invalid-cursor", ("workspace_id:tokens", *_PAGE)),
    "POST /v1/admin/registration-tokens/{id}/revoke": Op(
        "Revoke a manual registration token (idempotent)", ADM, admin.Revoke,
        admin.CredentialOut, _IDEMPOTENT_REVOKE, _KEY, optional_body=True),
    "GET /v1/admin/queue": Op("Queue depth, per workspace", ADM, None, admin.QueueOut),
    "GET /v1/admin/queue/pending": Op(
        "Pending label sets per workspace, oldest first, with who could take them and whether "
        "they are stuck", ADM, None, jobs.PendingGroupList),
    "GET /v1/admin/jobs": Op(
        "List executions, newest change (enqueued, started, ended) first, a page at a time",
        ADM, None, jobs.JobList, "invalid-cursor",
        query=("workspace_id:jobs", "status:jobs", "labels:jobs", *_PAGE)),
    "GET /v1/admin/jobs/{job_execution_id}": Op(
        "One execution: its timestamps, outcome, exit code, output tail, and why it waits",
        ADM, None, jobs.JobDetail, "not-found"),
    "POST /v1/admin/jobs/{job_execution_id}/cancel": Op(
        "Cancel an execution as the orchestrator would (idempotent)", ADM, None,
        jobs.JobCancelled, "not-found"),
    "GET /v1/admin/runners": Op(
        "Runners seen recently, with their leases", ADM, None, admin.ActiveRunners,
        query=("workspace_id:tokens", "window_seconds")),
    "GET /v1/admin/runner-instances": Op(
        "List runner instances of every provisioner, newest first, a page at a time", ADM, None,
        admin.RunnerInstanceList, "invalid-cursor",
        query=("state", "assignment", "label", "provisioner_id", "workspace_id:tokens", *_PAGE)),
    "GET /v1/admin/runner-instances/active": Op(
        "A workspace's active runner instances, updated recently", ADM, None,
        admin.ActiveRunnerInstances, query=("workspace_id:required",)),
    "GET /v1/admin/runner-instances/counts": Op(
        "Runner instances per state", ADM, None, admin.RunnerInstanceCounts),
    "GET /v1/admin/reservations": Op(
        "Live reservations per workspace, labels and kind", ADM, None, admin.ReservationList,
        query=("workspace_id:reservations",)),
    "GET /v1/provisioners/me": Op(
        "The calling provisioner's identity", PT, None, provisioners.ProvisionerIdentity,
        "provisioner-token-revoked provisioner-token-expired"),
    "POST /v1/admin/provisioner-tokens": Op(
        "Create a provisioner token (workspace_id omitted: installation scope)", ADM,
        provisioners.CreateProvisionerToken, provisioners.CreatedProvisionerToken, _IDEMPOTENT,
        _KEY, ok=201),
    "GET /v1/admin/provisioner-tokens": Op(
        "List provisioner tokens, newest first, a page at a time", ADM, None,
        provisioners.ProvisionerTokenList, "invalid-cursor",
        ("workspace_id:tokens", "active", *_PAGE)),
    "POST /v1/admin/provisioner-tokens/{id}/revoke": Op(
        "Revoke a provisioner token of either scope (idempotent); the first revocation "
        "cascades", ADM, admin.Revoke, provisioners.ProvisionerTokenOut, _IDEMPOTENT_REVOKE,
        _KEY, optional_body=True),
    "POST /v1/runner-enrollment/exchange": Op(
        "Trade a bootstrap token for a control session", None, runner_control.ExchangeRequest,
        runner_control.ExchangeResponse, "runner-bootstrap-token-invalid server-error",
        tag="provisioned-runners"),
    "POST /v1/runner-control/enrollment": Op(
        "Enroll: declare labels and metadata; may answer an activation token", RCS,
        runner_control.EnrollmentRequest, runner_control.ActivationResponse,
        "runner-labels-reserved runner-control-session-invalid"),
    "POST /v1/runner-control/provider-runner": Op(
        "Attach the provider identity (once)", RCS, runner_control.ProviderRunnerRequest,
        runner_control.ProviderRunnerResponse, "provider-runner-id-taken"),
    "POST /v1/runner-control/heartbeat": Op(
        "Control session liveness", RCS, None, runner_control.ControlHeartbeatResponse),
    "GET /v1/runner-control/assignment": Op(
        "Long-poll for an assignment; answers an activation token", RCS, None,
        runner_control.ActivationResponse, query=("wait_seconds",)),
}
# fmt: on

_IDEMPOTENT_NOTE = (
    "With an `Idempotency-Key` header (1-256 characters), a replay of the same request answers "
    "the same credential and token; the same key with another body is 409."
)
_REVOKE_NOTE = (
    "The body is optional: `{}`, `null` or none at all revoke without a reason. The first "
    "revocation sets `revoked_at` and `revocation_reason`; a later one (with another "
    "Idempotency-Key, or none) changes nothing and answers them as they are. With an "
    "`Idempotency-Key`, a replay of the same request answers the first answer byte for byte "
    "without revoking again; the same key for another token, another reason or another command "
    "is 409 idempotency-key-reused. An unknown id is 404 and nothing is remembered."
)
_PAGE_NOTE = (
    "Unknown query parameters are 400. Ordered by (created_at, id) descending; `next_cursor` is "
    "null on the last page, and passed as `cursor` gives the next one."
)

# Longer notes, as each operation's description.
NOTES = {
    "POST /v1/runners/register": "Labels are canonicalised (trimmed, lower-cased, deduplicated, "
    "sorted); labels in runners.reserved_labels are dropped, except for an activation or "
    "ephemeral token of an installation provisioner. A manual token gives an uncapped `manual` "
    "session; an activation token (one use) gives an `activation` session with `max_claims` 1 "
    "and closes the runner's control session; an ephemeral token (one use) gives an "
    "`ephemeral` session with `max_claims` 1, linked to the provisioner's runner of that "
    "provider id. Ephemeral attempts are counted per token after the body is validated: "
    "beyond provisioners.ephemeral_register_rate_limit (default "
    f"{_P.ephemeral_register_rate_limit}) per provisioners.ephemeral_register_rate_window_seconds "
    f"(default {_P.ephemeral_register_rate_window_seconds}) they get 429; a used token still "
    "counts, then gets 409. A 429 or 503 leaves the token unused.",
    "POST /v1/runner-enrollment/exchange": "Unauthenticated; the bootstrap token is the "
    "credential, usable once before provisioners.bootstrap_token_ttl_seconds (default "
    f"{_P.bootstrap_token_ttl_seconds}) pass.",
    "POST /v1/runner-control/enrollment": "The body is validated before the token. The "
    "instance becomes `running`; labels, capabilities, provider_kind and protocol_version are "
    "stored while it has no assignment. When it was created for a reservation, that "
    "reservation is promoted to its assignment and an activation token returned; otherwise, "
    "or when the promotion fails, `activation_token` is null.",
    "POST /v1/runner-control/provider-runner": "The body is validated before the token. "
    "`attached` is false when the instance already has an identity or is finished.",
    "GET /v1/runner-control/assignment": "The query is validated before the token; unknown "
    "parameters are 400. Held until the runner is assigned (answers a fresh activation token, "
    "revoking earlier ones) or `wait_seconds` pass (`activation_token` null).",
    "POST /v1/runners/jobs/request": "No request body is read. Claims the oldest compatible "
    "pending job of the session's workspace; a claim whose client went away is put back.",
    "POST /v1/runners/jobs/{job_execution_id}/heartbeat": "An empty or `null` body is `{}`. "
    "`capabilities` omitted keeps the stored report, `null` clears it, an object replaces it.",
    "POST /v1/runners/jobs/{job_execution_id}/complete": "`recorded` is false when the execution "
    "had already ended (the orchestrator ended it first); the lease is removed either way.",
    "POST /v1/jobs": f"At most queue.max_batch_size (default {_KNOBS.queue.max_batch_size}) jobs; "
    f"a payload is a JSON object of at most queue.max_payload_bytes (default "
    f"{_KNOBS.queue.max_payload_bytes}) bytes. One result per job, in order.",
    "POST /v1/jobs/{job_execution_id}/outcome": "An installation-wide key may end an execution "
    "never seen (its tombstone stops a later enqueue); a workspace-scoped key gets 404.",
    "GET /v1/events": "Events after `after`, oldest first; with `wait`, held until one arrives. "
    f"A key holds at most events.held_reads_per_key (default {_KNOBS.events.held_reads_per_key}) "
    "reads with `wait` on one replica; more get 429.",
    "GET /v1/admin/runner-instances": "Installation-wide: instances of workspace and "
    "installation provisioners alike. Unknown query parameters are 400. Derived per row: "
    "`lifecycle_state` (unassigned, assigned, activated, claimed; an assigned instance in a "
    "terminal state is completed), `enrollment_state` (activated: has a runner session; "
    "enrolled: an open control session; else pending) and `reconciliation_status` (terminal; "
    "unknown: its provisioner was never seen; stale: its last report or its provisioner's "
    "last-seen is older than provisioners.stale_runner_threshold_seconds (default "
    f"{_P.stale_runner_threshold_seconds}); else current).",
    "GET /v1/admin/runner-instances/active": "Instances in starting, running or stopping "
    "whose row the server updated within provisioners.runner_active_window_seconds (default "
    f"{_P.runner_active_window_seconds}); server time, never a reported one.",
    "POST /v1/admin/api-keys": _IDEMPOTENT_NOTE,
    "POST /v1/admin/registration-tokens": _IDEMPOTENT_NOTE,
    "POST /v1/admin/provisioner-tokens": _IDEMPOTENT_NOTE,
    "POST /v1/admin/api-keys/{id}/revoke": _REVOKE_NOTE,
    "POST /v1/admin/registration-tokens/{id}/revoke": _REVOKE_NOTE,
    "POST /v1/admin/provisioner-tokens/{id}/revoke": _REVOKE_NOTE
    + " Any provisioner token of either scope: admin keys are installation-wide. The first "
    "revocation revokes the provisioner's boot-path credentials and unused runner sessions, "
    "closes its control sessions and terminates its instances without a runner session; it runs "
    "once.",
    "GET /v1/admin/api-keys": _PAGE_NOTE,
    "GET /v1/admin/registration-tokens": _PAGE_NOTE,
    "GET /v1/admin/provisioner-tokens": _PAGE_NOTE + " `active` pages the same way.",
}


def status(code: str) -> int:
    kind = ERRORS[code][0]
    return next(value for base, value in STATUS if issubclass(kind, base))


def codes(route: Route, op: Op) -> list[str]:
    """Every error code the route can answer with, in ERRORS order."""
    found = set(op.errors.split())
    if op.auth is not None:
        found.update((*SECURITY[op.auth][1], "database-unavailable", "server-error"))
        for other in op.alternative_auth:
            found.update(SECURITY[other][1])
    if op.body is not None:
        found.update(("validation-error", "payload-too-large"))
    if op.query or route.param_convertors:
        found.add("validation-error")
    return [code for code in ERRORS if code in found]


@dataclass(frozen=True)
class _Build:
    """What one document is built with: the serving daemon's settings, and the `$ref` msgspec
    gave each Struct (its name, qualified by module only when two Structs share one)."""

    settings: Settings
    refs: dict[type, dict[str, str]]
    shared_names: set[str]  # endpoint names that two modules use (`heartbeat`)

    def operation_id(self, route: Route, method: str) -> str:
        """The endpoint's name; prefixed with its module's when shared, as operationIds are
        unique in a document."""
        module, name = _endpoint_name(route, method)
        return f"{module}_{name}" if name in self.shared_names else name

    def schema(self, kind: Any) -> Any:
        return self.refs[kind] if isinstance(kind, type) else kind

    def json(self, schema: Any) -> dict[str, Any]:
        return {"application/json": {"schema": self.schema(schema)}}

    def errors(self, found: Sequence[str]) -> dict[str, Any]:
        by_status: dict[int, list[str]] = {}
        for code in found:
            by_status.setdefault(status(code), []).append(code)
        out: dict[str, Any] = {}
        for value, group in sorted(by_status.items()):
            only = {"properties": {"error": {"properties": {"code": {"enum": group}}}}}
            out[str(value)] = {
                "description": "; ".join(f"`{code}`: {ERRORS[code][1]}" for code in group),
                "content": self.json({"allOf": [self.schema(ErrorEnvelope), only]}),
                **({"headers": _RETRY} if value in (429, 503) else {}),
            }
        return out

    def parameter(self, key: str) -> dict[str, Any]:
        found = QUERY[key]
        if key not in MAXIMA:
            return found
        found = copy.deepcopy(found)
        found["schema"]["maximum"] = knob(self.settings, MAXIMA[key])
        return found

    def operation(self, route: Route, method: str, key: str, op: Op) -> dict[str, Any]:
        ok: dict[str, Any] = {"description": op.summary}
        if op.answer is _TEXT:
            ok["content"] = {_TEXT: {"schema": {"type": "string"}}}
        elif op.answer is not None:
            ok["content"] = self.json(op.answer)
        out: dict[str, Any] = {
            "operationId": self.operation_id(route, method),
            "summary": op.summary,
            "tags": [op.tag or (SECURITY[op.auth][0] if op.auth else "health")],
        }
        if key in NOTES:
            out["description"] = NOTES[key]
        if op.auth is not None:
            out["security"] = [{name: []} for name in (op.auth, *op.alternative_auth)]
        path = [
            {"name": name, "in": "path", "required": True, "schema": _UUID}
            for name in route.param_convertors
        ]
        if parameters := path + [self.parameter(name) for name in op.query]:
            out["parameters"] = parameters
        if op.body is not None:
            # An optional body may also be `null` (or absent: not required).
            body = (
                {"anyOf": [self.schema(op.body), {"type": "null"}]} if op.optional_body else op.body
            )
            out["requestBody"] = {"required": not op.optional_body, "content": self.json(body)}
        out["responses"] = {str(op.ok): ok, **op.also, **self.errors(codes(route, op))}
        return out


def _endpoint_name(route: Route, method: str) -> tuple[str, str]:
    """(module, name) of the endpoint serving `method` on `route` (a Resource has one each)."""
    endpoint = getattr(route, "endpoints", {}).get(method, route.endpoint)
    module = getattr(endpoint, "__module__", "").rsplit(".", 1)[-1]
    return module, getattr(endpoint, "__name__", route.name)


def _structs() -> list[type]:
    found: set[type] = {ErrorEnvelope}
    for op in OPERATIONS.values():
        found.update(kind for kind in (op.body, op.answer) if isinstance(kind, type))
    return sorted(found, key=lambda kind: (kind.__name__, kind.__module__))


def _components(settings: Settings) -> tuple[dict[type, dict[str, str]], dict[str, Any]]:
    """msgspec's schemas of every Struct, with the rules a Struct checks beyond its fields'
    constraints (its `json_schema_extra`) and the limits that are settings."""
    kinds = _structs()
    refs, schemas = msgspec.json.schema_components(kinds, ref_template=_REF)
    by_kind = dict(zip(kinds, refs, strict=True))
    for kind, ref in by_kind.items():
        name = ref["$ref"].rsplit("/", 1)[1]
        schemas[name].update(getattr(kind, "json_schema_extra", {}))
    enqueue = schemas[by_kind[orchestrator.EnqueueRequest]["$ref"].rsplit("/", 1)[1]]
    enqueue["properties"]["jobs"]["maxItems"] = settings.queue.max_batch_size
    return by_kind, dict(sorted(schemas.items()))


def document(routes: Sequence[BaseRoute], settings: Settings | None = None) -> dict[str, Any]:
    """The document for `routes` served with `settings` (default: the built-in defaults).
    Raises ValueError when a route and OPERATIONS disagree."""
    settings = settings or _KNOBS
    refs, schemas = _components(settings)
    http: list[tuple[Route, str]] = []
    for route in routes:
        if isinstance(route, WebSocketRoute):
            continue  # OpenAPI has no WebSocket; docs/provisioner-protocol.md describes it
        if not isinstance(route, Route):
            raise ValueError(f"cannot document {route!r}")
        http.extend((route, method) for method in sorted((route.methods or set()) - {"HEAD"}))
    modules: dict[str, set[str]] = {}
    for route, method in http:
        module, name = _endpoint_name(route, method)
        modules.setdefault(name, set()).add(module)
    build = _Build(settings, refs, {name for name, found in modules.items() if len(found) > 1})
    paths: dict[str, dict[str, Any]] = {}
    seen: set[str] = set()
    for route, method in http:
        key = f"{method} {route.path}"
        if key not in OPERATIONS:
            raise ValueError(f"{key} has no row in OPERATIONS")
        seen.add(key)
        paths.setdefault(route.path, {})[method.lower()] = build.operation(
            route, method, key, OPERATIONS[key]
        )
    if missing := sorted(set(OPERATIONS) - seen):
        raise ValueError(f"OPERATIONS rows without a route: {missing}")
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "controlplane",
            "version": version("controlplane"),
            "description": "Dispatches CI job executions to self-hosted runners. Every error "
            "body is an ErrorEnvelope. Strings never hold NUL (U+0000). A credential is sent "
            "as `Authorization: Bearer <token>`, exactly one space between the two (the scheme "
            "in any case). Guide: docs/api.md.",
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                name: {"type": "http", "scheme": "bearer", "description": text}
                for name, (_, _, text) in SECURITY.items()
            },
        },
    }


def encode(doc: dict[str, Any]) -> bytes:
    return msgspec.json.format(msgspec.json.encode(doc), indent=2) + b"\n"


async def openapi_json(request: Request) -> Response:
    """GET /openapi.json: the document for this app's routes, built on first use."""
    state = request.app.state
    if getattr(state, "openapi", None) is None:
        services = getattr(state, "services", None)
        state.openapi = document(request.app.routes, services and services.settings)
    return json_response(state.openapi)


def main() -> None:
    from controlplane.web import app  # imported here: app imports this module

    # build() only stores the services on the app state; routes do not need them.
    sys.stdout.buffer.write(encode(document(app.build(None).routes)))


if __name__ == "__main__":
    main()
