"""Where the enqueue transaction's time goes, statement by statement, before and after (issue 13).

One embedded server (durable, as the daemon's) with pg_stat_statements; databases migrated with
the baseline tree's sql/ (BENCH_BASELINE_REF, default 1089cdd: `before`) and with this tree's:
`main`, the transaction main ran before sql/0026 (BEGIN, the execution lock, the insert
statement, COMMIT: four round trips, each timed from the client), `after`, one call of
cp_enqueue, `after_store`, store/queue.py's `enqueue` (Python included), plus variants of main's
(BENCH_ENQUEUE_VARIANTS, comma-separated names of VARIANTS: the demand trigger disabled or
emptied, one index dropped). Each round enqueues BENCH_ENQUEUE_JOBS single jobs (the HTTP
route's defaults) into one workspace of every database, the order alternating round by round.
pg_stat_statements (track = all) then gives the server's time in each statement, the trigger's
nested ones included, and EXPLAIN ANALYZE the trigger's time in one insert. Prints medians per
database and step; writes nothing to bench/results.

    nice -n 19 .venv/bin/python -m bench.enqueue_cost
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path

import asyncpg

from bench import harness
from controlplane.domain.jobs import NewJob
from controlplane.store import locks, migrations, queue
from controlplane.store.embedded import EmbeddedPostgres
from controlplane.store.records import json_text

ROUNDS = int(os.environ.get("BENCH_ENQUEUE_ROUNDS", "7"))
JOBS = int(os.environ.get("BENCH_ENQUEUE_JOBS", "300"))

# The baseline's statement (store/queue.py at 1089cdd), verbatim.
BEFORE_STATEMENT = """
            WITH input AS (
                SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::uuid[], $4::uuid[], $5::uuid[],
                                     $6::uuid[], $7::text[], $8::text[], $9::timestamptz[],
                                     $10::text[])
                     AS t(ws, run, attempt, job, ex, project, labels, body, queued, wake)
            ), running AS (
                SELECT job_execution_id AS ex FROM running_jobs
                WHERE job_execution_id IN (SELECT ex FROM input)
            ), ended AS (
                SELECT job_execution_id AS ex FROM ended_executions
                WHERE job_execution_id IN (SELECT ex FROM input)
            ), inserted AS (
                INSERT INTO pending_jobs (workspace_id, workflow_run_id, workflow_run_attempt_id,
                    job_id, job_execution_id, project_id, required_labels, payload, created_at)
                SELECT ws, run, attempt, job, ex, project,
                       ARRAY(SELECT jsonb_array_elements_text(labels::jsonb)), body::jsonb, queued
                FROM input
                WHERE ex NOT IN (SELECT ex FROM running) AND ex NOT IN (SELECT ex FROM ended)
                ON CONFLICT (job_execution_id) DO NOTHING
                RETURNING job_execution_id
            ), woken AS (
                SELECT count(pg_notify($11, wake)) AS n
                FROM (SELECT DISTINCT input.wake FROM inserted
                      JOIN input ON input.ex = inserted.job_execution_id) AS w
            )
            SELECT ARRAY(SELECT job_execution_id FROM inserted) AS inserted,
                   ARRAY(SELECT ex FROM running) AS running,
                   ARRAY(SELECT ex FROM ended) AS ended,
                   (SELECT n FROM woken) AS woken
            """

# The statement of store/queue.py before cp_enqueue (sql/0026), verbatim; its transaction was
# BEGIN, the execution lock, this, COMMIT.
MAIN_STATEMENT = """
            WITH input AS (
                SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::uuid[], $4::uuid[], $5::uuid[],
                                     $6::uuid[], $7::text[], $8::text[], $9::timestamptz[],
                                     $10::text[], $12::integer[], $13::text[], $14::integer[],
                                     $15::integer[], $16::integer[], $17::integer[])
                     AS t(ws, run, attempt, job, ex, project, labels, body, queued, wake,
                          priority, ckey, climit, timeout, queue_timeout, retries)
            ), running AS (
                SELECT job_execution_id AS ex FROM running_jobs
                WHERE job_execution_id IN (SELECT ex FROM input)
            ), ended AS (
                SELECT job_execution_id AS ex FROM ended_executions
                WHERE job_execution_id IN (SELECT ex FROM input)
            ), inserted AS (
                INSERT INTO pending_jobs (workspace_id, workflow_run_id, workflow_run_attempt_id,
                    job_id, job_execution_id, project_id, required_labels, payload, created_at,
                    priority, concurrency_key, concurrency_limit,
                    timeout_seconds, queue_timeout_seconds, expires_at, retries_on_lost)
                SELECT ws, run, attempt, job, ex, project,
                       ARRAY(SELECT jsonb_array_elements_text(labels::jsonb)), body::jsonb, queued,
                       priority, ckey, climit,
                       timeout, queue_timeout, now() + queue_timeout * interval '1 second', retries
                FROM input
                WHERE ex NOT IN (SELECT ex FROM running) AND ex NOT IN (SELECT ex FROM ended)
                ON CONFLICT (job_execution_id) DO NOTHING
                RETURNING job_execution_id
            ), keyed AS (
                -- The count row of each key (store/ordering.py); an existing one is not locked.
                INSERT INTO concurrency_keys (workspace_id, concurrency_key)
                SELECT DISTINCT ws, ckey FROM input WHERE ckey IS NOT NULL
                ORDER BY 1, 2
                ON CONFLICT DO NOTHING
            ), woken AS (
                SELECT count(pg_notify($11, wake)) AS n
                FROM (SELECT DISTINCT input.wake FROM inserted
                      JOIN input ON input.ex = inserted.job_execution_id) AS w
            )
            SELECT ARRAY(SELECT job_execution_id FROM inserted) AS inserted,
                   ARRAY(SELECT ex FROM running) AS running,
                   ARRAY(SELECT ex FROM ended) AS ended,
                   (SELECT n FROM woken) AS woken
            """

# Changes applied to a database of this tree after its migrations, one variant each.
VARIANTS = {
    "no_trigger": "ALTER TABLE pending_jobs DISABLE TRIGGER pending_jobs_demand_added",
    "no_oldest_idx": "DROP INDEX pending_jobs_workspace_oldest_idx",
    "no_project_idx": "DROP INDEX pending_jobs_workspace_project_priority_idx",
    "no_enqueued_idx": "DROP INDEX pending_jobs_enqueued_idx",
    "no_expires_idx": "DROP INDEX pending_jobs_expires_at_idx",
    "no_job_id_idx": "DROP INDEX pending_jobs_job_id_idx",
    "empty_trigger": "CREATE OR REPLACE FUNCTION cp_workspace_demand_added() RETURNS trigger"
    " LANGUAGE plpgsql AS $$ BEGIN RETURN NULL; END $$",
    "empty_no_transition": "DROP TRIGGER pending_jobs_demand_added ON pending_jobs;"
    " CREATE FUNCTION cp_nothing() RETURNS trigger LANGUAGE plpgsql"
    " AS $$ BEGIN RETURN NULL; END $$;"
    " CREATE TRIGGER t AFTER INSERT ON pending_jobs FOR EACH STATEMENT"
    " EXECUTE FUNCTION cp_nothing()",
    "insert_only": "CREATE OR REPLACE FUNCTION cp_workspace_demand_added() RETURNS trigger"
    " LANGUAGE plpgsql AS $$ BEGIN INSERT INTO workspace_demand (workspace_id, oldest)"
    " SELECT w.workspace_id, w.oldest FROM (SELECT workspace_id, min(created_at) AS oldest"
    " FROM added GROUP BY workspace_id ORDER BY workspace_id) AS w,"
    " LATERAL pg_advisory_xact_lock_shared(('x' || left(md5('cp_workspace_demand:'"
    " || w.workspace_id::text), 16))::bit(64)::bigint) AS held"
    " ON CONFLICT (workspace_id) DO NOTHING; RETURN NULL; END $$",
}


def after_job(ws: uuid.UUID) -> NewJob:
    """One job as the HTTP route makes it by default (priority 0, no key, the default run and
    queue timeouts, no retries)."""
    return replace(harness.new_job(ws), timeout_seconds=21600, queue_timeout_seconds=86400)


def after_args(ws: uuid.UUID) -> list[object]:
    """after_job's arguments as store/queue.py passes them."""
    job = after_job(ws)
    labels = json_text(job.required_labels)
    return [
        [ws], [uuid.uuid4()], [uuid.uuid4()], [uuid.uuid4()], [job.identity.job_execution_id],
        [uuid.uuid4()], [labels], ["{}"], [job.queued_at],
        [queue.enqueued_payload(ws, job.required_labels)], queue.ENQUEUED_CHANNEL,
        [0], [None], [None], [21600], [86400], [0],
    ]  # fmt: skip


def before_args(ws: uuid.UUID) -> list[object]:
    return after_args(ws)[:11]


CALL = "SELECT * FROM cp_enqueue(" + ", ".join(f"${n}" for n in range(1, 19)) + ")"  # noqa: S608 -- placeholders only


async def call(conn: asyncpg.Connection, args: list[object]) -> list[float]:
    """This tree's enqueue: one call of cp_enqueue (its own transaction)."""
    ex = args[4][0]  # type: ignore[index]
    t0 = time.perf_counter()
    await conn.fetchrow(CALL, [locks.execution(ex)], *args)
    t1 = time.perf_counter()
    return [0.0, 0.0, (t1 - t0) * 1e3, 0.0, (t1 - t0) * 1e3]


async def store(conn: asyncpg.Connection, ws: uuid.UUID) -> list[float]:
    """This tree's store call, Python included."""
    t0 = time.perf_counter()
    await queue.enqueue(conn, [after_job(ws)])
    t1 = time.perf_counter()
    return [0.0, 0.0, (t1 - t0) * 1e3, 0.0, (t1 - t0) * 1e3]


async def one(conn: asyncpg.Connection, statement: str, args: list[object]) -> list[float]:
    ex = args[4][0]  # type: ignore[index]
    t0 = time.perf_counter()
    await conn.execute("BEGIN")
    t1 = time.perf_counter()
    await conn.execute("SELECT pg_advisory_xact_lock($1)", locks.execution(ex))
    t2 = time.perf_counter()
    await conn.fetchrow(statement, *args)
    t3 = time.perf_counter()
    await conn.execute("COMMIT")
    t4 = time.perf_counter()
    return [(t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3, (t4 - t3) * 1e3, (t4 - t0) * 1e3]


async def setup(server: str, name: str, sql_dir: Path, tweak: str | None) -> str:
    admin = await asyncpg.connect(f"{server}/postgres")
    await admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
    await admin.execute(f'CREATE DATABASE "{name}"')
    await admin.close()
    url = f"{server}/{name}"
    conn = await asyncpg.connect(url)
    await migrations.migrate(conn, sql_dir)
    if tweak:
        await conn.execute(tweak)
    await conn.close()
    return url


async def main() -> None:
    variants = [v for v in os.environ.get("BENCH_ENQUEUE_VARIANTS", "").split(",") if v]
    with tempfile.TemporaryDirectory(prefix="cp-enqueue-pg-") as folder:
        server = EmbeddedPostgres(Path(folder) / "data")
        url = server.start()
        admin = await asyncpg.connect(url)
        await admin.execute("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'")
        await admin.execute("ALTER SYSTEM SET pg_stat_statements.track = 'all'")
        await admin.execute("ALTER SYSTEM SET pg_stat_statements.track_planning = on")
        await admin.close()
        server.stop("fast")
        url = server.start()
        try:
            await measure(url.rsplit("/", 1)[0], variants)
        finally:
            server.stop("fast")


async def measure(server: str, variants: list[str]) -> None:
    with harness.baseline_tree("1089cdd") as (tree, _ref):
        sides = {"before": await setup(server, "before", tree / "sql", None)}
    sides["main"] = await setup(server, "main", migrations.default_sql_dir(), None)
    sides["after"] = await setup(server, "after", migrations.default_sql_dir(), None)
    sides["after_store"] = await setup(server, "after_store", migrations.default_sql_dir(), None)
    for variant in variants:
        tweak = VARIANTS[variant]
        sides[variant] = await setup(server, variant, migrations.default_sql_dir(), tweak)
    conns = {name: await asyncpg.connect(url) for name, url in sides.items()}
    for conn in conns.values():
        await conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    workspace = uuid.uuid4()
    samples: dict[str, list[list[float]]] = {name: [] for name in sides}
    names = list(sides)
    for round_ in range(ROUNDS + 1):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        if round_ == 1:  # for every database of the server at once
            await conns["before"].execute("SELECT pg_stat_statements_reset()")
        for name in order:
            conn = conns[name]
            await conn.execute("TRUNCATE pending_jobs")
            for _ in range(JOBS):
                if name == "before":
                    times = await one(conn, BEFORE_STATEMENT, before_args(workspace))
                elif name == "after":
                    times = await call(conn, after_args(workspace))
                elif name == "after_store":
                    times = await store(conn, workspace)
                else:  # main, and the variants of its schema
                    times = await one(conn, MAIN_STATEMENT, after_args(workspace))
                if round_:  # the first round warms up
                    samples[name].append(times)
    steps = ["begin", "lock", "statement", "commit", "total"]
    print(f"load average {os.getloadavg()}, {ROUNDS} rounds x {JOBS} enqueues, client-side ms:")
    print(f"{'database':16}" + "".join(f"{s:>11}" for s in steps) + "   (median; mean total)")
    for name, timings in samples.items():
        medians = [statistics.median(column) for column in zip(*timings, strict=True)]
        print(
            f"{name:16}"
            + "".join(f"{m:11.3f}" for m in medians)
            + f"   {statistics.mean(t[4] for t in timings):.3f}"
        )
    print("\nserver-side (pg_stat_statements, track=all): mean ms per call, calls")
    for name, conn in conns.items():
        rows = await conn.fetch(
            """
            SELECT calls, plans, mean_exec_time, mean_plan_time, shared_blks_hit, wal_records,
                   left(regexp_replace(query, '\\s+', ' ', 'g'), 90) AS q
            FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid
            WHERE d.datname = current_database() AND calls >= $1
            ORDER BY total_exec_time DESC LIMIT 8
            """,
            ROUNDS * JOBS,
        )
        print(f"-- {name}")
        for row in rows:
            print(
                f"  {row['mean_exec_time']:7.4f} ms x{row['calls']:<6} "
                f"plan {row['mean_plan_time']:6.4f} ms x{row['plans']:<6} "
                f"hit/call {row['shared_blks_hit'] / row['calls']:5.1f} "
                f"wal/call {row['wal_records'] / row['calls']:4.1f}  {row['q']}"
            )
    await explain(conns, MAIN_STATEMENT, workspace)
    for conn in conns.values():
        await conn.close()


async def explain(conns: dict[str, asyncpg.Connection], after: str, ws: uuid.UUID) -> None:
    print("\nEXPLAIN (ANALYZE, BUFFERS) of one insert (rolled back): triggers and total")
    for name, conn in conns.items():
        statement, args = (
            (BEFORE_STATEMENT, before_args(ws)) if name == "before" else (after, after_args(ws))
        )
        tr = conn.transaction()
        await tr.start()
        plan = await conn.fetchval(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {statement}", *args)
        await tr.rollback()
        top = json.loads(plan)[0]
        triggers = [(t["Trigger Name"], round(t["Time"], 3)) for t in top.get("Triggers", [])]
        print(f"  {name:16} execution {top['Execution Time']:.3f} ms  triggers {triggers}")


if __name__ == "__main__":
    subprocess.run(["uptime"], check=False)
    asyncio.run(main())
