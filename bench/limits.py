"""Connection limits (issue 11): the HTTP lifecycle before and after them, in the same run.

Two sides on one PostgreSQL, opened as bench/compare.py opens them: the tree before the limits
(harness.baseline_tree: BENCH_BASELINE_REF, default 78daf06, or BENCH_BASELINE_TREE) and this
tree, each with a database of its own migrated by its own replica, and a measuring process in its
own tree's code. The measuring process must be the side's own: bench/throughput.py fills the
queue through the store, and this tree's enqueue writes columns (priority, concurrency keys) the
older schema does not have. Each round runs the HTTP lifecycle through one side's first replica
and then the other's, the order alternating from round to round, so a slow spell of the machine
falls on both; each run also records the replica's CPU time per job. Before measuring, a 20 KiB
header tells the two apart by behaviour: the baseline answers it 200, this tree 431.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from bench import compare, harness

RUNNER_COUNTS = (10, 50, 200)
JOBS = 3000
ROUNDS = 7
BASELINE_REF = "78daf06"


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
    """Sizes from BENCH_LIMITS_JOBS and BENCH_LIMITS_ROUNDS when set."""
    jobs = int(os.environ.get("BENCH_LIMITS_JOBS", jobs))
    rounds = int(os.environ.get("BENCH_LIMITS_ROUNDS", rounds))
    harness.raise_fd_limit()
    results: dict[str, Any] = {"jobs_per_run": jobs, "rounds": rounds, "runs": {}}
    measurements = [
        compare.Measurement(
            "throughput", f"HTTP lifecycle, {n} runners", "http_lifecycle", n, jobs, 1
        )
        for n in runner_counts
    ]
    tracks: dict[str, compare.Track] = {}
    with harness.baseline_tree(BASELINE_REF) as (tree, name), harness.postgres() as server:
        results["baseline"] = name
        async with (
            compare.open_side("before", tree, server) as before,
            compare.open_side("after", harness.ROOT, server) as after,
        ):
            compare.check_code(before, after)
            assert head_status(before.replicas[0].address, 20 * 1024) == 200, "baseline limits"
            assert head_status(after.replicas[0].address, 20 * 1024) == 431, "no head limit"
            await compare.measure_rounds(before, after, measurements, rounds, tracks)
    for count, measured in zip(runner_counts, measurements, strict=True):
        rate = tracks[f"throughput: {measured.title}: jobs/s"].values.summary()
        cpu = tracks[f"throughput: {measured.title}: replica CPU us/job"].values.summary()
        results["runs"][str(count)] = {
            "before_jobs_per_s": rate["before"],
            "after_jobs_per_s": rate["after"],
            "after_to_before": rate["after_to_before"],
            "paired_after_to_before": rate["paired_after_to_before"],
            "before_cpu_us_per_job": cpu["before"],
            "after_cpu_us_per_job": cpu["after"],
            "paired_cpu_after_to_before": cpu["paired_after_to_before"],
            "before_rounds": rate["before_rounds"],
            "after_rounds": rate["after_rounds"],
        }
        print(
            f"{count:>4} runners: before {rate['before']:.0f} jobs/s, after "
            f"{rate['after']:.0f} jobs/s ({rate['after_to_before']:.3f}; medians of {rounds}; "
            f"median of the rounds' ratios {rate['paired_after_to_before']:.3f}); replica CPU "
            f"per job {cpu['before']:.0f} -> {cpu['after']:.0f} us "
            f"(rounds' ratios {cpu['paired_after_to_before']:.3f})"
        )
    path = harness.write_result("limits", results)
    print(f"wrote {path}")
    return results
