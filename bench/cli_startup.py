"""How long the `controlplane` command takes before it does anything: `--help`, a client
command's `--help`, and a client command that fails at once (a daemon that is not there).

Each command runs as a fresh process, interleaved round by round with the baseline, a bare
`python -c pass` of the same interpreter, so the ratios hold on a busy machine. Target from
issue 12: `--help` and client commands start in under 0.3 s.
"""

from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import time
from typing import Any

from bench.harness import machine, write_result

ROUNDS = 15


def _closed_url() -> str:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{closed.getsockname()[1]}"


def _commands() -> dict[str, list[str]]:
    cli = [sys.executable, "-m", "controlplane.cli"]
    return {
        "baseline: python -c pass": [sys.executable, "-c", "pass"],
        "controlplane --help": [*cli, "--help"],
        "controlplane enqueue --help": [*cli, "enqueue", "--help"],
        "controlplane status (no daemon there)": [
            *cli, "status", "--url", _closed_url(), "--key", "cp_adm_" + "x" * 40,
        ],
        "controlplane tokens --help": [*cli, "tokens", "--help"],
    }  # fmt: skip


def _time(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, capture_output=True, check=False, timeout=60)
    return time.perf_counter() - started


def measure(rounds: int = ROUNDS) -> dict[str, Any]:
    commands = _commands()
    samples: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(rounds):
        for name, command in commands.items():
            samples[name].append(_time(command))
    base = statistics.median(samples["baseline: python -c pass"])
    return {
        "machine": machine(),
        "rounds": rounds,
        "commands": {
            name: {
                "median_s": round(statistics.median(values), 3),
                "max_s": round(max(values), 3),
                "ratio_to_baseline": round(statistics.median(values) / base, 1),
            }
            for name, values in samples.items()
        },
    }


async def run() -> None:
    result = measure()
    write_result("cli_startup", result)
    for name, row in result["commands"].items():
        print(f"{name:40} {row['median_s']:.3f} s  x{row['ratio_to_baseline']}")
