"""What each endpoint declares about itself for the API description, beside its handler.

A handler module decorates each endpoint with `@operation(Op(...))`: its summary, the credential
it takes (a key of `SECURITY`), its request and success bodies (wire Structs), the error codes of
its own (those its credential, body and parameters imply are added by web/openapi/), its query
(a Struct of wire/queries.py), its headers and a longer description. web/openapi/ walks the
app's routes and reads these; an endpoint without a declaration, or a declared code no class of
errors.py owns, stops the build.

The parameters and notes that several modules share live here; the rest beside their handlers.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from controlplane.settings import Settings

Endpoint = Callable[[Request], Awaitable[Response]]
# A handler as written: the request alone, or what its module needs and the request (the
# endpoint Starlette calls is then web/endpoints.py's `bound` wrapper, which names it).
Handler = TypeVar("Handler", bound=Callable[..., Awaitable[Response]])

TEXT = "text/plain"  # `Op.answer` of a plain-text answer
KNOBS = Settings()  # the built-in defaults, which descriptions name
_OPAQUE = "opaque `cp_{}_<43 base64url chars>` (256 random bits; only its SHA-256 is stored)"
_SIGNED = "signed `cp_{}_<kid>.<base64url claims>.<HMAC-SHA256>` (kid names the signing key)"
_API_KEY_CODES = ("unauthorized", "api-key-revoked", "api-key-expired")

OAK, ADM, MRT = "orchestratorKey", "adminKey", "manualRegistrationToken"
WAK = "workspaceAdminKey"
RS, JL, PT = "runnerSession", "jobLease", "provisionerToken"
RAT, RCS, ERT = "activationToken", "controlSession", "ephemeralRegistrationToken"
_P = KNOBS.provisioners
_R = KNOBS.runners
_MRT_CODES = ("unauthorized", "registration-token-expired", "manual-registration-token-revoked")
_PT_CODES = ("unauthorized", "provisioner-token-revoked", "provisioner-token-expired")

# Security scheme -> (tag of its routes, auth error codes, description).
# fmt: off
SECURITY: dict[str, tuple[str, tuple[str, ...], str]] = {
    OAK: ("orchestrator", _API_KEY_CODES, f"Orchestrator API key, {_OPAQUE.format('oak')}."),
    ADM: ("admin", (*_API_KEY_CODES, "forbidden"), f"Admin API key, {_OPAQUE.format('adm')}, "
          "with a role: owner, or observer (GET only). A valid workspace admin key is 403 on "
          "installation routes."),
    WAK: ("workspaces", _API_KEY_CODES, f"Workspace admin API key, {_OPAQUE.format('wak')}, "
          "good for its own workspace's `/v1/workspaces/{workspace_id}/...` routes only, with a "
          "role: owner, or observer (GET only)."),
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
ROLE_KEYS = frozenset({ADM, WAK})  # keys with a role: an observer's change is 403


@dataclass(frozen=True)
class Param:
    """A parameter that is not in the query string (a header)."""

    name: str
    schema: dict[str, Any]
    description: str
    where: str = "header"

    def openapi(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "in": self.where,
            "required": False,
            "schema": self.schema,
            "description": self.description,
        }


UUID_SCHEMA = {"type": "string", "format": "uuid"}
IDEMPOTENCY_KEY = Param(
    "Idempotency-Key",
    {"type": "string", "minLength": 1, "maxLength": 256, "pattern": "\\S"},
    "Optional; 1-256 characters, not blank. A replay answers the first answer.",
)

IDEMPOTENT = "idempotency-key-invalid idempotency-key-reused idempotency-replay-unavailable"
IDEMPOTENT_REVOKE = "not-found idempotency-key-invalid idempotency-key-reused"
IDEMPOTENT_NOTE = (
    "With an `Idempotency-Key` header (1-256 characters), a replay of the same request answers "
    "the same credential and token; the same key with another body is 409."
)
REVOKE_NOTE = (
    "The body is optional: `{}`, `null` or none at all revoke without a reason. The first "
    "revocation sets `revoked_at` and `revocation_reason`; a later one (with another "
    "Idempotency-Key, or none) changes nothing and answers them as they are. With an "
    "`Idempotency-Key`, a replay of the same request answers the first answer byte for byte "
    "without revoking again; the same key for another token, another reason or another command "
    "is 409 idempotency-key-reused. An unknown id is 404 and nothing is remembered."
)
PAGE_NOTE = (
    "Unknown query parameters are 400. Ordered by (created_at, id) descending; `next_cursor` is "
    "null on the last page, and passed as `cursor` gives the next one."
)


@dataclass(frozen=True)
class Op:
    """One endpoint: summary, token kind, request and success bodies, its own error codes."""

    summary: str
    auth: str | None = None  # a SECURITY key; None: no auth
    body: type | None = None
    answer: Any = None  # a Struct type, an inline JSON schema, or TEXT
    errors: str = ""  # codes beyond those implied by auth, body and parameters
    query: type[msgspec.Struct] | None = None  # a Struct of wire/queries.py
    headers: tuple[Param, ...] = ()
    ok: int = 200
    also: dict[str, Any] = field(default_factory=dict)  # other non-error responses
    optional_body: bool = False
    alternative_auth: tuple[str, ...] = ()  # other SECURITY keys the route also accepts
    tag: str | None = None  # default: the tag of its token kind ("health" without one)
    notes: str | None = None  # the longer description


_DECLARED: dict[Callable[..., Awaitable[Response]], Op] = {}


def operation(op: Op) -> Callable[[Handler], Handler]:
    """Declare what `op` says about the handler it decorates."""

    def declare(handler: Handler) -> Handler:
        _DECLARED[handler] = op
        return handler

    return declare


def declared(endpoint: Endpoint) -> Op | None:
    """The declaration of the handler behind `endpoint` (through `bound`'s wrapper, if any)."""
    return _DECLARED.get(inspect.unwrap(endpoint))


def create(summary: str, body: type, answer: type) -> Op:
    """An admin create: admin key, 201, replayed with the same Idempotency-Key."""
    return Op(
        summary,
        ADM,
        body,
        answer,
        IDEMPOTENT,
        headers=(IDEMPOTENCY_KEY,),
        ok=201,
        notes=IDEMPOTENT_NOTE,
    )


def listing(summary: str, answer: type, query: type[msgspec.Struct], notes: str = PAGE_NOTE) -> Op:
    """An admin list, newest first a page at a time: admin key, a query with a cursor."""
    return Op(summary, ADM, None, answer, "invalid-cursor", query, notes=notes)


def revoke(summary: str, body: type, answer: type, notes: str = REVOKE_NOTE) -> Op:
    """An admin revoke: admin key, optional body, replayed with the same Idempotency-Key."""
    return Op(
        summary,
        ADM,
        body,
        answer,
        IDEMPOTENT_REVOKE,
        headers=(IDEMPOTENCY_KEY,),
        optional_body=True,
        notes=notes,
    )
