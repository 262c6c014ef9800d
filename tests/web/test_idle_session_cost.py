"""An idle provisioner control session costs the database no statement of its own (issue 16).

A daemon reaches PostgreSQL through a proxy that counts the statements it runs, by text
(tests/pgproxy.py). Its demand sweep ticks every TICK seconds, and the sweep's statement is the
test's clock: a window is a number of sweeps, not of seconds. Over a window in which every idle
session pings at every tick, the replica runs only its per-replica work: one sweep per tick, at
most one last-seen batch per `provisioners.session_seen_batch_seconds` (= TICK) whatever the
number of sessions, one full-round check per half `provisioners.demand_full_round_seconds` (FULL,
so several fall in the window), and the listener's probe. No round (the full round finds
nothing for an idle session), no fence, no per-session statement.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import anyio
import asyncpg
from websockets.asyncio.client import ClientConnection

from controlplane.store import provisioners
from tests.pgproxy import PgProxy, pg_proxy
from tests.web.conftest import Api, api_with
from tests.web.control_client import hello, open_session, send
from tests.web.provisioning_client import advertise, until

TICK = 0.1
FULL = 1.0  # the slow full round's interval (its least)
SESSIONS = 6
WINDOW = 30  # sweeps
SWEEP = "AS everywhere_others_new"  # store/demand_sweep.py sweep_figures
STAMP = "FOR UPDATE OF s SKIP LOCKED"  # store/provisioner_sessions.py stamp_seen
FULL_CHECK = "SELECT provisioner_id FROM holding"  # store/demand_sweep.py full_round_due
PROBE = "SELECT 1"  # the listener's liveness probe (actors/listener.py)
ROUND = "FOR SHARE OF s"  # hold_fence: the first statement of every round and session write
# asyncpg's own type introspection, once per pool connection and type (the batch's uuid[]).
INTROSPECTION = ("typeinfo_tree", "set_config('jit'")
PER_REPLICA = (SWEEP, STAMP, FULL_CHECK, PROBE, *INTROSPECTION)


async def _idle_daemon(database_url: str) -> AsyncIterator[tuple[PgProxy, Api]]:
    async with pg_proxy(database_url) as proxy:
        async for api in api_with(
            proxy.url,
            provisioners__demand_safety_tick_seconds=TICK,
            provisioners__session_seen_batch_seconds=TICK,
            provisioners__demand_full_round_seconds=FULL,
            # The leader's jobs run on their own clocks, not per session: kept out of the window.
            maintenance__reaper_interval_seconds=3600,
            maintenance__dispatch_safety_tick_seconds=600,
            maintenance__provisioning_interval_seconds=3600,
            maintenance__session_gc_interval_seconds=86_400,
            maintenance__retention_interval_seconds=86_400,
        ):
            yield proxy, api


async def _sweeps(proxy: PgProxy, count: int) -> None:
    """Wait for `count` more sweeps."""
    target = proxy.count(SWEEP) + count
    with anyio.fail_after(60):
        while proxy.count(SWEEP) < target:
            await anyio.sleep(TICK / 10)


async def _settled(proxy: PgProxy) -> None:
    """Until three sweeps pass with no round (the advertisements' and first sight's are done)."""
    with anyio.fail_after(60):
        while True:
            rounds = proxy.count(ROUND)
            await _sweeps(proxy, 3)
            if proxy.count(ROUND) == rounds:
                return


async def _session(stack: AsyncExitStack, db: asyncpg.Connection, api: Api) -> ClientConnection:
    _, token = await provisioners.create(
        db, name=f"idle-{uuid.uuid4().hex[:6]}", workspace_id=uuid.uuid4()
    )
    ws = await stack.enter_async_context(await open_session(api.daemon, token))
    await hello(ws)
    await advertise(ws)
    await until(ws, "demand")  # the advertisement's round
    return ws


async def test_idle_sessions_cost_only_the_replicas_batched_statements(database_url: str) -> None:
    async for proxy, api in _idle_daemon(database_url):
        db = await asyncpg.connect(database_url)
        try:
            async with AsyncExitStack() as stack:
                sessions = [await _session(stack, db, api) for _ in range(SESSIONS)]
                await _settled(proxy)
                before, began = Counter(proxy.executed), anyio.current_time()
                for tick in range(WINDOW):
                    for ws in sessions:  # every session pinged at every tick
                        await send(ws, {"type": "ping", "request_id": f"p{tick}"})
                        await until(ws, "pong")
                    await _sweeps(proxy, 1)
                ran, lasted = Counter(proxy.executed), anyio.current_time() - began
                ran.subtract(before)
        finally:
            await db.close()
    window = {text: n for text, n in ran.items() if n > 0}
    sweeps = sum(n for text, n in window.items() if SWEEP in text)
    stamps = sum(n for text, n in window.items() if STAMP in text)
    full_checks = sum(n for text, n in window.items() if FULL_CHECK in text)
    others = {text: n for text, n in window.items() if not any(f in text for f in PER_REPLICA)}
    assert others == {}  # no round, no fence, nothing per session
    # One statement per tick for all the sessions (on a loaded machine the pings of one turn
    # of the loop can outlast a tick, so the window is counted in ticks too).
    assert WINDOW <= sweeps <= lasted / TICK + 1
    # All the sessions' pings of a batch interval in one statement (SESSIONS pings per tick).
    assert 1 <= stamps <= lasted / TICK + 2
    # The slow full round: one statement per half FULL for all the sessions (a window of WINDOW
    # sweeps lasts at least WINDOW * TICK seconds).
    assert 2 <= full_checks <= 2 * lasted / FULL + 1
