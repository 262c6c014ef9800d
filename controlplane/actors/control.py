"""Provisioner control sessions on this replica, and the fencing row they live by.

A provisioner token has at most one live control session cluster-wide. Every accepted hello bumps
`provisioner_sessions.generation` in one statement that also NOTIFYs `cp_provisioner_takeover`
with "<provisioner_id>:<generation>". Every replica's listener hands that payload to its
`ControlSessions`, which cancels each local session of that provisioner holding an older
generation; the web handler then closes it with 4409 (superseded).

A notification can be lost (listener reconnect), so the registry is only the fast path: every
message that touches the database checks the session's generation, and a stale one is refused
and closed. Ping checks it in the statement that stamps `last_seen_at`; every write takes the
session's fencing row first. Both happen in one place, the session's store
(store/provisioning.py); the statements (take-over, fence, hold) live in
store/provisioner_sessions.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from uuid import UUID

import anyio

log = logging.getLogger("controlplane.control")

DEFAULT_IDLE_SECONDS = 60.0


@dataclass(eq=False)
class LocalSession:
    provisioner_id: UUID
    session_id: UUID
    generation: int
    scope: anyio.CancelScope
    superseded: bool = field(default=False)

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
