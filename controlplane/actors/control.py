"""Provisioner control sessions on this replica, and the fencing row they live by.

A provisioner token has at most one live control session cluster-wide. Every accepted hello bumps
`provisioner_sessions.generation` in one statement that also NOTIFYs `cp_provisioner_takeover`
with "<provisioner_id>:<generation>". Every replica's listener hands that payload to its
`ControlSessions`, which cancels each local session of that provisioner holding an older
generation; the web handler then closes it with 4409 (superseded).

A notification can be lost (listener reconnect), so the registry is only the fast path: every
message that touches the database checks the session's generation, and a stale one is refused
and closed. Every write takes the session's fencing row first, in one place, the session's store
(store/provisioning.py); the statements (take-over, fence, hold, stamp) live in
store/provisioner_sessions.py.

A `ping` is answered at once and only marks its session seen; `LastSeen` stamps
`provisioner_sessions.last_seen_at` for every session pinged since its previous batch in ONE
statement per `provisioners.session_seen_batch_seconds`, and checks each fence on the way: a
session left out is fenced alone (`fence`), and one that lost its generation (a takeover or a
revocation whose notification was lost, an expired token) is superseded, so its socket closes
with the fence's code. An idle session's pings cost no transaction of their own.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol
from uuid import UUID

import anyio
import anyio.abc
import asyncpg

from controlplane.domain.provisioners import Fence
from controlplane.store import provisioner_sessions
from controlplane.store.pool import borrow

log = logging.getLogger("controlplane.control")

DEFAULT_IDLE_SECONDS = 60.0


@dataclass(eq=False)
class LocalSession:
    provisioner_id: UUID
    session_id: UUID
    generation: int
    scope: anyio.CancelScope
    superseded: bool = field(default=False)
    seen: bool = field(default=False)  # pinged since the last batch of `LastSeen`

    def supersede(self) -> None:
        self.superseded = True
        self.scope.cancel()


class ControlSessions:
    """The control sessions held on this replica, by provisioner. Synchronous: the listener's
    callbacks and the web handlers run on the same event loop."""

    def __init__(self, idle_seconds: float = DEFAULT_IDLE_SECONDS) -> None:
        self.idle_seconds = idle_seconds
        self._live: dict[UUID, set[LocalSession]] = {}
        self._newest: dict[UUID, int] = {}

    def register(self, session: LocalSession) -> None:
        """Add a session that won its hello; supersede at once if a newer one is already known."""
        self._live.setdefault(session.provisioner_id, set()).add(session)
        self._advance(session.provisioner_id, session.generation)

    def unregister(self, session: LocalSession) -> None:
        peers = self._live.get(session.provisioner_id)
        if peers is None:
            return
        peers.discard(session)
        if not peers:
            del self._live[session.provisioner_id]

    def take_seen(self) -> list[LocalSession]:
        """The live sessions pinged since the previous call (their marks cleared)."""
        seen = [s for peers in self._live.values() for s in peers if s.seen and not s.superseded]
        for session in seen:
            session.seen = False
        return seen

    def sessions(self, provisioner_id: UUID) -> list[LocalSession]:
        return sorted(self._live.get(provisioner_id, ()), key=lambda s: s.generation)

    def notify(self, payload: str) -> None:
        """`cp_provisioner_takeover`: "<provisioner_id>:<generation>"."""
        provisioner, _, generation = payload.partition(":")
        try:
            provisioner_id, newest = UUID(provisioner), int(generation)
        except ValueError:
            log.warning("control.bad_takeover_payload", extra={"payload": payload[:100]})
            return
        self._advance(provisioner_id, newest)

    def _advance(self, provisioner_id: UUID, generation: int) -> None:
        newest = max(self._newest.get(provisioner_id, 0), generation)
        self._newest[provisioner_id] = newest
        for session in self._live.get(provisioner_id, ()):
            if session.generation < newest and not session.superseded:
                session.supersede()


class SeenStore(Protocol):
    async def stamp(self, sessions: Sequence[tuple[UUID, int]]) -> set[tuple[UUID, int]]:
        """Stamp those still current (one statement); the pairs stamped."""
        ...

    async def current(self, provisioner_id: UUID, generation: int) -> bool:
        """Stamp one session alone if it still holds its generation; whether it does."""
        ...


class LastSeen:
    """The replica's batch of pinged sessions' last-seen stamps (see the module's docstring)."""

    def __init__(self, registry: ControlSessions, store: SeenStore, *, every: float) -> None:
        self._registry = registry
        self._store = store
        self._every = every

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        task_status.started()
        while True:
            await anyio.sleep(self._every)
            try:
                await self.flush()
            except Exception as error:
                log.warning("control.last_seen_failed", extra={"error": repr(error)})

    async def flush(self) -> list[LocalSession]:
        """One batch; the sessions found fenced (now superseded)."""
        seen = self._registry.take_seen()
        if not seen:
            return []
        stamped = await self._store.stamp([(s.provisioner_id, s.generation) for s in seen])
        lost = []
        for session in seen:
            key = (session.provisioner_id, session.generation)
            if key not in stamped and not await self._store.current(*key):
                lost.append(session)
        for session in lost:
            log.info(
                "control.fence_lost",
                extra={
                    "provisioner_id": str(session.provisioner_id),
                    "generation": session.generation,
                },
            )
            session.supersede()
        return lost


class PoolSeen:
    """`LastSeen`'s view of the store: the batch stamp, and one session's fence alone."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def stamp(self, sessions: Sequence[tuple[UUID, int]]) -> set[tuple[UUID, int]]:
        async with borrow(self._pool) as conn:
            return await provisioner_sessions.stamp_seen(conn, sessions)

    async def current(self, provisioner_id: UUID, generation: int) -> bool:
        async with borrow(self._pool) as conn:
            verdict = await provisioner_sessions.fence(conn, provisioner_id, generation)
        return verdict is Fence.CURRENT
