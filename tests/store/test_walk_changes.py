"""An installation walk that leaves out covered, unchanged workspaces (actors/provisioning/
changes.py) and the workspaces it can give nothing more (rounds.py `could_give`, their figures
read in one statement) grants exactly what a full walk grants, against real PostgreSQL: two
installation provisioners, each limited to its own twin set of workspaces, go through the same
changes; one walks with the memory and the figures, the other runs every listed workspace's
transaction every round, and their rounds are compared position by position (grants, bound
runners, demand figures)."""

from __future__ import annotations

import uuid
from collections.abc import Collection, Sequence
from datetime import timedelta
from uuid import UUID

import asyncpg
import pytest

from controlplane.actors.provisioning.changes import WalkMemory
from controlplane.actors.provisioning.rounds import RoundOutcome, installation_walk
from controlplane.domain.demand import Template
from controlplane.domain.labels import LabelSet
from controlplane.domain.provisioners import Provisioner
from controlplane.domain.rounds import WalkEntry, WorkspaceRound
from controlplane.store import (
    demand,
    demand_inputs,
    demand_list,
    provisioner_sessions,
    queue,
    walk_figures,
)
from controlplane.store.pool import Conn
from controlplane.store.provisioning import RoundTerms
from tests import provisioning as rows
from tests.factories import new_job
from tests.store.test_demand_store import (
    GPU,
    HOUR,
    LINUX,
    TTL,
    X64,
    WalkStore,
    poll,
    runner_row,
    template,
)

Shape = list[tuple[int, LabelSet, int]]  # (position in the set, labels, count)


class TwinStore(WalkStore):
    """The walk's store over one twin's workspaces, listing at most `limit` by age (besides the
    notified ones). Without `figures` it reads none, so every listed workspace that is not left
    out as covered runs its transaction: with no memory, the full walk."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        inst: Provisioner,
        generation: int,
        workspaces: list[UUID],
        *,
        figures: bool,
        limit: int = 1000,
    ) -> None:
        super().__init__(pool, inst, generation, workspaces, None)
        self.figures = figures
        self.limit = limit
        self.read: list[UUID] = []  # workspaces whose figures were read, every round

    async def walk_workspaces(self, changed: Collection[UUID] = ()) -> list[WalkEntry]:
        async with self.pool.acquire() as conn:
            entries, _ = await demand_list.walk_list(
                conn, self.eligible, limit=self.limit, changed=changed
            )
            return entries

    async def walk_figures(
        self, workspace_ids: Sequence[UUID], terms: RoundTerms
    ) -> list[WorkspaceRound]:
        if not self.figures:
            return []
        self.read.extend(workspace_ids)
        return await super().walk_figures(workspace_ids, terms)


class Twin:
    """One installation provisioner over its own workspaces."""

    def __init__(self, store: TwinStore, workspaces: list[UUID], memory: WalkMemory | None):
        self.store = store
        self.workspaces = workspaces
        self.memory = memory
        self.clock = 0.0

    async def walk(
        self, *, fair_share: bool, templates: tuple[Template, ...] = (template(20),)
    ) -> RoundOutcome:
        terms = RoundTerms(
            templates=templates,
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


async def twins(
    pool: asyncpg.Pool,
    conn: Conn,
    count: int,
    *,
    labels: Sequence[LabelSet] = (),
    limit: int = 1000,
) -> tuple[Twin, Twin]:
    """Two provisioners, each over `count` workspaces with one job each (of `labels[i]`, else
    LINUX), the sets' demand interleaved in age (the k-th of each set as old as the other's).
    The first walks with the memory and the figures, its list limited to `limit` by age; the
    second is the full walk."""
    sets: tuple[list[UUID], list[UUID]] = ([], [])
    for index in range(count):
        for members in sets:
            workspace_id = uuid.uuid4()
            job = labels[index] if index < len(labels) else LINUX
            await rows.pending_jobs(conn, workspace_id, job, 1)
            members.append(workspace_id)
    made = []
    for members, remembering in zip(sets, (True, False), strict=True):
        inst = await rows.provisioner(conn)
        generation = await provisioner_sessions.take_over(conn, inst.id, uuid.uuid4())
        assert generation is not None
        store = TwinStore(
            pool,
            inst,
            generation,
            members,
            figures=remembering,
            limit=limit if remembering else 1000,
        )
        memory = WalkMemory(full_walk_seconds=3600) if remembering else None
        made.append(Twin(store, members, memory))
    return made[0], made[1]


async def same_round(
    pair: tuple[Twin, Twin], *, fair_share: bool, templates: tuple[Template, ...] = (template(20),)
) -> tuple[RoundOutcome, Shape]:
    changed_only, full = pair
    left = await changed_only.walk(fair_share=fair_share, templates=templates)
    right = await full.walk(fair_share=fair_share, templates=templates)
    assert changed_only.shape(left) == full.shape(right)
    assert not right.unchanged and not right.figured
    return left, changed_only.shape(left)[0]


async def more_jobs(
    conn: Conn, pair: tuple[Twin, Twin], position: int, labels: LabelSet, n: int
) -> None:
    """`n` more jobs in the workspace at `position` of both sets; the memory is told."""
    for twin in pair:
        await rows.pending_jobs(conn, twin.workspaces[position], labels, n)
    assert pair[0].memory is not None
    pair[0].memory.changed(pair[0].workspaces[position])


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


@pytest.mark.parametrize("fair_share", [False, True])
async def test_a_walk_runs_no_transaction_where_it_can_give_nothing_and_reports_the_same_figures(
    pool: asyncpg.Pool, conn: Conn, fair_share: bool
) -> None:
    # One gpu slot; the oldest workspace wants a gpu runner, the three after it a linux one,
    # which the idle linux runner each provisioner has could take, but binding is capped by the
    # slots too (spec 3.3 step 7): once the gpu job takes the slot, nothing more is given.
    pair = await twins(pool, conn, 4, labels=[GPU])
    idle = [await rows.runner(conn, twin.store.provisioner.id) for twin in pair]
    gpu = (template(1, GPU, key="gpu"),)
    before = [twin.store.asked for twin in pair]

    outcome, grants = await same_round(pair, fair_share=fair_share, templates=gpu)

    assert grants == [(0, GPU, 1)]
    assert outcome.figured == pair[0].workspaces[1:]  # their figures, in one statement
    assert [twin.store.asked - b for twin, b in zip(pair, before, strict=True)] == [1, 4]
    for runner_id in idle:
        assert (await runner_row(conn, runner_id))["workspace_id"] is None

    # Nothing changed: the figures are carried (no notice, the same reservations), not read.
    before = [twin.store.asked for twin in pair]
    outcome, grants = await same_round(pair, fair_share=fair_share, templates=gpu)
    assert grants == [] and outcome.figured == pair[0].workspaces[1:]
    assert pair[0].store.asked == before[0] and len(pair[0].store.read) == 3
    # A new job in the third (notified), another provisioner's reservation in the fourth (not
    # notified, its fingerprint shows): only their figures are read again.
    await more_jobs(conn, pair, 2, LINUX, 1)
    other = await rows.provisioner(conn)
    for twin in pair:
        await rows.reservation(conn, workspace_id=twin.workspaces[3], provisioner_id=other.id)
    outcome, grants = await same_round(pair, fair_share=fair_share, templates=gpu)
    assert grants == [] and pair[0].store.read[3:] == pair[0].workspaces[2:]

    # Slots free (a new advertisement, which walks everything): the idle runner is bound in
    # the first linux workspace, taking no slot, and the slots go to the next (the fourth's job
    # is reserved by the other provisioner).
    assert pair[0].memory is not None
    pair[0].memory.resync()
    more = (template(4, GPU, key="gpu"),)
    outcome, grants = await same_round(pair, fair_share=fair_share, templates=more)
    assert grants == [(2, LINUX, 2)] and outcome.figured == []
    assert outcome.bound_ids == {idle[0]}

    # Nothing left to give and nothing changed: no transaction and no read at all (every
    # workspace is covered), the same figures.
    before = [twin.store.asked for twin in pair]
    read = len(pair[0].store.read)
    outcome, grants = await same_round(pair, fair_share=fair_share, templates=more)
    assert grants == [] and pair[0].store.asked == before[0] and len(pair[0].store.read) == read


async def test_a_notified_workspace_joins_the_list_whatever_its_age(
    pool: asyncpg.Pool, conn: Conn
) -> None:
    """The remembering walk lists the 2 oldest and the notified ones, the full walk everything;
    a workspace the remembering walk does not list reports no figures, so figures are compared
    for what it lists. (Without fair share: its shares depend on the list's length.)"""
    pair = await twins(pool, conn, 2, limit=2)
    for twin in pair:
        twin.workspaces.extend([uuid.uuid4(), uuid.uuid4()])  # young ones, no demand yet

    async def both(templates: tuple[Template, ...] = (template(20),)) -> tuple[RoundOutcome, Shape]:
        left = await pair[0].walk(fair_share=False, templates=templates)
        right = await pair[1].walk(fair_share=False, templates=templates)
        (left_grants, left_figures), (right_grants, right_figures) = (
            pair[0].shape(left),
            pair[1].shape(right),
        )
        assert left_grants == right_grants
        listed = {i for i, _, _ in left_figures}
        assert left_figures == [f for f in right_figures if f[0] in listed]
        return left, left_grants

    outcome, grants = await both()
    assert grants == [(0, LINUX, 1), (1, LINUX, 1)]

    # New demand in a young workspace, younger than the list's limit: walked this round.
    await more_jobs(conn, pair, 2, LINUX, 1)
    outcome, grants = await both()
    assert grants == [(2, LINUX, 1)]
    assert outcome.unchanged == pair[0].workspaces[:2]

    # The oldest takes every slot left: the next young one, notified, is listed but given
    # nothing; it keeps its notice (walked next time), where the list alone would drop it.
    await more_jobs(conn, pair, 0, LINUX, 30)
    await more_jobs(conn, pair, 3, LINUX, 1)
    outcome, grants = await both()
    assert grants == [(0, LINUX, 17)] and pair[0].workspaces[3] in outcome.figured
    assert pair[0].memory is not None
    pair[0].memory.resync()  # a new advertisement: more slots
    outcome, grants = await both((template(40),))
    assert grants == [(0, LINUX, 13), (3, LINUX, 1)]


async def test_the_figures_are_what_a_round_with_no_budget_reports(conn: Conn) -> None:
    """`walk_figures` against the round's own read (P-30's stats-only round), workspace by
    workspace: a concurrency key's waiting jobs, demand a workspace provisioner covers, live,
    expired and other provisioners' reservations, demand no template takes, no demand at all."""
    keyed, plain, empty = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    inst = await rows.provisioner(conn)
    other = await rows.provisioner(conn)
    await queue.enqueue(conn, [new_job(keyed, list(GPU), key=("deploy", 1)) for _ in range(3)])
    await rows.pending_jobs(conn, keyed, GPU, 2)
    await rows.pending_jobs(conn, keyed, LINUX, 1)
    await rows.pending_jobs(conn, keyed, X64, 1)
    own = await rows.provisioner(conn, keyed)
    await demand_inputs.replace_templates(conn, own.id, keyed, [template(0, X64)])
    await rows.pending_jobs(conn, plain, LINUX, 4)
    await rows.pending_jobs(conn, plain, ("arm", "linux"), 1)
    await rows.reservation(conn, workspace_id=plain, provisioner_id=other.id, count=1)
    await rows.reservation(conn, workspace_id=plain, provisioner_id=inst.id, count=2)
    await rows.reservation(
        conn, workspace_id=plain, provisioner_id=other.id, count=5, ttl=-timedelta(seconds=1)
    )
    templates = (template(0, GPU, key="gpu"), template(3, X64, key="x64"), template(0))
    order = [keyed, plain, empty]

    figures = await walk_figures.walk_figures(
        conn,
        provisioner_id=inst.id,
        workspace_ids=order,
        templates=templates,
        launch_ttl=TTL,
        activation_grace=TTL,
        covering_window=HOUR,
    )

    rounds = [
        await poll(conn, inst, w, templates=templates, max_reservations=0, covering_window=HOUR)
        for w in order
    ]
    assert [f.workspace_id for f in figures] == order
    assert [f.allocation.stats for f in figures] == [r.allocation.stats for r in rounds]
    # The key admits one of its three jobs; the workspace's own x64 provisioner covers its linux
    # and x64 demand; only live reservations count; no template takes arm demand.
    assert [[(s.labels, s.queued, s.reserved) for s in f.allocation.stats] for f in figures] == [
        [(GPU, 3, 0)],
        [(LINUX, 4, 3)],
        [],
    ]
    assert (figures[1].grants, figures[1].bound, figures[1].covered) == ((), 0, False)


@pytest.mark.parametrize("fair_share", [False, True])
async def test_with_one_template_full_the_walk_reads_figures_once_a_round_gave_nothing(
    pool: asyncpg.Pool, conn: Conn, fair_share: bool
) -> None:
    """The shape of bench/installation.py's probes: the backlog's template full, a probe
    template free. A walk with a template full reads the figures only once one of its rounds
    gave nothing (before that the slots may all go to the first workspace), and from then on
    only the notified workspaces run a transaction: a walked workspace's round is carried as
    its figures, so it is not walked again only to find it can be given nothing."""
    bulk, probe = ("bulk", "linux"), ("linux", "probe")
    pair = await twins(pool, conn, 3, labels=[bulk, bulk, bulk])
    for twin in pair:
        for workspace_id in twin.workspaces:
            await rows.pending_jobs(conn, workspace_id, bulk, 1)
    templates = (template(1, bulk, key="bulk"), template(5, probe, key="probe"))
    left = pair[0].store

    _, grants = await same_round(pair, fair_share=fair_share, templates=templates)
    assert grants == [(0, bulk, 1)]
    # The second gave nothing: the figures of the rest are read, its own round's are kept.
    assert (left.asked, left.read) == (2, pair[0].workspaces[2:])

    await more_jobs(conn, pair, 2, probe, 1)
    _, grants = await same_round(pair, fair_share=fair_share, templates=templates)
    assert grants == [(2, probe, 1)]
    # The first's and the second's figures are their own rounds' (the grant reserved): only
    # the notified third runs a transaction, and nothing is read.
    assert left.asked == 3 and len(left.read) == 1

    await more_jobs(conn, pair, 2, probe, 1)
    _, grants = await same_round(pair, fair_share=fair_share, templates=templates)
    assert grants == [(2, probe, 1)]
    assert left.asked == 4 and len(left.read) == 1  # every figure carried: one transaction


async def test_a_walked_round_is_carried_as_figures_unless_it_left_demand_to_own_provisioners(
    conn: Conn,
) -> None:
    """A walk's round keeps the fingerprint it left, so the memory carries its figures to the
    next round (no notice, the same reservations); not where the workspace's own provisioner
    covers demand a template takes, which changes with time alone (as `walk_figures`)."""
    plain, covered_by_own = uuid.uuid4(), uuid.uuid4()
    inst = await rows.provisioner(conn)
    for workspace_id in (plain, covered_by_own):
        await rows.pending_jobs(conn, workspace_id, LINUX, 2)
    own = await rows.provisioner(conn, covered_by_own)
    await demand_inputs.replace_templates(conn, own.id, covered_by_own, [template(0)])
    memory = WalkMemory(full_walk_seconds=3600)
    entries = [WalkEntry(plain, 0), WalkEntry(covered_by_own, 0)]
    memory.plan(entries, now=0)
    found = {}
    for entry in entries:
        result = await demand.allocate_in_walk(
            conn,
            provisioner_id=inst.id,
            workspace_id=entry.workspace_id,
            templates=(template(1),),
            max_reservations=10,
            launch_ttl=TTL,
            activation_grace=TTL,
            covering_window=HOUR,
        )
        assert result is not None
        memory.walked(entry, result)
        found[entry.workspace_id] = result

    # One unit granted of two: not covered, its figures count the grant as reserved.
    assert len(found[plain].grants) == 1 and not found[plain].covered
    fingerprint = found[plain].reservations
    assert fingerprint is not None
    assert [(s.labels, s.queued, s.reserved) for s in found[plain].allocation.stats] == [
        (LINUX, 2, 1)
    ]
    assert found[covered_by_own].reservations is None and not found[covered_by_own].grants
    after = [WalkEntry(plain, fingerprint), WalkEntry(covered_by_own, 0)]
    assert memory.plan(after, now=1) == frozenset()  # neither is covered
    carried = memory.figures(plain)
    assert carried is not None and carried.grants == ()
    assert carried.allocation.stats == found[plain].allocation.stats
    assert memory.figures(covered_by_own) is None
    # A notice, or another fingerprint, and the figures are read again.
    memory.changed(plain)
    memory.plan(after, now=2)
    assert memory.figures(plain) is None
