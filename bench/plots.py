"""PNG charts for docs/benchmarks.md, drawn from the same result files as its tables.

matplotlib comes with the `bench` extra; without it the report is written with its tables only
and says so. Each chart puts our figure beside the baseline measured in the same run.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

Chart = Callable[[dict[str, Any], Path], None]


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _save(figure: Any, path: Path) -> None:
    for axes in figure.axes:  # room above the bars for the legend
        axes.set_ylim(0, axes.get_ylim()[1] * 1.3)
        axes.legend(loc="upper left", ncol=2, fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    _pyplot().close(figure)


def _grouped(
    path: Path,
    groups: list[str],
    series: dict[str, list[float]],
    labels: tuple[str, str, str],
    lines: list[tuple[float, str, str]],
) -> None:
    """Bars for each series side by side in each group; `lines` are (y, label, style) rules;
    `labels` are the x label, the y label and the title."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(6.4, 3.6))
    width = 0.8 / len(series)
    for index, (name, values) in enumerate(series.items()):
        offset = (index - (len(series) - 1) / 2) * width
        axes.bar([i + offset for i in range(len(groups))], values, width, label=name)
    for y, label, style in lines:
        axes.axhline(y, color="grey" if style == "--" else "red", linestyle=style, label=label)
    axes.set_xticks(list(range(len(groups))), groups)
    axes.set_xlabel(labels[0])
    axes.set_ylabel(labels[1])
    axes.set_title(labels[2])
    _save(figure, path)


def _latency(
    result: dict[str, Any], path: Path, x_label: str, title: str, target_ms: float
) -> None:
    sizes = list(result["sizes"])
    _grouped(
        path,
        sizes,
        {q: [result["sizes"][s][f"{q}_ms"] for s in sizes] for q in ("p50", "p99")},
        (x_label, "ms", title),
        [
            (result["baseline_insert_notify_listen"]["p99_ms"], "baseline p99", "--"),
            (target_ms, f"target p99 {target_ms:g} ms", ":"),
        ],
    )


def dispatch(result: dict[str, Any], path: Path) -> None:
    _latency(result, path, "parked runners", "Enqueue to runner-has-job", 10)


def demand(result: dict[str, Any], path: Path) -> None:
    _latency(result, path, "connected provisioners", "Enqueue to grant received", 50)


def throughput(result: dict[str, Any], path: Path) -> None:
    runs = result["runs"]
    counts = list(runs)
    _grouped(
        path,
        counts,
        {
            "HTTP": [runs[c]["http_jobs_per_s"] for c in counts],
            "raw SQL (baseline)": [runs[c]["sql_jobs_per_s"] for c in counts],
        },
        ("concurrent runners", "jobs/s", "Whole lifecycle (claim, heartbeat, complete)"),
        [(1000, "target 1,000 jobs/s", "--")],
    )


def peers(result: dict[str, Any], path: Path) -> None:
    runs = result["peers"]["by_concurrency"] if "peers" in result else {}
    if not runs:
        return
    sizes = list(runs)
    series = {
        "ours (HTTP)": [runs[size]["http_jobs_per_s"] for size in sizes],
        "raw SQL": [runs[size]["sql_jobs_per_s"] for size in sizes],
    }
    for name in sorted({peer for row in runs.values() for peer in row["peers"]}):
        series[name] = [runs[size]["peers"].get(name, {}).get("jobs_per_s", 0) for size in sizes]
    _grouped(
        path,
        sizes,
        series,
        ("concurrency", "jobs/s", "Against the peers, same server, no-op jobs"),
        [],
    )


def replicas(result: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    scaling = result.get("replicas")
    if not scaling:
        return
    counts = list(scaling["replicas"])
    figure, axes = plt.subplots(figsize=(6.4, 3.6))
    axes.bar(counts, [scaling["replicas"][c]["http_jobs_per_s"] for c in counts], label="HTTP")
    axes.axhline(scaling["sql_jobs_per_s"], color="grey", linestyle="--", label="raw SQL")
    axes.set_xlabel("replicas")
    axes.set_ylabel("jobs/s")
    axes.set_title(f"Lifecycle by replica count, {scaling['runners']} runners")
    _save(figure, path)


def installation_rounds(result: dict[str, Any], path: Path) -> None:
    found = result.get("allocation")
    if not found:
        return
    sizes = list(found["by_workspaces"])
    rounds = {size: found["by_workspaces"][size]["rounds_by_bulk_slots"] for size in sizes}
    slots = list(rounds[sizes[0]])
    series = {
        f"{size} workspaces{' (baseline)' if index else ''}": [
            rounds[size][point]["round_ms"] for point in slots
        ]
        for index, size in enumerate(sizes)
    }
    _grouped(
        path,
        slots,
        series,
        ("bulk slots (units the round may grant)", "ms", "One installation allocation round"),
        [],
    )


def installation_grants(result: dict[str, Any], path: Path) -> None:
    found = result.get("allocation")
    if not found:
        return
    sizes = list(found["by_workspaces"])
    _grouped(
        path,
        [f"{size} workspaces" for size in sizes],
        {
            f"{kind} p99": [found["by_workspaces"][size]["grant"][kind]["p99_ms"] for size in sizes]
            for kind in ("cold", "hot")
        },
        ("", "ms", "Enqueue to grant, installation provisioner"),
        [(50, "target p99 50 ms", ":")],
    )


def installation_fanout(result: dict[str, Any], path: Path) -> None:
    found = result.get("fanout")
    if not found:
        return
    replicas = [f"replica {index + 1}" for index in range(len(found["idle_cpu_percent"]))]
    _grouped(
        path,
        replicas,
        {
            "idle (baseline)": found["idle_cpu_percent"],
            f"{found['achieved_rate']:g} enqueues/s": found["loaded_cpu_percent"],
        },
        ("listening replica", "CPU % of a core", "NOTIFY fan-out, no runner parked"),
        [(10, "target 10 %", ":")],
    )


# result file -> the charts drawn from it, each (file name, alt text, chart)
CHARTS: dict[str, list[tuple[str, str, Chart]]] = {
    "dispatch": [("dispatch.png", "dispatch latency by parked runners", dispatch)],
    "demand": [("demand.png", "demand latency by provisioners", demand)],
    "throughput": [
        ("throughput.png", "lifecycle jobs/s, HTTP and raw SQL", throughput),
        ("peers.png", "ours beside procrastinate and pgqueuer", peers),
    ],
    "scale": [("replicas.png", "lifecycle jobs/s by replica count", replicas)],
    "installation": [
        (
            "installation_rounds.png",
            "installation round by slots and workspaces",
            installation_rounds,
        ),
        ("installation_grants.png", "grant p99, cold and hot workspace", installation_grants),
        (
            "installation_fanout.png",
            "listening replicas' CPU at the enqueue rate",
            installation_fanout,
        ),
    ],
}
