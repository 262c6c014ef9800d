"""What tells this replica's open pages that something changed which the event feed does not
mark: an enqueue, heard on `cp_enqueued` from any replica. The event feed (claims, cancels,
completions, audit entries) reaches the pages through actors/feed.py instead."""

from __future__ import annotations

import anyio


class Pulse:
    """Set on every change while a page watches; costs one comparison when none does (the
    listener calls it on every enqueue notification)."""

    def __init__(self) -> None:
        self._changed = anyio.Event()
        self.watchers = 0

    def poke(self) -> None:
        if self.watchers:
            self._changed.set()
            self._changed = anyio.Event()

    def changed(self) -> anyio.Event:
        """Set at the next change. Take it before reading what the page shows."""
        return self._changed
