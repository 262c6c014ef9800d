"""The runner sessions this replica heard were paused (NOTIFY `cp_paused`, store/pauses.py), so
that their job requests are answered "paused" at once instead of parking.

Only a courtesy to people: the claim statements refuse a paused session by themselves. So when in
doubt it forgets: after a listener reconnect (a resume may have been missed, and a runner wrongly
held "paused" could never learn otherwise) and past `MAX_SESSIONS`; a forgotten paused session's
requests park and find nothing until its next pause is heard.
"""

from __future__ import annotations

from uuid import UUID

MAX_SESSIONS = 100_000


class PausedSessions:
    def __init__(self) -> None:
        self._sessions: set[UUID] = set()

    def holds(self, runner_session_id: UUID) -> bool:
        return runner_session_id in self._sessions

    def note(self, runner_session_id: UUID, paused: bool) -> None:
        if not paused:
            self._sessions.discard(runner_session_id)
            return
        if len(self._sessions) >= MAX_SESSIONS:
            self._sessions.clear()
        self._sessions.add(runner_session_id)

    def forget(self) -> None:
        self._sessions.clear()
