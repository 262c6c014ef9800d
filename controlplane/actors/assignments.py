"""Assignment long-polls parked on this replica, by runner instance.

Assignment and binding NOTIFY `reservations.ASSIGNED_CHANNEL` with the runner instance id when
they commit; the listener calls `notify`, which wakes the polls parked for that runner so they
re-read the database at once. A lost notification only delays a poll until its next re-check.
"""

from __future__ import annotations

from controlplane.actors.wakeups import WakeBoard


class AssignmentBoard(WakeBoard):
    """Keyed by runner instance id."""
