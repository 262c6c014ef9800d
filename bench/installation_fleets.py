"""The fleet parts of bench/installation.py (its docstring says what each measures): many
provisioner sessions over several replicas, and many runners parked over two."""

from __future__ import annotations

import contextlib
import json
import random
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import asyncpg
from anyio.streams.buffered import BufferedByteReceiveStream

from bench import dispatch, harness, scale, wire
from bench.installation_clients import (
    Arrivals,
    Provisioner,
    Template,
    cpu_percent,
    enqueue,
    job,
    metrics,
    orchestrator_key,
    proc_window,
    rss_mib,
)
from bench.profiling import each_profiled, summaries
from controlplane.store import credentials, provisioners

if TYPE_CHECKING:
    from bench.installation import Sizes

RUNNERS_PER_PROCESS = 5000  # parked runners per child process (open files: one socket each)
CONNECT_BATCH = 50  # sessions opened at once: well inside the listen backlog
ENQUEUERS = 8  # connections the steady enqueues go out on
GRANT_WAIT = 10.0  # seconds after the last enqueue for its grant
FLOOR_SAMPLES = 100  # INSERT + NOTIFY -> LISTEN round trips for a latency's floor


async def window(pids: Sequence[int], conn: asyncpg.Connection, seconds: float) -> dict[str, Any]:
    """Each replica's RSS and CPU, and the database's committed transactions and written rows a
    minute, over `seconds`."""
    counters, before = await harness.database_counters(conn), proc_window(pids)
    await anyio.sleep(seconds)
    cpu = cpu_percent(pids, before)
    delta = harness.counter_delta(counters, await harness.database_counters(conn))
    minutes = (time.monotonic() - before[0]) / 60
    return {
        "window_s": round(minutes * 60, 1),
        "rss_mib": rss_mib(pids),
        "cpu_percent": cpu,
        "xact_commit_per_min": round(delta["xact_commit"] / minutes, 1),
        "rows_written_per_min": round(
            (delta["tup_inserted"] + delta["tup_updated"] + delta["tup_deleted"]) / minutes, 1
        ),
    }


def per_member(loaded: dict[str, Any], idle: dict[str, Any], members: int) -> dict[str, float]:
    """What each session (or runner) adds: RSS summed over the replicas, and transactions."""
    rss = sum(loaded["rss_mib"]) - sum(idle["rss_mib"])
    xacts = loaded["xact_commit_per_min"] - idle["xact_commit_per_min"]
    return {
        "rss_kib": round(rss * 1024 / members, 2),
        "xacts_per_min": round(xacts / members, 4),
    }


async def gauge(started: Sequence[harness.Replica], name: str) -> list[float]:
    return [(await metrics(replica.address)).get(name, 0.0) for replica in started]


# --- provisioner sessions ------------------------------------------------------------------------


async def _connect(fleet: list[Provisioner], group: anyio.abc.TaskGroup) -> None:
    """Open every session, CONNECT_BATCH at a time, and advertise one `linux` template."""
    for start in range(0, len(fleet), CONNECT_BATCH):
        batch = fleet[start : start + CONNECT_BATCH]
        readies = []
        for member in batch:
            ready = anyio.Event()
            readies.append(ready)
            group.start_soon(member.run, ready)
        with anyio.fail_after(120):
            for ready in readies:
                await ready.wait()
        async with anyio.create_task_group() as advertising:
            for member in batch:
                advertising.start_soon(
                    member.advertise, [Template("k", ["linux"], 1000)], 1000, 600
                )


async def _steady_grants(
    started: Sequence[harness.Replica], key: str, fleet: list[Provisioner], sizes: Sizes
) -> dict[str, Any]:
    """`sizes.enqueue_rate` enqueues a second for `sizes.load_seconds`, each of one job into the
    workspace of a random session of `fleet`, through a random replica; the grant latencies."""
    send, receive = anyio.create_memory_object_stream[Provisioner](1000)

    async def enqueuer() -> None:
        conn = wire.Connection(random.choice(started).address)
        try:
            async with receive.clone() as jobs:
                async for member in jobs:
                    assert member.workspace is not None
                    member.started.append(time.perf_counter())
                    await enqueue(conn, key, [job(member.workspace, ["linux"])])
        finally:
            await conn.aclose()

    sent = 0
    async with anyio.create_task_group() as group:
        for _ in range(ENQUEUERS):
            group.start_soon(enqueuer)
        async with send, receive:
            start = time.monotonic()
            while time.monotonic() - start < sizes.load_seconds:
                await send.send(random.choice(fleet))
                sent += 1
                await anyio.sleep(max(0.0, start + sent / sizes.enqueue_rate - time.monotonic()))
    elapsed = time.monotonic() - start
    with anyio.move_on_after(GRANT_WAIT):
        while any(member.started for member in fleet):
            await anyio.sleep(0.1)
    latencies = [value for member in fleet for value in member.latencies]
    return {
        **harness.summary_ms(latencies),
        "enqueued": sent,
        "achieved_rate": round(sent / elapsed, 1),
        "not_granted": sum(len(member.started) for member in fleet),
    }


async def sessions(
    url: str, started: list[harness.Replica], sizes: Sizes, profile: Path | None = None
) -> dict[str, Any]:
    """With `profile` (a folder), py-spy records every replica through the grants."""
    pids = [replica.process.pid for replica in started]
    conn = await asyncpg.connect(url)
    try:
        key = await orchestrator_key(conn)
        await anyio.sleep(sizes.settle)
        idle = await window(pids, conn, sizes.idle_window)
        print(f"  no sessions: {idle}")
        fleet = []
        for index in range(sizes.sessions):
            workspace = uuid.uuid4()
            _, token = await provisioners.create(conn, name=f"ws-{index}", workspace_id=workspace)
            fleet.append(Provisioner(started[index % len(started)].address, token, workspace))
        installation = []
        for index in range(sizes.installation_sessions):
            _, token = await provisioners.create(conn, name=f"inst-{index}", workspace_id=None)
            installation.append(Provisioner(started[index % len(started)].address, token))
        async with anyio.create_task_group() as group:
            connecting = time.monotonic()
            await _connect(fleet + installation, group)
            connected_s = time.monotonic() - connecting
            await anyio.sleep(sizes.settle)
            loaded = await window(pids, conn, sizes.idle_window)
            live = await gauge(started, "controlplane_provisioner_control_sessions")
            print(f"  {len(fleet)} + {len(installation)} sessions: {loaded}")
            async with each_profiled(pids, profile, "installation_profile_sessions"):
                grants = await _steady_grants(started, key, fleet, sizes)
            print(
                f"  grant at {grants['achieved_rate']} enqueues/s: p50 {grants['p50_ms']} ms, "
                f"p99 {grants['p99_ms']} ms, {grants['not_granted']} not granted"
            )
            closed = [member.closed for member in fleet + installation if member.closed]
            group.cancel_scope.cancel()
        floor = harness.summary_ms(await dispatch.baseline(url, FLOOR_SAMPLES))
    finally:
        await conn.close()
    return {
        "replicas": len(started),
        "workspace_sessions": sizes.sessions,
        "installation_sessions": sizes.installation_sessions,
        "connected_in_s": round(connected_s, 1),
        "sessions_gauge": live,
        "sessions_closed_early": len(closed),
        "idle": idle,
        "loaded": loaded,
        "per_session": per_member(loaded, idle, len(fleet) + len(installation)),
        "grant": grants,
        "baseline_insert_notify_listen": floor,
        "profiles": summaries(pids, profile, "installation_profile_sessions"),
    }


# --- parked runners ------------------------------------------------------------------------------


async def _dispatches(
    started: Sequence[harness.Replica],
    key: str,
    workspaces: list[uuid.UUID],
    arrivals: Arrivals,
    samples: int,
) -> dict[str, Any]:
    """One job at a time into a random workspace, through the replicas in turn; the seconds
    from the enqueue request to the long poll's answer carrying it."""
    conns = [wire.Connection(replica.address) for replica in started]
    missed = 0
    try:
        for index in range(samples):
            body = job(random.choice(workspaces), ["linux"])
            event = arrivals.events[body["job_execution_id"]] = anyio.Event()
            arrivals.started[body["job_execution_id"]] = time.perf_counter()
            await enqueue(conns[index % len(conns)], key, [body])
            with anyio.move_on_after(30) as scope:
                await event.wait()
            missed += scope.cancelled_caught
            await anyio.sleep(0.02)  # the runner completes and parks again
    finally:
        for conn in conns:
            await conn.aclose()
    return {**harness.summary_ms(arrivals.latencies), "missed": missed}


async def _runner_process(addresses: list[str], sessions: list[str], arrivals: Arrivals) -> None:
    """A child process (bench/installation_runners.py) holding `sessions` parked; the jobs it
    reports handed go to `arrivals`. Closing its stdin ends it."""
    process = await anyio.open_process(
        [sys.executable, "-m", "bench.installation_runners"], cwd=harness.ROOT, stderr=None
    )
    assert process.stdin is not None
    assert process.stdout is not None
    try:
        spec = {"addresses": addresses, "sessions": sessions}
        await process.stdin.send((json.dumps(spec) + "\n").encode())
        reader = BufferedByteReceiveStream(process.stdout)
        with contextlib.suppress(anyio.EndOfStream, anyio.IncompleteRead):
            while True:
                line = json.loads(await reader.receive_until(b"\n", 65_536))
                arrivals.arrived(line["job"], line["at"])
    finally:
        with anyio.CancelScope(shield=True):
            await process.stdin.aclose()
            with anyio.move_on_after(20):
                await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()


async def parked(
    url: str, started: list[harness.Replica], sizes: Sizes, profile: Path | None = None
) -> dict[str, Any]:
    """With `profile` (a folder), py-spy records every replica through the dispatches."""
    pids = [replica.process.pid for replica in started]
    conn = await asyncpg.connect(url)
    try:
        key = await orchestrator_key(conn)
        workspaces = [uuid.uuid4() for _ in range(sizes.parked_workspaces)]
        tokens = [
            (await credentials.create_manual_token(conn, workspace_id=w, name="bench"))[1]
            for w in workspaces
        ]
        await anyio.sleep(sizes.settle)
        idle = await window(pids, conn, sizes.idle_window)
        print(f"  no runners: {idle}")
        registering = time.monotonic()
        made = await scale._register(started[0].address, tokens, sizes.parked)
        arrivals = Arrivals()
        addresses = [replica.address for replica in started]
        async with anyio.create_task_group() as group:
            for start in range(0, len(made), RUNNERS_PER_PROCESS):
                share = made[start : start + RUNNERS_PER_PROCESS]
                group.start_soon(_runner_process, addresses, share, arrivals)
            with anyio.fail_after(600):
                while sum(await gauge(started, "controlplane_parked_runners")) < sizes.parked:
                    await anyio.sleep(0.5)
            parked_s = time.monotonic() - registering
            await anyio.sleep(sizes.settle)
            loaded = await window(pids, conn, sizes.idle_window)
            actors_parked = await gauge(started, "controlplane_workspace_actors")
            print(f"  {sizes.parked} parked: {loaded}, actors {actors_parked}")
            floor = harness.summary_ms(await dispatch.baseline(url, sizes.dispatch_samples))
            async with each_profiled(pids, profile, "installation_profile_parked"):
                dispatched = await _dispatches(
                    started, key, workspaces, arrivals, sizes.dispatch_samples
                )
            print(
                f"  dispatch p50 {dispatched['p50_ms']} ms, p99 {dispatched['p99_ms']} ms "
                f"(INSERT+NOTIFY->LISTEN p99 {floor['p99_ms']} ms)"
            )
            group.cancel_scope.cancel()
        # The runners have gone: their polls end, then the actors idle out.
        with anyio.move_on_after(120):
            while sum(await gauge(started, "controlplane_parked_runners")) > 0:
                await anyio.sleep(0.5)
        actors_left = await gauge(started, "controlplane_workspace_actors")
        actors_retired: list[float] | None = None
        if sizes.actor_idle_wait > 0:
            await anyio.sleep(sizes.actor_idle_wait)
            actors_retired = await gauge(started, "controlplane_workspace_actors")
        print(f"  actors: parked {actors_parked}, left {actors_left}, retired {actors_retired}")
        rss_after = rss_mib(pids)
    finally:
        await conn.close()
    return {
        "replicas": len(started),
        "runners": sizes.parked,
        "workspaces": sizes.parked_workspaces,
        "parked_in_s": round(parked_s, 1),
        "idle": idle,
        "loaded": loaded,
        "per_runner": per_member(loaded, idle, sizes.parked),
        "dispatch": dispatched,
        "baseline_insert_notify_listen": floor,
        "profiles": summaries(pids, profile, "installation_profile_parked"),
        "workspace_actors": {
            "parked": actors_parked,
            "runners_gone": actors_left,
            "after_idle_wait": actors_retired,
            "idle_wait_s": sizes.actor_idle_wait,
        },
        "rss_mib_after": rss_after,
    }
