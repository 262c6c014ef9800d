"""Errors to HTTP, mapped once. Every error body is {"error": {"code", "message", "details"}}."""

from __future__ import annotations

import logging

import msgspec
from starlette.exceptions import HTTPException
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
    (errors.RateLimited, 429),
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
    elif isinstance(error, errors.RateLimited):
        headers["Retry-After"] = str(error.retry_after_seconds)
    return Response(
        _encoder.encode(body), status_of(error), headers=headers, media_type="application/json"
    )


async def handle_control_plane_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, errors.ControlPlaneError)
    if isinstance(exc, errors.DatabaseUnavailable):
        # store/pool.py translated a fault (unreachable, restarting, too slow): retryable, 503.
        log.warning(
            "http.database_unavailable",
            extra={"path": request.url.path, "error": type(exc.__cause__ or exc).__name__},
        )
    return error_response(exc)


async def handle_http_exception(_request: Request, exc: Exception) -> Response:
    """Starlette's own 404 (no such route) and 405 (wrong method), in our envelope."""
    assert isinstance(exc, HTTPException)
    code = {404: "not-found", 405: "method-not-allowed"}.get(exc.status_code, "http-error")
    body = ErrorEnvelope(error=ErrorBody(code=code, message=str(exc.detail)))
    return Response(
        _encoder.encode(body), exc.status_code, headers=exc.headers, media_type="application/json"
    )


async def handle_client_disconnect(request: Request, _exc: Exception) -> Response:
    """The client left before its body was complete, or the body deadline passed
    (web/server.py answered 408 itself): nobody reads this answer, and nothing failed here."""
    log.info("http.client_disconnected", extra={"path": request.url.path})
    return Response(status_code=400)


async def handle_unexpected(request: Request, exc: Exception) -> Response:
    log.error(
        "http.unhandled",
        exc_info=exc,
        extra={"path": request.url.path, "request_id": request.headers.get("x-request-id")},
    )
    return error_response(errors.ControlPlaneError("internal error"))
