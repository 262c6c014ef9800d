"""The demand sweep's one statement (store/demand_sweep.py) against PostgreSQL: a session's
figures stay put while nothing its round reads changes, move when something does that no
notification reports (a claim's released unit, an expiry, an activation timeout, an enrollment,
an eligibility change), move for that session only, and are read without waiting for any lock
a round or a claim holds."""

from __future__ import annotations

import uuid
from datetime import timedelta

import anyio
import asyncpg

from controlplane.actors.provisioning.sweep import has_moved
from controlplane.domain.demand import Template
from controlplane.domain.eligibility import Eligibility, Mode
from controlplane.domain.provisioners import Provisioner
from controlplane.store import demand_inputs, eligibility, locks
from controlplane.store.demand_sweep import Figures, Read, SweptSession, sweep_figures
from controlplane.store.pool import Conn
from tests import provisioning as rows
from tests.factories import holding, holding_lock

TIMEOUT = timedelta(seconds=300)
WINDOW = timedelta(seconds=120)


def session(p: Provisioner) -> SweptSession:
    return SweptSession(p.id, p.workspace_id)


async def read(
    conn: Conn, *provisioners: Provisioner, cap: int = 1000, since: Read | None = None
) -> list[Figures]:
    """The figures, read as the tick after `since` reads them."""
    return (await reading(conn, *provisioners, cap=cap, since=since)).figures


async def reading(
    conn: Conn, *provisioners: Provisioner, cap: int = 1000, since: Read | None = None
) -> Read:
    return await sweep_figures(
        conn,
        [session(p) for p in provisioners],
        since=None if since is None else since.at,
        activation_timeout=TIMEOUT,
        covering_window=WINDOW,
        pending_cap=cap,
    )


async def moved(conn: Conn, before: Read, *provisioners: Provisioner) -> list[bool]:
    """Whether the next tick finds each session's figures moved since `before`."""
    after = await read(conn, *provisioners, since=before)
    return [has_moved(a, b) for a, b in zip(after, before.figures, strict=True)]


async def test_no_session_reads_nothing(conn: Conn) -> None:
    assert await read(conn) == []


async def test_figures_stay_put_until_the_sessions_own_inputs_change(conn: Conn) -> None:
    w1, w2 = uuid.uuid4(), uuid.uuid4()
    p1, p2 = await rows.provisioner(conn, w1), await rows.provisioner(conn, w2)
    first = await reading(conn, p1, p2)
    assert await moved(conn, first, p1, p2) == [False, False]  # nothing changed: nobody woken

    # A job enqueued in w1 moves nothing: its NOTIFY wakes p1 (one lost with the listener's
    # connection is made up by the reconnect's resync). Its claim after a read moves p1 only.
    [job] = await rows.pending_jobs(conn, w1, ("linux",))
    assert await moved(conn, first, p1, p2) == [False, False]
    before = await reading(conn, p1, p2)
    await conn.execute("DELETE FROM pending_jobs WHERE job_execution_id = $1", job)
    assert await moved(conn, before, p1, p2) == [True, False]
    [job] = await rows.pending_jobs(conn, w1, ("linux",))

    # p1's own launch grant in w1 moves nothing (its round made it); a claim that then uses a
    # unit of it moves p1 only.
    before = await reading(conn, p1, p2)
    reservation = await rows.reservation(conn, workspace_id=w1, provisioner_id=p1.id, count=2)
    assert await moved(conn, before, p1, p2) == [False, False]
    before = await reading(conn, p1, p2)
    await conn.execute("UPDATE reservations SET count = 1 WHERE id = $1", reservation)
    assert await moved(conn, before, p1, p2) == [True, False]
    before = await reading(conn, p1, p2)
    await conn.execute("DELETE FROM pending_jobs WHERE job_execution_id = $1", job)
    assert await moved(conn, before, p1, p2) == [True, False]

    # Another provisioner's reservation in w2 expires: demand there is uncovered again.
    other = await rows.provisioner(conn, w2)
    held = await rows.reservation(conn, workspace_id=w2, provisioner_id=other.id)
    before = await reading(conn, p1, p2)
    await conn.execute(
        "UPDATE reservations SET expires_at = now() - interval '1 second' WHERE id = $1", held
    )
    assert await moved(conn, before, p1, p2) == [False, True]


async def test_a_due_activation_timeout_and_an_enrollment_move_the_figures(conn: Conn) -> None:
    w = uuid.uuid4()
    p = await rows.provisioner(conn, w)
    booting = await rows.runner(
        conn,
        p.id,
        state="starting",
        workspace_id=w,
        age=timedelta(seconds=200),
        control_session=None,
    )
    before = await reading(conn, p)
    # Time passes: the demand launch is now older than the activation timeout.
    await conn.execute(
        "UPDATE runner_instances SET created_at = created_at - interval '200 seconds'"
        " WHERE id = $1",
        booting,
    )
    assert await moved(conn, before, p) == [True]

    # A runner of p enrolls (its control session opens): the warm pool's supply changed.
    idle = await rows.runner(conn, p.id, control_session=None)
    before = await reading(conn, p)
    await rows.open_control_session(conn, idle, p.id)
    assert await moved(conn, before, p) == [True]


async def test_an_installation_session_moves_with_its_eligibility_and_any_reservation(
    conn: Conn,
) -> None:
    installation = await rows.provisioner(conn)
    w = uuid.uuid4()
    local = await rows.provisioner(conn, w)
    before = await reading(conn, installation, local)
    await eligibility.replace(
        conn, installation.id, Eligibility(Mode.DENY, frozenset({uuid.uuid4()}))
    )
    assert await moved(conn, before, installation, local) == [True, False]
    before = await reading(conn, installation, local)
    # Any reservation anywhere may uncover demand the installation could take when it goes.
    await rows.reservation(conn, workspace_id=uuid.uuid4(), provisioner_id=local.id)
    assert (await moved(conn, before, installation, local))[0]
    # A workspace provisioner's advertisement ages out of the covering window: its labels'
    # demand is the installation's again.
    await demand_inputs.replace_templates(conn, local.id, w, [Template("k", ("linux",), 1)])
    before = await reading(conn, installation, local)
    await conn.execute(
        "UPDATE provisioner_templates SET advertised_at = now() - interval '1 hour'"
        " WHERE provisioner_id = $1",
        local.id,
    )
    assert await moved(conn, before, installation, local) == [True, False]


async def test_pending_jobs_are_counted_up_to_the_cap(conn: Conn) -> None:
    w = uuid.uuid4()
    p = await rows.provisioner(conn, w)
    await rows.pending_jobs(conn, w, ("linux",), count=3)
    capped = await read(conn, p, cap=2)
    await rows.pending_jobs(conn, w, ("linux",))
    assert await read(conn, p, cap=2) == capped  # past the cap: not seen here
    assert await read(conn, p, cap=10) != await read(conn, p, cap=3)


async def test_the_sweep_waits_for_no_lock_a_round_or_a_claim_holds(
    conn: Conn, database_url: str
) -> None:
    w = uuid.uuid4()
    p = await rows.provisioner(conn, w)
    await rows.reservation(conn, workspace_id=w, provisioner_id=p.id)
    await rows.runner(conn, p.id, workspace_id=w)
    await rows.pending_jobs(conn, w, ("linux",))
    async with (
        holding_lock(database_url, locks.workspace(w)),
        holding(database_url, "SELECT 1 FROM reservations FOR UPDATE"),
        holding(database_url, "SELECT 1 FROM runner_instances FOR UPDATE"),
        holding(database_url, "SELECT 1 FROM pending_jobs FOR UPDATE"),
        holding(database_url, "SELECT 1 FROM concurrency_keys FOR UPDATE"),
    ):
        with anyio.fail_after(5):
            assert len(await read(conn, p)) == 1


async def test_own_grants_move_nothing_but_another_provisioners_and_late_commits_do(
    conn: Conn, database_url: str
) -> None:
    w = uuid.uuid4()
    mine, theirs = await rows.provisioner(conn, w), await rows.provisioner(conn, w)
    await rows.pending_jobs(conn, w, ("linux",), count=3)
    before = await reading(conn, mine)
    await rows.reservation(conn, workspace_id=w, provisioner_id=mine.id)
    assert await moved(conn, before, mine) == [False]  # its own round's grant
    # The next tick compares with the figures that include it: still nothing moved.
    before = await reading(conn, mine, since=before)
    assert await moved(conn, before, mine) == [False]
    # Another provisioner's grant in the workspace: the demand left to this one shrank.
    await rows.reservation(conn, workspace_id=w, provisioner_id=theirs.id)
    assert await moved(conn, before, mine) == [True]
    # A grant of its own committed after a read by a transaction that began before it counts
    # as older than the read: the next tick wakes the session (one wake too many, not too few).
    other = await asyncpg.connect(database_url)
    try:
        async with other.transaction():
            await rows.reservation(other, workspace_id=w, provisioner_id=mine.id)
            before = await reading(conn, mine, since=await reading(conn, mine))
        assert await moved(conn, before, mine) == [True]
    finally:
        await other.close()
