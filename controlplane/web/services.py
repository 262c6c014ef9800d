"""What the routes need, built once by app.py and hung on the Starlette app's state."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import anyio
import asyncpg

from controlplane.actors.assignments import AssignmentBoard
from controlplane.actors.cancels import CancelBoard
from controlplane.actors.control import ControlSessions
from controlplane.actors.dispatch import Dispatcher
from controlplane.actors.feed import FeedWatch
from controlplane.actors.listener import Listener
from controlplane.actors.provisioning import DemandBoard
from controlplane.domain import tokens
from controlplane.domain.labels import LabelSet
from controlplane.settings import Settings
from controlplane.store import credentials, migrations, queries

log = logging.getLogger("controlplane.health")


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


@dataclass(frozen=True, slots=True)
class DatabaseFacts:
    """What /readyz and /metrics report about the database."""

    database: str  # "ok", or why not
    migrations: str  # "ok", "<n> pending" or "unknown"
    depth: queries.QueueDepth | None


class DatabaseProbe:
    """The database facts, read at most once per `refresh_seconds` however many requests ask:
    a request finding them stale reads them while concurrent ones wait for that same read.
    /readyz and /metrics answer without a credential, so nothing they do may cost a query per
    request. A read is bounded by `deadline_seconds` and, on failure, cached like a success."""

    def __init__(
        self, pool: asyncpg.Pool, *, refresh_seconds: float, deadline_seconds: float = 1.0
    ) -> None:
        self._pool = pool
        self._refresh = refresh_seconds
        self._deadline = deadline_seconds
        self._lock = anyio.Lock()
        self._facts: DatabaseFacts | None = None
        self._due = 0.0
        self.reads = 0

    async def facts(self) -> DatabaseFacts:
        if self._facts is not None and anyio.current_time() < self._due:
            return self._facts
        async with self._lock:
            if self._facts is None or anyio.current_time() >= self._due:
                self._facts = await self._read()
                # Counted from the end of the read: a database that hangs for the whole
                # deadline is asked again a full interval later, not at once.
                self._due = anyio.current_time() + self._refresh
            return self._facts

    async def _read(self) -> DatabaseFacts:
        self.reads += 1
        try:
            with anyio.fail_after(self._deadline):
                async with self._pool.acquire() as conn:
                    todo = await migrations.pending(conn)
                    depth = await queries.depth(conn)
        except Exception as error:
            log.warning("health.database_unreachable", extra={"error": repr(error)})
            return DatabaseFacts(f"unreachable: {type(error).__name__}", "unknown", None)
        return DatabaseFacts("ok", "ok" if not todo else f"{len(todo)} pending", depth)


@dataclass
class Services:
    settings: Settings
    pool: asyncpg.Pool
    dispatcher: Dispatcher
    cancels: CancelBoard
    keys: KeyRing
    reserved_labels: LabelSet
    feed: FeedWatch
    probe: DatabaseProbe
    listener: Listener | None = None
    control: ControlSessions = field(default_factory=ControlSessions)
    demand: DemandBoard = field(default_factory=DemandBoard)
    assignments: AssignmentBoard = field(default_factory=AssignmentBoard)
    clock: Callable[[], datetime] = utc_now
    closing: bool = False

    @property
    def liveness_throttle(self) -> timedelta:
        return timedelta(seconds=self.settings.runners.liveness_throttle_seconds)

    def close(self) -> None:
        """Shutdown: release held heartbeats and event polls so they answer now."""
        self.closing = True
        self.cancels.wake_all()
        self.feed.wake_all()

    def signal_events(self) -> None:
        """The feed may have grown: called by the listener on `cp_events` (rare events, from any
        replica) and after this replica's own claims and completions, which do not NOTIFY (see
        store/events.py). The feed watcher checks once for all held reads (actors/feed.py)."""
        self.feed.poke()
