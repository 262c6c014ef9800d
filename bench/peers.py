"""Peers: procrastinate and pgqueuer processing no-op jobs on the same PostgreSQL.

Each peer gets its own database on the server the throughput run uses, installs its own schema,
has `jobs` no-op jobs deferred in batches, then one worker processes them until the queue is
empty; jobs/s is jobs divided by the worker's time. One job per fetch where the peer lets us
choose (pgqueuer `batch_size=1`; procrastinate always fetches one job per sub-worker), and the
worker's concurrency set to the same number as our runners at that size:

* procrastinate: `run_worker_async(concurrency=c, wait=False)` with its psycopg connector and
  LISTEN/NOTIFY (its defaults);
* pgqueuer: `QueueManager.run(batch_size=1, max_concurrent_tasks=max(2, c), mode=drain)` on one
  asyncpg connection (2 is the smallest cap it accepts with batch 1).

The peers are optional (`pip install -e '.[bench]'`); one that is not installed is skipped with
a message, and the rest of the run goes on. They are imported by name, so neither ruff nor mypy
needs them installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import time
from datetime import timedelta
from importlib import metadata
from typing import Any

import anyio
import asyncpg

from bench import harness

PEERS = ("procrastinate", "pgqueuer")
CONCURRENCY = (1, 10)
JOBS = 3000


def missing(peer: str) -> str | None:
    """Why `peer` cannot run here, or None when it can."""
    if importlib.util.find_spec(peer) is None:
        return f"{peer} is not installed (pip install -e '.[bench]'); skipped"
    return None


async def procrastinate_rate(url: str, jobs: int, concurrency: int) -> float:
    procrastinate: Any = importlib.import_module("procrastinate")
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=url))

    async def nothing() -> None:
        return None

    noop = app.task(name="noop", queue="bench")(nothing)

    async with app.open_async():
        await app.schema_manager.apply_schema_async()
        for start in range(0, jobs, 500):
            await noop.batch_defer_async(*({} for _ in range(min(500, jobs - start))))
        started = time.perf_counter()
        await app.run_worker_async(
            queues=["bench"], concurrency=concurrency, wait=False, install_signal_handlers=False
        )
        elapsed = time.perf_counter() - started
        left = await app.connector.execute_query_one_async(
            "SELECT count(*) AS n FROM procrastinate_jobs WHERE status <> 'succeeded'"
        )
    if left["n"]:
        raise RuntimeError(f"procrastinate left {left['n']} jobs unfinished")
    return jobs / elapsed


async def pgqueuer_rate(url: str, jobs: int, concurrency: int) -> float:
    pgqueuer: Any = importlib.import_module("pgqueuer")
    setup = await asyncpg.connect(url)
    try:
        queries = pgqueuer.Queries(pgqueuer.AsyncpgDriver(setup))
        await queries.install()
        for start in range(0, jobs, 500):
            size = min(500, jobs - start)
            await queries.enqueue(["noop"] * size, [None] * size, [0] * size)
    finally:
        await setup.close()
    worker = await asyncpg.connect(url)
    manager = pgqueuer.QueueManager(pgqueuer.Queries(pgqueuer.AsyncpgDriver(worker)))
    done = 0

    async def noop(_job: Any) -> None:
        nonlocal done
        done += 1

    manager.entrypoint("noop")(noop)

    started = time.perf_counter()
    try:
        await manager.run(
            batch_size=1,
            max_concurrent_tasks=max(2, concurrency),
            mode=importlib.import_module("pgqueuer.types").QueueExecutionMode.drain,
            dequeue_timeout=timedelta(seconds=1),
        )
    finally:
        elapsed = time.perf_counter() - started
        if not worker.is_closed():
            await worker.close()
    if done != jobs:
        raise RuntimeError(f"pgqueuer processed {done} of {jobs} jobs")
    return jobs / elapsed


RATES = {"procrastinate": procrastinate_rate, "pgqueuer": pgqueuer_rate}


async def measure(server_url: str, jobs: int, concurrency: int) -> dict[str, Any]:
    """{peer: jobs/s} for every installed peer, {peer: reason} under "skipped" for the others.
    Each peer runs in a database of its own on `server_url`, dropped afterwards."""
    rates: dict[str, Any] = {"skipped": {}}
    for peer in PEERS:
        reason = missing(peer)
        if reason is not None:
            print(reason)
            rates["skipped"][peer] = reason
            continue
        url = await _empty_database(server_url)
        try:
            rates[peer] = round(await RATES[peer](url, jobs, concurrency), 1)
        except Exception as error:  # a broken peer is reported, it does not end the run
            rates["skipped"][peer] = f"{peer} failed: {error!r}"
            print(rates["skipped"][peer])
        finally:
            await harness.drop_database(url)
    return rates


async def _empty_database(server_url: str) -> str:
    name = f"cp_peer_{time.monotonic_ns()}"
    admin = await asyncpg.connect(server_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    return server_url.rsplit("/", 1)[0] + f"/{name}"


def versions() -> dict[str, str]:
    found = {}
    for peer in PEERS:
        try:
            found[peer] = metadata.version(peer)
        except metadata.PackageNotFoundError:
            continue
    return found


def compare(peer_rates: dict[str, Any], http: float, sql: float) -> dict[str, Any]:
    """Each peer's jobs/s beside our HTTP lifecycle and the raw-SQL floor of the same size."""
    row: dict[str, Any] = {
        "http_jobs_per_s": round(http, 1),
        "sql_jobs_per_s": round(sql, 1),
        "peers": {},
    }
    for peer in PEERS:
        rate = peer_rates.get(peer)
        if rate is None:
            continue
        row["peers"][peer] = {
            "jobs_per_s": rate,
            "http_to_peer": round(http / rate, 2),
            "peer_to_sql": round(rate / sql, 2),
        }
    return row


def describe(concurrency: int, row: dict[str, Any]) -> str:
    parts = [
        f"{peer} {figures['jobs_per_s']:.0f} jobs/s (ours {figures['http_to_peer']}x it; "
        f"it is {figures['peer_to_sql']} of sql)"
        for peer, figures in row["peers"].items()
    ]
    return (
        f"concurrency {concurrency:>3}: http {row['http_jobs_per_s']:.0f}, "
        f"sql {row['sql_jobs_per_s']:.0f}; " + ("; ".join(parts) or "no peer ran")
    )


async def run(jobs: int = JOBS, concurrency: tuple[int, ...] = CONCURRENCY) -> dict[str, Any]:
    """Standalone: the peers beside our HTTP lifecycle (one replica) and the SQL floor."""
    from bench import throughput

    results: dict[str, Any] = {
        "jobs_per_run": jobs,
        "replicas": throughput.REPLICAS,
        "versions": versions(),
        "runs": {},
    }
    with harness.postgres() as server:
        url = await harness.fresh_database(server)
        async with harness.replicas(url, throughput.REPLICAS) as started:
            addresses = [replica.address for replica in started]
            for size in concurrency:
                sql = await throughput.sql_lifecycle(url, size, jobs)
                http = await throughput.http_lifecycle(url, addresses, size, jobs)
                rates = await measure(server, jobs, size)
                results["skipped"] = rates.pop("skipped")
                row = compare(rates, http, sql)
                results["runs"][str(size)] = row
                print(describe(size, row))
    path = harness.write_result("peers", results)
    print(f"wrote {path}")
    return results


def main() -> None:
    anyio.run(run)


if __name__ == "__main__":
    main()
