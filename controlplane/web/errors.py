"""Errors to HTTP, mapped once. Every error body is {"error": {"code", "message", "details"}}."""

from __future__ import annotations

import logging

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from controlplane import errors
from controlplane.wire.common import ErrorBody, ErrorEnvelope

log = logging.getLogger("controlplane.web")

# Most specific first: the first class an error is an instance of decides its status.
STATUS: list[tuple[type[errors.ControlPlaneError], int]] = [
    (errors.ShuttingDown, 503),
    (errors.Unavailable, 503),
    (errors.PayloadTooLarge, 413),
    (errors.Unauthorized, 401),
    (errors.Forbidden, 403),
    (errors.NotFound, 404),
    (errors.Conflict, 409),
    (errors.InvalidInput, 400),
    (errors.ControlPlaneError, 500),
]

_encoder = msgspec.json.Encoder()


def status_of(error: errors.ControlPlaneError) -> int:
    return next(status for kind, status in STATUS if isinstance(error, kind))


def error_response(error: errors.ControlPlaneError) -> Response:
    body = ErrorEnvelope(
        error=ErrorBody(code=error.code, message=error.message, details=error.details)
    )
    headers = {}
    if isinstance(error, errors.Unavailable):
        headers["Retry-After"] = "1"
    return Response(
        _encoder.encode(body), status_of(error), headers=headers, media_type="application/json"
    )


async def handle_control_plane_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, errors.ControlPlaneError)
    return error_response(exc)


async def handle_unexpected(request: Request, exc: Exception) -> Response:
    log.error(
        "http.unhandled",
        exc_info=exc,
        extra={"path": request.url.path, "request_id": request.headers.get("x-request-id")},
    )
    return error_response(errors.ControlPlaneError("internal error"))
