"""Requests parked on this replica until a notification names what they wait for, by UUID:
the held heartbeats of actors/cancels.py and the assignment polls of actors/assignments.py.

`notify` (the listener calls it with a NOTIFY payload) wakes the requests parked for the id it
names, so they re-read the database at once; `wake_all` (after a listener reconnect, or at
shutdown) makes every one re-check. A lost notification only delays a request until its next
re-check.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from uuid import UUID

import anyio


class WakeBoard:
    def __init__(self) -> None:
        self._waiting: defaultdict[UUID, set[anyio.Event]] = defaultdict(set)

    @property
    def parked(self) -> int:
        return sum(len(events) for events in self._waiting.values())

    @contextlib.contextmanager
    def watch(self, key: UUID) -> Iterator[anyio.Event]:
        """An event set when what `key` names may have changed (re-check the database). Arm it
        before reading, so a change committed between the read and the wait is not lost."""
        event = anyio.Event()
        self._waiting[key].add(event)
        try:
            yield event
        finally:
            events = self._waiting.get(key)
            if events is not None:
                events.discard(event)
                if not events:
                    del self._waiting[key]

    def notify(self, payload: str) -> None:
        try:
            key = UUID(payload)
        except ValueError:
            return
        for event in self._waiting.get(key, ()):
            event.set()

    def wake_all(self) -> None:
        for events in self._waiting.values():
            for event in events:
                event.set()
