"""The installation walk's memory (actors/provisioning/changes.py): which listed workspaces a
round may leave out, and when it must walk them all."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from controlplane.actors.provisioning.changes import WalkMemory
from controlplane.domain.demand import Allocation, DemandStat
from controlplane.domain.rounds import Grant, WalkEntry, WorkspaceRound

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def walked(workspace_id: uuid.UUID, *, covered: bool, after: int | None = None) -> WorkspaceRound:
    stats = (DemandStat(("linux",), 1, 1, NOW),)
    grant = Grant(uuid.uuid4(), workspace_id, ("linux",), 1, NOW)
    allocation = Allocation(stats, (), (), 0, 0)
    return WorkspaceRound(
        workspace_id, allocation, (grant,), bound=0, rebound=0, covered=covered, reservations=after
    )


def test_only_covered_unchanged_workspaces_are_left_out_and_full_walks_come_back() -> None:
    a, b, c, d = (uuid.uuid4() for _ in range(4))
    memory = WalkMemory(full_walk_seconds=60)
    entries = [WalkEntry(a, 1), WalkEntry(b, 2), WalkEntry(c, 3), WalkEntry(d, 4)]
    assert memory.plan(entries, now=0) == frozenset()  # the first round walks everything
    memory.walked(entries[0], walked(a, covered=True))
    memory.walked(entries[1], walked(b, covered=True, after=20))  # its grants: fingerprint 20
    memory.walked(entries[2], walked(c, covered=False))
    memory.walked(entries[3], None)  # busy
    assert memory.plan([*entries[:1], WalkEntry(b, 20), *entries[2:]], now=1) == {a, b}
    carried = memory.carried(b)
    assert (
        carried.grants == ()
        and carried.allocation.stats == walked(b, covered=True).allocation.stats
    )

    memory.changed(a)  # a notification
    assert memory.plan([*entries[:1], WalkEntry(b, 21), *entries[2:]], now=2) == frozenset()
    memory.walked(entries[0], walked(a, covered=True))
    assert memory.plan([entries[0]], now=3) == {a}
    assert memory.plan([], now=4) == frozenset()  # left the list (paused): forgotten
    assert memory.plan([entries[0]], now=5) == frozenset()

    memory.walked(entries[0], walked(a, covered=True))
    assert memory.plan([entries[0]], now=6) == {a}
    memory.resync()
    assert memory.plan([entries[0]], now=7) == frozenset()
    memory.walked(entries[0], walked(a, covered=True))
    assert memory.plan([entries[0]], now=66) == {a}
    assert memory.plan([entries[0]], now=67.5) == frozenset()  # a full walk every 60 s


def test_a_notice_stays_until_its_workspace_is_walked_or_leaves_the_list() -> None:
    a, b, c = (uuid.uuid4() for _ in range(3))
    memory = WalkMemory(full_walk_seconds=60)
    for workspace_id in (a, b, c):
        memory.changed(workspace_id)
    assert memory.marked() == {a, b, c}
    memory.plan([WalkEntry(a, 1), WalkEntry(b, 2)], now=0)  # c has no demand left: dropped
    memory.changed(b)  # noted while the round runs: its transaction may not have seen it
    memory.walked(WalkEntry(a, 1), walked(a, covered=False))
    memory.walked(WalkEntry(b, 2), walked(b, covered=False))
    assert memory.marked() == {b}  # a was walked; b's later notice waits for the next round

    memory.changed(a)
    assert memory.marked() == {a, b}
    memory.plan([WalkEntry(a, 1), WalkEntry(b, 2)], now=1)
    memory.walked(WalkEntry(a, 1), None)  # busy: still to walk
    assert memory.marked() == {a, b}  # b was not reached (nothing left to give it)
