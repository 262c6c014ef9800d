"""Which workspaces an installation provisioner's walk must visit: those whose demand may have
changed since its last round, those the last round left uncovered, and every one on a slow
periodic full walk (`provisioners.demand_full_walk_seconds`) or after a resync.

The walk lists the workspaces with demand, oldest first (store/demand_list.py reads that list
from the `workspace_demand` summary, at a cost of about the rows it lists): the 1,000 oldest, and
with them, whatever their age, every workspace notified since the walk last visited it
(`marked`), so new demand in a young workspace is walked the round its notification arrives
rather than after every older one. It stays listed so until its round commits (`walked`: a busy
one, or one the walk could give nothing, stays), or until a list that asked for it does not
hold it (no demand left that could start). The walk counts each listed
workspace for the fair share of the ones after it. It leaves out the transaction of a workspace
that is *covered and unchanged*, which could grant or bind nothing:

* covered: the last time this provisioner walked it (committed, not skipped as busy), every
  demand group was reserved in full or matched none of its templates (`domain.demand.covers`;
  a group left to the workspace's own provisioners by the covering window is never covered,
  since that changes with time alone). `allocate` grants a group `queued - reserved` at most,
  so a covered workspace's round grants nothing, binds nothing, uses none of the budget and
  draws no slot, whatever the budget, the slots left or the idle runners are.
* unchanged: nothing that could raise `queued - reserved` happened since. `queued` grows only
  when a row enters pending_jobs (enqueue, put-back, retry), or when a concurrency key frees a
  slot and one of its waiting jobs becomes startable, or when a paused workspace is resumed;
  each of those notifies `cp_enqueued` (or the pause channel) with the workspace, and the
  `DemandBoard` marks it here (`changed`). `reserved` falls when a reservation of the workspace
  expires, is given back (a first claim, a release, a failed push) or is cleaned up: the walk's
  list carries a fingerprint of the workspace's live reservations, read at the list's snapshot,
  and it must equal the one the workspace's last round left (read in that round's transaction,
  under the workspace lock, after its own grants). The templates change only with an
  advertisement, which forgets everything (`resync`). Eligibility and pauses only add or remove
  list entries, and a workspace that leaves the list is forgotten, so it is walked when it
  comes back.

A notification that arrives while a round runs is kept for the next one, and wakes the actor, so
a change that the round's list already showed but its memory did not is walked at most one round
late, exactly as a full walk that ran just before the commit would have found it a round late;
its notice stays until a round that planned after it walks the workspace or reads its figures.
(A walk also leaves out the workspaces it can give nothing because a template has no slot left,
rounds.py says why; their figures, read in one statement, are kept here under the same rule as a
covered workspace's round: carried while no notice came and the fingerprint, read in the
figures' own snapshot, is unchanged. So is the round of a walked workspace it left uncovered:
its stats are the figures a read would give after it, its own grants counted as reserved, and
its fingerprint is read after its writes; without that, the next round would run its
transaction again only to find it can give nothing (issue 16: a hot workspace's GROUP BY over
its pending rows, twice a round). Figures of a workspace whose own provisioners cover some of
its demand are not kept, since that changes with time alone.) Notifications lost while the
listener reconnects are covered by its `resync` (a full walk) and the periodic full walk. What a
skipped workspace reports in `demand` is what its last walk found (its queued count may have
fallen since, by claims, until it is walked again).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from uuid import UUID

from controlplane.domain.rounds import WalkEntry, WorkspaceRound


@dataclass
class WalkMemory:
    """One installation provisioner's memory of its walks (its actor's, not shared)."""

    full_walk_seconds: float
    _covered: dict[UUID, tuple[int, WorkspaceRound]] = field(default_factory=dict)
    # Figures read for workspaces the walk could give nothing, with their fingerprint.
    _figured: dict[UUID, tuple[int, WorkspaceRound]] = field(default_factory=dict)
    # Workspaces notified since they were last read, each with the number of its latest notice.
    _changed: dict[UUID, int] = field(default_factory=dict)
    _waiting: set[UUID] = field(default_factory=set)  # notified and not walked since
    _notices: int = 0
    _asked: int = 0  # notices up to this one were asked for by the round's list
    _planned: int = 0  # notices up to this one are seen by the round's reads
    _full_due: bool = True
    _last_full: float | None = None

    def changed(self, workspace_id: UUID) -> None:
        """The workspace's demand may have grown (a notification)."""
        self._notices += 1
        self._changed[workspace_id] = self._notices
        self._waiting.add(workspace_id)

    def resync(self) -> None:
        """Walk every workspace next round (an advertisement, a listener that reconnected)."""
        self._full_due = True

    def marked(self) -> frozenset[UUID]:
        """The workspaces the round's list must hold whatever their age: those notified and not
        walked since. Called just before the list is read."""
        self._asked = self._notices
        return frozenset(self._waiting)

    def plan(self, entries: Sequence[WalkEntry], now: float) -> frozenset[UUID]:
        """The listed workspaces this round may leave out; `now` is the monotonic clock. A
        notified workspace the list did not hold has no demand left: its notice is dropped."""
        self._planned = self._notices
        listed = {e.workspace_id: e.reservations for e in entries}
        self._changed = {
            w: notice for w, notice in self._changed.items() if w in listed or notice > self._asked
        }
        self._waiting = {w for w in self._waiting if w in listed or w in self._changed}
        if (
            self._full_due
            or self._last_full is None
            or now - self._last_full >= self.full_walk_seconds
        ):
            self._full_due = False
            self._last_full = now
            self._covered.clear()
            self._figured.clear()
            return frozenset()
        self._covered = {
            w: kept
            for w, kept in self._covered.items()
            if w not in self._changed and listed.get(w) == kept[0]
        }
        self._figured = {
            w: kept
            for w, kept in self._figured.items()
            if w not in self._changed and listed.get(w) == kept[0]
        }
        return frozenset(self._covered)

    def walked(self, entry: WalkEntry, result: WorkspaceRound | None) -> None:
        """Remember a walked workspace while it stays covered (None: skipped as busy, and
        still notified). A committed round saw every notice noted before the round planned.
        A round that left the workspace uncovered is remembered as its figures (those a read
        would give after it: its stats count its own grants as reserved), under the same rule
        as figures read, so the next round does not run its transaction again only to find
        that it can give nothing; not one that left demand to the workspace's own provisioners
        (no fingerprint)."""
        self._figured.pop(entry.workspace_id, None)
        if result is not None:
            self._seen(entry.workspace_id)
            if entry.workspace_id not in self._changed:
                self._waiting.discard(entry.workspace_id)
        if result is not None and result.covered:
            # The fingerprint the round left (its own grants included), else the list's.
            after = entry.reservations if result.reservations is None else result.reservations
            self._covered[entry.workspace_id] = (after, result)
            return
        self._covered.pop(entry.workspace_id, None)
        if result is not None and result.reservations is not None:
            self._figured[entry.workspace_id] = (result.reservations, _figures_only(result))

    def figures(self, workspace_id: UUID) -> WorkspaceRound | None:
        """Figures read in an earlier round that still hold (no notice, the same fingerprint
        since), if any."""
        kept = self._figured.get(workspace_id)
        return None if kept is None else kept[1]

    def read(self, figures: Sequence[WorkspaceRound]) -> None:
        """Figures read this round, for workspaces the walk could give nothing: they may be
        carried while nothing changes (not those without a fingerprint). The workspaces stay
        listed whatever their age until they are walked."""
        for result in figures:
            self._seen(result.workspace_id)
            if result.reservations is None:
                self._figured.pop(result.workspace_id, None)
            else:
                self._figured[result.workspace_id] = (result.reservations, result)

    def _seen(self, workspace_id: UUID) -> None:
        """A read of this round saw the workspace's notices up to the plan: drop them."""
        if self._changed.get(workspace_id, 0) <= self._planned:
            self._changed.pop(workspace_id, None)

    def carried(self, workspace_id: UUID) -> WorkspaceRound:
        """A left-out workspace's last round, with only its demand figures (nothing in it is
        granted or bound again)."""
        _, result = self._covered[workspace_id]
        return _figures_only(result)


def _figures_only(result: WorkspaceRound) -> WorkspaceRound:
    """A round with only its demand figures (nothing in it is granted or bound again)."""
    return replace(
        result,
        allocation=replace(result.allocation, reservations=(), rebound=0),
        grants=(),
        bound=0,
        rebound=0,
        terminate_intents=(),
        terminate_truncated=False,
    )
