"""Connection limits (issue 11): the HTTP lifecycle before and after them, in the same run.

Two replicas on one PostgreSQL, each on a database of its own (the baseline's migrations are
older than this tree's): one runs this tree, the other the tree before the limits
(`git archive` of BENCH_BASELINE_REF, default 78daf06, unpacked into a temporary folder; or the
checkout named by BENCH_BASELINE_TREE). Each round runs bench/throughput.py's HTTP lifecycle
through one replica and then the other, the order alternating from round to round, so a slow
spell of the machine falls on both; each run also records the replica's CPU time per job.
Before measuring, a 20 KiB header tells the two apart: the
baseline answers it 200, this tree 431.
"""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench import harness, throughput

RUNNER_COUNTS = (10, 50, 200)
JOBS = 2000
ROUNDS = 7
BASELINE_REF = "78daf06"


@contextlib.contextmanager
def baseline_tree() -> Iterator[Path]:
    configured = os.environ.get("BENCH_BASELINE_TREE")
    if configured:
        yield Path(configured)
        return
    ref = os.environ.get("BENCH_BASELINE_REF", BASELINE_REF)
    with tempfile.TemporaryDirectory(prefix="cp-bench-baseline-") as folder:
        archive = Path(folder) / "tree.tar"
        subprocess.run(
            ["git", "-C", str(harness.ROOT), "archive", "-o", str(archive), ref], check=True
        )
        with tarfile.open(archive) as tar:
            tar.extractall(Path(folder) / "tree", filter="data")
        yield Path(folder) / "tree"


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def head_status(address: str, header_bytes: int) -> int:
    """The status a request with one `header_bytes` header gets from the replica."""
    host, port = address.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"GET /healthz HTTP/1.1\r\nhost: b\r\nconnection: close\r\nx-big: "
            + b"a" * header_bytes
            + b"\r\n\r\n"
        )
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return int(answer.split(b" ", 2)[1])


async def run(
    jobs: int = JOBS, runner_counts: tuple[int, ...] = RUNNER_COUNTS, rounds: int = ROUNDS
) -> dict[str, Any]:
    harness.raise_fd_limit()
    results: dict[str, Any] = {"jobs_per_run": jobs, "rounds": rounds, "runs": {}}
    with baseline_tree() as tree, harness.postgres() as server:
        results["baseline"] = os.environ.get("BENCH_BASELINE_TREE") or os.environ.get(
            "BENCH_BASELINE_REF", BASELINE_REF
        )
        url = await harness.fresh_database(server)
        # The baseline gets a database of its own, which it migrates itself at start: this
        # tree's migrations (0010 replaced cp_complete) are newer than its code.
        url_before = await harness.empty_database(server)
        # PYTHONSAFEPATH: `python -m` would otherwise put this working directory (this tree)
        # ahead of PYTHONPATH.
        before = await harness.start_replica(url_before, PYTHONPATH=str(tree), PYTHONSAFEPATH="1")
        after = await harness.start_replica(url)
        urls = {"before": url_before, "after": url}
        try:
            assert head_status(before.address, 20 * 1024) == 200, "baseline has a head limit"
            assert head_status(after.address, 20 * 1024) == 431, "this tree has no head limit"
            for count in runner_counts:
                rates: dict[str, list[float]] = {"before": [], "after": []}
                # The replica's own CPU per job: what the limits could cost, and much less
                # swayed than jobs/s by other work on the machine.
                cpu: dict[str, list[float]] = {"before": [], "after": []}
                for index in range(rounds):
                    order = [("before", before), ("after", after)]
                    for name, replica in order if index % 2 == 0 else order[::-1]:
                        spent = cpu_seconds(replica.process.pid)
                        rate = await throughput.http_lifecycle(
                            urls[name], [replica.address], count, jobs
                        )
                        spent = cpu_seconds(replica.process.pid) - spent
                        rates[name].append(rate)
                        cpu[name].append(spent / jobs * 1e6)
                median = {name: statistics.median(values) for name, values in rates.items()}
                # A round's two runs are seconds apart: their ratio cancels most of the drift
                # of a machine shared with other work.
                paired = [a / b for a, b in zip(rates["after"], rates["before"], strict=True)]
                results["runs"][str(count)] = {
                    "before_jobs_per_s": round(median["before"], 1),
                    "after_jobs_per_s": round(median["after"], 1),
                    "after_to_before": round(median["after"] / median["before"], 3),
                    "paired_after_to_before": round(statistics.median(paired), 3),
                    "before_cpu_us_per_job": round(statistics.median(cpu["before"]), 1),
                    "after_cpu_us_per_job": round(statistics.median(cpu["after"]), 1),
                    "before_rounds": [round(rate, 1) for rate in rates["before"]],
                    "after_rounds": [round(rate, 1) for rate in rates["after"]],
                }
                print(
                    f"{count:>4} runners: before {median['before']:.0f} jobs/s, after "
                    f"{median['after']:.0f} jobs/s ({median['after'] / median['before']:.3f}; "
                    f"medians of {rounds}; median of the rounds' ratios "
                    f"{statistics.median(paired):.3f}); replica CPU per job "
                    f"{statistics.median(cpu['before']):.0f} -> "
                    f"{statistics.median(cpu['after']):.0f} us"
                )
        finally:
            harness.stop_replicas([before, after])
    path = harness.write_result("limits", results)
    print(f"wrote {path}")
    return results
