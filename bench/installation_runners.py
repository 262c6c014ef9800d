"""A process of parked runners for bench/installation.py's `parked` part, which spreads its
runners over several of these: one process may not hold 20,000 sockets (the open-file limit).

Reads one JSON line from stdin, `{"addresses": [...], "sessions": [...]}`, parks runner `i` on
`addresses[i % len(addresses)]`, and for every job a runner is handed writes one JSON line,
`{"job": execution id, "at": time.perf_counter()}`. perf_counter is CLOCK_MONOTONIC on Linux, one
clock for every process of the machine, so the parent subtracts its own enqueue stamps from it.
Ends when stdin closes.
"""

from __future__ import annotations

import json
import sys

import anyio

from bench import harness
from bench.installation_clients import parked_runner

BATCH = 250  # runners connecting at once: stay well inside the listen backlog


async def hold(addresses: list[str], sessions: list[str]) -> None:
    harness.raise_fd_limit()

    def handed(execution: str, at: float) -> None:
        sys.stdout.write(json.dumps({"job": execution, "at": at}) + "\n")
        sys.stdout.flush()

    async with anyio.create_task_group() as group:
        for start in range(0, len(sessions), BATCH):
            for index, session in enumerate(sessions[start : start + BATCH], start):
                group.start_soon(parked_runner, addresses[index % len(addresses)], session, handed)
            await anyio.sleep(0.05)
        await anyio.to_thread.run_sync(sys.stdin.read)  # until the parent closes our stdin
        group.cancel_scope.cancel()


def main() -> None:
    spec = json.loads(sys.stdin.readline())
    anyio.run(hold, spec["addresses"], spec["sessions"])


if __name__ == "__main__":
    main()
