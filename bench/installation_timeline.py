"""Where an installation provisioner's enqueue -> grant time goes (issue 16): the timeline of
each grant probe of bench/installation.py's allocation part, stage by stage, with the database's
plans of the statements a round runs and, optionally, py-spy's profile of the replica.

The replica runs with a `sitecustomize` (`INSTRUMENT`; it works for `--tree` too, as long as
that tree has the same names) that writes a wall-clock stamp, as JSON lines, at:
the listener's delivery of an enqueue's NOTIFY to the demand board, the start and end of each
allocation round, each store call of the walk (the list, the provisioner's pending grants, one
workspace's transaction, the figures read) with its duration, and the `demand` push. The probe
client stamps the enqueue request, its answer and the push's arrival. Stages of one probe:

    enqueue -> notify heard -> round start -> list -> pending grants -> [transactions, figures]
    -> pending grants -> round end -> push sent -> push received

`python -m bench.installation_timeline --workspaces 10000 --pending 200000 --probes 20 --explain`
(`--help` for the rest). Writes the report to BENCH_RESULTS or bench/results/
installation_grant_latency.txt (`--output` elsewhere) and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import anyio
import asyncpg

from bench import harness, wire
from bench.installation import (
    BULK,
    GRANT_TTL,
    PROBE,
    PROBE_SLOTS,
    fill_sql,
    installation_session,
)
from bench.installation_clients import Template, enqueue, job, orchestrator_key
from bench.profiling import profile_summary, py_spy
from controlplane.store import demand_inputs, demand_list, walk_figures
from controlplane.store.embedded import EmbeddedPostgres

# The replica's sitecustomize (Python imports it at start, before the daemon's code runs): wraps
# the grant path's methods with stamps.
INSTRUMENT = r"""
import functools, json, os, time
LOG = open(os.environ["CP_TIMELINE_LOG"], "a", buffering=1)
def note(what, **kw):
    stamp = {"t": time.time(), "what": what, **{k: str(v) for k, v in kw.items()}}
    LOG.write(json.dumps(stamp) + "\n")
from controlplane.actors.provisioning import actor, board
from controlplane.store import provisioning
wake = board.DemandBoard.wake_workspace
def wake_workspace(self, workspace_id, labels=None):
    note("notify", ws=workspace_id)
    return wake(self, workspace_id, labels)
board.DemandBoard.wake_workspace = wake_workspace
measured = actor.ProvisionerActor._measured_round
async def measured_round(self, advertisement):
    note("round_start")
    try:
        return await measured(self, advertisement)
    finally:
        note("round_end")
actor.ProvisionerActor._measured_round = measured_round
init = actor.ProvisionerActor.__init__
def new_init(self, store, provisioner, limits, send, clock):
    async def timed(message):
        note("send_start", grants=len(message.grants), stats=len(message.stats))
        await send(message)
        note("send_end")
    init(self, store, provisioner, limits, timed, clock)
actor.ProvisionerActor.__init__ = new_init
def stamped(name, f):
    @functools.wraps(f)
    async def g(self, *a, **k):
        start = time.time()
        result = await f(self, *a, **k)
        extra = {"n": len(a[0])} if name in ("walk_figures", "walk_workspaces") and a else {}
        if name == "walk_workspaces":
            extra["n"] = len(result)
        if name == "allocate_in_walk":
            extra = {"ws": a[0], "grants": -1 if result is None else len(result.grants)}
        note(name, dur_ms=round((time.time() - start) * 1000, 2), start=start, **extra)
        return result
    return g
Store = provisioning.SessionStore
for name in ("walk_workspaces", "outstanding_grants", "walk_figures", "allocate_in_walk"):
    setattr(Store, name, stamped(name, getattr(Store, name)))
"""

STORE_CALLS = ("walk_workspaces", "outstanding_grants", "allocate_in_walk", "walk_figures")


async def start_replica(url: str, log: Path, tree: Path | None) -> harness.Replica:
    """A replica (of `tree`, else this checkout) whose grant path writes its stamps to `log`."""
    site = log.parent / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(INSTRUMENT)
    env = harness.tree_env(tree) if tree else {}
    path = [str(site), *([env["PYTHONPATH"]] if env else [])]
    replica = await harness.start_replica(
        url, **{**env, "PYTHONPATH": os.pathsep.join(path), "CP_TIMELINE_LOG": str(log)}
    )
    if tree is not None and not harness.within(replica.code, tree):
        harness.stop_replicas([replica])
        raise RuntimeError(f"a replica of {tree} runs {replica.code}")
    return replica


async def probe(
    client: Any, conn: wire.Connection, key: str, workspace: uuid.UUID, deadline: float
) -> tuple[float, float, float | None]:
    """Enqueue one probe job; wall-clock stamps of the request, its answer and the grant."""
    offset = time.time() - time.perf_counter()
    seen = len(client.demands)
    start = time.time()
    await enqueue(conn, key, [job(workspace, PROBE)])
    answered = time.time()
    with anyio.move_on_after(deadline):
        while True:
            while seen < len(client.demands):
                at, message = client.demands[seen]
                seen += 1
                if any(
                    g["workspace_id"] == str(workspace) and "probe" in g["labels"]
                    for g in message["grants"]
                ):
                    return start, answered, at + offset
            client.pushed = anyio.Event()
            await client.pushed.wait()
    return start, answered, None


def stages(stamp: dict[str, Any], events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One probe's stages (ms) from the replica's stamps between its enqueue and its grant."""
    start, end = stamp["start"], stamp["granted"]
    if end is None:
        return None
    seen = [e for e in events if start - 0.001 <= e["t"] <= end + 0.001]
    begun = [e["t"] for e in seen if e["what"] == "round_start"]
    ended = [e["t"] for e in seen if e["what"] == "round_end"]
    if not (begun and ended):
        return None

    def spent(name: str) -> float:
        return sum(float(e["dur_ms"]) for e in seen if e["what"] == name)

    found = {
        "total": (end - start) * 1000,
        "enqueue_answered": (stamp["answered"] - start) * 1000,
        "round_started": (begun[0] - start) * 1000,
        "rounds": len(begun),
        **{f"{name}_ms": spent(name) for name in STORE_CALLS},
        "transactions": sum(1 for e in seen if e["what"] == "allocate_in_walk"),
        "figure_reads": sum(1 for e in seen if e["what"] == "walk_figures"),
        "round_end_to_received_ms": (end - ended[-1]) * 1000,  # the push, built and sent
    }
    found["replica_python_ms"] = (ended[-1] - begun[0]) * 1000 - sum(
        found[f"{name}_ms"] for name in STORE_CALLS
    )
    return found


def timeline(stamp: dict[str, Any], events: list[dict[str, Any]]) -> list[str]:
    start, end = stamp["start"], stamp["granted"] or stamp["start"] + 5
    lines = [
        f"probe into a {stamp['kind']} workspace: enqueue answered "
        f"+{(stamp['answered'] - start) * 1000:.1f} ms, grant received +{(end - start) * 1000:.1f}"
    ]
    for e in events:
        if start - 0.001 <= e["t"] <= end + 0.001:
            began = f" (began +{(float(e['start']) - start) * 1000:.1f})" if "start" in e else ""
            extra = {k: v for k, v in e.items() if k not in ("t", "what", "start", "ws")}
            lines.append(f"  +{(e['t'] - start) * 1000:7.1f} {e['what']}{began} {extra}")
    return lines


async def explain(conn: asyncpg.Connection, hot: uuid.UUID, cold: uuid.UUID) -> list[str]:
    """EXPLAIN (ANALYZE, BUFFERS) of the statements a round runs, at this backlog."""
    listed, _ = await demand_list.walk_list(conn)
    demand_rows = demand_inputs.startable("$1")
    startable = f"SELECT required_labels, count(*)::int, min(created_at) FROM ({demand_rows}) AS d GROUP BY required_labels"  # noqa: E501, S608 -- interpolates constants only
    statements: list[tuple[str, str, tuple[Any, ...]]] = [
        (
            "the walk's list, its first page (one notified workspace)",
            demand_list._PAGE,
            (None, 1133, None, None, None, [cold], demand_list._NIL),
        ),
        ("a hot workspace's demand groups", startable, (hot,)),
        ("a hot workspace's figures", walk_figures._FIGURES, ([hot], None)),
        ("a cold workspace's figures", walk_figures._FIGURES, ([cold], None)),
        (
            f"the figures of every listed workspace ({len(listed)}: a full walk's read)",
            walk_figures._FIGURES,
            ([e.workspace_id for e in listed], None),
        ),
    ]
    lines = []
    for name, sql, params in statements:
        rows = await conn.fetch("EXPLAIN (ANALYZE, BUFFERS) " + sql, *params)
        lines += [f"=== {name}", *(r[0] for r in rows), ""]
    return lines


def summary(found: list[dict[str, Any]]) -> list[str]:
    lines = []
    for kind in ("cold", "hot"):
        rows = [f for f in found if f["kind"] == kind]
        if not rows:
            continue
        totals = sorted(f["total"] for f in rows)
        medians = {
            key: round(statistics.median(f[key] for f in rows), 1)
            for key in rows[0]
            if key not in ("kind", "total")
        }
        lines.append(
            f"{kind}: {len(rows)} probes, p50 {statistics.median(totals):.1f} ms, "
            f"max {totals[-1]:.1f} ms; stage medians (ms or counts): {medians}"
        )
    return lines


async def run(args: argparse.Namespace) -> list[str]:
    folder = Path(tempfile.mkdtemp(prefix="cp-timeline-"))
    server = EmbeddedPostgres(folder / "data", max_connections=200)
    tree = f"tree {args.tree}" if args.tree else "this checkout"
    report = [
        f"{args.workspaces} workspaces, {args.pending} pending (9 of 10 in {args.hot} hot), "
        f"{args.probes} probes of each kind; {tree}; load average before: {os.getloadavg()}",
    ]
    url = await harness.fresh_database(server.start())
    replica: harness.Replica | None = None
    try:
        conn = await asyncpg.connect(url)
        workspaces = [uuid.uuid4() for _ in range(args.workspaces)]
        hot_count = max(1, min(args.hot, args.workspaces // 10))
        hot, cold = workspaces[:hot_count], workspaces[hot_count:] or workspaces[:hot_count]
        key = await orchestrator_key(conn)
        await fill_sql(conn, args.pending, hot, cold)
        await conn.execute("VACUUM ANALYZE")
        log = folder / "stamps.jsonl"
        replica = await start_replica(url, log, args.tree)
        report.append(f"replica code: {replica.code}")
        stamps: list[dict[str, Any]] = []
        async with installation_session(conn, replica.address, "probes") as client:
            await client.advertise(
                [Template("bulk", BULK, 1000), Template("probe", PROBE, PROBE_SLOTS)],
                1000,
                GRANT_TTL,
            )
            await anyio.sleep(args.settle)
            spy = None
            if args.spy and py_spy():
                command = [str(py_spy()), "record", "--pid", str(replica.process.pid)]
                command += ["--format", "raw", "--rate", "500", "--nonblocking"]
                spy = subprocess.Popen(
                    [*command, "--output", str(args.spy)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                await anyio.sleep(1.0)
            wired = wire.Connection(replica.address)
            try:
                for kind, among in (("cold", cold), ("hot", hot)):
                    for _ in range(args.probes):
                        start, answered, granted = await probe(
                            client, wired, key, random.choice(among), args.deadline
                        )
                        stamps.append(
                            {"kind": kind, "start": start, "answered": answered, "granted": granted}
                        )
                        await anyio.sleep(args.gap)
            finally:
                await wired.aclose()
            if spy is not None:
                spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
                spy.wait(60)
            report.append(f"load average after: {os.getloadavg()}")
            events = [json.loads(line) for line in log.read_text().splitlines()]
            found: list[dict[str, Any]] = []
            for stamp in stamps:
                figures = stages(stamp, events)
                if figures is not None:
                    found.append({"kind": stamp["kind"], **figures})
            report += ["", *summary(found), ""]
            missed = [s for s in stamps if s["granted"] is None]
            report.append(f"missed (no grant within {args.deadline} s): {len(missed)}")
            for kind in ("cold", "hot"):
                ordered = sorted(
                    (s for s in stamps if s["kind"] == kind and s["granted"]),
                    key=lambda s: s["granted"] - s["start"],
                )
                if ordered:
                    report += [
                        "",
                        f"median {kind} probe:",
                        *timeline(ordered[len(ordered) // 2], events),
                    ]
                    report += [f"slowest {kind} probe:", *timeline(ordered[-1], events)]
            if spy is not None:
                profile = profile_summary(args.spy, 20)
                report += ["", "py-spy:", json.dumps(profile, indent=1)]
            if args.explain:
                report += ["", *await explain(conn, hot[0], cold[0])]
        await conn.close()
    finally:
        if replica is not None:
            harness.stop_replicas([replica])
        server.stop("fast")
        shutil.rmtree(folder, ignore_errors=True)  # the database: hundreds of MB
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.installation_timeline")
    parser.add_argument("--workspaces", type=int, default=10_000)
    parser.add_argument("--pending", type=int, default=200_000)
    parser.add_argument("--hot", type=int, default=10)
    parser.add_argument("--probes", type=int, default=20, help="of each kind, cold and hot")
    parser.add_argument("--gap", type=float, default=0.2, help="seconds between probes")
    parser.add_argument("--deadline", type=float, default=5.0)
    parser.add_argument("--settle", type=float, default=3.0)
    parser.add_argument("--tree", type=Path, help="run the replica of this checkout")
    parser.add_argument("--spy", type=Path, help="py-spy's raw profile of the replica, here")
    parser.add_argument("--explain", action="store_true", help="EXPLAIN the round's statements")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    report = anyio.run(run, args)
    text = "\n".join(report) + "\n"
    output = args.output or harness.RESULTS / "installation_grant_latency.txt"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text)
    print(text)
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
