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


def _latency(
    result: dict[str, Any], path: Path, x_label: str, title: str, target_ms: float
) -> None:
    plt = _pyplot()
    sizes = list(result["sizes"])
    base = result["baseline_insert_notify_listen"]
    figure, axes = plt.subplots(figsize=(6.4, 3.6))
    x = range(len(sizes))
    axes.bar([i - 0.2 for i in x], [result["sizes"][s]["p50_ms"] for s in sizes], 0.4, label="p50")
    axes.bar([i + 0.2 for i in x], [result["sizes"][s]["p99_ms"] for s in sizes], 0.4, label="p99")
    axes.axhline(base["p99_ms"], color="grey", linestyle="--", label="baseline p99")
    axes.axhline(target_ms, color="red", linestyle=":", label=f"target p99 {target_ms:g} ms")
    axes.set_xticks(list(x), sizes)
    axes.set_xlabel(x_label)
    axes.set_ylabel("ms")
    axes.set_title(title)
    _save(figure, path)


def dispatch(result: dict[str, Any], path: Path) -> None:
    _latency(result, path, "parked runners", "Enqueue to runner-has-job", 10)


def demand(result: dict[str, Any], path: Path) -> None:
    _latency(result, path, "connected provisioners", "Enqueue to grant received", 50)


def throughput(result: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    runs = result["runs"]
    counts = list(runs)
    figure, axes = plt.subplots(figsize=(6.4, 3.6))
    x = range(len(counts))
    axes.bar([i - 0.2 for i in x], [runs[c]["http_jobs_per_s"] for c in counts], 0.4, label="HTTP")
    axes.bar(
        [i + 0.2 for i in x],
        [runs[c]["sql_jobs_per_s"] for c in counts],
        0.4,
        label="raw SQL (baseline)",
    )
    axes.axhline(1000, color="grey", linestyle="--", label="target 1,000 jobs/s")
    axes.set_xticks(list(x), counts)
    axes.set_xlabel("concurrent runners")
    axes.set_ylabel("jobs/s")
    axes.set_title("Whole lifecycle (claim, heartbeat, complete)")
    _save(figure, path)


def peers(result: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    runs = result["peers"]["by_concurrency"] if "peers" in result else {}
    if not runs:
        return
    sizes = list(runs)
    names = ["ours (HTTP)", "raw SQL", *sorted({p for row in runs.values() for p in row["peers"]})]
    figure, axes = plt.subplots(figsize=(6.4, 3.6))
    width = 0.8 / len(names)
    for index, name in enumerate(names):
        values = []
        for size in sizes:
            row = runs[size]
            if name == "ours (HTTP)":
                values.append(row["http_jobs_per_s"])
            elif name == "raw SQL":
                values.append(row["sql_jobs_per_s"])
            else:
                values.append(row["peers"].get(name, {}).get("jobs_per_s", 0))
        axes.bar([i + (index - (len(names) - 1) / 2) * width for i in range(len(sizes))],
                 values, width, label=name)  # fmt: skip
    axes.set_xticks(list(range(len(sizes))), sizes)
    axes.set_xlabel("concurrency")
    axes.set_ylabel("jobs/s")
    axes.set_title("Against the peers, same server, no-op jobs")
    _save(figure, path)


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


# result file -> the charts drawn from it, each (file name, alt text, chart)
CHARTS: dict[str, list[tuple[str, str, Chart]]] = {
    "dispatch": [("dispatch.png", "dispatch latency by parked runners", dispatch)],
    "demand": [("demand.png", "demand latency by provisioners", demand)],
    "throughput": [
        ("throughput.png", "lifecycle jobs/s, HTTP and raw SQL", throughput),
        ("peers.png", "ours beside procrastinate and pgqueuer", peers),
    ],
    "scale": [("replicas.png", "lifecycle jobs/s by replica count", replicas)],
}
