"""Throughput: the whole job lifecycle, through HTTP and as plain SQL, on one PostgreSQL.

A run pre-enqueues `jobs` executions, then lets `runners` concurrent workers take them until
none is left; jobs/s is jobs divided by the time from the first request to the last completion.

* http: runners over real HTTP against one daemon process: long-poll claim, one heartbeat,
  complete (three requests per job). One replica, because a replica is one event loop on one
  core and this machine has two, shared with PostgreSQL and the client (bench/scale.py measures
  1, 2 and 3 replicas). Each runner is one keep-alive connection of the lean client in
  bench/wire.py, so that the benchmark's own client takes little of the two cores;
* sql: the same three steps as the store's own statements on direct asyncpg connections, with no
  HTTP, daemon or token work in between: the floor of what the database allows with our schema;
* http with policies: the same HTTP lifecycle, interleaved with the plain one round by round,
  with every job carrying one of POLICY_KEYS concurrency keys (limit POLICY_KEY_LIMIT) and one of
  POLICY_PROJECTS projects, in a workspace set to `fair` ordering (issue 14: within 20% of the
  plain lifecycle; the ratio of each round's pair is reported, and the median of those ratios);
* pgbench: TPC-B (`pgbench -c 10 -j 2 -T 10`) on the same server, for the machine's scale;
* peers: procrastinate and pgqueuer on the same server (bench/peers.py), each beside our HTTP
  and SQL figures measured again at the same concurrency just before it.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import anyio
import asyncpg

from bench import harness, peers, wire
from controlplane.domain.jobs import NewJob, Outcome
from controlplane.store import claiming, credentials, leases, ordering, queue

RUNNER_COUNTS = (10, 50, 200)
JOBS = 6000
REPLICAS = 1
ROUNDS = 3  # each figure is the median of this many runs (single runs varied by a third)
POLICY_KEYS = 100  # concurrency keys of the policies variant, POLICY_KEY_LIMIT each: up to 500
POLICY_KEY_LIMIT = 5  # running at once, more than the largest runner count, so no key starves
POLICY_PROJECTS = 10  # projects the fair ordering ranks by their running executions


def _policy_job(workspace: uuid.UUID, projects: list[uuid.UUID], index: int) -> NewJob:
    """A job of the policies variant: a concurrency key and a project, round-robin."""
    job = harness.new_job(workspace)
    return replace(
        job,
        identity=replace(job.identity, project_id=projects[index % len(projects)]),
        concurrency_key=f"key-{index % POLICY_KEYS}",
        concurrency_limit=POLICY_KEY_LIMIT,
    )


async def _fill(url: str, workspace: uuid.UUID, count: int, policies: bool = False) -> None:
    conn = await asyncpg.connect(url)
    try:
        if policies:
            await ordering.set_workspace_ordering(conn, workspace, ordering.Ordering.FAIR)
            projects = [uuid.uuid4() for _ in range(POLICY_PROJECTS)]
            jobs = [_policy_job(workspace, projects, index) for index in range(count)]
        else:
            jobs = [harness.new_job(workspace) for _ in range(count)]
        for start in range(0, count, 500):
            await queue.enqueue(conn, jobs[start : start + 500])
        # Statistics as autovacuum keeps them on a running system. Without this a burst into a
        # new workspace is planned from statistics that have never seen it (a few rows, so a
        # bitmap scan and a sort of every pending row of the workspace, 1.7 ms a claim against
        # 0.03 ms by the index with 6,000 rows), until autovacuum analyses the table, up to a
        # minute later: the first rounds of a run measured that, not the steady state.
        await conn.execute("ANALYZE pending_jobs")
    finally:
        await conn.close()


async def sql_lifecycle(url: str, runners: int, jobs: int) -> float:
    workspace = uuid.uuid4()
    await _fill(url, workspace, jobs)
    pool = await asyncpg.create_pool(url, min_size=runners, max_size=runners)
    assert pool is not None
    done = 0

    async def worker() -> None:
        nonlocal done
        async with pool.acquire() as conn:
            session = await harness.manual_session(conn, workspace)
            while (job := await claiming.claim(conn, session)) is not None:
                execution = job.identity.job_execution_id
                await leases.heartbeat(conn, execution, session.runner_session_id)
                await leases.complete(conn, execution, session.runner_session_id, Outcome.SUCCEEDED)
                done += 1

    start = time.perf_counter()
    async with anyio.create_task_group() as group:
        for _ in range(runners):
            group.start_soon(worker)
    elapsed = time.perf_counter() - start
    await pool.close()
    assert done == jobs, (done, jobs)
    return jobs / elapsed


async def lifecycle_runner(
    conn: wire.Connection,
    registration: str,
    stop: anyio.Event,
    on_done: Callable[[], None],
    request: str = "/v1/runners/jobs/request?wait=1",
) -> None:
    """One runner: register, then claim (long poll, held as `request` asks: 1 s by default),
    heartbeat once and complete until `stop`."""
    status, body = await conn.post("/v1/runners/register", registration, {"labels": ["linux"]})
    assert status == 200, (status, body)
    session = body["session_token"]
    while not stop.is_set():
        status, body = await conn.post(request, session)
        if status != 200:
            continue
        path = f"/v1/runners/jobs/{body['job_execution_id']}"
        status, beat = await conn.post(f"{path}/heartbeat", body["lease_token"])
        assert status == 200, (status, beat)
        status, done = await conn.post(
            f"{path}/complete", beat["lease_token"], {"outcome": "succeeded"}
        )
        assert status == 200, (status, done)
        on_done()


def runner_clients(addresses: list[str], runners: int) -> list[wire.Connection]:
    """One connection per runner, as real runners have, spread over the replicas."""
    return [wire.Connection(addresses[index % len(addresses)]) for index in range(runners)]


async def registration_token(url: str, workspace: uuid.UUID) -> str:
    conn = await asyncpg.connect(url)
    try:
        _, registration = await credentials.create_manual_token(
            conn, workspace_id=workspace, name="b"
        )
    finally:
        await conn.close()
    return registration


async def http_lifecycle(
    url: str, addresses: list[str], runners: int, jobs: int, policies: bool = False
) -> float:
    """Jobs/s of `runners` HTTP runners spread over the replicas at `addresses`; with
    `policies`, every job has a concurrency key and the workspace orders fairly."""
    workspace = uuid.uuid4()
    registration = await registration_token(url, workspace)
    await _fill(url, workspace, jobs, policies)
    clients = runner_clients(addresses, runners)
    done = 0
    finished = anyio.Event()

    def counted() -> None:
        nonlocal done
        done += 1
        if done >= jobs:
            finished.set()

    start = time.perf_counter()
    async with anyio.create_task_group() as group:
        for client in clients:
            group.start_soon(lifecycle_runner, client, registration, finished, counted)
        await finished.wait()
        elapsed = time.perf_counter() - start
        group.cancel_scope.cancel()
    for client in clients:
        await client.aclose()
    return jobs / elapsed


async def pgbench_tps(server_url: str) -> float | None:
    binary = Path(harness.pg_bin_dir()) / "pgbench"
    parts = urlsplit(server_url)
    target = ["-h", "127.0.0.1", "-p", str(parts.port), "-U", "postgres"]
    # The password goes by the environment, never on a command line that `ps` shows.
    env = {**os.environ, "PGPASSWORD": unquote(parts.password or "")}
    init = await anyio.run_process(
        [str(binary), "-i", "-s", "10", "-q", *target, "postgres"], env=env
    )
    if init.returncode != 0:
        return None
    run = await anyio.run_process(
        [str(binary), "-c", "10", "-j", "2", "-T", "10", *target, "postgres"], check=False, env=env
    )
    found = re.search(r"tps = ([0-9.]+)", run.stdout.decode())
    return float(found.group(1)) if found else None


async def run(
    jobs: int = JOBS,
    runner_counts: tuple[int, ...] = RUNNER_COUNTS,
    peer_concurrency: tuple[int, ...] = peers.CONCURRENCY,
    rounds: int = ROUNDS,
) -> dict[str, Any]:
    results: dict[str, Any] = {
        "jobs_per_run": jobs,
        "replicas": REPLICAS,
        "rounds": rounds,
        "policies": {
            "keys": POLICY_KEYS,
            "key_limit": POLICY_KEY_LIMIT,
            "projects": POLICY_PROJECTS,
        },
        "runs": {},
    }
    with harness.postgres() as server:
        url = await harness.fresh_database(server)
        async with harness.replicas(url, REPLICAS) as started:
            addresses = [replica.address for replica in started]
            for count in runner_counts:
                sqls: list[float] = []
                https: list[float] = []
                policed: list[float] = []
                for index in range(rounds):  # interleaved, so a slow spell hits every figure
                    sqls.append(await sql_lifecycle(url, count, jobs))
                    pair = [False, True] if index % 2 == 0 else [True, False]
                    for policies in pair:  # plain and policies alternate which goes first
                        rate = await http_lifecycle(url, addresses, count, jobs, policies)
                        (policed if policies else https).append(rate)
                sql, http = statistics.median(sqls), statistics.median(https)
                policy = statistics.median(policed)
                paired = statistics.median(p / h for p, h in zip(policed, https, strict=True))
                results["runs"][str(count)] = {
                    "sql_jobs_per_s": round(sql, 1),
                    "http_jobs_per_s": round(http, 1),
                    "http_to_sql": round(http / sql, 2),
                    "http_policies_jobs_per_s": round(policy, 1),
                    "policies_to_plain": round(policy / http, 3),
                    "paired_policies_to_plain": round(paired, 3),
                    "sql_rounds": [round(rate, 1) for rate in sqls],
                    "http_rounds": [round(rate, 1) for rate in https],
                    "http_policies_rounds": [round(rate, 1) for rate in policed],
                }
                print(
                    f"{count:>4} runners: sql {sql:.0f} jobs/s, http {http:.0f} jobs/s "
                    f"({http / sql:.2f} of sql), http with policies {policy:.0f} jobs/s "
                    f"({paired:.3f} of plain, median of round pairs); medians of {rounds}: "
                    f"sql {_spread(sqls)}, http {_spread(https)}, policies {_spread(policed)}"
                )
            if peer_concurrency:
                results["peers"] = await _peers(
                    server, url, addresses, jobs, peer_concurrency, rounds
                )
        # Last, so that its million-row initialisation and the checkpoint after it cannot fall
        # into a lifecycle round.
        results["pgbench_tpcb_tps"] = await pgbench_tps(server)
        print(f"pgbench TPC-B: {results['pgbench_tpcb_tps']} tps")
    path = harness.write_result("throughput", results)
    print(f"wrote {path}")
    return results


def _spread(rates: list[float]) -> str:
    return f"{min(rates):.0f}-{max(rates):.0f}"


async def _peers(
    server: str,
    url: str,
    addresses: list[str],
    jobs: int,
    concurrency: tuple[int, ...],
    rounds: int,
) -> dict[str, Any]:
    """procrastinate and pgqueuer on the same server, each beside our HTTP lifecycle and the SQL
    floor measured in the same rounds, at the same concurrency; medians of `rounds`."""
    found: dict[str, Any] = {"versions": peers.versions(), "skipped": {}, "by_concurrency": {}}
    for size in concurrency:
        sqls: list[float] = []
        https: list[float] = []
        peer_rates: dict[str, list[float]] = {}
        for _ in range(rounds):
            sqls.append(await sql_lifecycle(url, size, jobs))
            https.append(await http_lifecycle(url, addresses, size, jobs))
            rates = await peers.measure(server, jobs, size)
            found["skipped"].update(rates.pop("skipped"))
            for peer, rate in rates.items():
                peer_rates.setdefault(peer, []).append(rate)
        medians = {peer: statistics.median(values) for peer, values in peer_rates.items()}
        row = peers.compare(medians, statistics.median(https), statistics.median(sqls))
        row["rounds"] = {"sql": sqls, "http": https, **peer_rates}
        found["by_concurrency"][str(size)] = row
        print(peers.describe(size, row))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.throughput", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--jobs", type=int, default=JOBS)
    parser.add_argument("--runners", default=",".join(map(str, RUNNER_COUNTS)))
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument(
        "--no-peers", action="store_true", help="leave procrastinate and pgqueuer out"
    )
    args = parser.parse_args()
    counts = tuple(int(part) for part in args.runners.split(",") if part)
    peer_concurrency = () if args.no_peers else peers.CONCURRENCY

    async def go() -> None:
        await run(args.jobs, counts, peer_concurrency, args.rounds)

    anyio.run(go)


if __name__ == "__main__":
    main()
