"""The few errors the domain and the store raise. `web/` maps each to a status and a code once."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from uuid import UUID


class ControlPlaneError(Exception):
    """Base of every error we raise on purpose. `code` is the stable wire code."""

    code = "server-error"

    def __init__(self, message: str, *, code: str | None = None, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details
        if code is not None:
            self.code = code


class InvalidInput(ControlPlaneError):
    code = "validation-error"


class EmptyRequiredLabels(InvalidInput):
    code = "empty-required-labels"


class EmptyRunnerLabels(InvalidInput):
    code = "empty-runner-labels"


class RunnerLabelsReserved(InvalidInput):
    code = "runner-labels-reserved"


class NotFound(ControlPlaneError):
    code = "not-found"


class RunningJobExecutionNotFound(NotFound):
    code = "running-job-execution-not-found"

    def __init__(self) -> None:
        super().__init__("Running job execution not found")


class Conflict(ControlPlaneError):
    code = "conflict"


class RunnerSessionExhausted(Conflict):
    code = "runner-session-exhausted"

    def __init__(self) -> None:
        super().__init__("The runner session has no claims left")


class RateLimited(ControlPlaneError):
    """Too many attempts in a window; answered 429 with Retry-After."""

    code = "rate-limited"

    def __init__(self, message: str, *, retry_after_seconds: int) -> None:
        super().__init__(message, retry_after_seconds=retry_after_seconds)
        self.retry_after_seconds = retry_after_seconds


class Unavailable(ControlPlaneError):
    """This replica cannot serve the request now; it may be retried."""

    code = "unavailable"


class DatabaseUnavailable(Unavailable):
    """The database is unreachable, refused us, or missed a client-side deadline."""

    code = "database-unavailable"


class ConfigError(ControlPlaneError):
    code = "config-error"


class MigrationError(ControlPlaneError):
    code = "migration-error"


class Unauthorized(ControlPlaneError):
    """Missing, malformed, unknown, expired or revoked credentials (the code says which)."""

    code = "unauthorized"

    def __init__(self, message: str = "missing or invalid credentials", *, code: str | None = None):
        super().__init__(message, code=code)


class Forbidden(ControlPlaneError):
    code = "forbidden"


class LeaseJobMismatch(NotFound):
    code = "lease-job-mismatch"

    def __init__(self) -> None:
        super().__init__("The lease token is for another job execution")


class PayloadTooLarge(ControlPlaneError):
    code = "payload-too-large"


class ShuttingDown(Unavailable):
    code = "shutting-down"


# --- store errors (moved)


class BootstrapTokenInvalid(Unauthorized):
    """A booting runner's bootstrap token is unknown, already exchanged, revoked or expired
    (raised by the exchange for a control session, spec 4.3)."""

    def __init__(self) -> None:
        super().__init__(
            "the bootstrap token is unknown, used, revoked or expired",
            code="runner-bootstrap-token-invalid",
        )


class ControlSessionInvalid(Conflict):
    """A runner's control session asked for what its instance can no longer do: the instance
    is gone, or it is stopping or finished and so cannot enroll (spec 4.5)."""

    code = "runner-control-session-invalid"


class ProviderRunnerIdTaken(Conflict):
    """Another instance of the same provisioner already has this provider identity (raised
    when a provider identity is attached, spec 4.2)."""

    code = "provider-runner-id-taken"


class ReservationNotFound(NotFound):
    """No launch reservation of this provisioner with that id, bound ones included (raised by
    an assignment, spec 4.6, and by an ephemeral-token batch naming a reservation)."""

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
