"""py-spy's record of a replica through a benchmark's window, and the summary of what it
found. py-spy (PyPI, in the `bench` extra) samples a running process without stopping it; without
it these record nothing and say so."""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any


def py_spy() -> str | None:
    """py-spy (PyPI), beside this interpreter or on PATH; None when not installed."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


@contextlib.asynccontextmanager
async def profiled(pid: int, path: Path | None) -> AsyncIterator[None]:
    """py-spy's record of process `pid` while the body runs, as collapsed stacks in `path`
    (nothing when `path` is None or py-spy is missing). Sampling does not stop the process."""
    spy = py_spy()
    if path is None or spy is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    command = [spy, "record", "--pid", str(pid), "--format", "raw", "--nonblocking"]
    process = subprocess.Popen(
        [*command, "--output", str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        yield
    finally:
        process.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def profile_summary(path: Path, top: int = 12) -> dict[str, Any]:
    """The functions with the most samples in a collapsed-stack file: where the samples ended
    (self) and, for the replica's own code, every sample a function was on the stack for."""
    if not path.exists():
        return {"file": None, "why": f"py-spy wrote no {path.name} (is it installed?)"}
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [frame.rsplit(":", 1)[0] + ")" for frame in stack.split(";")]
        total += int(count)
        own[frames[-1]] += int(count)
        for frame in set(frames):
            if "controlplane/" in frame and "controlplane/cli/" not in frame:  # not main()
                inclusive[frame] += int(count)

    def shares(counter: Counter[str]) -> list[tuple[str, float]]:
        return [(name, round(100 * n / total, 1)) for name, n in counter.most_common(top)]

    return {
        "file": str(path),
        "samples": total,
        "self_percent": shares(own),
        "controlplane_inclusive_percent": shares(inclusive),
    }


@contextlib.asynccontextmanager
async def each_profiled(pids: Sequence[int], folder: Path | None, stem: str) -> AsyncIterator[None]:
    """`profiled` for every process of `pids` at once, into `folder`/`stem`_N.txt (N counts
    from 1); nothing when `folder` is None."""
    async with contextlib.AsyncExitStack() as stack:
        for index, pid in enumerate(pids, 1):
            path = None if folder is None else folder / f"{stem}_{index}.txt"
            await stack.enter_async_context(profiled(pid, path))
        yield


def summaries(pids: Sequence[int], folder: Path | None, stem: str) -> list[dict[str, Any]] | None:
    """`profile_summary` of each file `each_profiled` wrote; None when nothing was recorded."""
    if folder is None:
        return None
    return [profile_summary(folder / f"{stem}_{index}.txt") for index in range(1, len(pids) + 1)]
