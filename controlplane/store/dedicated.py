"""A connection of its own, outside the pool, for state that lives as long as its session: the
leader's advisory lock (`locks.LeaderLock`) and LISTEN (actors/listener.py).

asyncpg resets a pooled connection with `pg_advisory_unlock_all()` and `UNLISTEN *`, so that state
lives on a connection that never returns to a pool, and ends with it. When the server or the
network ends the session, `wait_lost` returns and the holder must take its lock or its
subscriptions as gone. A connection can also hang without ending (a server that stopped
answering, a network dropping every packet): `probe` is the statement that finds out, under the
caller's deadline.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
import asyncpg

from controlplane.store.pool import PoolSettings, connect


class Dedicated:
    def __init__(self, conn: asyncpg.Connection) -> None:
        self.connection = conn
        self._lost = anyio.Event()
        conn.add_termination_listener(self._on_terminated)

    @classmethod
    async def open(cls, settings: PoolSettings) -> Dedicated:
        """A new session, with the pool's deadlines (pool.connect)."""
        return cls(await connect(settings))

    def _on_terminated(self, _conn: object) -> None:
        self._lost.set()

    @property
    def lost(self) -> bool:
        return self._lost.is_set() or self.connection.is_closed()

    async def wait_lost(self) -> None:
        """Return once the session has ended, whoever ended it."""
        await self._lost.wait()

    async def probe(self) -> None:
        """A round trip: raises if the session is gone; hangs while the server does."""
        await self.connection.execute("SELECT 1")

    async def listen(self, channel: str, deliver: Callable[[str], None]) -> None:
        """`LISTEN channel`: each notification's payload goes to `deliver`, on the event loop."""

        def callback(_conn: object, _pid: int, _channel: str, payload: object) -> None:
            deliver(str(payload))  # a notification's payload is text

        await self.connection.add_listener(channel, callback)

    def close(self) -> None:
        """End the session at once, without a goodbye that a hung server would never answer;
        the server then drops its locks and subscriptions."""
        self.connection.terminate()
