"""Held heartbeats waiting for a cancellation, by job execution, on this replica.

Reconcile and cancel-session NOTIFY `cp_cancel` with the execution id after they commit; the
listener calls `notify`, which wakes the heartbeats held for that execution. After a listener
reconnect `wake_all` makes every held heartbeat re-check the database.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from uuid import UUID

import anyio


class CancelBoard:
    def __init__(self) -> None:
        self._waiting: defaultdict[UUID, set[anyio.Event]] = defaultdict(set)

    @property
    def held(self) -> int:
        return sum(len(events) for events in self._waiting.values())

    @contextlib.contextmanager
    def watch(self, job_execution_id: UUID) -> Iterator[anyio.Event]:
        """An event set when a cancel for the execution may have happened (re-check the DB)."""
        event = anyio.Event()
        self._waiting[job_execution_id].add(event)
        try:
            yield event
        finally:
            events = self._waiting.get(job_execution_id)
            if events is not None:
                events.discard(event)
                if not events:
                    del self._waiting[job_execution_id]

    def notify(self, payload: str) -> None:
        try:
            execution = UUID(payload)
        except ValueError:
            return
        for event in self._waiting.get(execution, ()):
            event.set()

    def wake_all(self) -> None:
        for events in self._waiting.values():
            for event in events:
                event.set()
