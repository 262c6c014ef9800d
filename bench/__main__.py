"""`python -m bench [name ...]`: run the named benchmarks (default: all but the explicit ones),
then the report. The soak (minutes of kills), the standalone peers, the before/after runs
against an older tree (`limits`: the connection limits; `compare`: issue 13's refactor, every
figure of throughput, dispatch and demand), `footprint` (each job's rows, WAL, transactions and
CPU, for docs/scaling.md), idle provisioner sessions (`idle_sessions`) and the big installation
(`installation`, issue 16) run only when named."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable

import anyio

from bench import (
    cli_startup,
    compare,
    demand,
    dispatch,
    footprint,
    idle_sessions,
    installation,
    limits,
    pages,
    peers,
    report,
    scale,
    soak,
    throughput,
)

Bench = Callable[[], Awaitable[object]]

BENCHES: dict[str, Bench] = {
    "dispatch": dispatch.run,
    "demand": demand.run,
    "throughput": throughput.run,
    "scale": scale.run,
    "cli_startup": cli_startup.run,
}
EXPLICIT: dict[str, Bench] = {
    "soak": soak.run,
    "peers": peers.run,
    "limits": limits.run,
    "compare": compare.run,
    "pages": pages.run,
    "idle_sessions": idle_sessions.run,
    "footprint": footprint.run,
    "installation": installation.run,  # issue 16's sizes: an hour or more
}


def main(argv: list[str]) -> int:
    names = argv or list(BENCHES)
    known = {**BENCHES, **EXPLICIT}
    unknown = [name for name in names if name not in known]
    if unknown:
        sys.stderr.write(f"unknown benchmark(s): {', '.join(unknown)}; have {', '.join(known)}\n")
        return 2
    for name in names:
        anyio.run(known[name])
    report.main()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
