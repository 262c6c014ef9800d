"""Connection limits (issue 11): the HTTP lifecycle before and after them, in the same run.

Two replicas on one PostgreSQL, each on a database of its own which it migrates itself (the
baseline's migrations are older than this tree's): one runs this tree, the other the tree before
the limits (harness.baseline_tree: BENCH_BASELINE_REF, default 78daf06, or BENCH_BASELINE_TREE).
Each round runs bench/throughput.py's HTTP lifecycle, with this tree's client, through one replica
and then the other, the order alternating from round to round, so a slow spell of the machine
falls on both; each run also records the replica's CPU time per job. Before measuring, each
replica names the `controlplane` it imported, and a 20 KiB header tells the two apart by
behaviour: the baseline answers it 200, this tree 431. bench/compare.py does the same for every
figure of throughput, dispatch and demand, each side with its own tree's client too.
"""

from __future__ import annotations

import socket
from typing import Any

from bench import harness, throughput

RUNNER_COUNTS = (10, 50, 200)
JOBS = 2000
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
    harness.raise_fd_limit()
    results: dict[str, Any] = {"jobs_per_run": jobs, "rounds": rounds, "runs": {}}
    with harness.baseline_tree(BASELINE_REF) as (tree, name), harness.postgres() as server:
        results["baseline"] = name
        urls = {side: await harness.empty_database(server) for side in ("before", "after")}
        started: list[harness.Replica] = []
        try:
            for side, side_tree in (("before", tree), ("after", harness.ROOT)):
                started.append(await harness.start_tree_replica(urls[side], side_tree))
            before, after = started
            assert head_status(before.address, 20 * 1024) == 200, "baseline has a head limit"
            assert head_status(after.address, 20 * 1024) == 431, "this tree has no head limit"
            for count in runner_counts:
                rates = harness.BeforeAfter()
                # The replica's own CPU per job: what the limits could cost, and much less
                # swayed than jobs/s by other work on the machine.
                cpu = harness.BeforeAfter()
                for index in range(rounds):
                    order = [("before", before), ("after", after)]
                    for side, replica in harness.alternated(index, order):
                        spent = harness.cpu_seconds(replica.process.pid)
                        rate = await throughput.http_lifecycle(
                            urls[side], [replica.address], count, jobs
                        )
                        spent = harness.cpu_seconds(replica.process.pid) - spent
                        rates.add(side, rate)
                        cpu.add(side, spent / jobs * 1e6)
                per_s, used = rates.summary(), cpu.summary()
                results["runs"][str(count)] = {
                    "before_jobs_per_s": per_s["before"],
                    "after_jobs_per_s": per_s["after"],
                    "after_to_before": per_s["after_to_before"],
                    "paired_after_to_before": per_s["paired_after_to_before"],
                    "before_cpu_us_per_job": used["before"],
                    "after_cpu_us_per_job": used["after"],
                    "before_rounds": per_s["before_rounds"],
                    "after_rounds": per_s["after_rounds"],
                }
                print(
                    f"{count:>4} runners: before {per_s['before']:.0f} jobs/s, after "
                    f"{per_s['after']:.0f} jobs/s ({per_s['after_to_before']:.3f}; medians of "
                    f"{rounds}; median of the rounds' ratios "
                    f"{per_s['paired_after_to_before']:.3f}); replica CPU per job "
                    f"{used['before']:.0f} -> {used['after']:.0f} us"
                )
        finally:
            harness.stop_replicas(started)
    path = harness.write_result("limits", results)
    print(f"wrote {path}")
    return results
