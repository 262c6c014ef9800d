"""The measuring process of one side of bench/compare.py, in the code of the tree it measures.

compare.py runs this file by its path with harness.tree_env(tree), so the `bench` and
`controlplane` modules imported below are that tree's own: its store enqueues the jobs and makes
the tokens and provisioners, its statements run the SQL lifecycle, and its bench functions drive
the replicas. Hence this file imports nothing else from the checkout it sits in, and calls only
functions that bench/throughput.py, dispatch.py and demand.py have had, with these signatures,
since 1089cdd.

Protocol, one JSON object a line: first out, the files of the `controlplane` and `bench` it
imported; then one answer for each request read from stdin, `{"value": ...}` (jobs/s, or a list
of latencies in seconds) or `{"error": traceback}`. It ends at the end of its input.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

import anyio

import controlplane
from bench import demand, dispatch, throughput


async def measure(request: dict[str, Any]) -> float | list[float]:
    url, addresses = request["url"], request["addresses"]
    size, amount = request["size"], request["amount"]
    match request["measure"]:
        case "http_lifecycle":
            return await throughput.http_lifecycle(url, addresses, size, amount)
        case "sql_lifecycle":
            return await throughput.sql_lifecycle(url, size, amount)
        case "dispatch":
            return await dispatch.measure(url, addresses, size, amount)
        case "cancel":
            return await dispatch.cancel_latency(url, addresses[0], amount)
        case "demand":
            return await demand.measure(url, addresses, size, amount)
    raise ValueError(f"unknown measure {request['measure']!r}")


def main() -> None:
    # Answers keep the real stdout; whatever the measured code prints goes to stderr.
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    def answer(value: dict[str, Any]) -> None:
        answers.write(json.dumps(value) + "\n")
        answers.flush()

    answer({"controlplane": controlplane.__file__, "bench": throughput.__file__})
    for line in sys.stdin:
        try:
            answer({"value": anyio.run(measure, json.loads(line))})
        except Exception:
            answer({"error": traceback.format_exc()})


if __name__ == "__main__":
    main()
