"""What the routes need, built once by app.py and hung on the Starlette app's state."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import anyio
import asyncpg

from controlplane.actors.assignments import AssignmentBoard
from controlplane.actors.cancels import CancelBoard
from controlplane.actors.control import ControlSessions
from controlplane.actors.dispatch import Dispatcher
from controlplane.actors.listener import Listener
from controlplane.actors.provisioning import DemandBoard
from controlplane.domain import tokens
from controlplane.domain.labels import LabelSet
from controlplane.settings import Settings
from controlplane.store import credentials


def utc_now() -> datetime:
    return datetime.now(UTC)


class KeyRing:
    """Signing keys cached in memory; an unknown key id triggers at most one reload a second."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool
        self._keys: dict[str, tokens.SigningKey] = {}
        self._current: tokens.SigningKey | None = None
        self._loaded_at = -1.0

    async def load(self) -> None:
        async with self._pool.acquire() as conn:
            self._current = await credentials.current_signing_key(conn)
            self._keys = await credentials.signing_keys(conn)
        self._loaded_at = anyio.current_time()

    @property
    def current(self) -> tokens.SigningKey:
        assert self._current is not None, "KeyRing.load() first"
        return self._current

    async def keys_for(self, token: str) -> dict[str, tokens.SigningKey]:
        kid = token.split("_", 2)[-1].split(".", 1)[0]
        if kid not in self._keys and anyio.current_time() - self._loaded_at > 1.0:
            await self.load()
        return self._keys


@dataclass
class Services:
    settings: Settings
    pool: asyncpg.Pool
    dispatcher: Dispatcher
    cancels: CancelBoard
    keys: KeyRing
    reserved_labels: LabelSet
    listener: Listener | None = None
    control: ControlSessions = field(default_factory=ControlSessions)
    demand: DemandBoard = field(default_factory=DemandBoard)
    assignments: AssignmentBoard = field(default_factory=AssignmentBoard)
    clock: Callable[[], datetime] = utc_now
    events_changed: anyio.Event = field(default_factory=anyio.Event)
    closing: bool = False

    @property
    def liveness_throttle(self) -> timedelta:
        return timedelta(seconds=self.settings.runners.liveness_throttle_seconds)

    def close(self) -> None:
        """Shutdown: release held heartbeats and event polls so they answer now."""
        self.closing = True
        self.cancels.wake_all()
        self.signal_events()

    def signal_events(self) -> None:
        """Wake this replica's event-feed long-polls: called by the listener on `cp_events`
        (rare events, from any replica) and after this replica's own claims and completions,
        which do not NOTIFY (see store/events.py)."""
        self.events_changed.set()
        self.events_changed = anyio.Event()
