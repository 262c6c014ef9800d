"""Held event-feed reads on this replica, and the one task that tells them when to read again.

A held read (`GET /v1/events?wait=...`) reads once, then parks on its scope: a workspace, or
None for an installation-wide key, which reads every workspace. It reads again only when woken.
The watcher, one per replica, is what asks the database: when poked (a `cp_events` NOTIFY, a
claim or completion committed on this replica, a listener reconnect) and once every
`recheck_seconds` while any read is held, it reads which workspaces' feeds grew past the mark it
last saw, and wakes the reads of those workspaces (and the installation-wide ones). So a replica
with a thousand held reads runs one cheap statement per re-check, not a thousand, and a read is
re-run only when its feed may hold something new.

The periodic re-check is the only path for two kinds of event: claims and completions committed
on another replica (they do not NOTIFY; store/events.py says why), and events that were hidden
behind an older open transaction when they were notified (the feed shows only the stable prefix).

Correctness of a wake: a read takes its scope's wake-up before it reads, and the watcher's mark
comes from a snapshot older than that read. An event the read missed was not yet stable in its
snapshot, so it sorts past the mark (the stable prefix only grows at its end), and the first
check that sees it stable ran after the read took its wake-up: it reports the event and sets
that wake-up. With no read held the watcher stops checking and forgets its mark (it would go
stale); the first read held after that reads a fresh mark before its own first read.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator
from uuid import UUID

import anyio
import anyio.abc
import asyncpg

from controlplane import metrics
from controlplane.errors import RateLimited
from controlplane.store import events

log = logging.getLogger("controlplane.feed")

Scope = UUID | None  # a workspace, or None for an installation-wide read


class FeedWatch:
    def __init__(self, pool: asyncpg.Pool, *, recheck_seconds: float, held_per_key: int) -> None:
        self._pool = pool
        self._recheck = recheck_seconds
        self._cap = held_per_key
        self._by_key: Counter[UUID] = Counter()
        self._by_scope: Counter[Scope] = Counter()
        self._wakes: dict[Scope, anyio.Event] = {}
        self._poked = anyio.Event()
        self._busy = anyio.Event()
        self._mark: tuple[int, int] | None = None
        self._marking = anyio.Lock()
        self.held = 0
        self.checks = 0

    @contextlib.asynccontextmanager
    async def hold(self, key_id: UUID, scope: Scope) -> AsyncIterator[None]:
        """Count a held read against its key's cap on this replica (RateLimited beyond it), and
        make sure the watcher has a mark older than the read's first snapshot."""
        if self._by_key[key_id] >= self._cap:
            raise RateLimited(
                f"this key already holds {self._cap} event-feed reads on this replica",
                retry_after_seconds=1,
            )
        self._by_key[key_id] += 1
        self._by_scope[scope] += 1
        self.held += 1
        metrics.event_reads_held.inc()
        self._busy.set()
        try:
            if self._mark is None:
                async with self._marking:  # reads held at once share one query
                    if self._mark is None:
                        async with self._pool.acquire() as conn:
                            self._mark = await events.stable_mark(conn)
            yield
        finally:
            self.held -= 1
            metrics.event_reads_held.dec()
            self._by_key[key_id] -= 1
            if not self._by_key[key_id]:
                del self._by_key[key_id]
            self._by_scope[scope] -= 1
            if not self._by_scope[scope]:
                del self._by_scope[scope]
                self._wakes.pop(scope, None)

    def wake_for(self, scope: Scope) -> anyio.Event:
        """Set when `scope`'s feed may have grown. Take it before reading, wait on it after."""
        wake = self._wakes.get(scope)
        if wake is None:
            wake = self._wakes[scope] = anyio.Event()
        return wake

    def poke(self) -> None:
        """Something may have been written to the feed: check now, if anyone is waiting."""
        if self.held:
            self._poked.set()

    def wake_all(self) -> None:
        """Every held read reads again (shutdown, so each answers now)."""
        self._wake(None)

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        task_status.started()
        while True:
            if not self.held:
                self._mark = None  # it goes stale while nobody waits
                self._busy = anyio.Event()
                await self._busy.wait()
            with anyio.move_on_after(self._recheck):
                await self._poked.wait()
            self._poked = anyio.Event()
            if self.held:
                await self._check()

    async def _check(self) -> None:
        mark = self._mark
        if mark is None:  # the first held read is still reading it
            return
        self.checks += 1
        try:
            async with self._pool.acquire() as conn:
                newest, grown = await events.grown_since(conn, mark)
        except Exception as error:  # held reads answer at their deadline; the next check retries
            log.warning("feed.check_failed", extra={"error": repr(error)})
            return
        self._mark = newest
        self._wake(grown)

    def _wake(self, grown: set[Scope] | None) -> None:
        """Wake the reads of the grown scopes (every read when None). An installation-wide read
        sees every workspace, so any growth wakes it."""
        if grown is None:
            scopes: list[Scope] = list(self._wakes)
        elif grown:
            scopes = [*grown, None]
        else:
            return
        for scope in scopes:
            wake = self._wakes.pop(scope, None)
            if wake is not None:
                wake.set()
