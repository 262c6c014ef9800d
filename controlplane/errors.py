"""The few errors the domain and the store raise. `web/` maps each to a status and a code once."""

from __future__ import annotations

from typing import Any


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


# --- provisioning (moved)


class Fenced(ControlPlaneError):
    """A provisioner's control session lost its generation (a takeover, a revocation or the
    expiry of its token): raised by the fencing lock that opens every transaction run for the
    session, so the session wrote nothing, and closes with the code its `verdict` names
    ("superseded", "revoked" or "expired"). It ends a session; no request is answered with it."""

    code = "session-fenced"

    def __init__(self, verdict: str) -> None:
        super().__init__(f"the control session was {verdict}", verdict=verdict)
        self.verdict = verdict
