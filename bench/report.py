"""Render docs/benchmarks.md from bench/results/*.json and the notes in bench/notes.md."""

from __future__ import annotations

import json
import os
from typing import Any

from bench import footprint, installation_report, plots
from bench.harness import RESULTS, ROOT

# A run with BENCH_RESULTS set (a smoke run) renders beside its results, not into docs/.
DOC = (
    RESULTS / "benchmarks.md"
    if os.environ.get("BENCH_RESULTS")
    else ROOT / "docs" / "benchmarks.md"
)
NOTES = ROOT / "bench" / "notes.md"
IMAGES = DOC.parent / "benchmarks"  # the charts, linked from DOC by relative path


def _machine(result: dict[str, Any]) -> str:
    m = result["machine"]
    return (
        f"{m['cores']} cores ({m['cpu']}), {m['memory_mib']} MiB, Python {m['python']}, "
        f"measured {m['measured_at']}"
    )


def _section(title: str, result: dict[str, Any], intro: str, header: str, rule: str) -> list[str]:
    """A section's title, the machine and what was measured, and the head of its table."""
    return [f"## {title}", "", f"Machine: {_machine(result)}. {intro}", "", header, rule]


def _latency(title: str, result: dict[str, Any], intro: str, sized_by: str) -> list[str]:
    """dispatch's and demand's table: each size beside the INSERT + NOTIFY -> LISTEN floor."""
    base = result["baseline_insert_notify_listen"]
    lines = [
        *_section(
            title,
            result,
            intro,
            f"| {sized_by} | p50 ms | p99 ms | max ms | p50 / baseline | p99 / baseline |",
            "|---:|---:|---:|---:|---:|---:|",
        ),
        f"| baseline: INSERT+NOTIFY -> LISTEN | {base['p50_ms']} | {base['p99_ms']} | "
        f"{base['max_ms']} | 1.0 | 1.0 |",
    ]
    for size, row in result["sizes"].items():
        lines.append(
            f"| {size} | {row['p50_ms']} | {row['p99_ms']} | {row['max_ms']} | "
            f"{row['p50_ratio_to_baseline']} | {row['p99_ratio_to_baseline']} |"
        )
    return lines


def _dispatch(result: dict[str, Any]) -> list[str]:
    lines = _latency(
        "Dispatch latency (enqueue to runner-has-job)",
        result,
        f"Two replicas, runners split across them, {result['samples_per_size']} jobs enqueued "
        "one at a time per size.",
        "parked runners",
    )
    cancel = result.get("cancel_to_held_heartbeat")
    if cancel:
        lines += [
            "",
            "Cancellation reaching a running runner (orchestrator's cancel request sent to the "
            f"held heartbeat answering `cancel: true`, {cancel['n']} samples): "
            f"p50 {cancel['p50_ms']} ms, p99 {cancel['p99_ms']} ms, max {cancel['max_ms']} ms "
            "(the target is under 1 s; the reference waits for the next 10 s heartbeat).",
        ]
    return [*lines, ""]


def _throughput(result: dict[str, Any]) -> list[str]:
    lines = _section(
        "Throughput (whole lifecycle: claim, one heartbeat, complete)",
        result,
        f"{result['jobs_per_run']} jobs per run, pre-enqueued; HTTP through {_replicas(result)}; "
        "SQL on direct connections with the store's statements. Each figure is the median of "
        f"{result.get('rounds', 1)} interleaved runs (their range in brackets). Same-server "
        f"pgbench TPC-B: {result['pgbench_tpcb_tps']} tps.",
        "| runners | HTTP jobs/s | SQL jobs/s (baseline) | HTTP / SQL | HTTP with policies "
        "jobs/s | policies / plain (median of round pairs) |",
        "|---:|---:|---:|---:|---:|---:|",
    )
    for count, row in result["runs"].items():
        policies = row.get("http_policies_jobs_per_s", "")  # recorded since issue 14
        if policies:
            policies = f"{policies}{_range(row.get('http_policies_rounds'))}"
        lines.append(
            f"| {count} | {row['http_jobs_per_s']}{_range(row.get('http_rounds'))} | "
            f"{row['sql_jobs_per_s']}{_range(row.get('sql_rounds'))} | {row['http_to_sql']} | "
            f"{policies} | {row.get('policies_to_plain', '')} "
            f"({row.get('paired_policies_to_plain', '')}) |"
        )
    if "policies" in result:
        shape = result["policies"]
        lines += [
            "",
            f"HTTP with policies: every job with one of {shape['keys']} concurrency keys (limit "
            f"{shape['key_limit']}) and one of {shape['projects']} projects, the workspace "
            "ordering `fair`; plain and policies alternate which runs first in each round. "
            "Target (issue 14): policies / plain at least 0.8.",
        ]
    if "peers" in result:
        lines += ["", *_peer_table(result["peers"], result["peers"]["by_concurrency"])]
    return [*lines, ""]


def _replicas(result: dict[str, Any]) -> str:
    count = result.get("replicas", 2)  # results recorded before the key existed used two
    return "one replica" if count == 1 else f"{count} replicas"


def _range(rounds: list[float] | None) -> str:
    if not rounds or len(rounds) < 2:
        return ""
    return f" ({min(rounds):.0f}-{max(rounds):.0f})"


def _peer_table(found: dict[str, Any], runs: dict[str, Any]) -> list[str]:
    versions = ", ".join(f"{name} {version}" for name, version in found["versions"].items())
    lines = [
        f"Peers (measured {found.get('measured_at', 'with the table above')}) on the same "
        "server, no-op jobs, one job per fetch (pgqueuer `batch_size=1`; "
        "procrastinate fetches one job per sub-worker), worker concurrency = our runner count; "
        "our HTTP and SQL figures measured again in the same rounds, each figure the median of "
        f"its rounds ({versions or 'none'}). "
        "Targets: ours at least 3x procrastinate and at least 1x pgqueuer.",
        "",
        "| concurrency | peer | peer jobs/s | our HTTP jobs/s | ours / peer | "
        "SQL floor jobs/s | peer / SQL |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for size, row in runs.items():
        for peer, figures in row["peers"].items():
            lines.append(
                f"| {size} | {peer} | {figures['jobs_per_s']} | {row['http_jobs_per_s']} | "
                f"{figures['http_to_peer']} | {row['sql_jobs_per_s']} | {figures['peer_to_sql']} |"
            )
    for reason in found.get("skipped", {}).values():
        lines += ["", f"Skipped: {reason}."]
    return lines


def _peers(result: dict[str, Any]) -> list[str]:
    lines = [
        "## Peers (standalone run of bench/peers.py)",
        "",
        f"Machine: {_machine(result)}. {result['jobs_per_run']} jobs per run; HTTP through "
        f"{_replicas(result)}.",
        "",
    ]
    found = {"versions": result["versions"], "skipped": result.get("skipped", {})}
    return [*lines, *_peer_table(found, result["runs"]), ""]


def _scale(result: dict[str, Any]) -> list[str]:
    lines = ["## Scale", "", f"Machine: {_machine(result)}.", ""]
    if "parked" in result:
        parked, base, loaded = (
            result["parked"],
            result["parked"]["baseline"],
            result["parked"]["loaded"],
        )
        lines += [
            f"### {parked['parked']} parked long-polls on one replica, idle",
            "",
            f"Each state measured over {loaded['window_s']} s on the same daemon process; "
            "database work from pg_stat_database / pg_stat_user_tables (pg_stat_statements is "
            "not loaded). Target: under 300 MB with no per-runner database queries.",
            "",
            "| state | RSS MiB | peak RSS MiB | CPU % | xacts/min | scans/min | rows written/min |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for name, row in (("baseline: 0 parked", base), (f"{parked['parked']} parked", loaded)):
            lines.append(
                f"| {name} | {row['rss_mib']} | {row['peak_rss_mib']} | {row['cpu_percent']} | "
                f"{row['xact_commit_per_min']} | {row['scans_per_min']} | "
                f"{row['rows_written_per_min']} |"
            )
        lines += [
            "",
            f"Per parked runner: {parked['rss_per_runner_kib']} KiB of RSS, "
            f"{parked['extra_xacts_per_runner_per_min']} extra transactions a minute "
            f"({loaded['polls_answered_per_min']} long polls answered a minute, each "
            "re-asked at once).",
            "",
        ]
    if "pending" in result:
        pending = result["pending"]
        lines += [
            "### Claim latency against a deep queue",
            "",
            f"The store's `claiming.claim` on direct connections, {pending['samples']} timed "
            "claims per size, each followed by an untimed enqueue so the depth holds; rows "
            "spread over 10 workspaces. Target: the deepest queue within 1.5x of the shallowest.",
            "",
            "| pending rows | p50 ms (1 conn) | p99 ms (1 conn) | "
            f"p50 ms ({pending['connections']} conns) | p99 ms ({pending['connections']} conns) |",
            "|---:|---:|---:|---:|---:|",
        ]
        many = f"{pending['connections']}_connections"
        for size, row in pending["sizes"].items():
            lines.append(
                f"| {size} | {row['one_connection']['p50_ms']} | "
                f"{row['one_connection']['p99_ms']} | {row[many]['p50_ms']} | "
                f"{row[many]['p99_ms']} |"
            )
        ratio = pending["ratio_deepest_to_smallest"]
        lines += [
            f"| deepest / shallowest | {ratio['one_connection']['p50_ms']} | "
            f"{ratio['one_connection']['p99_ms']} | {ratio[many]['p50_ms']} | "
            f"{ratio[many]['p99_ms']} |",
            "",
        ]
    if "ordering" in result:
        lines += _ordering(result["ordering"])
    if "reaper" in result:
        reaper = result["reaper"]
        lines += [
            "### The reaper under load",
            "",
            f"{reaper['stale_leases']} leases stale for an hour inserted at once while "
            f"{reaper['runners']} HTTP runners run the whole lifecycle against one replica "
            f"(reaper every {reaper['reaper_interval_s']} s, {reaper['reaper_batch_limit']} "
            f"leases per statement). All expired {reaper['insert_to_drained_s']} s after the "
            f"insert, {reaper['first_to_last_expired_s']} s from the first to the last; "
            f"{reaper['expired_tombstones']} tombstones written.",
            "",
            "| lifecycle jobs/s | before (baseline) | while reaping | after | during / before |",
            "|---|---:|---:|---:|---:|",
            f"| one replica | {reaper['jobs_per_s_before']} | {reaper['jobs_per_s_during']} | "
            f"{reaper['jobs_per_s_after']} | {reaper['during_to_before']} |",
            "",
        ]
    if "replicas" in result:
        scaling = result["replicas"]
        lines += [
            "### Throughput by replica count",
            "",
            f"bench/throughput.py's HTTP lifecycle, {scaling['runners']} runners, "
            f"{scaling['jobs_per_run']} jobs per run; SQL floor (same runners as direct "
            f"connections) {scaling['sql_jobs_per_s']} jobs/s in the same run.",
            "",
            "| replicas | HTTP jobs/s | HTTP / SQL |",
            "|---:|---:|---:|",
        ]
        for count, row in scaling["replicas"].items():
            lines.append(f"| {count} | {row['http_jobs_per_s']} | {row['http_to_sql']} |")
        lines.append("")
    return lines


def _ordering(found: dict[str, Any]) -> list[str]:
    many = f"{found['connections']}_connections"
    lines = [
        f"### Claim latency with the ordering policies, {found['depth']:,} pending rows",
        "",
        f"The store's `claiming.claim`, {found['samples']} timed claims per variant, each "
        "followed by an untimed completion and an enqueue of the same shape; a fresh database "
        f"per variant, in the same run: plain FIFO, and the rows spread over "
        f"{found['projects']:,} projects, {found['priorities']} priorities and "
        f"{found['keys']:,} concurrency keys of limit {found['key_limit']}"
        + (
            " (`fair`: the same, every workspace ordered fairly)"
            if "ratio_fair_to_plain" in found
            else ""
        )
        + (
            "; `fair_hot_front`: fair's worst shape, a project holding leases owns the front "
            "of each workspace's queue, so every claim walks past it and probes every project"
            if "ratio_fair_hot_front_to_plain" in found
            else ""
        )
        + f". Measured {found.get('measured_at', '?')}. "
        "Target: policies within 1.5x of plain.",
        "",
        "| variant | filled in s | p50 ms (1 conn) | p99 ms (1 conn) | "
        f"p50 ms ({found['connections']} conns) | p99 ms ({found['connections']} conns) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, row in found["variants"].items():
        lines.append(
            f"| {name} | {row['filled_in_s']} | {row['one_connection']['p50_ms']} | "
            f"{row['one_connection']['p99_ms']} | {row[many]['p50_ms']} | {row[many]['p99_ms']} |"
        )
    for label, key in (
        ("policies / plain", "ratio_policies_to_plain"),
        ("fair / plain", "ratio_fair_to_plain"),
        ("fair, hot front / plain", "ratio_fair_hot_front_to_plain"),
    ):
        if key not in found:
            continue  # results from before the fair variant
        ratio = found[key]
        lines.append(
            f"| {label} | | {ratio['one_connection']['p50_ms']} | "
            f"{ratio['one_connection']['p99_ms']} | {ratio[many]['p50_ms']} | "
            f"{ratio[many]['p99_ms']} |"
        )
    return [*lines, ""]


def _soak(result: dict[str, Any]) -> list[str]:
    found, given, activity = result["audit"], result["parameters"], result["activity"]
    lines = _section(
        "Soak",
        result,
        f"{given['minutes']} min of chaos: {given['replicas']} replicas, {given['runners']} "
        f"runners, {given['provisioners']} provisioners, {given['jobs_per_s']} jobs/s enqueued "
        f"({given['provisioned_share']:.0%} for provisioned runners), a kill every "
        f"{given['chaos_every_s']} s on average (seed {given['seed']}): "
        f"{activity.get('replica_kills', 0)} replica SIGKILLs, "
        f"{activity.get('runner_kills', 0)} runners or machines killed, "
        f"{activity.get('machines_started', 0)} machines launched, "
        f"{activity.get('provisioner_reconnects', 0)} provisioner reconnects. Then the queue "
        f"drained; {result['elapsed_s']} s in all.",
        "| audit | count | must be |",
        "|---|---:|---|",
    )
    for key, name in (
        ("enqueued", "jobs enqueued"),
        ("completed", "completed"),
        ("expired", "expired"),
        ("cancelled", "cancelled"),
        ("timed_out", "timed out"),
        ("queue_expired", "queue expired"),
        ("retries", "retries (job.retried)"),
        ("pending", "still pending"),
        ("running", "still running"),
    ):
        if key in found:  # the policy lines arrived with issue 14
            lines.append(f"| {name} | {found[key]} | |")
    for key in (
        "lost",
        "run_twice",
        "deadlocks",
        "resurrected",
        "terminal_events_twice",
        "tombstones_without_event",
        "ended_but_queued",
        "acked_but_not_succeeded",
        "key_over_limit",
        "timed_out_late",
        "retried_beyond_limit",
    ):
        if key in found:
            lines.append(f"| {key.replace('_', ' ')} | {found[key]} | 0 |")
    return [*lines, ""]


def _demand(result: dict[str, Any]) -> list[str]:
    lines = _latency(
        "Demand latency (enqueue commit to grant received over the control session)",
        result,
        "Two replicas, workspace provisioners split across them (one workspace each), "
        f"{result['samples_per_size']} jobs enqueued one at a time per size, each into the next "
        "provisioner's workspace. Target: p99 under 50 ms.",
        "connected provisioners",
    )
    return [*lines, ""]


def _cli_startup(result: dict[str, Any]) -> list[str]:
    lines = _section(
        "CLI start-up (a fresh process per run, until it exits)",
        result,
        f"Medians of {result['rounds']} rounds, each command interleaved with the baseline. "
        "Target: under 0.3 s.",
        "| command | median s | max s | median / baseline |",
        "|---|---:|---:|---:|",
    )
    for name, row in result["commands"].items():
        lines.append(
            f"| {name} | {row['median_s']} | {row['max_s']} | {row['ratio_to_baseline']} |"
        )
    return [*lines, ""]


def _limits(result: dict[str, Any]) -> list[str]:
    lines = _section(
        "Connection limits: throughput before and after (same run)",
        result,
        f"bench/throughput.py's HTTP lifecycle, {result['jobs_per_run']} jobs per run, through "
        f"one replica of the tree before the limits ({result['baseline']}) and one of this tree, "
        "both on one database, the order alternating round by round; medians of "
        f"{result['rounds']} rounds (all rounds in brackets). Target: after / before at least "
        "0.95.",
        "| runners | before jobs/s | after jobs/s | after / before | median of round ratios "
        "| replica CPU us/job before | after |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    )
    for count, row in result["runs"].items():
        lines.append(
            f"| {count} | {row['before_jobs_per_s']} ({', '.join(map(str, row['before_rounds']))}) "
            f"| {row['after_jobs_per_s']} ({', '.join(map(str, row['after_rounds']))}) "
            f"| {row['after_to_before']} | {row.get('paired_after_to_before', '')} "
            f"| {row.get('before_cpu_us_per_job', '')} | {row.get('after_cpu_us_per_job', '')} |"
        )
    return [*lines, ""]


def _compare(result: dict[str, Any]) -> list[str]:
    return _before_after(
        result,
        "Refactor: before and after (same run)",
        "Issue 13's acceptance: the main figures of bench/throughput.py, bench/dispatch.py and "
        f"bench/demand.py through the tree before the refactor ({result['baseline']}) and "
        + (
            "this tree"
            if result.get("after", "this checkout") == "this checkout"
            else result["after"]
        ),
    )


def _compare_interleaved(result: dict[str, Any]) -> list[str]:
    """A dispatch-only run of bench/compare.py with more samples a round, renamed."""
    return _before_after(
        result,
        "Dispatch, 1,000 samples a round, interleaved: before and after (same run)",
        "Issue 13's dispatch figures alone, with more samples a round for steadier p99s "
        "(`BENCH_COMPARE_RUNNERS= BENCH_COMPARE_DEMAND= BENCH_COMPARE_CANCEL=0 "
        "BENCH_COMPARE_SAMPLES=1000`, the result renamed compare_interleaved.json): both "
        "sides' runners parked at once and their samples alternating one by one; the tree "
        f"before the refactor ({result['baseline']}) and this tree",
    )


def _compare_refactor(result: dict[str, Any]) -> list[str]:
    """bench/compare.py with BENCH_AFTER_REF at the refactor's last commit, renamed."""
    return _before_after(
        result,
        "Refactor alone: before and after (same run)",
        "Issue 13's acceptance for the refactor's own work: the same figures through the tree "
        f"before it ({result['baseline']}) and its last commit before issue 14's first merge "
        f"({result['after']}; `BENCH_AFTER_REF={result['after']}`, the result renamed "
        "compare_refactor.json), so that no later issue's change is in either side",
    )


def _policies_off(result: dict[str, Any]) -> list[str]:
    return _before_after(
        result,
        "Dispatch policies off: before and after (same run)",
        "Issue 14's acceptance (the HTTP lifecycle with every policy off within 5% of before): "
        f"bench/compare.py's throughput only, the tree before issue 14 ({result['baseline']}) "
        "and this tree",
    )


def _interleaved(result: dict[str, Any]) -> str:
    """What a compare run interleaved, as it recorded; a run from before it recorded that
    interleaved dispatch and demand."""
    measures = result.get("interleaved", ["dispatch", "demand"])
    names = [f"the {m}" if m == "cancel" else m for m in measures]
    return ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else "".join(names)


def _before_after(result: dict[str, Any], title: str, what: str) -> list[str]:
    sizes = result["sizes"]
    lines = _section(
        title,
        result,
        f"{what}, each side with its own two replicas, database and measuring process, all in its "
        "own tree's code (bench/compare.py); the order alternating round by round"
        + (
            f" ({_interleaved(result)} through both sides at once, their samples alternating one "
            "by one)"
            if sizes.get("interleave")
            else ""
        )
        + (", both databases vacuumed before each round's latencies" if sizes.get("vacuum") else "")
        + (
            f", each lifecycle run {sizes['repeats']} times a side a round, the sides taking turns "
            "run by run"
            if sizes.get("repeats", 1) > 1
            else ""
        )
        + f", medians of {sizes['rounds']} rounds; {sizes['jobs']} jobs per lifecycle run, "
        f"{sizes['samples']} samples per dispatch and demand run"
        + (f", {sizes['cancel']} cancels" if sizes.get("cancel") else "")
        + f"; {result['elapsed_s']} s in all. Change is "
        "the median of the rounds' own after / before ratios, signed so that negative is worse. "
        "Target: no figure worse by more than 5%.",
        "| benchmark | figure | unit | before | after | after / before | median of round "
        "ratios | round ratios, lowest to highest | change |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    )
    for row in result["figures"]:
        verdict = " (worse by more than 5%)" if row["worse_by_more_than_5_percent"] else ""
        ratios = [a / b for a, b in zip(row["after_rounds"], row["before_rounds"], strict=True)]
        lines.append(
            f"| {row['benchmark']} | {row['figure']} | {row['unit']} | {row['before']} | "
            f"{row['after']} | {row['after_to_before']} | {row['paired_after_to_before']} | "
            f"{min(ratios):.3f} to {max(ratios):.3f} | {row['change']:+.1%}{verdict} |"
        )
    worse = [
        f"{row['benchmark']} {row['figure']} ({row['unit']})"
        for row in result["figures"]
        if row["worse_by_more_than_5_percent"]
    ]
    lines += ["", f"Worse by more than 5%: {'; '.join(worse) if worse else 'none'}."]
    if result.get("costs"):
        lines += [
            "",
            "What each latency sample cost in CPU (outside the verdict, a diagnostic: CPU moves "
            "far less than a latency on a loaded machine, so it says where a latency's change "
            "comes from). Per sample, over the whole run of one measurement: setting up its "
            "runners or provisioners, and between samples the benchmark's own polling of "
            "`/metrics`, included; the database is every process of the server both sides "
            "share, measured while one side ran.",
            "",
            "| benchmark | figure | CPU of | before us | after us | median of round ratios |",
            "|---|---|---|---:|---:|---:|",
        ]
        for row in result["costs"]:
            lines.append(
                f"| {row['benchmark']} | {row['figure']} | "
                f"{row['unit'].removesuffix(' CPU us/sample')} | {row['before']} | "
                f"{row['after']} | {row['paired_after_to_before']} |"
            )
    return [*lines, ""]


def _idle_sessions(result: dict[str, Any]) -> list[str]:
    """Commits a minute per idle provisioner session, the baseline tree beside this one."""
    lines = _section(
        "Idle provisioner sessions",
        result,
        f"One replica, {result['sessions']} workspace-scope control sessions that advertise once "
        "and then only ping, nothing enqueued; database commits over "
        f"{result['window_seconds']:.0f} s windows with and without the sessions "
        "(`python -m bench idle_sessions`). Target "
        "(issue 16): no transaction a minute per idle session.",
        "| tree | replica alone, commits/min | with the sessions | per idle session /min |",
        "|---|---:|---:|---:|",
    )
    for side in ("before", "after"):
        row = result[side]
        lines.append(
            f"| {row['tree']} ({side}) | {row['replica_alone_per_minute']} | "
            f"{row['with_sessions_per_minute']} | {row['per_idle_session_per_minute']} |"
        )
    moved = result["after"].get("replica_metrics_per_minute", {})
    if moved:
        lines += [
            "",
            "This tree's replica, a minute: "
            + ", ".join(f"`{name}` {value}" for name, value in moved.items())
            + ".",
        ]
    return [*lines, ""]


def _pages(result: dict[str, Any]) -> list[str]:
    """The operator pages beside the admin API's reads of the same data, in one run."""
    target = 50.0
    lines = _section(
        "Operator pages under a full queue",
        result,
        f"{result['pending']:,} pending jobs over {result['label_sets']} label sets in "
        f"{result['workspaces']} workspaces, {result['runners']:,} live runners; each page and "
        f"API read fetched once a round, interleaved, for {result['rounds']} rounds after a warm "
        f"one. Target (issue 15): every page's p99 under {target:.0f} ms.",
        "| path | kind | p50 ms | p99 ms | max ms | p99 under target |",
        "|---|---|---:|---:|---:|---|",
    )
    for path, row in result["latency"].items():
        kind = "admin API" if path.startswith("/v1/") else "page"
        met = "yes" if row["p99_ms"] < target else "no"
        lines.append(
            f"| `{path}` | {kind} | {row['p50_ms']} | {row['p99_ms']} | {row['max_ms']} | "
            f"{met if kind == 'page' else '-'} |"
        )
    plots = result.get("plots_drawn")
    if plots:  # results from before the plots were drawn once per sample have none
        lines += [
            "",
            f"The overview's plots at a full hour ({plots['workspaces']} workspaces, "
            f"{plots['points_per_series']} points a series), timed in the benchmark's process: "
            f"drawn after a new sample (miss) p50 {plots['miss']['p50_ms']} ms, p99 "
            f"{plots['miss']['p99_ms']} ms; read back by a view (hit) p50 "
            f"{plots['hit']['p50_ms']} ms, p99 {plots['hit']['p99_ms']} ms.",
        ]
    return [*lines, ""]


RENDERERS = {
    "dispatch": _dispatch,
    "demand": _demand,
    "throughput": _throughput,
    "peers": _peers,
    "scale": _scale,
    "soak": _soak,
    "cli_startup": _cli_startup,
    "limits": _limits,
    "compare": _compare,
    "compare_interleaved": _compare_interleaved,
    "compare_refactor": _compare_refactor,  # bench/compare.py's result, 1089cdd to 7569915
    "policies_off": _policies_off,  # bench/compare.py's result against 7569915, renamed
    "pages": _pages,
    "idle_sessions": _idle_sessions,
    "footprint": footprint.render,
    "installation": installation_report.render,
}
# Sections written even before their bench has recorded a result: what to run to fill them.
PLACEHOLDERS = {"installation": installation_report.missing}


def _charts(name: str, result: dict[str, Any]) -> list[str]:
    """Draw the charts of one result file; the Markdown lines that show them."""
    if not plots.available():
        return []
    lines = []
    IMAGES.mkdir(parents=True, exist_ok=True)
    for file_name, alt, draw in plots.CHARTS.get(name, []):
        image = IMAGES / file_name
        image.unlink(missing_ok=True)
        draw(result, image)
        if image.exists():
            lines += [f"![{alt}]({IMAGES.name}/{file_name})", ""]
    return lines


def main() -> None:
    parts = [
        "# Benchmarks",
        "",
        "Generated by `just bench` (bench/report.py) from bench/results/.",
        "",
    ]
    if not plots.available():
        parts += ["Charts: not drawn (matplotlib is missing; `pip install -e '.[bench]'`).", ""]
    for name, render in RENDERERS.items():
        path = RESULTS / f"{name}.json"
        if path.exists():
            result = json.loads(path.read_text())
            parts += render(result)
            parts += _charts(name, result)
        elif name in PLACEHOLDERS:
            parts += PLACEHOLDERS[name]()
    if NOTES.exists():
        parts += [NOTES.read_text().rstrip(), ""]
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text("\n".join(parts))
    print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
