"""Held heartbeats waiting for a cancellation, by job execution, on this replica.

Reconcile and cancel-session NOTIFY `cp_cancel` with the execution id after they commit; the
listener calls `notify`, which wakes the heartbeats held for that execution. After a listener
reconnect `wake_all` makes every held heartbeat re-check the database.
"""

from __future__ import annotations

from controlplane.actors.wakeups import WakeBoard


class CancelBoard(WakeBoard):
    """Keyed by job execution id."""
