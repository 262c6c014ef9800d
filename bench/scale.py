"""Scale: idle cost of parked long-polls, claim latency against a deep queue, the reaper under
load, and throughput as replicas are added.

* parked: one replica, first idle with nobody connected (the baseline), then with N runners
  each holding a long poll (`wait=50`, re-polling at once when answered 204). Over a window of
  the same length in both states: the daemon's RSS and CPU (from /proc/<pid>), and database
  work per minute from pg_stat_database (committed transactions, rows) and
  pg_stat_user_tables (sequential and index scans). pg_stat_statements is not loaded, so
  "queries" means committed transactions and scans. Runners are raw HTTP/1.1 sockets in this
  process: an httpx client per runner would cost more than the daemon we are measuring.
* pending: the store's `claiming.claim` on direct connections against P pending rows (bulk inserted
  with generate_series in the shape `queue.enqueue` writes, spread over 10 workspaces, then
  VACUUM ANALYZE). Every timed claim is followed by an untimed `queue.enqueue` of one new job,
  so the queue keeps its depth. One connection, then 8 at once. The ratio of the deepest to the
  shallowest queue is the figure (target: within 1.5x).
* ordering: `claiming.claim` as in `pending`, at one depth (1,000,000 by default) in three fresh
  databases of the same run: plain FIFO (every priority 0, no key), with the ordering policies
  on (the rows spread over 1,000 projects, 5 priorities and 10,000 concurrency keys of limit 2),
  and the same with every workspace set to `fair` (each of the 10 workspaces then has 100 of the
  projects, round-robin). Every timed claim is followed by an untimed completion of its lease
  (freeing its key's slot) and an enqueue of one job of the same shape, so depth and key counts
  hold. Each connection claims with its own `KnownOrderings`, as a replica does. The ratios of
  policies and of fair to plain are the figures (target: within 1.5x). A fourth database has
  fair's worst shape (store/ordering.py, "The fair pick"): in each workspace one hot project owns
  the front of the queue (HOT_SHARE of its rows, the highest priority, the oldest, no key) and
  holds HOT_LEASES leases that never end, so no claim takes its rows and each walks past them
  and probes every project; its ratio to plain is reported beside the others.
* reaper: one replica with its maintenance at the configured defaults; HTTP runners run the
  whole lifecycle (bench/throughput.py) from a queue kept topped up; then S leases that went
  stale an hour ago are inserted in one transaction. Time until the reaper has expired all of
  them, and the completion rate before, while it drains, and after.
* replicas: bench/throughput.py's HTTP lifecycle through 1, 2 and 3 replicas, beside the SQL
  floor measured in the same run.

`python -m bench.scale --help` for the sizes; BENCH_RESULTS=/tmp/x for a smoke run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import httpx
from anyio.abc import SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

from bench import harness, throughput
from controlplane.domain.jobs import ClaimedJob, NewJob, Outcome, SessionClaims
from controlplane.settings import Maintenance
from controlplane.store import claiming, credentials, leases, ordering, queue, sessions

PARTS = ("parked", "pending", "ordering", "reaper", "replicas")
PARKED = 10_000
IDLE_SECONDS = 60.0
PENDING = (1_000, 1_000_000)
CLAIM_SAMPLES = 500
CLAIM_CONNECTIONS = 8
ORDERED_PENDING = 1_000_000
PROJECTS = 1_000
PRIORITIES = 5
KEYS = 10_000
KEY_LIMIT = 2
HOT_SHARE = 0.5  # of the rows in the hot-front variant: the hot projects' (one a workspace)
HOT_LEASES = 4  # leases each hot project holds throughout
STALE = 10_000
REAPER_RUNNERS = 20
REAPER_WINDOW = 15.0
REPLICAS = (1, 2, 3)
REPLICA_RUNNERS = 50
REPLICA_JOBS = 3000
WORKSPACES = 10
SETTLE_SECONDS = 15.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# What a claim-latency run does, untimed, after each timed claim.
AfterClaim = Callable[[asyncpg.Connection, SessionClaims, ClaimedJob], Awaitable[None]]


@dataclass(frozen=True)
class ProcSample:
    rss_kib: int
    peak_rss_kib: int
    cpu_seconds: float
    at: float


def proc_sample(pid: int) -> ProcSample:
    rss = peak = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1])
        elif line.startswith("VmHWM:"):
            peak = int(line.split()[1])
    # Fields after "(comm)": state is field 3, utime 14 and stime 15 (proc(5)).
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return ProcSample(rss, peak, cpu, time.monotonic())


async def idle_window(pid: int, conn: asyncpg.Connection, seconds: float) -> dict[str, Any]:
    """What the daemon and the database do over `seconds` while nothing is enqueued."""
    before, counters = proc_sample(pid), await harness.database_counters(conn)
    await anyio.sleep(seconds)
    after, delta = (
        proc_sample(pid),
        harness.counter_delta(counters, await harness.database_counters(conn)),
    )
    per_minute = 60 / (after.at - before.at)
    return {
        "window_s": round(after.at - before.at, 1),
        "rss_mib": round(after.rss_kib / 1024, 1),
        "peak_rss_mib": round(after.peak_rss_kib / 1024, 1),
        "cpu_percent": round(
            100 * (after.cpu_seconds - before.cpu_seconds) / (after.at - before.at), 2
        ),
        # Our own two counter reads are one committed transaction each: left in, they are noise.
        "xact_commit_per_min": round(delta["xact_commit"] * per_minute, 1),
        "scans_per_min": round((delta["seq_scan"] + delta["idx_scan"]) * per_minute, 1),
        "seq_scans_per_min": round(delta["seq_scan"] * per_minute, 1),
        "rows_written_per_min": round(
            (delta["tup_inserted"] + delta["tup_updated"] + delta["tup_deleted"]) * per_minute, 1
        ),
    }


async def _gauge(client: httpx.AsyncClient, name: str) -> float:
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    return 0.0


async def _register(address: str, tokens: Sequence[str], count: int) -> list[str]:
    """`count` runner sessions over HTTP, round-robin over the registration `tokens`."""
    limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
    made: list[str] = []
    gate = anyio.Semaphore(32)
    async with httpx.AsyncClient(base_url=address, timeout=60, limits=limits) as client:

        async def one(index: int) -> None:
            async with gate:
                response = await client.post(
                    "/v1/runners/register",
                    json={"labels": ["linux"]},
                    headers={"Authorization": f"Bearer {tokens[index % len(tokens)]}"},
                )
                response.raise_for_status()
                made.append(response.json()["session_token"])

        async with anyio.create_task_group() as group:
            for index in range(count):
                group.start_soon(one, index)
    return made


@dataclass
class Polls:
    answered: int = 0
    reconnects: int = 0


async def _hold_polls(host: str, port: int, token: str, polls: Polls) -> None:
    """One runner parked on a raw socket: POST the long poll, read the answer, ask again."""
    request = (
        f"POST /v1/runners/jobs/request?wait=50 HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Authorization: Bearer {token}\r\nContent-Length: 0\r\n\r\n"
    ).encode()
    while True:
        stream: SocketStream = await anyio.connect_tcp(host, port)
        async with stream:
            reader = BufferedByteReceiveStream(stream)
            try:
                while True:
                    await stream.send(request)
                    head = await reader.receive_until(b"\r\n\r\n", 65_536)
                    length = 0
                    for line in head.split(b"\r\n")[1:]:
                        name, _, value = line.partition(b":")
                        if name.strip().lower() == b"content-length":
                            length = int(value)
                    if length:
                        await reader.receive_exactly(length)
                    polls.answered += 1
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, OSError):
                polls.reconnects += 1  # the server closed a kept-alive connection


async def parked_idle(server: str, parked: int, seconds: float) -> dict[str, Any]:
    url = await harness.fresh_database(server)
    conn = await asyncpg.connect(url)
    try:
        async with harness.replicas(url, 1) as [replica]:
            pid = replica.process.pid
            # Start-up work out of the window, and statistics flushed: an idle backend reports
            # its counters up to 10 s late.
            await anyio.sleep(SETTLE_SECONDS)
            baseline = await idle_window(pid, conn, seconds)
            print(f"idle, 0 parked: {_idle_line(baseline)}")
            tokens = [
                (await credentials.create_manual_token(conn, workspace_id=uuid.uuid4(), name="s"))[
                    1
                ]
                for _ in range(WORKSPACES)
            ]
            started = time.monotonic()
            sessions_made = await _register(replica.address, tokens, parked)
            registered_s = time.monotonic() - started
            host, port = replica.address.removeprefix("http://").rsplit(":", 1)
            polls = Polls()
            async with (
                httpx.AsyncClient(base_url=replica.address, timeout=30) as metrics,
                anyio.create_task_group() as group,
            ):
                for start in range(0, parked, 250):
                    for token in sessions_made[start : start + 250]:
                        group.start_soon(_hold_polls, host, int(port), token, polls)
                    await anyio.sleep(0.05)  # stay well inside the listen backlog
                with anyio.fail_after(300):
                    while await _gauge(metrics, "controlplane_parked_runners") < parked:
                        await anyio.sleep(0.5)
                parked_s = time.monotonic() - started
                await anyio.sleep(SETTLE_SECONDS)
                answered = polls.answered
                loaded = await idle_window(pid, conn, seconds)
                loaded["polls_answered_per_min"] = round(
                    (polls.answered - answered) * 60 / loaded["window_s"], 1
                )
                loaded["parked_gauge"] = await _gauge(metrics, "controlplane_parked_runners")
                group.cancel_scope.cancel()
            print(f"idle, {parked} parked: {_idle_line(loaded)}")
    finally:
        await conn.close()
        await harness.drop_database(url)
    extra_xacts = loaded["xact_commit_per_min"] - baseline["xact_commit_per_min"]
    return {
        "parked": parked,
        "registered_in_s": round(registered_s, 1),
        "parked_in_s": round(parked_s, 1),
        "baseline": baseline,
        "loaded": loaded,
        "rss_per_runner_kib": round((loaded["rss_mib"] - baseline["rss_mib"]) * 1024 / parked, 2),
        "extra_xacts_per_runner_per_min": round(extra_xacts / parked, 4),
    }


def _idle_line(window: dict[str, Any]) -> str:
    return (
        f"RSS {window['rss_mib']} MiB, CPU {window['cpu_percent']} %, "
        f"{window['xact_commit_per_min']} xacts/min, {window['scans_per_min']} scans/min"
    )


async def _fill_pending(conn: asyncpg.Connection, workspaces: list[uuid.UUID], rows: int) -> None:
    """`rows` pending jobs round-robin over `workspaces`, as `queue.enqueue` writes them."""
    await conn.execute(
        """
        INSERT INTO pending_jobs (workspace_id, workflow_run_id, workflow_run_attempt_id, job_id,
                                  job_execution_id, project_id, required_labels, payload,
                                  created_at)
        SELECT ($1::uuid[])[1 + g % cardinality($1::uuid[])], gen_random_uuid(),
               gen_random_uuid(), gen_random_uuid(), gen_random_uuid(), gen_random_uuid(),
               ARRAY['linux'], '{}'::jsonb, $3::timestamptz + g * interval '1 microsecond'
        FROM generate_series(0, $2 - 1) AS g
        """,
        workspaces,
        rows,
        datetime.now(UTC) - timedelta(hours=1),
    )
    await conn.execute("VACUUM ANALYZE pending_jobs")


async def _refill(conn: asyncpg.Connection, session: SessionClaims, _claimed: ClaimedJob) -> None:
    await queue.enqueue(conn, [harness.new_job(session.workspace_id)])


async def _timed_claims(
    url: str,
    claimers: list[SessionClaims],
    connections: int,
    total: int,
    after: AfterClaim = _refill,
) -> list[float]:
    """`total` claims over `connections` connections, each followed by an untimed `after`
    (by default a refill of one job)."""
    latencies: list[float] = []

    async def worker(offset: int) -> None:
        conn = await asyncpg.connect(url)
        orderings = ordering.KnownOrderings()  # one per connection, as one per replica
        try:
            for index in range(offset, total, connections):
                session = claimers[index % len(claimers)]
                start = time.perf_counter()
                claimed = await claiming.claim(conn, session, orderings=orderings)
                latencies.append(time.perf_counter() - start)
                if claimed is None:
                    raise RuntimeError("the queue ran dry")
                await after(conn, session, claimed)
        finally:
            await conn.close()

    async with anyio.create_task_group() as group:
        for offset in range(connections):
            group.start_soon(worker, offset)
    return latencies


async def _claimers(conn: asyncpg.Connection, workspaces: list[uuid.UUID]) -> list[SessionClaims]:
    """One manual `linux` session per workspace."""
    return [await harness.manual_session(conn, workspace) for workspace in workspaces]


async def _latencies(
    url: str, claimers: list[SessionClaims], samples: int, after: AfterClaim = _refill
) -> tuple[dict[str, float], dict[str, float]]:
    """Warm up, then `samples` timed claims on one connection and on CLAIM_CONNECTIONS."""
    await _timed_claims(url, claimers, 1, 50, after)  # warm caches and prepared statements
    one = harness.summary_ms(await _timed_claims(url, claimers, 1, samples, after))
    many = harness.summary_ms(await _timed_claims(url, claimers, CLAIM_CONNECTIONS, samples, after))
    return one, many


def _ratios(top: dict[str, Any], bottom: dict[str, Any]) -> dict[str, dict[str, float]]:
    return {
        mode: {
            quantile: round(top[mode][quantile] / bottom[mode][quantile], 2)
            for quantile in ("p50_ms", "p99_ms")
        }
        for mode in ("one_connection", f"{CLAIM_CONNECTIONS}_connections")
    }


async def claim_latency(server: str, sizes: Sequence[int], samples: int) -> dict[str, Any]:
    found: dict[str, Any] = {"samples": samples, "connections": CLAIM_CONNECTIONS, "sizes": {}}
    for size in sizes:
        url = await harness.fresh_database(server)
        conn = await asyncpg.connect(url)
        try:
            workspaces = [uuid.uuid4() for _ in range(WORKSPACES)]
            started = time.monotonic()
            await _fill_pending(conn, workspaces, size)
            filled_s = time.monotonic() - started
            one, many = await _latencies(url, await _claimers(conn, workspaces), samples)
            depth = await conn.fetchval("SELECT count(*) FROM pending_jobs")
        finally:
            await conn.close()
            await harness.drop_database(url)
        found["sizes"][str(size)] = {
            "filled_in_s": round(filled_s, 1),
            "pending_after": depth,
            "one_connection": one,
            f"{CLAIM_CONNECTIONS}_connections": many,
        }
        print(
            f"{size:>9} pending: claim p50 {one['p50_ms']} ms, p99 {one['p99_ms']} ms "
            f"(1 conn); p50 {many['p50_ms']} ms, p99 {many['p99_ms']} ms "
            f"({CLAIM_CONNECTIONS} conns)"
        )
    smallest, deepest = (found["sizes"][str(size)] for size in (min(sizes), max(sizes)))
    found["ratio_deepest_to_smallest"] = _ratios(deepest, smallest)
    print(f"deepest / smallest: {found['ratio_deepest_to_smallest']}")
    return found


async def _fill_ordered(
    conn: asyncpg.Connection,
    workspaces: list[uuid.UUID],
    projects: list[uuid.UUID],
    rows: int,
    policies: bool,
    fair: bool = False,
) -> None:
    """`rows` pending jobs round-robin over `workspaces` and `projects`; with `policies`, also
    over PRIORITIES priorities and KEYS keys of limit KEY_LIMIT (with their count rows); with
    `fair`, every workspace set to fair ordering."""
    for workspace in workspaces if fair else ():
        await ordering.set_workspace_ordering(conn, workspace, ordering.Ordering.FAIR)
    await conn.execute(
        """
        INSERT INTO pending_jobs (workspace_id, workflow_run_id, workflow_run_attempt_id, job_id,
                                  job_execution_id, project_id, required_labels, payload,
                                  created_at, priority, concurrency_key, concurrency_limit)
        SELECT ($1::uuid[])[1 + g % cardinality($1::uuid[])], gen_random_uuid(),
               gen_random_uuid(), gen_random_uuid(), gen_random_uuid(),
               ($2::uuid[])[1 + g % cardinality($2::uuid[])],
               ARRAY['linux'], '{}'::jsonb, $4::timestamptz + g * interval '1 microsecond',
               CASE WHEN $5 THEN g % $6 - $6 / 2 ELSE 0 END,
               CASE WHEN $5 THEN 'key-' || g % $7 END,
               CASE WHEN $5 THEN $8::int END
        FROM generate_series(0, $3 - 1) AS g
        """,
        workspaces,
        projects,
        rows,
        datetime.now(UTC) - timedelta(hours=1),
        policies,
        PRIORITIES,
        KEYS,
        KEY_LIMIT,
    )
    await conn.execute(
        """
        INSERT INTO concurrency_keys (workspace_id, concurrency_key)
        SELECT DISTINCT workspace_id, concurrency_key FROM pending_jobs
        WHERE concurrency_key IS NOT NULL
        """
    )
    await conn.execute("VACUUM ANALYZE pending_jobs")


async def _hot_front(
    conn: asyncpg.Connection, workspaces: list[uuid.UUID], rows: int
) -> list[uuid.UUID]:
    """Fair's worst shape on top of `_fill_ordered`'s rows: in each workspace a hot project of
    `rows` jobs of the highest priority, older than every other, holding HOT_LEASES leases
    (claimed while the workspace is plain). Returns the hot projects."""
    hot = [uuid.uuid4() for _ in workspaces]
    await conn.execute(
        """
        INSERT INTO pending_jobs (workspace_id, workflow_run_id, workflow_run_attempt_id, job_id,
                                  job_execution_id, project_id, required_labels, payload,
                                  created_at, priority)
        SELECT ($1::uuid[])[1 + g % cardinality($1::uuid[])], gen_random_uuid(),
               gen_random_uuid(), gen_random_uuid(), gen_random_uuid(),
               ($2::uuid[])[1 + g % cardinality($2::uuid[])],
               ARRAY['linux'], '{}'::jsonb, $4::timestamptz + g * interval '1 microsecond', $5
        FROM generate_series(0, $3 - 1) AS g
        """,
        workspaces,
        hot,
        rows,
        datetime.now(UTC) - timedelta(hours=2),
        PRIORITIES // 2,
    )
    await conn.execute("VACUUM ANALYZE pending_jobs")
    for workspace, project in zip(workspaces, hot, strict=True):
        await ordering.set_workspace_ordering(conn, workspace, ordering.Ordering.FIFO)
        for _ in range(HOT_LEASES):
            session = await harness.manual_session(conn, workspace)
            claimed = await claiming.claim(conn, session)
            assert claimed is not None
            assert claimed.identity.project_id == project
        await ordering.set_workspace_ordering(conn, workspace, ordering.Ordering.FAIR)
    return hot


def _ordered_job(workspace: uuid.UUID, projects: list[uuid.UUID], policies: bool) -> NewJob:
    job = harness.new_job(workspace)
    if not policies:
        return replace(job, identity=replace(job.identity, project_id=random.choice(projects)))
    return replace(
        job,
        identity=replace(job.identity, project_id=random.choice(projects)),
        priority=random.randrange(PRIORITIES) - PRIORITIES // 2,
        concurrency_key=f"key-{random.randrange(KEYS)}",
        concurrency_limit=KEY_LIMIT,
    )


def _complete_and_refill(projects: list[uuid.UUID], policies: bool) -> AfterClaim:
    """After a timed claim: complete its lease (freeing its key's slot) and enqueue one job of
    the same shape, so the depth and the keys' counts hold."""

    async def after(conn: asyncpg.Connection, session: SessionClaims, claimed: ClaimedJob) -> None:
        execution = claimed.identity.job_execution_id
        await leases.complete(conn, execution, session.runner_session_id, Outcome.SUCCEEDED)
        await queue.enqueue(conn, [_ordered_job(session.workspace_id, projects, policies)])

    return after


async def ordering_latency(server: str, depth: int, samples: int) -> dict[str, Any]:
    """Claim latency at `depth` pending rows, plain FIFO against the ordering policies on."""
    found: dict[str, Any] = {
        "samples": samples,
        "connections": CLAIM_CONNECTIONS,
        "depth": depth,
        "projects": PROJECTS,
        "priorities": PRIORITIES,
        "keys": KEYS,
        "key_limit": KEY_LIMIT,
        "hot_share": HOT_SHARE,
        "hot_leases": HOT_LEASES,
        "variants": {},
    }
    variants = (
        ("plain_fifo", False, False, False),
        ("priority_and_keys", True, False, False),
        ("fair_priority_and_keys", True, True, False),
        ("fair_hot_front", True, True, True),
    )
    for name, policies, fair, hot in variants:
        url = await harness.fresh_database(server)
        conn = await asyncpg.connect(url)
        try:
            workspaces = [uuid.uuid4() for _ in range(WORKSPACES)]
            projects = [uuid.uuid4() for _ in range(PROJECTS)]
            started = time.monotonic()
            hot_rows = int(depth * HOT_SHARE) if hot else 0
            await _fill_ordered(conn, workspaces, projects, depth - hot_rows, policies, fair)
            if hot:
                await _hot_front(conn, workspaces, hot_rows)
            filled_s = time.monotonic() - started
            after = _complete_and_refill(projects, policies)
            one, many = await _latencies(url, await _claimers(conn, workspaces), samples, after)
        finally:
            await conn.close()
            await harness.drop_database(url)
        found["variants"][name] = {
            "filled_in_s": round(filled_s, 1),
            "one_connection": one,
            f"{CLAIM_CONNECTIONS}_connections": many,
        }
        print(
            f"{depth:>9} pending, {name}: claim p50 {one['p50_ms']} ms, p99 {one['p99_ms']} ms "
            f"(1 conn); p50 {many['p50_ms']} ms, p99 {many['p99_ms']} ms "
            f"({CLAIM_CONNECTIONS} conns)"
        )
    plain, ordered = found["variants"]["plain_fifo"], found["variants"]["priority_and_keys"]
    found["ratio_policies_to_plain"] = _ratios(ordered, plain)
    found["ratio_fair_to_plain"] = _ratios(found["variants"]["fair_priority_and_keys"], plain)
    found["ratio_fair_hot_front_to_plain"] = _ratios(found["variants"]["fair_hot_front"], plain)
    print(f"policies / plain: {found['ratio_policies_to_plain']}")
    print(f"fair / plain: {found['ratio_fair_to_plain']}")
    print(f"fair, hot front / plain: {found['ratio_fair_hot_front_to_plain']}")
    return found


async def _insert_stale(conn: asyncpg.Connection, workspace: uuid.UUID, count: int) -> uuid.UUID:
    """`count` leases of one dead runner, last heard of an hour ago; returns its session."""
    dead = await sessions.create(
        conn,
        workspace_id=workspace,
        registration_token_id=uuid.uuid4(),
        kind="manual",
        labels=("linux",),
    )
    await conn.execute(
        """
        INSERT INTO running_jobs (pending_id, workspace_id, workflow_run_id,
            workflow_run_attempt_id, job_id, job_execution_id, project_id, runner_session_id,
            required_labels, runner_labels, payload, queued_at, started_at, first_heartbeat_at,
            last_heartbeat_at)
        SELECT gen_random_uuid(), $1, gen_random_uuid(), gen_random_uuid(), gen_random_uuid(),
               gen_random_uuid(), gen_random_uuid(), $2, ARRAY['linux'], ARRAY['linux'],
               '{}'::jsonb, now() - interval '2 hours', now() - interval '1 hour',
               now() - interval '1 hour', now() - interval '1 hour' - g * interval '1 millisecond'
        FROM generate_series(1, $3) AS g
        """,
        workspace,
        dead.id,
        count,
    )
    return dead.id


def _rate(stamps: list[float], start: float, end: float) -> float:
    if end <= start:
        return float("nan")
    return sum(1 for stamp in stamps if start <= stamp < end) / (end - start)


async def reaper_under_load(server: str, stale: int, runners: int, window: float) -> dict[str, Any]:
    url = await harness.fresh_database(server)
    conn = await asyncpg.connect(url)
    feeder = await asyncpg.connect(url)
    workspace = uuid.uuid4()
    done: list[float] = []
    stop = anyio.Event()

    async def top_up() -> None:
        while not stop.is_set():
            depth = await feeder.fetchval(
                "SELECT count(*) FROM pending_jobs WHERE workspace_id = $1", workspace
            )
            if depth < 2000:
                await queue.enqueue(feeder, [harness.new_job(workspace) for _ in range(500)])
            else:
                await anyio.sleep(0.2)

    try:
        registration = await throughput.registration_token(url, workspace)
        async with harness.replicas(url, 1) as [replica]:
            clients = throughput.runner_clients([replica.address], runners)
            async with anyio.create_task_group() as group:
                group.start_soon(top_up)
                for client in clients:
                    group.start_soon(
                        throughput.lifecycle_runner,
                        client,
                        registration,
                        stop,
                        lambda: done.append(time.monotonic()),
                    )
                await anyio.sleep(3)
                before_start = time.monotonic()
                await anyio.sleep(window)
                dead = await _insert_stale(conn, workspace, stale)
                inserted = time.monotonic()
                first = drained = 0.0
                with anyio.fail_after(600):
                    while True:
                        left = await conn.fetchval(
                            "SELECT count(*) FROM running_jobs WHERE runner_session_id = $1", dead
                        )
                        now = time.monotonic()
                        if left < stale and not first:
                            first = now
                        if left == 0:
                            drained = now
                            break
                        await anyio.sleep(0.05)
                await anyio.sleep(window)
                after_end = time.monotonic()
                stop.set()
                group.cancel_scope.cancel()
            for client in clients:
                await client.aclose()
        expired = await conn.fetchval(
            "SELECT count(*) FROM ended_executions "
            "WHERE ended_by = 'reaper' AND outcome = 'expired'"
        )
    finally:
        await conn.close()
        await feeder.close()
        await harness.drop_database(url)
    before = _rate(done, before_start, inserted)
    # While draining: from the first expired lease seen (50 ms polls) to the last.
    during = _rate(done, first - 0.05, drained)
    after = _rate(done, drained, after_end)
    found = {
        "stale_leases": stale,
        "runners": runners,
        "expired_tombstones": expired,
        "reaper_interval_s": Maintenance().reaper_interval_seconds,
        "reaper_batch_limit": Maintenance().reaper_batch_limit,
        "insert_to_drained_s": round(drained - inserted, 2),
        "first_to_last_expired_s": round(drained - first + 0.05, 2),
        "jobs_per_s_before": round(before, 1),
        "jobs_per_s_during": round(during, 1),
        "jobs_per_s_after": round(after, 1),
        "during_to_before": round(during / before, 2) if before else None,
    }
    print(
        f"reaper: {stale} stale leases gone {found['insert_to_drained_s']} s after insert "
        f"({found['first_to_last_expired_s']} s of reaping); lifecycle {before:.0f} jobs/s "
        f"before, {during:.0f} during, {after:.0f} after"
    )
    return found


async def replica_scaling(
    server: str, counts: Sequence[int], runners: int, jobs: int
) -> dict[str, Any]:
    url = await harness.fresh_database(server)
    sql = await throughput.sql_lifecycle(url, runners, jobs)
    found: dict[str, Any] = {
        "runners": runners,
        "jobs_per_run": jobs,
        "sql_jobs_per_s": round(sql, 1),
        "replicas": {},
    }
    print(f"sql floor, {runners} connections: {sql:.0f} jobs/s")
    for count in counts:
        async with harness.replicas(url, count) as started:
            addresses = [replica.address for replica in started]
            http = await throughput.http_lifecycle(url, addresses, runners, jobs)
        found["replicas"][str(count)] = {
            "http_jobs_per_s": round(http, 1),
            "http_to_sql": round(http / sql, 2),
        }
        print(f"{count} replica(s): {http:.0f} jobs/s ({http / sql:.2f} of sql)")
    await harness.drop_database(url)
    return found


async def run(
    parts: Sequence[str] = PARTS,
    parked: int = PARKED,
    idle_seconds: float = IDLE_SECONDS,
    pending: Sequence[int] = PENDING,
    claim_samples: int = CLAIM_SAMPLES,
    ordered_pending: int = ORDERED_PENDING,
    stale: int = STALE,
    reaper_window: float = REAPER_WINDOW,
    replicas: Sequence[int] = REPLICAS,
    replica_jobs: int = REPLICA_JOBS,
) -> dict[str, Any]:
    harness.raise_fd_limit()  # 10,000 sockets here, as many in the daemon (inherits it)
    results: dict[str, Any] = {}
    with harness.postgres() as server:
        if "parked" in parts:
            results["parked"] = await parked_idle(server, parked, idle_seconds)
        if "pending" in parts:
            results["pending"] = await claim_latency(server, pending, claim_samples)
        if "ordering" in parts:
            results["ordering"] = await ordering_latency(server, ordered_pending, claim_samples)
        if "reaper" in parts:
            results["reaper"] = await reaper_under_load(
                server, stale, REAPER_RUNNERS, reaper_window
            )
        if "replicas" in parts:
            results["replicas"] = await replica_scaling(
                server, replicas, REPLICA_RUNNERS, replica_jobs
            )
    stamp = harness.machine()["measured_at"]
    for part in results.values():
        part["measured_at"] = stamp
    if set(parts) != set(PARTS):
        # A partial run keeps the other parts' figures from the last run, each with its own time.
        with contextlib.suppress(OSError, ValueError):
            earlier = json.loads((harness.RESULTS / "scale.json").read_text())
            results = {
                **{name: earlier[name] for name in PARTS if name in earlier},
                **results,
            }
    path = harness.write_result("scale", results)
    print(f"wrote {path}")
    return results


def _sizes(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.scale", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--parts", default=",".join(PARTS), help="comma-separated subset of %(default)s"
    )
    parser.add_argument("--parked", type=int, default=PARKED)
    parser.add_argument("--idle-seconds", type=float, default=IDLE_SECONDS)
    parser.add_argument("--pending", type=_sizes, default=list(PENDING))
    parser.add_argument("--claim-samples", type=int, default=CLAIM_SAMPLES)
    parser.add_argument("--ordered-pending", type=int, default=ORDERED_PENDING)
    parser.add_argument("--stale", type=int, default=STALE)
    parser.add_argument("--reaper-window", type=float, default=REAPER_WINDOW)
    parser.add_argument("--replicas", type=_sizes, default=list(REPLICAS))
    parser.add_argument("--replica-jobs", type=int, default=REPLICA_JOBS)
    args = parser.parse_args()
    parts = [part for part in args.parts.split(",") if part]
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts: {', '.join(sorted(unknown))}")

    async def go() -> None:
        await run(
            parts,
            args.parked,
            args.idle_seconds,
            args.pending,
            args.claim_samples,
            args.ordered_pending,
            args.stale,
            args.reaper_window,
            args.replicas,
            args.replica_jobs,
        )

    anyio.run(go)


if __name__ == "__main__":
    main()
