"""Assignment long-polls parked on this replica, by runner instance.

Assignment and binding NOTIFY `reservations.ASSIGNED_CHANNEL` with the runner instance id when
they commit; the listener calls `notify`, which wakes the polls parked for that runner so they
re-read the database at once. A lost notification only delays a poll until its next re-check.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from uuid import UUID

import anyio


class AssignmentBoard:
    def __init__(self) -> None:
        self._waiting: defaultdict[UUID, set[anyio.Event]] = defaultdict(set)

    @property
    def parked(self) -> int:
        return sum(len(events) for events in self._waiting.values())

    @contextlib.contextmanager
    def watch(self, runner_instance_id: UUID) -> Iterator[anyio.Event]:
        """An event set when the runner may have been assigned (re-check the database). Arm it
        before reading, so an assignment committed between the read and the wait is not lost."""
        event = anyio.Event()
        self._waiting[runner_instance_id].add(event)
        try:
            yield event
        finally:
            events = self._waiting.get(runner_instance_id)
            if events is not None:
                events.discard(event)
                if not events:
                    del self._waiting[runner_instance_id]

    async def wait(self, runner_instance_id: UUID, seconds: float) -> bool:
        """Wait up to `seconds` for a notification; True when one came."""
        with self.watch(runner_instance_id) as event:
            with anyio.move_on_after(seconds):
                await event.wait()
            return event.is_set()

    def notify(self, payload: str) -> None:
        try:
            runner_instance_id = UUID(payload)
        except ValueError:
            return
        for event in self._waiting.get(runner_instance_id, ()):
            event.set()

    def wake_all(self) -> None:
        """After a listener reconnect: every parked poll re-checks."""
        for events in self._waiting.values():
            for event in events:
                event.set()
