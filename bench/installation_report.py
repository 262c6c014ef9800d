"""docs/benchmarks.md's section for bench/installation.py's result (bench/report.py calls it)."""

from __future__ import annotations

from typing import Any


def _machine(result: dict[str, Any]) -> str:
    m = result["machine"]
    return (
        f"{m['cores']} cores ({m['cpu']}), {m['memory_mib']} MiB, Python {m['python']}, "
        f"measured {m['measured_at']}"
    )


def _joined(values: list[float]) -> str:
    return " / ".join(f"{value:g}" for value in values)


def _profile(profile: dict[str, Any] | None, where: str) -> list[str]:
    """A paragraph of what py-spy (`--profile`) found in `where`; none when it recorded nothing."""
    if not profile or not profile.get("file"):
        return []

    def named(key: str) -> str:
        return "; ".join(f"`{name}` {share}%" for name, share in profile[key][:6])

    return [
        "",
        f"py-spy (`--profile`) on {where}, {profile['samples']} samples of its thread that "
        f"py-spy did not find idle. Where they ended: {named('self_percent')} (a sample "
        "ending in `Runner.run` is inside the event loop's own C code: polling, socket I/O, "
        f"callbacks). Our functions on the stack: {named('controlplane_inclusive_percent')}.",
    ]


def _profiles(found: dict[str, Any], window: str) -> list[str]:
    """`_profile` of each replica's record through `window` (a profiled run's figures include
    py-spy's own CPU)."""
    lines: list[str] = []
    run = found.get("profiles_run")  # set when the profiles come from another run than the figures
    where = f"of a second run with py-spy attached ({run})" if run else "of this run"
    for index, profile in enumerate(found.get("profiles") or [], 1):
        lines += _profile(profile, f"replica {index} through {window} {where}")
    return [*lines, ""] if lines else []


def _allocation(found: dict[str, Any]) -> list[str]:
    sizes = list(found["by_workspaces"])
    big, small = (found["by_workspaces"][size] for size in sizes)
    lines = [
        "### Installation allocation rounds",
        "",
        f"{found['pending']} pending jobs (filled by {found['fill']}), 9 of 10 in "
        f"{big['hot_workspaces']} hot workspaces, one installation provisioner with "
        f"{found['slots']} slots, one replica. A round is the advertise that runs it, to its "
        "`demand` push; `server` is the replica's `controlplane_allocation_round_seconds` "
        "over the same window (mean); database CPU is what the server's backends spent "
        f"(/proc). Medians of {found['rounds_per_point']} rounds per point. Targets (issue "
        "16): a round's cost independent of the workspaces without demand, at most linear in "
        "those granted.",
        "",
        "| bulk slots | workspaces | round ms | server ms | database CPU ms | replica CPU ms | "
        "units granted | grants | round / baseline |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for slots, row in big["rounds_by_bulk_slots"].items():
        base = small["rounds_by_bulk_slots"][slots]
        for count, figures, ratio in (
            (sizes[0], row, found["round_ms_ratio_to_baseline"][slots]),
            (f"{sizes[1]} (baseline)", base, 1.0),
        ):
            lines.append(
                f"| {slots} | {count} | {figures['round_ms']} | {figures['server_round_ms']} | "
                f"{figures['db_cpu_ms']} | {figures['replica_cpu_ms']} | "
                f"{figures['granted_units']} | {figures['grants']} | {ratio} |"
            )
    lines += [
        "",
        f"Enqueue (HTTP) to the push granting it, one probe job at a time into a random cold or "
        f"hot workspace, with the bulk slots taken; {found['probes']} probes each; a probe not "
        f"granted within {found['grant_deadline_s']} s is missed and counted at that deadline. "
        "Target: p99 under 50 ms in both.",
        "",
        "| workspaces | cold p50 ms | cold p99 ms | cold missed | hot p50 ms | hot p99 ms | "
        "hot missed |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size in sizes:
        cold, hot = (found["by_workspaces"][size]["grant"][kind] for kind in ("cold", "hot"))
        lines.append(
            f"| {size} | {cold['p50_ms']} | {cold['p99_ms']} | {cold['missed']} | "
            f"{hot['p50_ms']} | {hot['p99_ms']} | {hot['missed']} |"
        )
    for key, what in (("profile", "rounds"), ("grant_profile", "grant probes")):
        lines += _profile(found.get(key), f"the replica through the {sizes[0]}-workspace {what}")
    return [*lines, ""]


def _idle_table(first: str, idle: dict[str, Any], second: str, loaded: dict[str, Any]) -> list[str]:
    lines = [
        "| state | RSS MiB per replica | CPU % per replica | xacts/min | rows written/min |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, row in ((first, idle), (second, loaded)):
        lines.append(
            f"| {name} | {_joined(row['rss_mib'])} | {_joined(row['cpu_percent'])} | "
            f"{row['xact_commit_per_min']} | {row['rows_written_per_min']} |"
        )
    return lines


def _floor(found: dict[str, Any]) -> str:
    floor = found.get("baseline_insert_notify_listen")
    return f"p50 {floor['p50_ms']} ms, p99 {floor['p99_ms']} ms" if floor else "(not measured)"


def _sessions(found: dict[str, Any]) -> list[str]:
    total = found["workspace_sessions"] + found["installation_sessions"]
    each, grant = found["per_session"], found["grant"]
    return [
        "### Provisioner sessions",
        "",
        f"{found['workspace_sessions']} workspace-scope sessions (one workspace each) and "
        f"{found['installation_sessions']} installation-scope ones over {found['replicas']} "
        f"replicas, each advertised once and pinging every 20 s; windows of "
        f"{found['loaded']['window_s']} s (connected in {found['connected_in_s']} s; "
        f"{found['sessions_closed_early']} closed early).",
        "",
        *_idle_table("baseline: no session", found["idle"], f"{total} sessions", found["loaded"]),
        "",
        f"Per session: {each['rss_kib']} KiB of RSS, {each['xacts_per_min']} transactions a "
        "minute (target: 0 for an idle session). Enqueue (HTTP) to grant over the session at "
        f"{grant['achieved_rate']} enqueues/s into random workspaces: p50 {grant['p50_ms']} ms, "
        f"p99 {grant['p99_ms']} ms, max {grant['max_ms']} ms, {grant['not_granted']} of "
        f"{grant['enqueued']} not granted (target: p99 under 50 ms), beside INSERT + NOTIFY -> "
        f"LISTEN {_floor(found)}.",
        "",
        *_profiles(found, "the grants"),
    ]


def _parked(found: dict[str, Any]) -> list[str]:
    each, dispatched = found["per_runner"], found["dispatch"]
    floor, actors = found["baseline_insert_notify_listen"], found["workspace_actors"]
    retired = actors["after_idle_wait"]
    after = (
        f"and {_joined(retired)} {actors['idle_wait_s']} s later"
        if retired is not None
        else "(the wait for their retirement was skipped)"
    )
    return [
        "### Parked runners",
        "",
        f"{found['runners']} runners on long polls over {found['replicas']} replicas in "
        f"{found['workspaces']} workspaces (all parked {found['parked_in_s']} s after the first "
        f"registration); windows of {found['loaded']['window_s']} s.",
        "",
        *_idle_table(
            "baseline: no runner", found["idle"], f"{found['runners']} parked", found["loaded"]
        ),
        "",
        f"Per runner: {each['rss_kib']} KiB of RSS, {each['xacts_per_min']} transactions a "
        f"minute. Dispatch (HTTP enqueue to the long poll's answer, {dispatched['n']} jobs into "
        f"random workspaces): p50 {dispatched['p50_ms']} ms, p99 {dispatched['p99_ms']} ms, "
        f"{dispatched['missed']} missed, beside INSERT + NOTIFY -> LISTEN p50 {floor['p50_ms']} "
        f"ms, p99 {floor['p99_ms']} ms (target: p99 under 10 ms). Workspace actors per replica: "
        f"{_joined(actors['parked'])} while parked, {_joined(actors['runners_gone'])} once the "
        f"runners left {after}; RSS afterwards {_joined(found['rss_mib_after'])} MiB.",
        "",
        *_profiles(found, "the dispatches"),
    ]


def _fanout(found: dict[str, Any]) -> list[str]:
    return [
        "### NOTIFY fan-out",
        "",
        f"{found['achieved_rate']} enqueues/s (target {found['target_rate']:g}) over HTTP into "
        f"one more replica, across {found['workspaces']} workspaces, no runner parked; each "
        f"listening replica only hears the NOTIFYs. Windows of {found['window_s']} s.",
        "",
        "| state | CPU % per listening replica |",
        "|---|---:|",
        f"| baseline: idle | {_joined(found['idle_cpu_percent'])} |",
        f"| {found['achieved_rate']} enqueues/s | {_joined(found['loaded_cpu_percent'])} |",
        "",
        f"Target: under 10% of a core per replica. The replica taking the enqueues: "
        f"{found['enqueueing_replica_cpu_percent']} %.",
        "",
    ]


def render(result: dict[str, Any]) -> list[str]:
    smoke = (
        " Smoke sizes: these figures show the bench works, not the issue's sizes."
        if result.get("smoke")
        else ""
    )
    lines = [
        "## A big installation (issue 16)",
        "",
        f"Machine: {_machine(result)}. Replicas of {result['tree']}; bench/installation.py "
        f"says how each part is measured.{smoke}",
        "",
    ]
    for name, part in (
        ("allocation", _allocation),
        ("sessions", _sessions),
        ("parked", _parked),
        ("fanout", _fanout),
    ):
        if name in result:
            lines += part(result[name])
    return lines


def missing() -> list[str]:
    """The section before a full run has recorded bench/results/installation.json."""
    return [
        "## A big installation (issue 16)",
        "",
        "Not measured at the issue's sizes yet: `just bench installation` (or "
        "`python -m bench.installation`, `--help` for the sizes, `--tree PATH` for another "
        "checkout) records it.",
        "",
    ]
