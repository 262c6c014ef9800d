"""`python -m bench [name ...]`: run the named benchmarks (default: all), then the report."""

from __future__ import annotations

import sys

import anyio

from bench import demand, dispatch, report, throughput

BENCHES = {"dispatch": dispatch.run, "demand": demand.run, "throughput": throughput.run}


def main(argv: list[str]) -> int:
    names = argv or list(BENCHES)
    unknown = [name for name in names if name not in BENCHES]
    if unknown:
        sys.stderr.write(f"unknown benchmark(s): {', '.join(unknown)}; have {', '.join(BENCHES)}\n")
        return 2
    for name in names:
        anyio.run(BENCHES[name])
    report.main()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
