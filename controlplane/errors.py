"""Every error we raise on purpose, in one hierarchy. `web/` maps each to a status and a code once.

Each class carries its stable wire `code` and a docstring whose first paragraph says when it is
raised: web/openapi/ builds the API's error catalogue from them (`catalogue`, `when`), walking
the subclasses of `ControlPlaneError`, and takes the status from web/errors.py's table.
A new class is catalogued by being defined; no table lists the codes.

A class may be raised with another `code=` than its own (a variant that shares its status);
such a variant gets a class of its own here so that the catalogue knows it. A class always
raised with the same words declares them as its `default_message` and is raised bare.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar
from uuid import UUID


class ControlPlaneError(Exception):
    """an unexpected error

    Base of every error we raise on purpose. `code` is the stable wire code; raised as itself it
    is a bug of ours (500)."""

    code = "server-error"
    default_message: ClassVar[str | None] = None

    def __init__(
        self, message: str | None = None, *, code: str | None = None, **details: Any
    ) -> None:
        if message is None:
            if self.default_message is None:
                raise TypeError(f"{type(self).__name__} is raised with its message")
            message = self.default_message
        super().__init__(message)
        self.message = message
        self.details = details
        if code is not None:
            self.code = code


# ------------------------------------------------------------------------------------------ 400


class InvalidInput(ControlPlaneError):
    """a body, path or query value is invalid"""

    code = "validation-error"


class InvalidCursor(InvalidInput):
    """`after` is not a `<xid>.<seq>` cursor, or `cursor` is not one we gave"""

    code = "invalid-cursor"


class EmptyRequiredLabels(InvalidInput):
    """a job requires no label once its labels are canonicalised"""

    code = "empty-required-labels"


class PriorityOutOfRange(InvalidInput):
    """a job's `priority` is outside `queue.priority_min`..`queue.priority_max`"""

    code = "priority-out-of-range"


class ConcurrencyLimitOutOfRange(InvalidInput):
    """a job's `concurrency_limit` is above `queue.max_concurrency_limit`"""

    code = "concurrency-limit-out-of-range"


class ConcurrencyKeyIncomplete(InvalidInput):
    """a job has a `concurrency_key` without a `concurrency_limit`, or a limit without a key"""

    code = "concurrency-key-incomplete"


class EmptyRunnerLabels(InvalidInput):
    """a runner offers no label once its labels are canonicalised"""

    code = "empty-runner-labels"


class RunnerLabelsReserved(InvalidInput):
    """every supplied label is reserved"""

    code = "runner-labels-reserved"


class IdempotencyKeyInvalid(InvalidInput):
    """Idempotency-Key is empty or too long"""

    code = "idempotency-key-invalid"


# ------------------------------------------------------------------------------------------ 401


class Unauthorized(ControlPlaneError):
    """missing, malformed, wrong-kind, unknown or expired

    Credentials we cannot accept; the variants below say which when the credential is known."""

    code = "unauthorized"
    default_message = "missing or invalid credentials"


class ApiKeyRevoked(Unauthorized):
    """the API key was revoked"""

    code = "api-key-revoked"


class ApiKeyExpired(Unauthorized):
    """the API key expired"""

    code = "api-key-expired"


class RegistrationTokenExpired(Unauthorized):
    """the registration token expired"""

    code = "registration-token-expired"
    default_message = "the registration token expired"


class ManualRegistrationTokenRevoked(Unauthorized):
    """the token was revoked"""

    code = "manual-registration-token-revoked"


class ProvisionerTokenRevoked(Unauthorized):
    """the provisioner token was revoked"""

    code = "provisioner-token-revoked"


class ProvisionerTokenExpired(Unauthorized):
    """the provisioner token expired"""

    code = "provisioner-token-expired"


# ------------------------------------------------------------------------------------------ 403


class Forbidden(ControlPlaneError):
    """the key is scoped to another workspace, or is a workspace admin key on an installation
    route"""

    code = "forbidden"


class ReadOnlyKey(Forbidden):
    """an observer admin key asked for a change (anything but GET)"""

    code = "admin-key-read-only"
    default_message = "this admin key is an observer: it may only read"


# ------------------------------------------------------------------------------------------ 404


class NotFound(ControlPlaneError):
    """no such execution, key or token (visible to this key)"""

    code = "not-found"


class LeaseJobMismatch(NotFound):
    """the lease is for another execution"""

    code = "lease-job-mismatch"
    default_message = "The lease token is for another job execution"


class RunningJobExecutionNotFound(NotFound):
    """this session holds no lease on the execution"""

    code = "running-job-execution-not-found"
    default_message = "Running job execution not found"


# ------------------------------------------------------------------------------------------ 409


class Conflict(ControlPlaneError):
    """the request contradicts the state it found"""

    code = "conflict"


class IdempotencyKeyReused(Conflict):
    """the Idempotency-Key was used for another request"""

    code = "idempotency-key-reused"


class IdempotencyReplayUnavailable(Conflict):
    """the signing key rotated since the create"""

    code = "idempotency-replay-unavailable"


class IllegalTransition(Conflict):
    """the runner instance cannot make that state change

    A move the state machine of domain/runner_instances.py refuses. Enrollment of a finished
    instance keeps the wire code the runner sees for a dead control session
    (`runner-control-session-invalid`)."""

    code = "runner-instance-illegal-transition"

    def __init__(self, current: str | None, target: str, cause: str) -> None:
        # The domain passes its StrEnums (RunnerState, Cause); details hold their plain values.
        source = "no row" if current is None else str(current)
        super().__init__(
            f"{cause} cannot move a runner instance from {source} to {target}",
            code="runner-control-session-invalid" if cause == "enrollment" else None,
            current=None if current is None else str(current),
            target=str(target),
            cause=str(cause),
        )
        self.current = current
        self.target = target
        self.cause = cause


class RegistrationTokenConsumed(Conflict):
    """the ephemeral registration token was already used"""

    code = "registration-token-consumed"
    default_message = "the ephemeral registration token was already used"


class RunnerSessionExhausted(Conflict):
    """a capped session is used up"""

    code = "runner-session-exhausted"
    default_message = "The runner session has no claims left"


class EphemeralTokenActive(Conflict):
    """a provider runner of the request already has an unconsumed, unexpired token"""

    code = "ephemeral-token-active"


class ReservationCapacityExhausted(Conflict):
    """a batch would mint more tokens for the reservation than it has units"""

    code = "reservation-capacity-exhausted"


# ------------------------------------------------------------------------------------------ 413


class PayloadTooLarge(ControlPlaneError):
    """body or job payload over its limit"""

    code = "payload-too-large"


# ------------------------------------------------------------------------------------------ 429


class RateLimited(ControlPlaneError):
    """too many attempts with this ephemeral token in its window, or too many held event-feed
    reads by this key on this replica (`details.retry_after_seconds`, also in Retry-After)

    Answered 429 with Retry-After."""

    code = "rate-limited"

    def __init__(self, message: str, *, retry_after_seconds: int) -> None:
        super().__init__(message, retry_after_seconds=retry_after_seconds)
        self.retry_after_seconds = retry_after_seconds


class RegistrationRateLimited(RateLimited):
    """too many registration attempts with one token in its window (429 with Retry-After)"""

    def __init__(self, retry_after_seconds: int) -> None:
        super().__init__(
            "too many registration attempts with this token; retry later",
            retry_after_seconds=retry_after_seconds,
        )


# ------------------------------------------------------------------------------------------ 503


class Unavailable(ControlPlaneError):
    """too many runners waiting, or a claim failed; retry

    This replica cannot serve the request now; it may be retried."""

    code = "unavailable"


class DatabaseUnavailable(Unavailable):
    """the database did not answer within a deadline, or refused; retry

    store/pool.py raises it for every connection fault, client-side deadline, lock or statement
    timeout and refusal to connect, whatever the statement; the original is its `__cause__`."""

    code = "database-unavailable"


class RateLimitUnavailable(Unavailable):
    """the registration rate limiter failed or timed out"""

    code = "runners-rate-limit-unavailable"
    default_message = "the registration rate limiter is unavailable; retry"


class ShuttingDown(Unavailable):
    """this replica is shutting down; retry on another"""

    code = "shutting-down"


# ------------------------------------------------------------------------ 500, never on the wire


class RunnerPaused(ControlPlaneError):
    """a paused runner's job request: answered 204 with `Controlplane-Paused` and a
    `Retry-After` of runners.paused_retry_seconds, never as an error body"""

    code = "runner-paused"


class ConfigError(ControlPlaneError):
    """a setting is missing, malformed or out of range (at start-up)"""

    code = "config-error"


class MigrationError(ControlPlaneError):
    """the database schema cannot be brought to this version (at start-up)"""

    code = "migration-error"


class EmbeddedPostgresError(ControlPlaneError):
    """the embedded server could not be initialised, started or stopped

    A ControlPlaneError, so the CLI prints the message (what to do) rather than a traceback."""

    code = "embedded-database-error"


class RegistrationTokenWorkspaceMismatch(ControlPlaneError):
    """consumption named another workspace than the token's: a bug of the caller"""

    code = "registration-token-workspace-mismatch"


class Fenced(ControlPlaneError):
    """A provisioner's control session lost its generation (a takeover, a revocation or the
    expiry of its token): raised by the fencing lock that opens every transaction run for the
    session, so the session wrote nothing, and closes with the code its `verdict` names
    ("superseded", "revoked" or "expired"). It ends a session; no request is answered with it."""

    code = "session-fenced"

    def __init__(self, verdict: str) -> None:
        super().__init__(f"the control session was {verdict}", verdict=verdict)
        self.verdict = verdict


def catalogue() -> dict[str, type[ControlPlaneError]]:
    """Every error code and the class that owns it: a depth-first walk of the subclasses of
    `ControlPlaneError` (definition order among siblings), the first class to claim a code
    owning it. Classes of the reference clients (controlplane.agent) are not the server's."""
    found: dict[str, type[ControlPlaneError]] = {}
    todo: list[type[ControlPlaneError]] = [ControlPlaneError]
    while todo:
        kind = todo.pop(0)
        if not kind.__module__.startswith("controlplane.agent"):
            found.setdefault(kind.code, kind)
        todo[:0] = kind.__subclasses__()
    return found


def when(kind: type[ControlPlaneError]) -> str:
    """The first paragraph of a class's docstring, on one line: when it is raised, as the API
    reference says it."""
    return " ".join((kind.__doc__ or "").strip().split("\n\n", 1)[0].split())


class BootstrapTokenInvalid(Unauthorized):
    """the bootstrap token is unknown, used, revoked or expired

    Raised by a booting runner's exchange for a control session (spec 4.3)."""

    code = "runner-bootstrap-token-invalid"
    default_message = "the bootstrap token is unknown, used, revoked or expired"


class ControlSessionInvalid(Conflict):
    """the runner instance is gone, finished or stopping

    A runner's control session asked for what its instance can no longer do (spec 4.5)."""

    code = "runner-control-session-invalid"


class ProviderRunnerIdTaken(Conflict):
    """another instance of the provisioner has that provider id

    Raised when a provider identity is attached (spec 4.2)."""

    code = "provider-runner-id-taken"


class ReservationNotFound(NotFound):
    """No launch reservation of this provisioner with that id (bound ones included).

    Raised by an assignment (spec 4.6) and by an ephemeral-token batch naming a reservation."""

    code = "reservation-not-found"


class ReservationExpired(Conflict):
    """The named launch reservation exists but has expired (raised by an assignment, spec 4.6,
    and by an ephemeral-token batch naming a reservation)."""

    code = "reservation-expired"


class RunnerNotAssignable(Conflict):
    """An assignment (spec 4.6) was refused for some of the named runners. `reason` is one of:
    runner-not-found, already-assigned, already-released, capacity-exhausted,
    runner-not-running, provider-identity-missing, control-session-not-active,
    labels-mismatch."""

    code = "runner-instance-not-assignable"

    def __init__(self, reason: str, runner_instance_ids: Sequence[UUID] = ()) -> None:
        super().__init__(
            f"runner instances cannot be assigned: {reason}",
            reason=reason,
            runner_instance_ids=[str(i) for i in runner_instance_ids],
        )
        self.reason = reason


class BindingMismatch(Conflict):
    """An allocation round's bind UPDATE matched fewer idle runners than it had locked and
    re-checked: a bug, not a race (the locks exclude every writer), so the whole round rolls
    back."""

    code = "binding-mismatch"
