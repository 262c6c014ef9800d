"""Decoding requests and encoding responses at the edge: bounded bodies, strict types."""

from __future__ import annotations

from typing import Any, TypeVar
from uuid import UUID

import anyio
import msgspec
from starlette.requests import HTTPConnection, Request
from starlette.responses import Response

from controlplane.errors import InvalidInput, PayloadTooLarge, Unauthorized

T = TypeVar("T")

_encoder = msgspec.json.Encoder()


def bearer(request: HTTPConnection) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    # Exactly "Bearer <token>": anything else (extra spaces, other schemes) is no token.
    if scheme.lower() != "bearer" or not token or token != token.strip() or " " in token:
        raise Unauthorized()
    return token


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body exceeds {limit} bytes", limit=limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds {limit} bytes", limit=limit)
        chunks.append(chunk)
    return b"".join(chunks)


def decode(body: bytes, kind: type[T]) -> T:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as error:
        raise InvalidInput(f"body: {error}") from error
    except msgspec.DecodeError as error:
        raise InvalidInput(f"body is not valid JSON: {error}") from error


async def read_json(request: Request, kind: type[T], limit: int, *, optional: bool = False) -> T:
    body = await read_body(request, limit)
    if optional and body.strip() in (b"", b"null"):
        return decode(b"{}", kind)
    return decode(body, kind)


def path_uuid(request: Request, name: str) -> UUID:
    try:
        return UUID(request.path_params[name])
    except ValueError as error:
        raise InvalidInput(f"{name} must be a UUID", field=name) from error


def query_only(request: Request, *allowed: str) -> None:
    """Strict query: an unknown parameter is 400."""
    if unknown := sorted(set(request.query_params) - set(allowed)):
        raise InvalidInput(f"unknown query parameter {unknown[0]}", field=unknown[0])


def query_uuid(request: Request, name: str) -> UUID | None:
    raw = request.query_params.get(name)
    if raw is None:
        return None
    try:
        return UUID(raw)
    except ValueError as error:
        raise InvalidInput(f"query {name} must be a UUID", field=name) from error


def query_number(request: Request, name: str, *, low: float, high: float, default: float) -> float:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError as error:
        raise InvalidInput(f"query {name} must be a number", field=name) from error
    if not low <= value <= high:
        raise InvalidInput(f"query {name} must be between {low:g} and {high:g}", field=name)
    return value


def query_integer(request: Request, name: str, *, low: int, high: int, default: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not raw.lstrip("-").isdigit() or not low <= int(raw) <= high:
        raise InvalidInput(f"query {name} must be an integer from {low} to {high}", field=name)
    return int(raw)


def json_response(value: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_encoder.encode(value), status, headers=headers, media_type="application/json")


async def hold(request: Request, event: anyio.Event, seconds: float) -> bool:
    """Wait up to `seconds` for `event`, giving up early if the client disconnects.

    Returns True when the client disconnected. Only `http.disconnect` ends the watch; any body
    chunks still arriving are ignored (the routes that hold read their body first).
    """
    disconnected = False

    async def watch(scope: anyio.CancelScope) -> None:
        nonlocal disconnected
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                disconnected = True
                scope.cancel()
                return

    async with anyio.create_task_group() as group:
        group.start_soon(watch, group.cancel_scope)
        with anyio.move_on_after(seconds):
            await event.wait()
        group.cancel_scope.cancel()
    return disconnected
