"""A big installation (issue 16): the costs that grow with workspaces, sessions and parked
runners rather than with work. Four parts, each beside a baseline measured in the same run:

* allocation: W workspaces (10,000) holding P pending jobs (1,000,000), skewed: 9 of every 10
  jobs in a few hot workspaces (10), the rest spread evenly over the others. One
  installation-scope provisioner advertises a `bulk` template for the backlog's labels with S
  slots (1,000) and a `probe` template for labels no backlog job needs. (1) Round cost: each
  advertise runs one allocation round; from sending it to the round's `demand` push, with the
  replica's mean `controlplane_allocation_round_seconds` over the same window and the CPU the
  database's backends spent in it (/proc), at bulk slots 0, 10, 100 and S (the round cost
  against the units granted). Grants live 1 s, and a zero advertise follows each measured one,
  so every measured round starts with the slots free. (2) Grant latency: with the S bulk slots
  taken, one probe job at a time is enqueued over HTTP into a random cold (or hot) workspace;
  the clock stops when the push granting it arrives (a probe not granted within the deadline is
  counted as missed). Baseline: the same with 10 workspaces and the same pending jobs.
* sessions: 1,000 workspace-scope provisioner sessions (each its own workspace) and 10
  installation-scope ones over 3 replicas, each having advertised once and pinging every 20 s.
  Per session: replica RSS over the idle replicas', committed transactions a minute
  (pg_stat_database) over the no-session baseline window; then grant p99 while 100 enqueues a
  second arrive across random workspaces (installation_fleets.py).
* parked: 20,000 runners parked on long polls over 2 replicas in 2,000 workspaces: RSS and idle
  CPU per replica beside the same replicas idle, dispatch p99 (HTTP enqueue to the long poll's
  answer) beside the INSERT + NOTIFY -> LISTEN floor, and each replica's workspace actors while
  parked, when the runners have left, and again after the actors' idle time
  (installation_fleets.py).
* fanout: 1,000 enqueues a second over HTTP into a third replica, across 10,000 workspaces, no
  runner parked: the CPU of each of the 2 other replicas, which only hear the NOTIFYs, beside
  the same replicas idle (target under 10% of a core each).

Every client speaks the public protocol, so `--tree PATH` measures another checkout: its
replicas run that tree's code and migrate their database themselves; this process only makes
credentials with this checkout's store (tables issue 16 leaves alone) and talks HTTP and
WebSocket. Fill the backlog with `--fill http` (the default: the enqueue route, 500 jobs a
request, so whatever bookkeeping a tree keeps on enqueue is kept) or `--fill sql` (one
generate_series INSERT in the shape queue.enqueue writes: faster, but it bypasses any
bookkeeping a tree adds to the enqueue transaction).

`python -m bench.installation --help` for every size; `--smoke` runs small sizes in about two
minutes and writes to BENCH_RESULTS or else a temporary folder, never bench/results/.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import resource
import statistics
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import asyncpg

from bench import harness, installation_fleets, report, wire
from bench.installation_clients import (
    Provisioner,
    Template,
    backend_cpu,
    cpu_percent,
    cpu_spent,
    enqueue,
    granted_units,
    job,
    metrics,
    orchestrator_key,
    proc_window,
    rss_mib,
)
from bench.profiling import profile_summary, profiled
from controlplane.store import provisioners

PARTS = ("allocation", "sessions", "parked", "fanout")
BULK = ["bulk", "linux"]  # the backlog's labels (canonical order)
PROBE = ["linux", "probe"]  # probe jobs only: no backlog job competes for these slots
FILL_BATCH = 500  # queue.max_batch_size's default
FILL_CONNECTIONS = 4
GRANT_TTL = 600  # seconds: no grant of the run expires while it runs
PROBE_SLOTS = 100_000


@dataclass(frozen=True)
class Sizes:
    """Every size of the run; the defaults are issue 16's."""

    parts: tuple[str, ...] = PARTS
    settle: float = 15.0  # start-up work out of the windows, and statistics flushed
    # allocation
    workspaces: int = 10_000
    baseline_workspaces: int = 10
    pending: int = 1_000_000
    hot: int = 10
    slots: int = 1000
    round_slots: tuple[int, ...] = (0, 10, 100, 1000)
    rounds: int = 5
    probes: int = 100
    grant_deadline: float = 5.0
    fill: str = "http"
    # sessions
    sessions: int = 1000
    installation_sessions: int = 10
    session_replicas: int = 3
    idle_window: float = 60.0
    enqueue_rate: float = 100.0
    load_seconds: float = 30.0
    # parked
    parked: int = 20_000
    parked_workspaces: int = 2000
    parked_replicas: int = 2
    dispatch_samples: int = 200
    # Actors retire 60 s after their last waiter before i16-dispatch, 5 s after it; 0 skips.
    actor_idle_wait: float = 75.0
    # fanout
    fanout_rate: float = 1000.0
    fanout_workspaces: int = 10_000
    fanout_seconds: float = 30.0
    fanout_replicas: int = 2


SIZES = Sizes()
SMOKE = Sizes(
    settle=2.0,
    workspaces=50,
    pending=10_000,
    hot=2,
    slots=50,
    round_slots=(0, 50),
    rounds=1,
    probes=3,
    grant_deadline=2.0,
    fill="sql",
    sessions=30,
    installation_sessions=2,
    session_replicas=2,
    idle_window=3.0,
    enqueue_rate=20.0,
    load_seconds=3.0,
    parked=200,
    parked_workspaces=20,
    dispatch_samples=20,
    actor_idle_wait=0.0,
    fanout_rate=200.0,
    fanout_workspaces=1000,
    fanout_seconds=3.0,
    fanout_replicas=1,
)


# --- replicas of a tree --------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def cluster(
    server: str, count: int, tree: Path | None
) -> AsyncIterator[tuple[str, list[harness.Replica]]]:
    """A database of its own and `count` replicas on it: this checkout's, on a database migrated
    here, or `tree`'s, on an empty one its first replica migrates. Dropped afterwards."""
    url = await (harness.empty_database(server) if tree else harness.fresh_database(server))
    started: list[harness.Replica] = []
    try:
        for _ in range(count):
            if tree is None:
                started.append(await harness.start_replica(url))
            else:
                started.append(await harness.start_tree_replica(url, tree))
        yield url, started
    finally:
        harness.stop_replicas(started)
        await harness.drop_database(url)


def raise_fd_limit(needed: int) -> None:
    """Open files enough for `needed`: up to the hard limit, and past it where this process may
    (root), else stop before the run rather than fail halfway."""
    soft = harness.raise_fd_limit()
    if soft >= needed:
        return
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, needed))
        return
    raise SystemExit(f"{needed} open files needed, the limit is {soft}: raise `ulimit -Hn`")


def grant_profile(rounds: Path) -> Path:
    """Where the replica's profile through the grant probes goes, beside the rounds' one."""
    return rounds.with_name(f"{rounds.stem}_grants{rounds.suffix}")


@contextlib.asynccontextmanager
async def installation_session(
    conn: asyncpg.Connection, address: str, name: str
) -> AsyncIterator[Provisioner]:
    """A new installation-scope provisioner, its control session open (hello answered) for the
    body, closed after it."""
    _, token = await provisioners.create(conn, name=name, workspace_id=None)
    client = Provisioner(address, token)
    async with anyio.create_task_group() as group:
        ready = anyio.Event()
        group.start_soon(client.run, ready)
        with anyio.fail_after(60):
            await ready.wait()
        yield client
        group.cancel_scope.cancel()


# --- allocation ----------------------------------------------------------------------------------


def skewed(index: int, hot: Sequence[uuid.UUID], cold: Sequence[uuid.UUID]) -> uuid.UUID:
    """The workspace of the backlog's job `index`: 9 of 10 hot, the tenth cold in turn."""
    if index % 10 < 9 or not cold:
        return hot[index % len(hot)]
    return cold[(index // 10) % len(cold)]


async def fill_http(
    address: str, key: str, rows: int, hot: list[uuid.UUID], cold: list[uuid.UUID]
) -> None:
    """`rows` backlog jobs through the enqueue route, FILL_BATCH a request."""
    batches = iter(range(0, rows, FILL_BATCH))

    async def sender() -> None:
        conn = wire.Connection(address)
        try:
            for start in batches:
                end = min(rows, start + FILL_BATCH)
                await enqueue(
                    conn, key, [job(skewed(i, hot, cold), BULK) for i in range(start, end)]
                )
        finally:
            await conn.aclose()

    async with anyio.create_task_group() as group:
        for _ in range(FILL_CONNECTIONS):
            group.start_soon(sender)


async def fill_sql(
    conn: asyncpg.Connection, rows: int, hot: list[uuid.UUID], cold: list[uuid.UUID]
) -> None:
    """The same backlog in one INSERT, in the shape `queue.enqueue` writes (scale.py's fill)."""
    await conn.execute(
        """
        INSERT INTO pending_jobs (workspace_id, workflow_run_id, workflow_run_attempt_id, job_id,
                                  job_execution_id, project_id, required_labels, payload,
                                  created_at)
        SELECT CASE WHEN g % 10 < 9 OR cardinality($2::uuid[]) = 0
                    THEN ($1::uuid[])[1 + g % cardinality($1::uuid[])]
                    ELSE ($2::uuid[])[1 + (g / 10) % greatest(cardinality($2::uuid[]), 1)] END,
               gen_random_uuid(), gen_random_uuid(), gen_random_uuid(), gen_random_uuid(),
               gen_random_uuid(), $4::text[], '{}'::jsonb,
               $5::timestamptz + g * interval '1 microsecond'
        FROM generate_series(0, $3 - 1) AS g
        """,
        hot,
        cold,
        rows,
        BULK,
        datetime.now(UTC) - timedelta(hours=1),
    )


async def one_round(
    client: Provisioner, replica: harness.Replica, conn: asyncpg.Connection, slots: int, budget: int
) -> dict[str, float]:
    """One measured allocation round, run by an advertise of `slots` bulk slots."""
    counters, db = await metrics(replica.address), await backend_cpu(conn)
    cpu = harness.cpu_seconds(replica.process.pid)
    elapsed, message = await client.advertise(
        [Template("bulk", BULK, slots), Template("probe", PROBE, 0)], budget, GRANT_TTL
    )
    spent_db = cpu_spent(db, await backend_cpu(conn))
    spent_replica = harness.cpu_seconds(replica.process.pid) - cpu
    after = await metrics(replica.address)
    name = "controlplane_allocation_round_seconds"
    rounds = after.get(f"{name}_count", 0) - counters.get(f"{name}_count", 0)
    server = after.get(f"{name}_sum", 0) - counters.get(f"{name}_sum", 0)
    return {
        "round_ms": elapsed * 1000,
        "server_round_ms": server / rounds * 1000 if rounds else float("nan"),
        "rounds_in_window": rounds,
        "db_cpu_ms": spent_db * 1000,
        "replica_cpu_ms": spent_replica * 1000,
        "granted_units": granted_units(message, "bulk"),
        "grants": len(message["grants"]),
    }


def _medians(samples: list[dict[str, float]]) -> dict[str, float]:
    return {key: round(statistics.median(s[key] for s in samples), 2) for key in samples[0]}


async def round_costs(
    replica: harness.Replica, conn: asyncpg.Connection, sizes: Sizes
) -> dict[str, Any]:
    """Median figures of `sizes.rounds` rounds at each bulk slot count. Each round is the first
    advertise of a provisioner of its own, so it starts with every slot free and no earlier
    grant of its own to deduct; the grants it makes hold the demand they cover for the rest of
    the run, as a launched runner's reservation would."""
    found: dict[str, Any] = {}
    for slots in sizes.round_slots:
        samples = []
        for index in range(sizes.rounds):
            async with installation_session(conn, replica.address, f"round-{index}") as client:
                samples.append(await one_round(client, replica, conn, slots, sizes.slots))
            await anyio.sleep(0.5)  # its session closed and its actor gone
        found[str(slots)] = _medians(samples)
        print(f"    {slots:>5} bulk slots: {found[str(slots)]}")
    return found


async def grant_latency(
    client: Provisioner,
    address: str,
    key: str,
    workspaces: list[uuid.UUID],
    sizes: Sizes,
) -> dict[str, Any]:
    """Enqueue one probe job at a time into a random workspace of `workspaces`; the seconds to
    the push granting it, or a miss at the deadline."""
    latencies: list[float] = []
    missed = 0
    conn = wire.Connection(address)
    try:
        for _ in range(sizes.probes):
            workspace = str(random.choice(workspaces))
            seen = len(client.demands)
            start = time.perf_counter()
            await enqueue(conn, key, [job(uuid.UUID(workspace), PROBE)])
            arrived = None
            with anyio.move_on_after(sizes.grant_deadline):
                while arrived is None:
                    while seen < len(client.demands):
                        at, message = client.demands[seen]
                        seen += 1
                        if any(
                            g["workspace_id"] == workspace and "probe" in g["labels"]
                            for g in message["grants"]
                        ):
                            arrived = at
                            break
                    else:
                        client.pushed = anyio.Event()
                        await client.pushed.wait()
            if arrived is None:
                missed += 1
            else:
                latencies.append(arrived - start)
    finally:
        await conn.aclose()
    # A miss counts as the deadline, so a p99 over many misses says so.
    summary = harness.summary_ms(latencies + [sizes.grant_deadline] * missed)
    return {**summary, "granted": len(latencies), "missed": missed}


async def allocation_at(
    server: str, tree: Path | None, sizes: Sizes, workspace_count: int, profile: Path | None
) -> dict[str, Any]:
    hot_count = max(1, min(sizes.hot, workspace_count // 10))
    workspaces = [uuid.uuid4() for _ in range(workspace_count)]
    hot, cold = workspaces[:hot_count], workspaces[hot_count:]
    async with cluster(server, 1, tree) as (url, [replica]):
        conn = await asyncpg.connect(url)
        try:
            key = await orchestrator_key(conn)
            started = time.monotonic()
            if sizes.fill == "sql":
                await fill_sql(conn, sizes.pending, hot, cold)
            else:
                await fill_http(replica.address, key, sizes.pending, hot, cold)
            await conn.execute("VACUUM ANALYZE")
            filled_s = time.monotonic() - started
            print(f"  {workspace_count} workspaces: {sizes.pending} pending in {filled_s:.0f} s")
            async with profiled(replica.process.pid, profile):
                rounds = await round_costs(replica, conn, sizes)
            async with installation_session(conn, replica.address, "probes") as client:
                # Steady state for the probes: the bulk slots taken by the backlog for good.
                await client.advertise(
                    [Template("bulk", BULK, sizes.slots), Template("probe", PROBE, PROBE_SLOTS)],
                    sizes.slots,
                    GRANT_TTL,
                )
                async with profiled(replica.process.pid, profile and grant_profile(profile)):
                    probes = {
                        kind: await grant_latency(client, replica.address, key, among, sizes)
                        for kind, among in (("cold", cold or hot), ("hot", hot))
                    }
                for kind, figures in probes.items():
                    print(
                        f"    grant, {kind} workspace: p50 {figures['p50_ms']} ms, "
                        f"p99 {figures['p99_ms']} ms, {figures['missed']} missed"
                    )
        finally:
            await conn.close()
    return {
        "workspaces": workspace_count,
        "hot_workspaces": hot_count,
        "filled_in_s": round(filled_s, 1),
        "rounds_by_bulk_slots": rounds,
        "grant": probes,
    }


async def allocation(
    server: str, tree: Path | None, sizes: Sizes, profile: Path | None = None
) -> dict[str, Any]:
    """Both workspace counts; with `profile`, py-spy records the replica through the rounds of
    the larger one (the slowest figure), and through its grant probes (`grant_profile`)."""
    found: dict[str, Any] = {
        "pending": sizes.pending,
        "slots": sizes.slots,
        "rounds_per_point": sizes.rounds,
        "probes": sizes.probes,
        "grant_deadline_s": sizes.grant_deadline,
        "fill": sizes.fill,
        "by_workspaces": {},
    }
    for count in (sizes.workspaces, sizes.baseline_workspaces):
        found["by_workspaces"][str(count)] = await allocation_at(
            server, tree, sizes, count, profile if count == sizes.workspaces else None
        )
    if profile is not None:
        found["profile"] = profile_summary(profile)
        found["grant_profile"] = profile_summary(grant_profile(profile))
    big = found["by_workspaces"][str(sizes.workspaces)]["rounds_by_bulk_slots"]
    small = found["by_workspaces"][str(sizes.baseline_workspaces)]["rounds_by_bulk_slots"]
    found["round_ms_ratio_to_baseline"] = {
        slots: round(big[slots]["round_ms"] / small[slots]["round_ms"], 2) for slots in big
    }
    return found


# --- fan-out -------------------------------------------------------------------------------------


async def steady_enqueues(
    address: str, key: str, rate: float, workspaces: list[uuid.UUID], seconds: float
) -> int:
    """`rate` jobs a second for `seconds`, each into a random workspace, in batches every 50 ms
    (one NOTIFY per job's workspace); the number sent."""
    tick, sent = 0.05, 0
    conn = wire.Connection(address)
    try:
        start = time.monotonic()
        while (now := time.monotonic()) - start < seconds:
            due = int(rate * (now - start + tick)) - sent
            if due > 0:
                await enqueue(
                    conn, key, [job(random.choice(workspaces), ["linux"]) for _ in range(due)]
                )
                sent += due
            await anyio.sleep(max(0.0, start + (sent / rate) - time.monotonic()))
    finally:
        await conn.aclose()
    return sent


async def fanout(server: str, tree: Path | None, sizes: Sizes) -> dict[str, Any]:
    async with cluster(server, sizes.fanout_replicas + 1, tree) as (url, started):
        *listeners, front = started
        pids = [replica.process.pid for replica in listeners]
        conn = await asyncpg.connect(url)
        try:
            key = await orchestrator_key(conn)
        finally:
            await conn.close()
        workspaces = [uuid.uuid4() for _ in range(sizes.fanout_workspaces)]
        await anyio.sleep(sizes.settle)
        before = proc_window(pids)
        await anyio.sleep(sizes.fanout_seconds)
        idle = cpu_percent(pids, before)
        before = proc_window([*pids, front.process.pid])
        sent = await steady_enqueues(
            front.address, key, sizes.fanout_rate, workspaces, sizes.fanout_seconds
        )
        elapsed = time.monotonic() - before[0]
        *loaded, front_cpu = cpu_percent([*pids, front.process.pid], before)
        rss = rss_mib(pids)
    found = {
        "replicas_listening": len(listeners),
        "workspaces": sizes.fanout_workspaces,
        "target_rate": sizes.fanout_rate,
        "achieved_rate": round(sent / elapsed, 1),
        "window_s": round(elapsed, 1),
        "idle_cpu_percent": idle,
        "loaded_cpu_percent": loaded,
        "enqueueing_replica_cpu_percent": front_cpu,
        "listener_rss_mib": rss,
    }
    print(
        f"  fan-out at {found['achieved_rate']} enqueues/s: listeners' CPU {loaded} % "
        f"(idle {idle} %), enqueueing replica {front_cpu} %"
    )
    return found


# --- the run -------------------------------------------------------------------------------------


def results_dir(smoke: bool) -> Path:
    """bench/results (or BENCH_RESULTS); a smoke run never writes to bench/results."""
    if smoke and not os.environ.get("BENCH_RESULTS"):
        return Path(tempfile.gettempdir()) / "cp-bench-installation-smoke"
    return harness.RESULTS


async def run(
    sizes: Sizes = SIZES, tree: Path | None = None, smoke: bool = False, profile: bool = False
) -> dict[str, Any]:
    """Run the parts of `sizes`; with `profile` (and py-spy installed), the replica of the
    larger allocation run is profiled through its rounds (installation_profile.txt) and its
    grant probes (installation_profile_grants.txt), and every replica through the sessions'
    grants (installation_profile_sessions_N.txt) and the parked runners' dispatches
    (installation_profile_parked_N.txt). A profiled run's figures include py-spy's own CPU."""
    # Each session is a socket here; the parked runners are spread over child processes.
    raise_fd_limit(sizes.sessions + sizes.installation_sessions + 1000)
    folder = results_dir(smoke)
    results: dict[str, Any] = {}
    with harness.postgres() as server:
        if "allocation" in sizes.parts:
            print("allocation:")
            spied = folder / "installation_profile.txt" if profile else None
            results["allocation"] = await allocation(server, tree, sizes, spied)
        if "sessions" in sizes.parts:
            print("sessions:")
            async with cluster(server, sizes.session_replicas, tree) as (url, started):
                results["sessions"] = await installation_fleets.sessions(
                    url, started, sizes, folder if profile else None
                )
        if "parked" in sizes.parts:
            print("parked:")
            async with cluster(server, sizes.parked_replicas, tree) as (url, started):
                results["parked"] = await installation_fleets.parked(
                    url, started, sizes, folder if profile else None
                )
        if "fanout" in sizes.parts:
            print("fanout:")
            results["fanout"] = await fanout(server, tree, sizes)
    stamp = harness.machine()["measured_at"]
    for part in results.values():
        part["measured_at"] = stamp
    path = folder / "installation.json"
    if set(sizes.parts) != set(PARTS):
        # A partial run keeps the other parts' figures from the last run, each with its own time.
        with contextlib.suppress(OSError, ValueError):
            earlier = json.loads(path.read_text())
            results = {**{n: earlier[n] for n in PARTS if n in earlier}, **results}
    results["tree"] = str(tree) if tree else "this checkout"
    results["smoke"] = smoke
    results["sizes"] = {k: v for k, v in dataclasses.asdict(sizes).items() if k != "parts"}
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": harness.machine(), **results}, indent=2) + "\n")
    print(f"wrote {path}")
    return results


def _numbers(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part)


def parse(argv: Sequence[str] | None = None) -> tuple[Sizes, Path | None, bool, bool]:
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--smoke", action="store_true")
    smoke = first.parse_known_args(argv)[0].smoke
    defaults = SMOKE if smoke else SIZES
    parser = argparse.ArgumentParser(
        prog="python -m bench.installation",
        description="A big installation (issue 16): allocation rounds, provisioner sessions, "
        "parked runners and NOTIFY fan-out, each beside a same-run baseline (see the module's "
        "docstring). Defaults are the issue's sizes.",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="small sizes (about two minutes), results not kept"
    )
    parser.add_argument("--tree", type=Path, help="measure the replicas of this checkout")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="py-spy the replicas through the larger allocation run's rounds and grant probes, "
        "the sessions' grants and the parked runners' dispatches (if installed)",
    )
    for spec in dataclasses.fields(Sizes):
        value = getattr(defaults, spec.name)
        flag = "--" + spec.name.replace("_", "-")
        if spec.name == "parts":
            parser.add_argument(flag, default=",".join(value), help="comma-separated subset")
        elif isinstance(value, tuple):
            parser.add_argument(
                flag, type=_numbers, default=value, help="comma-separated (%(default)s)"
            )
        elif spec.name == "fill":
            parser.add_argument(flag, choices=("http", "sql"), default=value, help="%(default)s")
        else:
            parser.add_argument(flag, type=type(value), default=value, help="%(default)s")
    args = parser.parse_args(argv)
    parts = tuple(part for part in args.parts.split(",") if part)
    if unknown := set(parts) - set(PARTS):
        parser.error(f"unknown parts: {', '.join(sorted(unknown))}")
    given = {spec.name: getattr(args, spec.name) for spec in dataclasses.fields(Sizes)}
    return Sizes(**{**given, "parts": parts}), args.tree, smoke, args.profile


def main(argv: Sequence[str] | None = None) -> None:
    sizes, tree, smoke, profile = parse(argv)

    async def go() -> None:
        await run(sizes, tree, smoke, profile)

    anyio.run(go)
    if not smoke or os.environ.get("BENCH_RESULTS"):
        report.main()  # docs/benchmarks.md, or BENCH_RESULTS/benchmarks.md


if __name__ == "__main__":
    main()
