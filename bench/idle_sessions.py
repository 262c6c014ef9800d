"""Idle provisioner sessions and the database (issue 16): committed transactions a minute per
idle workspace-scope control session, from `pg_stat_database.xact_commit`.

One replica; N provisioners, each with its own workspace, hold a control session, advertise one
template and then only ping every 20 s (what the reference provisioner does), with nothing
enqueued. The figure is the database's commits over a window with the N sessions, less those of
the same replica over a window with none (its maintenance, health probe, plot samples), divided
by N and by the window's minutes. The same, in the same run and on the same server, for the tree
at BENCH_BASELINE_REF (default 6da86d5, before issue 16's change), whose every session ran a
round each `provisioners.demand_safety_tick_seconds` (2 s).

`python -m bench.idle_sessions` (BENCH_IDLE_SESSIONS, default 100; BENCH_IDLE_WINDOW_SECONDS,
default 60: the statistics a backend flushes at most once a second need windows much longer).
Results: bench/results/idle_sessions.json.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import asyncpg
import httpx
from websockets.asyncio.client import connect

from bench import harness
from controlplane.store import provisioners

PING_SECONDS = 20.0


async def _session(address: str, token: str, ready: anyio.Event) -> None:
    url = address.replace("http://", "ws://", 1) + "/v1/provisioners/session"
    async with connect(url, additional_headers={"Authorization": f"Bearer {token}"}) as ws:
        await ws.send(json.dumps({"type": "hello", "protocol_version": 1, "request_id": "h"}))
        await ws.recv()
        advertise = {
            "type": "advertise",
            "request_id": "a",
            "max_reservations": 10,
            "templates": [{"template_key": "k", "labels": ["linux"], "available_slots": 10}],
        }
        await ws.send(json.dumps(advertise))
        ready.set()
        async with anyio.create_task_group() as group:

            async def drain() -> None:
                async for _frame in ws:
                    pass

            group.start_soon(drain)
            n = 0
            while True:
                await anyio.sleep(PING_SECONDS)
                n += 1
                await ws.send(json.dumps({"type": "ping", "request_id": f"p{n}"}))


# The replica's own account of the window, where its tree has these metrics.
_SAMPLES = (
    'controlplane_allocation_rounds_total{outcome="ok"}',
    'controlplane_allocation_round_triggers_total{trigger="wake"}',
    'controlplane_allocation_round_triggers_total{trigger="deadline"}',
    'controlplane_allocation_round_triggers_total{trigger="fallback"}',
    'controlplane_demand_sweeps_total{outcome="ok"}',
    "controlplane_demand_sweep_woken_total",
)


async def _metrics(address: str) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=address, timeout=10) as client:
        text = (await client.get("/metrics")).text
    found = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in _SAMPLES:
            found[name] = float(value)
    return found


async def _commits_over(
    conn: asyncpg.Connection, address: str, seconds: float
) -> tuple[int, dict[str, float]]:
    """Commits over the window, and the replica's metrics' moves over it."""
    before, seen = await harness.database_counters(conn), await _metrics(address)
    await anyio.sleep(seconds)
    after, now = await harness.database_counters(conn), await _metrics(address)
    moved = {name: now[name] - seen.get(name, 0.0) for name in now}
    return harness.counter_delta(before, after)["xact_commit"], moved


async def measure(
    url: str, start: Callable[[str], Awaitable[harness.Replica]], count: int, window: float
) -> dict[str, Any]:
    """Commits a minute of one replica with no session, then with `count` idle sessions."""
    conn = await asyncpg.connect(url)
    replica = await start(url)
    try:
        await anyio.sleep(5)  # start-up work done
        empty, _ = await _commits_over(conn, replica.address, window)
        tokens = []
        for i in range(count):
            _, raw = await provisioners.create(
                conn, name=f"idle-{i}-{uuid.uuid4().hex[:6]}", workspace_id=uuid.uuid4()
            )
            tokens.append(raw)
        async with anyio.create_task_group() as group:
            for token in tokens:
                ready = anyio.Event()
                group.start_soon(_session, replica.address, token, ready)
                with anyio.fail_after(30):
                    await ready.wait()
            await anyio.sleep(5)  # the advertisements' rounds done
            busy, moved = await _commits_over(conn, replica.address, window)
            group.cancel_scope.cancel()
    finally:
        harness.stop_replicas([replica])
        await conn.close()
    minutes = window / 60
    return {
        "replica_alone_per_minute": round(empty / minutes, 1),
        "with_sessions_per_minute": round(busy / minutes, 1),
        "per_idle_session_per_minute": round((busy - empty) / minutes / count, 3),
        "replica_metrics_per_minute": {k: round(v / minutes, 1) for k, v in moved.items()},
    }


async def run() -> dict[str, Any]:
    count = int(os.environ.get("BENCH_IDLE_SESSIONS", "100"))
    window = float(os.environ.get("BENCH_IDLE_WINDOW_SECONDS", "60"))
    harness.raise_fd_limit()
    results: dict[str, Any] = {"sessions": count, "window_seconds": window}
    with harness.postgres() as server, harness.baseline_tree("6da86d5") as (tree, ref):
        for side, start in (
            ("before", lambda url: harness.start_tree_replica(url, tree)),
            ("after", harness.start_replica),
        ):
            url = await harness.empty_database(server)
            figures = await measure(url, start, count, window)
            results[side] = {"tree": ref if side == "before" else "this tree", **figures}
            print(f"{side}: {figures}")
    path = harness.write_result("idle_sessions", results)
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    anyio.run(run)
