"""An installation walk that leaves out covered, unchanged workspaces (actors/provisioning/
changes.py) grants exactly what a full walk grants, against real PostgreSQL: two installation
provisioners, each limited to its own twin set of workspaces, go through the same changes; one
walks with the memory, the other walks everything every round, and their rounds are compared
position by position (grants, bound runners, demand figures)."""

from __future__ import annotations

import uuid
from uuid import UUID

import asyncpg
import pytest

from controlplane.actors.provisioning.changes import WalkMemory
from controlplane.actors.provisioning.rounds import RoundOutcome, installation_walk
from controlplane.domain.labels import LabelSet
from controlplane.store import provisioner_sessions
from controlplane.store.pool import Conn
from controlplane.store.provisioning import RoundTerms
from tests import provisioning as rows
from tests.store.test_demand_store import HOUR, LINUX, TTL, WalkStore, template

Shape = list[tuple[int, LabelSet, int]]  # (position in the set, labels, count)


class Twin:
    """One installation provisioner over its own workspaces."""

    def __init__(self, store: WalkStore, workspaces: list[UUID], memory: WalkMemory | None):
        self.store = store
        self.workspaces = workspaces
        self.memory = memory
        self.clock = 0.0

    async def walk(self, *, fair_share: bool) -> RoundOutcome:
        terms = RoundTerms(
            templates=(template(20),),
            max_reservations=100,
            launch_ttl=TTL,
            activation_grace=TTL,
            activation_timeout=None,
            covering_window=HOUR,
            fair_share=fair_share,
        )
        outcome = RoundOutcome(remaining=terms.templates)
        self.clock += 1
        await installation_walk(self.store, terms, outcome, self.memory, self.clock)
        return outcome

    def shape(self, outcome: RoundOutcome) -> tuple[Shape, Shape]:
        """Grants and demand figures by position, comparable between the twins."""
        at = {w: i for i, w in enumerate(self.workspaces)}
        grants = [(at[g.workspace_id], g.labels, g.count) for g in outcome.grants]
        figures = [
            (at[s.workspace_id], s.labels, s.queued * 1000 + s.reserved) for s in outcome.stats
        ]
        return grants, figures


async def twins(pool: asyncpg.Pool, conn: Conn, count: int) -> tuple[Twin, Twin]:
    """Two provisioners, each over `count` workspaces with one job each, the sets' demand
    interleaved in age (the k-th of each set as old as the other's)."""
    sets: tuple[list[UUID], list[UUID]] = ([], [])
    for _ in range(count):
        for members in sets:
            workspace_id = uuid.uuid4()
            await rows.pending_jobs(conn, workspace_id, LINUX, 1)
            members.append(workspace_id)
    made = []
    for members, memory in zip(sets, (WalkMemory(full_walk_seconds=3600), None), strict=True):
        inst = await rows.provisioner(conn)
        generation = await provisioner_sessions.take_over(conn, inst.id, uuid.uuid4())
        assert generation is not None
        made.append(Twin(WalkStore(pool, inst, generation, members, None), members, memory))
    return made[0], made[1]


async def same_round(pair: tuple[Twin, Twin], *, fair_share: bool) -> tuple[RoundOutcome, Shape]:
    changed_only, full = pair
    left = await changed_only.walk(fair_share=fair_share)
    right = await full.walk(fair_share=fair_share)
    assert changed_only.shape(left) == full.shape(right)
    assert not right.unchanged
    return left, changed_only.shape(left)[0]


@pytest.mark.parametrize("fair_share", [False, True])
async def test_a_walk_of_what_changed_grants_what_a_full_walk_grants(
    pool: asyncpg.Pool, conn: Conn, fair_share: bool
) -> None:
    pair = await twins(pool, conn, 4)
    both = [(a, b) for a, b in zip(pair[0].workspaces, pair[1].workspaces, strict=True)]

    async def to_both(statement: str, position: int) -> None:
        for workspace_id in both[position]:
            await conn.execute(statement, workspace_id)

    # Round 1 walks everything (a first round is a full walk): one unit each.
    outcome, grants = await same_round(pair, fair_share=fair_share)
    assert grants == [(i, LINUX, 1) for i in range(4)] and not outcome.unchanged

    # Nothing changed: the memory leaves every workspace out, the full walk grants nothing.
    outcome, grants = await same_round(pair, fair_share=fair_share)
    assert grants == [] and outcome.unchanged == pair[0].workspaces

    # Demand grows in the second (notified), the third's reservation expires, the fourth's is
    # given back (a failed push deletes it): no notification for either, the fingerprint shows.
    for workspace_id in both[1]:
        await rows.pending_jobs(conn, workspace_id, LINUX, 2)
    assert pair[0].memory is not None
    pair[0].memory.changed(both[1][0])
    await to_both(
        "UPDATE reservations SET expires_at = now() - interval '1 second' WHERE workspace_id = $1",
        2,
    )
    await to_both("DELETE FROM reservations WHERE workspace_id = $1", 3)
    outcome, grants = await same_round(pair, fair_share=fair_share)
    assert outcome.unchanged == [pair[0].workspaces[0]]
    assert {i for i, _, _ in grants} == {1, 2, 3}

    # A pause leaves the list; the resumed workspace is walked again. A lost notification (new
    # demand in the first, not told) waits for the resync a reconnected listener asks for.
    await to_both(
        "INSERT INTO paused_workspaces (workspace_id, paused_by) VALUES ($1, gen_random_uuid())", 0
    )
    outcome, grants = await same_round(pair, fair_share=fair_share)
    assert grants == [] and pair[0].workspaces[0] not in outcome.unchanged
    await to_both("DELETE FROM paused_workspaces WHERE workspace_id = $1", 0)
    for workspace_id in both[0]:
        await rows.pending_jobs(conn, workspace_id, LINUX, 1)
    outcome, grants = await same_round(pair, fair_share=fair_share)
    assert (0, LINUX, 1) in grants
    for workspace_id in both[2]:
        await rows.pending_jobs(conn, workspace_id, LINUX, 1)
    pair[0].memory.resync()
    outcome, grants = await same_round(pair, fair_share=fair_share)
    assert outcome.unchanged == [] and (2, LINUX, 1) in grants
