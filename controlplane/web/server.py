"""The HTTP server: uvicorn with the httptools parser and the connection limits of
web/connection_limits.py, bound to the daemon's socket, stopped by the daemon (`Server.exit`)
rather than by signals of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator
from dataclasses import replace

import uvicorn
from starlette.types import ASGIApp

from controlplane.settings import Settings
from controlplane.web.connection_limits import (
    BACKLOG,
    ConnectionLimits,
    LimitedConfig,
    LimitedHttpProtocol,
    LimitedWebSocketProtocol,
    descriptor_cap,
)

log = logging.getLogger("controlplane.server")

# Descriptors the daemon needs besides client connections: its pool, the LISTEN and leadership
# connections, log and library files.
_RESERVED_DESCRIPTORS = 64
_SHUTDOWN_POLL_SECONDS = 0.005


class Server(uvicorn.Server):
    """uvicorn without its own signal handling (the daemon decides when to stop: `exit()`) and
    without its waits on a 0.1 s clock: uvicorn notices `should_exit` at its next 0.1 s tick,
    then pauses 0.1 s and polls every 0.1 s for connections to close. Here `exit()` wakes the
    loop at once and the shutdown polls every `_SHUTDOWN_POLL_SECONDS`, so a stop costs what the
    connections in flight need, not up to 0.3 s of clock. The Date header still turns each second.
    """

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._exiting = asyncio.Event()

    def exit(self) -> None:
        self.should_exit = True
        self._exiting.set()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def main_loop(self) -> None:
        # uvicorn's on_tick refreshes the Date header when its counter is a multiple of 10: here
        # every call is a second apart (or the exit), so each one passes 0.
        while not await self.on_tick(0):
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self._exiting.wait()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        state = self.server_state
        for connection in list(state.connections):
            connection.shutdown()  # idle ones close now, busy ones after their response
        try:
            async with asyncio.timeout(self.config.timeout_graceful_shutdown):
                # ASYNC110: uvicorn's connection and task sets say nothing when they shrink.
                while state.connections or state.tasks:  # noqa: ASYNC110
                    await asyncio.sleep(_SHUTDOWN_POLL_SECONDS)
        except TimeoutError:
            log.warning("shutdown.grace_exceeded", extra={"tasks": len(state.tasks)})
            for task in state.tasks:
                task.cancel()
        for server in self.servers:
            await server.wait_closed()
        await self.lifespan.shutdown()


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio sets TCP_NODELAY on accepted connections only when it does,
    # and without it a response written as headers + body waits out the client's delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(BACKLOG)
    sock.setblocking(False)
    return sock


def build(app: ASGIApp, settings: Settings) -> Server:
    limits = ConnectionLimits.of(settings)
    cap = descriptor_cap(
        limits.max_connections, settings.database.pool_max_size + _RESERVED_DESCRIPTORS
    )
    if cap != limits.max_connections:
        limits = replace(limits, max_connections=cap)
    config = LimitedConfig(
        app,
        limits,
        http=LimitedHttpProtocol,
        ws=LimitedWebSocketProtocol,
        ws_max_size=limits.websocket_max_message_bytes,
        backlog=BACKLOG,
        log_config=None,
        access_log=False,
        lifespan="off",
        proxy_headers=False,  # nothing here reads the client address
        timeout_graceful_shutdown=int(settings.server.shutdown_grace_seconds),
        timeout_keep_alive=limits.keep_alive_seconds,
    )
    return Server(config)
