"""The limits a connection meets before any route (or credential check) sees it, as uvicorn
protocols and config for the HTTP server (web/server.py, uvicorn with the httptools parser).

- the request head (request line and headers) is at most `max_header_bytes`; beyond it the
  client gets 431 and the connection is closed. httptools keeps no such limit and buffers a
  header until its end, so the bytes are counted here, as they arrive, and the parser is never
  fed more than the limit;
- the head must be complete within `header_read_timeout_seconds` of the connection opening or
  of the first byte of the next request on a kept-alive connection, else the connection is
  closed (a slowloris holds a descriptor only that long);
- a request's body must be complete within `body_read_timeout_seconds` of its head, else the
  client gets 408 (or, once a response has begun, the connection is closed). Only a body that
  does not arrive in the head's own read arms the timer, so most requests never pay for it;
- at most `max_connections` connections are open per replica. At the cap a new connection
  closes the one that has waited longest without a request in progress (half-open, or idle
  between requests); when every connection is working, the new one gets 503 and is closed;
- WebSocket messages are at most `websocket_max_message_bytes`: websockets checks a frame's
  length from its header, so a bigger frame is refused with close code 1009 before its payload
  is read; reading stops there, so the rest is never buffered.

A refusal that answers (431, 1009) shuts our side of the connection, stops reading, and closes
`_LINGER_SECONDS` later (see _Linger).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import msgspec
import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from uvicorn.server import ServerState

from controlplane import metrics
from controlplane.domain.fields import by_name
from controlplane.settings import Settings
from controlplane.wire.common import ErrorBody, ErrorEnvelope

log = logging.getLogger("controlplane.server")

# The kernel's accept queue (asyncio's own loop also accepts up to this many in one go): the
# descriptor budget counts a full queue on top of the cap, accepted before any is refused.
BACKLOG = 2048
_LINGER_SECONDS = 1.0
_CAP_LOG_INTERVAL_SECONDS = 60.0


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    max_connections: int
    max_header_bytes: int
    header_read_timeout_seconds: float
    body_read_timeout_seconds: float
    keep_alive_seconds: int
    websocket_max_message_bytes: int

    @classmethod
    def of(cls, settings: Settings) -> ConnectionLimits:
        return by_name(cls, settings.server)


def _canned(status: int, reason: str, code: str, message: str, **details: Any) -> bytes:
    """A whole response, written by the protocol itself: there is no request for the app."""
    body = msgspec.json.encode(
        ErrorEnvelope(error=ErrorBody(code=code, message=message, details=details))
    )
    extra = "retry-after: 1\r\n" if status == 503 else ""
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n{extra}connection: close\r\n\r\n"
    )
    return head.encode() + body


class ConnectionGate:
    """The open connections of one replica, and which of them may be closed to make room.

    A connection is `waiting` from its opening, and again after each response, until its next
    request head is complete; then it is working (a request in progress, a parked long-poll, a
    WebSocket session). Waiting connections are kept in the order they started waiting.
    """

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._open: set[asyncio.BaseTransport] = set()
        self._waiting: dict[asyncio.BaseTransport, None] = {}
        self._evicted = 0
        self._refused = 0
        self._logged_at = -_CAP_LOG_INTERVAL_SECONDS

    def admit(self, transport: asyncio.BaseTransport) -> bool:
        if len(self._open) >= self.cap:
            if not self._waiting:
                self._refused += 1
                metrics.connections_closed.labels("refused").inc()
                self._report()
                return False
            oldest = next(iter(self._waiting))
            self.release(oldest)
            oldest.close()
            self._evicted += 1
            metrics.connections_closed.labels("evicted").inc()
            self._report()
        self._open.add(transport)
        self._waiting[transport] = None
        return True

    def working(self, transport: asyncio.BaseTransport) -> None:
        self._waiting.pop(transport, None)

    def waiting(self, transport: asyncio.BaseTransport) -> None:
        if transport in self._open:
            self._waiting[transport] = None

    def release(self, transport: asyncio.BaseTransport) -> None:
        self._open.discard(transport)
        self._waiting.pop(transport, None)

    def _report(self) -> None:
        # At most one line a minute however hard the cap is hit.
        now = time.monotonic()
        if now - self._logged_at < _CAP_LOG_INTERVAL_SECONDS:
            return
        self._logged_at = now
        log.warning(
            "server.connection_cap_reached",
            extra={"cap": self.cap, "evicted": self._evicted, "refused": self._refused},
        )


class LimitedConfig(uvicorn.Config):
    """uvicorn's Config, carrying our limits and the gate to the protocols it creates."""

    def __init__(self, app: ASGIApp, limits: ConnectionLimits, **options: Any) -> None:
        super().__init__(app, **options)
        self.limits = limits
        self.gate = ConnectionGate(limits.max_connections)
        self.head_too_large = _canned(
            431,
            "Request Header Fields Too Large",
            "header-too-large",
            f"the request line and headers exceed {limits.max_header_bytes} bytes",
            limit=limits.max_header_bytes,
        )
        self.body_too_slow = _canned(
            408,
            "Request Timeout",
            "body-timeout",
            f"the request body was not complete within {limits.body_read_timeout_seconds:g} s "
            "of its head",
            limit_seconds=limits.body_read_timeout_seconds,
        )
        self.over_capacity = _canned(
            503,
            "Service Unavailable",
            "too-many-connections",
            f"this replica is at its limit of {limits.max_connections} open connections; retry",
            limit=limits.max_connections,
        )


class _Linger:
    """After an answered refusal: our side is shut and reading stops; close a moment later.

    Closing at once, with the client's bytes still unread, would reset the connection, and a
    reset can destroy the answer before the client reads it. What the client still sends waits
    in the kernel's buffers, unread, costing us nothing, until the timer closes.
    """

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        if transport.can_write_eof():
            transport.write_eof()
        transport.pause_reading()
        self.timer = loop.call_later(_LINGER_SECONDS, transport.close)


class _ReadDeadline:
    """One read deadline of a connection (its head's or its body's): armed, or not. When it
    fires it is disarmed, then calls `expired`."""

    __slots__ = ("_expired", "_handle", "_loop", "_seconds")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, seconds: float, expired: Callable[[], None]
    ) -> None:
        self._loop = loop
        self._seconds = seconds
        self._expired = expired
        self._handle: asyncio.TimerHandle | None = None

    @property
    def armed(self) -> bool:
        return self._handle is not None

    def start(self) -> None:
        self._handle = self._loop.call_later(self._seconds, self._fire)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _fire(self) -> None:
        self._handle = None
        self._expired()


# Where a connection is in its current request, as far as the head limits care.
_BETWEEN = 0  # no request begun (or the last one fully read)
_HEAD = 1  # a request begun, its head not complete
_BODY = 2  # the head complete; body bytes, if any, are the app's business


class LimitedHttpProtocol(HttpToolsProtocol):
    """httptools with the head limits, the head deadline and the connection gate."""

    def __init__(self, config: uvicorn.Config, server_state: ServerState, **rest: Any) -> None:
        super().__init__(config, server_state, **rest)
        assert isinstance(config, LimitedConfig)
        self._config = config
        self._limits = config.limits
        self._gate = config.gate
        self._reading = _BETWEEN
        self._head_bytes = 0
        self._head_deadline = _ReadDeadline(
            self.loop, self._limits.header_read_timeout_seconds, self._head_too_slow
        )
        self._body_deadline = _ReadDeadline(
            self.loop, self._limits.body_read_timeout_seconds, self._body_too_slow
        )
        self._linger: _Linger | None = None
        self._upgraded = False
        self._admitted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's is one, not a subclass
        if not self._gate.admit(transport):
            # Nothing read, nothing parsed: the cheapest refusal there is.
            transport.write(self._config.over_capacity)
            transport.close()
            return
        self._admitted = True
        super().connection_made(transport)
        self._head_deadline.start()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._admitted:
            return
        self._gate.release(self.transport)
        self._head_deadline.stop()
        self._body_deadline.stop()
        if self._linger is not None:
            self._linger.timer.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._linger is not None:
            return  # refused; reading resumed by uvicorn's flow control, if at all
        limit = self._limits.max_header_bytes
        # httptools reads any buffer: past the limit, the rest is fed as a view of the read
        # (up to 256 KiB), never copied.
        rest: bytes | memoryview = data
        while rest:
            if self._reading == _BODY:
                super().data_received(cast(bytes, rest))
                break
            budget = limit - self._head_bytes
            if len(rest) <= budget:
                self._head_bytes += len(rest)
                super().data_received(cast(bytes, rest))
                break
            if budget <= 0:
                self._refuse_head()
                return
            # Feed the parser no more than the limit allows; if the head ends inside, go on.
            view = memoryview(rest)
            self._head_bytes = limit
            super().data_received(cast(bytes, view[:budget]))
            rest = view[budget:]
            if self._upgraded or self.transport.is_closing():
                return
        if self._awaiting_head() and not self._head_deadline.armed:
            self._head_deadline.start()
        elif self._reading == _BODY and not self._upgraded and not self._body_deadline.armed:
            # The head is in, its body is not: the client has this long to send the rest.
            self._body_deadline.start()

    def _awaiting_head(self) -> bool:
        if self._upgraded:
            # A WebSocket now: the bytes that follow are frames, and the head deadline is over.
            return False
        if self._reading == _HEAD:
            return True
        # Between requests with no response pending, uvicorn's keep-alive timer normally runs;
        # bytes that begin no request (blank lines) cancel it, so our deadline takes over.
        return (
            self._reading == _BETWEEN
            and (self.cycle is None or self.cycle.response_complete)
            and self.timeout_keep_alive_task is None
            and not self.transport.is_closing()
        )

    def on_message_begin(self) -> None:
        self._reading = _HEAD
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._reading = _BODY
        self._head_bytes = 0
        self._head_deadline.stop()
        self._gate.working(self.transport)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._reading = _BETWEEN
        self._body_deadline.stop()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.timeout_keep_alive_task is not None:  # idle now, not serving a pipelined one
            self._gate.waiting(self.transport)

    def handle_websocket_upgrade(self) -> None:
        # The connection keeps its place in the gate; the WebSocket protocol releases it.
        self._upgraded = True
        self._head_deadline.stop()
        super().handle_websocket_upgrade()

    def _head_too_slow(self) -> None:
        if not self.transport.is_closing():
            metrics.connections_closed.labels("header-timeout").inc()
            self.transport.close()

    def _body_too_slow(self) -> None:
        if self.transport.is_closing():
            return
        metrics.connections_closed.labels("body-timeout").inc()
        cycle = self.cycle
        if cycle is None or cycle.response_started:
            self.transport.close()
            return
        # Answer 408 ourselves. The app, still waiting for the body, is told the client left
        # (ClientDisconnect, web/errors.py), and anything it sends after is dropped by uvicorn.
        cycle.disconnected = True
        cycle.message_event.set()
        self.transport.write(self._config.body_too_slow)
        self._linger = _Linger(self.transport, self.loop)

    def _refuse_head(self) -> None:
        self._head_deadline.stop()
        metrics.connections_closed.labels("header-too-large").inc()
        if self.cycle is not None and not self.cycle.response_complete:
            # A pipelined head behind a request still being answered: no room for a 431.
            self.transport.close()
            return
        self._unset_keepalive_if_required()
        self.transport.write(self._config.head_too_large)
        self._linger = _Linger(self.transport, self.loop)


class LimitedWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's Sans-I/O websockets protocol, releasing its gate slot and lingering on 1009."""

    def __init__(self, config: uvicorn.Config, server_state: ServerState, **rest: Any) -> None:
        super().__init__(config, server_state, **rest)
        assert isinstance(config, LimitedConfig)
        self._gate = config.gate
        self._linger: _Linger | None = None

    def data_received(self, data: bytes) -> None:
        if self._linger is not None:
            return  # failed; reading resumed by uvicorn when the app drained its queue
        super().data_received(data)

    def handle_parser_exception(self) -> None:
        # websockets has failed the connection (1009 for a frame over the limit, 1002 for a
        # protocol error) and queued the close frame; send it, then linger rather than close.
        # (A frame over the limit fails as soon as its header is read: its payload never is.)
        closing = self.conn.close_sent
        code = closing.code if closing is not None else 1006
        reason = closing.reason if closing is not None else ""
        metrics.connections_closed.labels(
            "websocket-message-too-large" if code == 1009 else "websocket-protocol-error"
        ).inc()
        self.queue.put_nowait({"type": "websocket.disconnect", "code": code, "reason": reason})
        self.transport.write(b"".join(self.conn.data_to_send()))
        self.close_sent = True
        self.stop_keepalive()
        self._linger = _Linger(self.transport, self.loop)
        # uvicorn closes the transport when the app returns unless a close timer is pending.
        self.close_timer = self._linger.timer

    def connection_lost(self, exc: Exception | None) -> None:
        self._gate.release(self.transport)
        super().connection_lost(exc)


def descriptor_cap(wanted: int, reserve: int) -> int:
    """Raise the soft descriptor limit to fit `wanted` connections (plus a full accept batch
    and `reserve`); the connection cap the limit allows, `wanted` when it fits."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = wanted + BACKLOG + reserve
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return wanted
    allowed = max(1, soft - BACKLOG - reserve)
    log.warning(
        "server.max_connections_lowered",
        extra={"configured": wanted, "allowed": allowed, "descriptor_limit": soft},
    )
    return allowed
