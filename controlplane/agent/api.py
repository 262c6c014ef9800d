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


def base_url(url: str) -> str:
    """The daemon's base URL, refused early when it cannot work: httpx would otherwise fail on
    the first request with a bare `UnsupportedProtocol`."""
    scheme, separator, rest = url.partition("://")
    if not separator or scheme.lower() not in ("http", "https") or not rest.strip("/"):
        raise ApiError(
            f"the control plane URL must look like http://HOST:PORT (got {url!r}); "
            "pass --url or set CONTROLPLANE_URL"
        )
    return url.rstrip("/")


def unreachable(url: str, error: httpx.TransportError) -> str:
    """Why a request did not reach the daemon, naming it: `ConnectError` alone says neither."""
    reason = str(error) or type(error).__name__
    if isinstance(error, httpx.TimeoutException):
        reason = f"no answer in time ({type(error).__name__})"
    return f"cannot reach the control plane at {url}: {reason}"


def client(url: str, *, timeout: float = 10.0) -> httpx.AsyncClient:
    url = base_url(url)
    return httpx.AsyncClient(base_url=url, timeout=timeout, headers={"User-Agent": USER_AGENT})
