"""What the clients share about talking HTTP to a daemon: bearer headers and error answers."""

from __future__ import annotations

import httpx
import msgspec

from controlplane.errors import ControlPlaneError
from controlplane.wire.common import ErrorEnvelope

USER_AGENT = "controlplane-agent/0.1"


class ApiError(ControlPlaneError):
    """An answer the client cannot go on with. The message never contains a token."""

    code = "api-error"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def error_code(response: httpx.Response) -> str:
    """The envelope's stable code, or `http-<status>` for a body that is not our envelope."""
    try:
        return msgspec.json.decode(response.content, type=ErrorEnvelope).error.code
    except (msgspec.DecodeError, msgspec.ValidationError):
        return f"http-{response.status_code}"


def describe(response: httpx.Response) -> str:
    try:
        error = msgspec.json.decode(response.content, type=ErrorEnvelope).error
    except (msgspec.DecodeError, msgspec.ValidationError):
        return f"HTTP {response.status_code}"
    return f"HTTP {response.status_code} {error.code}: {error.message}"


def client(url: str, *, timeout: float = 10.0) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=url.rstrip("/"), timeout=timeout, headers={"User-Agent": USER_AGENT}
    )
