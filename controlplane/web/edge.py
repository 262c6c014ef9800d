"""Decoding requests and encoding responses at the edge: bounded bodies, strict types, and the
input rules of docs/api.md ("Input rules") applied once, here, to every body, control-session
frame and query parameter: no NUL anywhere, bounded nesting, times and integers that PostgreSQL
can store."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any, TypeVar
from uuid import UUID

import anyio
import msgspec
from starlette.requests import HTTPConnection, Request
from starlette.responses import Response

from controlplane.errors import InvalidInput, PayloadTooLarge, Unauthorized
from controlplane.wire.common import Capabilities

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


# Nesting is measured on a skeleton of the text: its quotes and brackets only, `{}` as `[]`.
_AS_BRACKETS = bytes.maketrans(b"{}", b"[]")
_NOT_SKELETON = bytes(sorted(set(range(256)) - set(b'"[]{}')))
_RUNS = re.compile(rb"\[+|\]+")
_OPEN = ord("[")
# The only way to write NUL in JSON text (a raw NUL byte is invalid JSON; `\U` is no escape).
_NUL_ESCAPE = b"\\u0000"
# Only these years can leave datetime's range when moved to UTC (offsets are under a day).
_EDGE_YEARS = (b'"0001-', b'"9999-')
_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}")


def _skeleton(text: bytes) -> bytes:
    """The brackets of `text` that are structure, not string content, with `{}` as `[]`.

    Escapes are pairs read left to right, as a parser reads them: deleting the escaped
    backslashes, then the escaped quotes, leaves only quotes that open or close a string, and
    every other gap between them is string text. Dropping two adjacent quotes (a string with no
    bracket, or the end of one and the start of the next) keeps that parity, so most strings
    go in one C-speed replace and only those holding brackets are split out. Exact up to where
    `text` stops being JSON, which is as far as a parser gets; no pattern can backtrack here."""
    if b"\\" in text:
        text = text.replace(b"\\\\", b"").replace(b'\\"', b"")
    quoted = text.translate(_AS_BRACKETS, _NOT_SKELETON).replace(b'""', b"")
    return b"".join(quoted.split(b'"')[0::2])


def too_deep(text: bytes, limit: int) -> bool:
    """Whether arrays and objects in `text` nest more than `limit` levels. Exact for JSON; for
    text that is not JSON, at least as deep as a parser gets before it fails. Byte operations
    in C do the bulk of the work, before any parser recurses."""
    if text.count(b"[") + text.count(b"{") <= limit:
        return False
    skeleton = _skeleton(text)
    if b"[" * (limit + 1) in skeleton:
        return True
    # A pass deletes every innermost pair ("[]"), lowering the nesting by exactly one. Passes
    # are cheap per byte and each shortens the text by two bytes a pair, so they pay while
    # pairs are dense (bushy or shallow nesting); sparse pairs mean long runs of one bracket,
    # which a loop counts run by run. Either way a 1 MiB body costs tens of milliseconds at
    # worst, and a deep one is refused after the first run longer than the limit.
    passes = 0
    leaves = skeleton.count(b"[]")
    while passes < limit and leaves * 24 > len(skeleton):
        skeleton = skeleton.replace(b"[]", b"")
        passes += 1
        leaves = skeleton.count(b"[]")
    depth = passes
    for run in _RUNS.finditer(skeleton):
        if run[0][0] == _OPEN:
            depth += len(run[0])
            if depth > limit:
                return True
        else:
            depth -= len(run[0])
    return False


def _member(path: str, key: str) -> str:
    if _PLAIN_KEY.fullmatch(key):
        return f"{path}.{key}"
    return f"{path}[{_encoder.encode(key[:64]).decode()}]"


def _nul_at(value: Any, root: str) -> tuple[str, str] | None:
    """Where the first string or object key holding NUL is, and which it is. Iterative: the
    value is already depth-checked, but a walk never needs the Python stack."""
    stack: list[tuple[str, Any]] = [(root, value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                return path, "strings"
        elif isinstance(item, dict):
            if any("\x00" in key for key in item):
                return path, "object keys"
            stack.extend((_member(path, k), v) for k, v in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(item))))
    return None


def _time_out_of_range(value: Any, root: str) -> str | None:
    """The path of the first datetime that has no UTC value (year 1 east of UTC, 9999 west of
    it): PostgreSQL stores times in UTC, and the driver's conversion of one of these overflows."""
    stack: list[tuple[str, Any]] = [(root, value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, datetime):
            try:
                item.astimezone(UTC)
            except OverflowError:
                return path
        elif isinstance(item, msgspec.Struct):
            stack.extend((f"{path}.{f}", getattr(item, f)) for f in item.__struct_fields__)
        elif isinstance(item, dict):
            stack.extend((_member(path, str(k)), v) for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(item))
    return None


def screen(text: bytes, max_depth: int, where: str = "body") -> None:
    """Refuse, before typed decoding, JSON that nests deeper than `max_depth` or holds NUL in
    any string or key (PostgreSQL stores neither in text nor in jsonb). Cheap when clean: the
    walk runs only when the text has the escape, and it decides (`\\\\u0000` is no NUL)."""
    if too_deep(text, max_depth):
        raise InvalidInput(
            f"{where} nests arrays and objects deeper than {max_depth} levels", limit=max_depth
        )
    if _NUL_ESCAPE in text:
        try:
            value = msgspec.json.decode(text)
        except msgspec.DecodeError as error:
            raise InvalidInput(f"{where} is not valid JSON: {error}") from error
        if (found := _nul_at(value, where)) is not None:
            path, what = found
            raise InvalidInput(f"{path}: {what} must not contain NUL", field=path)


def screen_decoded(value: Any, text: bytes, where: str = "body") -> None:
    """Refuse, after typed decoding, times PostgreSQL cannot take (see _time_out_of_range)."""
    if not any(year in text for year in _EDGE_YEARS):
        return
    if (path := _time_out_of_range(value, where)) is not None:
        raise InvalidInput(f"{path}: the time is out of range once converted to UTC", field=path)


def decode(body: bytes, kind: type[T], *, max_depth: int) -> T:
    screen(body, max_depth)
    try:
        value = msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as error:
        raise InvalidInput(f"body: {error}") from error
    except msgspec.DecodeError as error:
        raise InvalidInput(f"body is not valid JSON: {error}") from error
    screen_decoded(value, body)
    return value


def max_json_depth(request: HTTPConnection) -> int:
    depth: int = request.app.state.settings.server.max_json_depth
    return depth


async def read_json(request: Request, kind: type[T], limit: int, *, optional: bool = False) -> T:
    body = await read_body(request, limit)
    depth = max_json_depth(request)
    if optional and body.strip() in (b"", b"null"):
        return decode(b"{}", kind, max_depth=depth)
    return decode(body, kind, max_depth=depth)


def reject_duplicate_tools(capabilities: Capabilities | None) -> None:
    """A runner's capabilities name each tool once (registration, enrollment, heartbeat)."""
    if capabilities is not None and (duplicates := capabilities.duplicate_tools()):
        raise InvalidInput("capabilities list a tool twice", duplicates=duplicates)


def path_uuid(request: Request, name: str) -> UUID:
    try:
        return UUID(request.path_params[name])
    except ValueError as error:
        raise InvalidInput(f"{name} must be a UUID", field=name) from error


def query_only(request: Request, *allowed: str) -> None:
    """Strict query: an unknown parameter is 400."""
    if unknown := sorted(set(request.query_params) - set(allowed)):
        raise InvalidInput(f"unknown query parameter {unknown[0]}", field=unknown[0])


def query_value(request: Request, name: str, *, code: str | None = None) -> str | None:
    """A query parameter's value, None when absent. Empty or holding NUL: 400, with `code`
    (default `validation-error`), like any other malformed value of that parameter."""
    raw = request.query_params.get(name)
    if raw is None:
        return None
    if not raw:
        raise InvalidInput(f"query {name} must not be empty", field=name, code=code)
    if "\x00" in raw:
        raise InvalidInput(f"query {name} must not contain NUL", field=name, code=code)
    return raw


def query_uuid(request: Request, name: str) -> UUID | None:
    raw = query_value(request, name)
    if raw is None:
        return None
    try:
        return UUID(raw)
    except ValueError as error:
        raise InvalidInput(f"query {name} must be a UUID", field=name) from error


def query_number(request: Request, name: str, *, low: float, high: float, default: float) -> float:
    raw = query_value(request, name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError as error:
        raise InvalidInput(f"query {name} must be a number", field=name) from error
    if not low <= value <= high:
        raise InvalidInput(f"query {name} must be between {low:g} and {high:g}", field=name)
    return value


# ASCII digits only (str.isdigit also takes "²", which int() refuses), and few enough of them
# that int() never meets its digit limit; the range check then bounds what reaches SQL.
_INTEGER = re.compile(r"-?[0-9]{1,20}")


def query_integer(request: Request, name: str, *, low: int, high: int, default: int) -> int:
    raw = query_value(request, name)
    if raw is None:
        return default
    if not _INTEGER.fullmatch(raw) or not low <= int(raw) <= high:
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
