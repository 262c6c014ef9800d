"""LISTEN/NOTIFY on one dedicated connection per replica (store/dedicated.py).

The connection is probed every `check_seconds` (a round trip with a deadline) and re-opened with
backoff when it is lost: 0.05 s, doubling to at most 2 s, back to 0.05 s after a connection that
worked. Notifications sent while it was down are gone, so after every (re)connect `on_connect`
runs: the dispatcher wakes every actor and the cancel board wakes every held heartbeat, and each
re-checks the database.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

import anyio
import anyio.abc

from controlplane.retry import Backoff
from controlplane.store.dedicated import Dedicated
from controlplane.store.pool import PoolSettings

log = logging.getLogger("controlplane.listener")

Handler = Callable[[str], None]


class Subscription(Protocol):
    """One LISTEN session (`store.dedicated.Dedicated`)."""

    async def listen(self, channel: str, deliver: Handler) -> None: ...

    async def wait_lost(self) -> None: ...

    async def probe(self) -> None: ...

    def close(self) -> None: ...


class Listener:
    def __init__(
        self,
        settings: PoolSettings,
        handlers: Mapping[str, Handler],
        on_connect: Callable[[], None],
        *,
        check_seconds: float = 1.0,
        connect: Callable[[], Awaitable[Subscription]] | None = None,
    ) -> None:
        self._connect = connect or (lambda: Dedicated.open(settings))
        self._handlers = dict(handlers)
        self._on_connect = on_connect
        self._check = check_seconds
        self.connected = False
        self.reconnects = 0

    def _guarded(self, handler: Handler) -> Handler:
        def deliver(payload: str) -> None:
            try:
                handler(payload)
            except Exception:
                log.exception("listener.handler_failed")

        return deliver

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        started = False
        retry = Backoff(0.05, 2.0)
        while True:
            session: Subscription | None = None
            try:
                with anyio.fail_after(max(self._check * 5, 5)):
                    session = await self._connect()
                    for channel, handler in self._handlers.items():
                        await session.listen(channel, self._guarded(handler))
                self.connected = True
                self._on_connect()
                retry.reset()
                if not started:
                    task_status.started()
                    started = True
                await self._watch(session)
            except Exception as error:
                log.warning("listener.lost", extra={"error": repr(error)})
            finally:
                if self.connected:
                    self.reconnects += 1
                self.connected = False
                if session is not None:
                    session.close()
            await anyio.sleep(retry.next())

    async def _watch(self, session: Subscription) -> None:
        """Return when the session ends; raise when a probe fails or outlives its deadline."""
        while True:
            with anyio.move_on_after(self._check):
                await session.wait_lost()
                return
            with anyio.fail_after(self._check * 2):
                await session.probe()
