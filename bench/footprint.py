"""Footprint: what one job of the HTTP lifecycle costs PostgreSQL and the daemon.

One replica (the daemon's default pool size) on an embedded PostgreSQL, `runners` HTTP runners
parked on it, `enqueuers` orchestrator connections enqueuing one job per request over HTTP; each
job is claimed (long poll), heartbeated once and completed. Beside it in the same run, the SQL
floor: the same four steps as the store's own statements on direct connections, each a runner
of its own workspace (enqueue one, claim, heartbeat, complete), no HTTP and no daemon work in
between.

Per job, for each: rows inserted, updated and deleted (pg_stat_user_tables, per table), WAL bytes
(pg_current_wal_lsn before and after), committed transactions (pg_stat_database), CPU of every
PostgreSQL process (the postmaster's own and reaped children's time plus its live children's,
from /proc) and of the daemon process; so jobs/s per core of each side. Two idle windows of the
same replica say what is not per job: with no runner (per replica: its periodic rounds) and with
the runners parked (per idle session); each lifecycle window has the idle rate of its elapsed
time taken off, and the gross figure is kept beside the net one.

Connections of the replica, from pg_stat_activity matched to the replica's own sockets by client
port: idle and active, the LISTEN connection and the leader lock's (the only two that run `SELECT
1`, their probe; the lock's is the one holding `locks.LEADER_KEY`, or on a follower the one whose
last statement tried it).

First, on a database of its own with no daemon: the transactions one notifying commit costs with
0, 1 and 3 LISTEN sessions (every replica holds one, and every enqueue notifies).

bench/pgstats.py takes the readings: CPU and WAL at each window's edges, statistics counters
after `SETTLE_SECONDS` of quiet (backends publish them up to 10 s late).
"""

from __future__ import annotations

import argparse
import statistics
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import anyio
import asyncpg

from bench import harness, throughput, wire
from bench.pgstats import SETTLE_SECONDS, TABLE_COUNTERS, Meter, replica_connections
from controlplane.agent import queue_client
from controlplane.domain.jobs import Outcome
from controlplane.settings import Database
from controlplane.store import claiming, credentials, leases, queue

JOBS = 3000
RUNNERS = 50
ENQUEUERS = 10
IDLE_SECONDS = 60.0
ROUNDS = 3
FANOUT_LISTENERS = (0, 1, 3)
FANOUT_NOTIFIES = 300


def _most(samples: list[dict[str, int]]) -> dict[str, int]:
    return {key: max(sample[key] for sample in samples) for key in samples[0]} if samples else {}


# --- the two lifecycles -----------------------------------------------------------------------


async def _enqueuer(address: str, token: str, workspace: uuid.UUID, tickets: Iterator[int]) -> None:
    conn = wire.Connection(address)
    try:
        for _ in tickets:
            status, body = await conn.post(
                "/v1/jobs",
                token,
                queue_client.enqueue_body(workspace, ["linux"], ["true"], datetime.now(UTC)),
            )
            assert status == 200, (status, body)
            assert body["results"][0]["result"] == "enqueued", body
    finally:
        await conn.aclose()


class HttpSide:
    """`runners` runners parked on the replica in one workspace, and an orchestrator key."""

    def __init__(self, url: str, address: str, runners: int, enqueuers: int) -> None:
        self.url, self.address = url, address
        self.runners, self.enqueuers = runners, enqueuers
        self.workspace = uuid.uuid4()
        self.clients = throughput.runner_clients([address], runners)
        self.done = 0
        self.target = 1 << 62  # nothing to reach until `arm`
        self.reached = anyio.Event()
        self.halfway = anyio.Event()

    def _counted(self) -> None:
        self.done += 1
        if self.done * 2 >= self.target:
            self.halfway.set()
        if self.done >= self.target:
            self.reached.set()

    async def serve(self, stop: anyio.Event) -> None:
        """Run the runners until `stop`."""
        registration = await throughput.registration_token(self.url, self.workspace)
        async with anyio.create_task_group() as group:
            for client in self.clients:
                # The server's default hold (50 s), as real runners park.
                group.start_soon(
                    throughput.lifecycle_runner,
                    client,
                    registration,
                    stop,
                    self._counted,
                    "/v1/runners/jobs/request",
                )
            await stop.wait()
            group.cancel_scope.cancel()
        for client in self.clients:
            await client.aclose()

    def arm(self, jobs: int) -> None:
        """Count the next `jobs` completions (before `lifecycle` starts, so `halfway` is the
        event a watcher waits on)."""
        self.done, self.target = 0, jobs
        self.reached, self.halfway = anyio.Event(), anyio.Event()

    async def lifecycle(self, token: str) -> None:
        """Enqueue the armed jobs over HTTP and wait until the runners have completed them
        all, within a deadline of at least 5 jobs a second."""
        tickets = iter(range(self.target))
        with anyio.fail_after(max(120.0, self.target / 5)):
            async with anyio.create_task_group() as group:
                for _ in range(self.enqueuers):
                    group.start_soon(_enqueuer, self.address, token, self.workspace, tickets)
            await self.reached.wait()


async def sql_floor(url: str, connections: int, jobs: int) -> None:
    """The four steps as the store's statements on `connections` direct connections. Each
    connection is a runner of its own workspace, so that its claim finds the job it has just
    enqueued (in one shared workspace a claim can come back empty while the others' rows are
    locked by their claims, and the retries would be counted as the floor's work)."""
    pool = await asyncpg.create_pool(url, min_size=connections, max_size=connections)
    assert pool is not None
    tickets = iter(range(jobs))

    async def worker() -> None:
        workspace = uuid.uuid4()
        async with pool.acquire() as conn:
            session = await harness.manual_session(conn, workspace)
            for _ in tickets:
                await queue.enqueue(conn, [harness.new_job(workspace)])
                job = await claiming.claim(conn, session)
                assert job is not None, "a worker's own job was not claimable"
                execution = job.identity.job_execution_id
                await leases.heartbeat(conn, execution, session.runner_session_id)
                await leases.complete(conn, execution, session.runner_session_id, Outcome.SUCCEEDED)

    try:
        with anyio.fail_after(max(120.0, jobs / 5)):
            async with anyio.create_task_group() as group:
                for _ in range(connections):
                    group.start_soon(worker)
    finally:
        await pool.close()


async def notify_fanout(
    server: str, listeners: int, notifies: int = FANOUT_NOTIFIES
) -> dict[str, float]:
    """Transactions a notifying commit costs with `listeners` LISTEN sessions: each listening
    backend reads the notification queue in a transaction of its own (one read may take several
    notifications). Plain `pg_notify` commits from one connection, in a database of their own."""
    url = await harness.empty_database(server)
    heard = [0] * listeners
    sessions: list[asyncpg.Connection] = []
    for index in range(listeners):
        listening = await asyncpg.connect(url)

        def count(*_args: object, index: int = index) -> None:
            heard[index] += 1

        await listening.add_listener("cp_bench_fanout", count)
        sessions.append(listening)
    await anyio.sleep(SETTLE_SECONDS)
    reader = await asyncpg.connect(url)
    before = await harness.database_counters(reader)
    sender = await asyncpg.connect(url)
    for _ in range(notifies):
        await sender.execute("SELECT pg_notify('cp_bench_fanout', 'x')")
    await sender.close()
    with anyio.fail_after(60):
        while listeners and min(heard) < notifies:
            await anyio.sleep(0.05)
    for listening in sessions:
        await listening.close()  # a backend publishes its counters as it exits
    await anyio.sleep(SETTLE_SECONDS)
    after = await harness.database_counters(reader)
    await reader.close()
    await harness.drop_database(url)
    # The reader's first read is a transaction of its own, counted in `after`.
    commits = harness.counter_delta(before, after)["xact_commit"] - 1
    return {"listeners": listeners, "transactions_per_notify": round(commits / notifies, 3)}


# --- figures ----------------------------------------------------------------------------------


def _rate(total: float | None, seconds: float) -> float | None:
    return None if total is None or seconds <= 0 else total / seconds


def per_job(window: dict[str, Any], idle: dict[str, Any] | None, jobs: int) -> dict[str, Any]:
    """One window's totals per job, gross and net of `idle`'s rates over the same elapsed time."""

    def net(total: float | None, idle_total: float | None, seconds: float) -> float | None:
        if total is None:
            return None
        if idle is None or idle_total is None:
            return total / jobs
        idle_seconds = float(idle["seconds"])
        return (total - idle_total / idle_seconds * seconds) / jobs

    def net_counter(total: float, idle_total: float | None) -> float:
        if idle is None or idle_total is None:
            return total / jobs
        share = float(window["counter_seconds"]) / float(idle["counter_seconds"])
        return (total - idle_total * share) / jobs

    seconds = window["seconds"]
    idle_of = idle or {}
    figures: dict[str, Any] = {
        "jobs": jobs,
        "seconds": round(seconds, 2),
        "jobs_per_s": round(jobs / seconds, 1),
        "gross": {
            "pg_cpu_us": _round(_rate(window["pg_cpu"], jobs / 1e6)),
            "daemon_cpu_us": _round(_rate(window["daemon_cpu"], jobs / 1e6)),
            "client_cpu_us": _round(window["client_cpu"] / jobs * 1e6),
            "wal_bytes": round(window["wal_bytes"] / jobs, 1),
            "xact_commit": round(window["database"]["xact_commit"] / jobs, 3),
        },
    }
    pg = net(window["pg_cpu"], idle_of.get("pg_cpu"), seconds)
    daemon = net(window["daemon_cpu"], idle_of.get("daemon_cpu"), seconds)
    figures["net"] = {
        "pg_cpu_us": _round(pg * 1e6 if pg is not None else None),
        "daemon_cpu_us": _round(daemon * 1e6 if daemon is not None else None),
        "wal_bytes": round(net(window["wal_bytes"], idle_of.get("wal_bytes"), seconds) or 0, 1),
        "xact_commit": round(
            net_counter(
                window["database"]["xact_commit"], idle_of.get("database", {}).get("xact_commit")
            ),
            3,
        ),
        "pg_jobs_per_core_s": _round(1 / pg if pg else None),
        "daemon_jobs_per_core_s": _round(1 / daemon if daemon else None),
    }
    idle_tables = idle_of.get("tables", {})
    rows: dict[str, dict[str, float]] = {}
    for table, counts in window["tables"].items():
        quiet = idle_tables.get(table, {})
        rows[table] = {
            name.removeprefix("n_tup_"): round(net_counter(counts[name], quiet.get(name, 0)), 3)
            for name in TABLE_COUNTERS
        }
    figures["rows_per_job"] = rows
    figures["rows_per_job_total"] = {
        kind: round(sum(row[kind] for row in rows.values()), 3)
        for kind in ("ins", "upd", "hot_upd", "del")
    }
    return figures


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def idle_rates(window: dict[str, Any]) -> dict[str, Any]:
    """An idle window as rates a minute."""
    minutes = window["seconds"] / 60
    counted = window["counter_seconds"] / 60
    tables = window["tables"]
    return {
        "seconds": round(window["seconds"], 1),
        "pg_cpu_percent": _round(_rate(window["pg_cpu"], window["seconds"] / 100)),
        "daemon_cpu_percent": _round(_rate(window["daemon_cpu"], window["seconds"] / 100)),
        "wal_bytes_per_min": round(window["wal_bytes"] / minutes),
        "xact_commit_per_min": round(window["database"]["xact_commit"] / counted, 1),
        "rows_written_per_min": round(
            sum(c["n_tup_ins"] + c["n_tup_upd"] + c["n_tup_del"] for c in tables.values())
            / counted,
            1,
        ),
    }


def _median_figures(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The round whose net PostgreSQL CPU per job is the median (all rounds kept beside it)."""
    if len(rounds) == 1:
        return rounds[0]
    key = [r["net"]["pg_cpu_us"] or 0.0 for r in rounds]
    middle = statistics.median_low(key)
    return rounds[key.index(middle)]


# --- the run ----------------------------------------------------------------------------------


async def run(
    jobs: int = JOBS,
    runners: int = RUNNERS,
    enqueuers: int = ENQUEUERS,
    idle_seconds: float = IDLE_SECONDS,
    rounds: int = ROUNDS,
) -> dict[str, Any]:
    pool_size = Database().pool_max_size
    result: dict[str, Any] = {
        "jobs_per_round": jobs,
        "runners": runners,
        "enqueuers": enqueuers,
        "idle_seconds": idle_seconds,
        "rounds": rounds,
        "pool_max_size": pool_size,
    }
    with harness.postgres() as server:
        result["notify_fanout"] = [await notify_fanout(server, n) for n in FANOUT_LISTENERS]
        print(f"NOTIFY fan-out: {result['notify_fanout']}")
        url = await harness.fresh_database(server)
        admin = await asyncpg.connect(server)
        db = await asyncpg.connect(url)
        async with harness.replicas(
            url, 1, CONTROLPLANE_DATABASE_POOL_MAX_SIZE=str(pool_size)
        ) as started:
            replica = started[0]
            pid = replica.process.pid
            meter = Meter(admin, db, pid)
            await meter.start()
            result["postgres_cpu_measured"] = meter.postmaster is not None
            _, orchestrator = await credentials.create_api_key(db, kind="orchestrator", name="fp")

            async def idle_window() -> dict[str, Any]:
                await anyio.sleep(SETTLE_SECONDS)
                before = await meter.counters()
                first = await meter.edge()
                await anyio.sleep(idle_seconds)
                return await meter.window(first, await meter.edge(), before)

            quiet = await idle_window()
            result["idle_no_runners"] = idle_rates(quiet)
            result["connections_idle_no_runners"] = await replica_connections(admin, pid)
            print(f"idle, no runners: {result['idle_no_runners']}")

            side = HttpSide(url, replica.address, runners, enqueuers)
            stop = anyio.Event()
            https: list[dict[str, Any]] = []
            sqls: list[dict[str, Any]] = []
            busy: list[dict[str, int]] = []
            async with anyio.create_task_group() as group:
                group.start_soon(side.serve, stop)
                parked = await idle_window()
                result["idle_parked"] = idle_rates(parked)
                result["connections_idle_parked"] = await replica_connections(admin, pid)
                print(f"idle, {runners} parked: {result['idle_parked']}")
                for index in range(rounds):
                    for variant in harness.alternated(index, ["http", "sql"]):
                        await anyio.sleep(SETTLE_SECONDS)
                        before = await meter.counters()
                        first = await meter.edge()
                        if variant == "http":
                            async with anyio.create_task_group() as inner:
                                side.arm(jobs)
                                inner.start_soon(side.lifecycle, orchestrator)
                                await side.halfway.wait()
                                busy.append(await replica_connections(admin, pid))
                        else:
                            await sql_floor(url, runners, jobs)
                        window = await meter.window(first, await meter.edge(), before)
                        figures = per_job(window, parked, jobs)
                        (https if variant == "http" else sqls).append(figures)
                        print(
                            f"round {index} {variant}: {figures['jobs_per_s']} jobs/s, "
                            f"net {figures['net']}, rows {figures['rows_per_job_total']}"
                        )
                stop.set()
            result["connections_busy"] = _most(busy)
        await db.close()
        await admin.close()
    result["http"] = _median_figures(https)
    result["sql_floor"] = _median_figures(sqls)
    result["http_rounds"] = https
    result["sql_floor_rounds"] = sqls
    path = harness.write_result("footprint", result)
    print(f"wrote {path}")
    return result


# --- the report's section ---------------------------------------------------------------------


def _cell(value: object) -> str:
    return "n/a" if value is None else str(value)


def render(result: dict[str, Any]) -> list[str]:
    """docs/benchmarks.md's section (bench/report.py calls it)."""
    m = result["machine"]
    http, sql = result["http"], result["sql_floor"]
    lines = [
        "## Footprint per job (what one PostgreSQL carries)",
        "",
        f"Machine: {m['cores']} cores ({m['cpu']}), {m['memory_mib']} MiB, Python "
        f"{m['python']}, measured {m['measured_at']}. `python -m bench footprint`: one replica "
        f"(pool of {result['pool_max_size']}), {result['runners']} HTTP runners parked on it, "
        f"{result['enqueuers']} orchestrator connections enqueuing one job per request; each "
        "job claimed, heartbeated once and completed. The SQL floor runs the same four steps as "
        "the store's statements on as many direct connections, in the same run, alternating. "
        f"{result['jobs_per_round']} jobs per round, {result['rounds']} round(s); of each "
        "variant the round with the median PostgreSQL CPU per job is shown (the lower one of an "
        "even count), every round is in bench/results/footprint.json. Net: with the rates of "
        f"an idle window ({result['idle_seconds']} s, the runners parked) taken off over the "
        "same time.",
        "",
        "| per job | HTTP lifecycle | SQL floor (baseline) | HTTP / SQL |",
        "|---|---:|---:|---:|",
    ]

    def row(label: str, a: float | None, b: float | None, ratio: bool = True) -> str:
        quotient = round(a / b, 2) if ratio and a is not None and b else None
        return f"| {label} | {_cell(a)} | {_cell(b)} | {_cell(quotient)} |"

    hn, sn = http["net"], sql["net"]
    lines += [
        row("jobs/s (this run, shared machine)", http["jobs_per_s"], sql["jobs_per_s"]),
        row("PostgreSQL CPU us (net)", hn["pg_cpu_us"], sn["pg_cpu_us"]),
        row("PostgreSQL jobs/s per core", hn["pg_jobs_per_core_s"], sn["pg_jobs_per_core_s"]),
        row(
            "daemon CPU us (net; beside the SQL floor: hearing its NOTIFYs)",
            hn["daemon_cpu_us"],
            sn["daemon_cpu_us"],
            ratio=False,
        ),
        row("daemon jobs/s per core", hn["daemon_jobs_per_core_s"], None),
        row("WAL bytes (net)", hn["wal_bytes"], sn["wal_bytes"]),
        row("transactions committed (net)", hn["xact_commit"], sn["xact_commit"]),
    ]
    for kind, label in (
        ("ins", "rows inserted"),
        ("upd", "rows updated"),
        ("hot_upd", "of those, HOT updates"),
        ("del", "rows deleted"),
    ):
        lines.append(row(label, http["rows_per_job_total"][kind], sql["rows_per_job_total"][kind]))
    lines += ["", "Rows per job by table (HTTP lifecycle, net; inserted / updated / deleted):", ""]
    for table, counts in sorted(http["rows_per_job"].items()):
        lines.append(f"* `{table}`: {counts['ins']} / {counts['upd']} / {counts['del']}")
    lines += [
        "",
        "| idle window | PostgreSQL CPU % | daemon CPU % | WAL bytes/min | transactions/min | "
        "rows written/min |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for key, label in (
        ("idle_no_runners", "replica, no runner"),
        ("idle_parked", f"{result['runners']} runners parked"),
    ):
        idle = result[key]
        lines.append(
            f"| {label} | {_cell(idle['pg_cpu_percent'])} | {_cell(idle['daemon_cpu_percent'])}"
            f" | {idle['wal_bytes_per_min']} | {idle['xact_commit_per_min']} | "
            f"{idle['rows_written_per_min']} |"
        )
    lines += [
        "",
        "| replica's connections | total | active | idle | pool | LISTEN | leader lock |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for key, label in (
        ("connections_idle_no_runners", "idle, no runner"),
        ("connections_idle_parked", "idle, runners parked"),
        ("connections_busy", "mid-lifecycle (the most of one sample a round)"),
    ):
        c = result.get(key) or {}
        if c:
            lines.append(
                f"| {label} | {c['total']} | {c['active']} | {c['idle']} | {c['pool']} | "
                f"{c['listen']} | {c['leader_lock']} |"
            )
    fanout = result.get("notify_fanout")
    if fanout:
        lines += [
            "",
            f"Transactions per notifying commit ({FANOUT_NOTIFIES} `pg_notify` commits in a row, "
            "no daemon), by LISTEN sessions: "
            + ", ".join(f"{f['listeners']}: {f['transactions_per_notify']}" for f in fanout)
            + ". Each listening backend reads the notification queue in a transaction of its "
            "own, so every replica's LISTEN connection adds up to one transaction a notifying "
            "commit (fewer when one read takes several).",
        ]
    return [*lines, "", "docs/scaling.md reads these figures.", ""]


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.footprint", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--jobs", type=int, default=JOBS)
    parser.add_argument("--runners", type=int, default=RUNNERS)
    parser.add_argument("--enqueuers", type=int, default=ENQUEUERS)
    parser.add_argument("--idle-seconds", type=float, default=IDLE_SECONDS)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args()

    async def go() -> None:
        await run(args.jobs, args.runners, args.enqueuers, args.idle_seconds, args.rounds)

    anyio.run(go)


if __name__ == "__main__":
    main()
