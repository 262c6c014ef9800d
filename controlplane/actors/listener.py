"""LISTEN/NOTIFY on one dedicated connection per replica.

The connection is checked every `check_seconds` (a cheap SELECT 1 with a deadline) and re-opened
with backoff when it is lost. Notifications sent while it was down are gone, so after every
(re)connect `on_connect` runs: the dispatcher wakes every actor and the cancel board wakes every
held heartbeat, and each re-checks the database.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import anyio
import anyio.abc
import asyncpg

from controlplane.store.pool import PoolSettings, connect

log = logging.getLogger("controlplane.listener")

Handler = Callable[[str], None]


class Listener:
    def __init__(
        self,
        settings: PoolSettings,
        handlers: Mapping[str, Handler],
        on_connect: Callable[[], None],
        *,
        check_seconds: float = 1.0,
    ) -> None:
        self._settings = settings
        self._handlers = dict(handlers)
        self._on_connect = on_connect
        self._check = check_seconds
        self.connected = False
        self.reconnects = 0

    def _callback(self, handler: Handler) -> Callable[..., None]:
        def deliver(_conn: object, _pid: int, _channel: str, payload: str) -> None:
            try:
                handler(payload)
            except Exception:
                log.exception("listener.handler_failed")

        return deliver

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        started = False
        backoff = 0.05
        while True:
            conn: asyncpg.Connection | None = None
            try:
                with anyio.fail_after(max(self._check * 5, 5)):
                    conn = await connect(self._settings)
                    for channel, handler in self._handlers.items():
                        await conn.add_listener(channel, self._callback(handler))
                lost = anyio.Event()
                conn.add_termination_listener(lambda _conn, lost=lost: lost.set())
                self.connected = True
                self._on_connect()
                backoff = 0.05
                if not started:
                    task_status.started()
                    started = True
                while not lost.is_set():
                    with anyio.move_on_after(self._check):
                        await lost.wait()
                    if not lost.is_set():
                        with anyio.fail_after(self._check * 2):
                            await conn.execute("SELECT 1")
            except Exception as error:
                log.warning("listener.lost", extra={"error": repr(error)})
            finally:
                if self.connected:
                    self.reconnects += 1
                self.connected = False
                if conn is not None:
                    conn.terminate()
            await anyio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)
