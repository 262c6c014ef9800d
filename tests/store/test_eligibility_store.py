"""Installation-scope eligibility against PostgreSQL: setting it, and the installation walk's
list of workspaces with demand, which admits exactly what `Eligibility.admits` does and sees a
change on its next read."""

from __future__ import annotations

import uuid

import asyncpg
import pytest

from controlplane.domain.eligibility import EVERY_WORKSPACE, Eligibility, Mode
from controlplane.errors import Conflict, NotFound
from controlplane.store import demand_list, eligibility, provisioner_sessions
from controlplane.store.pool import Conn
from controlplane.store.provisioning import SessionStore
from tests import provisioning as rows


async def test_a_rule_is_set_read_and_reset_to_all(conn: Conn) -> None:
    inst = await rows.provisioner(conn)
    assert await eligibility.read(conn, inst.id) == (EVERY_WORKSPACE, None)
    allowed = Eligibility(Mode.ALLOW, frozenset({uuid.uuid4(), uuid.uuid4()}))
    rule, updated_at = await eligibility.replace(conn, inst.id, allowed)
    assert rule == allowed
    assert updated_at is not None
    assert await eligibility.read(conn, inst.id) == (allowed, updated_at)
    denied = Eligibility(Mode.DENY, frozenset({uuid.uuid4()}))
    await eligibility.replace(conn, inst.id, denied)
    assert (await eligibility.read(conn, inst.id))[0] == denied
    assert await eligibility.replace(conn, inst.id, EVERY_WORKSPACE) == (EVERY_WORKSPACE, None)
    assert await conn.fetchval("SELECT count(*) FROM provisioner_eligibility") == 0


async def test_only_an_installation_token_has_a_rule(conn: Conn) -> None:
    own = await rows.provisioner(conn, uuid.uuid4())
    rule = Eligibility(Mode.ALLOW, frozenset({uuid.uuid4()}))
    with pytest.raises(Conflict):
        await eligibility.replace(conn, own.id, rule)
    with pytest.raises(NotFound):
        await eligibility.replace(conn, uuid.uuid4(), rule)
    assert await conn.fetchval("SELECT count(*) FROM provisioner_eligibility") == 0


@pytest.mark.parametrize("mode", [Mode.ALL, Mode.ALLOW, Mode.DENY])
async def test_the_walk_lists_the_workspaces_the_rule_admits_oldest_first(
    pool: asyncpg.Pool, conn: Conn, mode: Mode
) -> None:
    inst = await rows.provisioner(conn)
    oldest, middle, newest = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    for workspace_id in (oldest, middle, newest):
        await rows.pending_jobs(conn, workspace_id, ("linux",))
    listed = frozenset({oldest, newest}) if mode is not Mode.ALL else frozenset()
    rule = Eligibility(mode, listed)
    await eligibility.replace(conn, inst.id, rule)
    generation = await provisioner_sessions.take_over(conn, inst.id, uuid.uuid4())
    assert generation is not None
    store = SessionStore(pool, inst, generation)
    expected = [w for w in (oldest, middle, newest) if rule.admits(w)]
    assert await store.demand_workspaces() == expected
    # Another provisioner's rule changes nothing for this one, nor does no provisioner at all.
    other = await rows.provisioner(conn)
    await eligibility.replace(conn, other.id, Eligibility(Mode.ALLOW, frozenset()))
    assert await store.demand_workspaces() == expected
    assert await demand_list.demand_workspaces(conn) == [oldest, middle, newest]


async def test_the_limit_counts_admitted_workspaces_only(pool: asyncpg.Pool, conn: Conn) -> None:
    """A deny list of the oldest workspaces does not use up the walk's limit."""
    inst = await rows.provisioner(conn)
    workspaces = [uuid.uuid4() for _ in range(3)]
    for workspace_id in workspaces:
        await rows.pending_jobs(conn, workspace_id, ("linux",))
    await eligibility.replace(conn, inst.id, Eligibility(Mode.DENY, frozenset(workspaces[:2])))
    found = await demand_list.demand_workspaces(conn, provisioner_id=inst.id, limit=1)
    assert found == [workspaces[2]]


async def test_a_change_shows_on_the_next_read_without_a_new_session(
    pool: asyncpg.Pool, conn: Conn
) -> None:
    inst = await rows.provisioner(conn)
    workspace_id = uuid.uuid4()
    await rows.pending_jobs(conn, workspace_id, ("linux",))
    generation = await provisioner_sessions.take_over(conn, inst.id, uuid.uuid4())
    assert generation is not None
    store = SessionStore(pool, inst, generation)
    assert await store.demand_workspaces() == [workspace_id]
    await eligibility.replace(conn, inst.id, Eligibility(Mode.DENY, frozenset({workspace_id})))
    assert await store.demand_workspaces() == []
    await eligibility.replace(conn, inst.id, EVERY_WORKSPACE)
    assert await store.demand_workspaces() == [workspace_id]
