"""Issue 13's acceptance: throughput, dispatch and demand before and after, in the same run.

Two sides on one PostgreSQL, each on a database of its own which its first replica migrates with
its own migrations: `before` runs the baseline tree (harness.baseline_tree: BENCH_BASELINE_REF,
default 1089cdd, the tree issue 13 started from; or the checkout BENCH_BASELINE_TREE names),
`after` this checkout (or the tree BENCH_AFTER_REF or BENCH_AFTER_TREE names, the same way: to
measure one commit against another, such as the refactor's last commit against its first). A
side is two replicas of its tree and one measuring process (bench/compare_side.py) that runs its
tree's own bench functions, so all that a side runs is its tree's code: the daemon, and the store
calls that enqueue jobs, make tokens and provisioners and run the SQL lifecycle. Before
measuring, every replica and both measuring processes name the `controlplane` they imported; the
run stops unless each lies in its side's tree.

Each round takes every measurement through both sides, the order alternating round by round
(harness.alternated):

* throughput: the HTTP lifecycle through the side's first replica (jobs/s, and that replica's
  CPU per job) and the SQL lifecycle (jobs/s), at each runner count;
* dispatch: enqueue to runner-has-job, runners parked on both replicas (p50, p99 ms), at each
  count of parked runners; cancel to held heartbeat (p50, p99 ms);
* demand: enqueue to grant over the control session, provisioners on both replicas (p50, p99 ms),
  at each count of provisioners.

Each figure is reported as the median of its rounds on each side, the ratio of those medians,
and the median of the rounds' own ratios, on which the verdict rests: a figure is worse by more
than 5% when that ratio is under 0.95 (jobs/s) or over 1.05 (ms, CPU). Beside the figures, and
outside the verdict, each latency run records its CPU per sample: of the side's replicas, of the
database server (all its processes) and of the side's measuring process (`costs`). CPU moves far
less than a latency on a loaded machine, so these say where a latency's change comes from. The
result goes to bench/results/compare.json; bench/report.py renders it.

Sizes come from the environment; the defaults make the full run (bench/notes.md says how long
it takes, about 34 minutes): BENCH_COMPARE_ROUNDS (5), BENCH_COMPARE_JOBS (3000 jobs per
throughput run), BENCH_COMPARE_RUNNERS (10,50,200), BENCH_COMPARE_SAMPLES (1000 per dispatch
or demand run), BENCH_COMPARE_DISPATCH (10,100,1000 parked runners), BENCH_COMPARE_DEMAND
(1,10,100 provisioners), BENCH_COMPARE_CANCEL (1000 samples; 0 leaves it out),
BENCH_COMPARE_REPEATS (2 runs a side a round of each lifecycle, below). An empty list
leaves a benchmark out. A p99 of 1,000 samples is the tenth-slowest; of 300 it was the third,
which moved by a third between rounds of the same code (bench/notes.md), too much to read 5%.

Dispatch, the cancel and demand are measured through both sides at once, their samples
alternating one by one (`measure_interleaved`), rather than one side's run of samples and then
the other's: a slow spell of the machine then falls on both sides' samples alike rather than on
one side's run. Run with the same code on both sides, this kept every round's p50 within 2.2% of
the other side's, where one side's run after the other's let it move by up to 38%
(bench/notes.md). BENCH_COMPARE_INTERLEAVE=0 measures them one side after the other.

A lifecycle run cannot alternate job by job (its runners claim concurrently), so each side runs
it BENCH_COMPARE_REPEATS times a round (2), whole, the sides taking turns run by run in the order
before, after, after, before (`measure_repeated`; swapped in odd rounds): a side's jobs/s is its
jobs over the sum of its runs' times. With one 5 to 8 s run a side, the SQL lifecycle at 200
runners moved from 0.82 to 1.02 of the baseline between rounds of one run, and a run with the
same code on both sides put it at 1.15 (bench/notes.md). Cutting a run's jobs into shorter runs
instead was tried and dropped: each run sets up its own 200 connections and runner sessions,
and at 500 jobs a run that set-up, not the lifecycle, was most of what it measured.

Between a round's throughput runs and its latencies both databases are vacuumed (`vacuum_both`,
about a second; BENCH_COMPARE_VACUUM=0 leaves it out), so that the
autovacuum those runs' rows call for does not fall inside one side's latency samples.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio
import asyncpg
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

from bench import harness

BASELINE_REF = "1089cdd"
REPLICAS = 2  # dispatch and demand split their clients over two; throughput uses the first
SIDE_SCRIPT = Path(__file__).with_name("compare_side.py")
# The longest one measurement may take: 3,000 jobs at 10 jobs/s on a machine busy with other work.
ANSWER_DEADLINE = 600
TOLERANCE = 0.05  # issue 13: no figure worse by more than 5%
# The measures whose samples alternate between the sides (compare_side.py has a form of each).
INTERLEAVED = ("dispatch", "cancel", "demand")


@dataclass(frozen=True)
class Sizes:
    rounds: int = 5
    jobs: int = 3000
    runners: tuple[int, ...] = (10, 50, 200)
    samples: int = 1000
    dispatch: tuple[int, ...] = (10, 100, 1000)
    demand: tuple[int, ...] = (1, 10, 100)
    cancel: int = 1000
    repeats: int = 2  # runs a side a round of each lifecycle, alternating between the sides
    interleave: bool = True  # dispatch, cancel, demand: the sides' samples alternate one by one
    vacuum: bool = True  # VACUUM both databases after a round's throughput runs

    @classmethod
    def from_env(cls) -> Sizes:
        default = cls()

        def number(name: str, value: int) -> int:
            return int(os.environ.get(f"BENCH_COMPARE_{name}", value))

        def counts(name: str, value: tuple[int, ...]) -> tuple[int, ...]:
            given = os.environ.get(f"BENCH_COMPARE_{name}")
            if given is None:
                return value
            return tuple(int(part) for part in given.split(",") if part.strip())

        return cls(
            rounds=number("ROUNDS", default.rounds),
            jobs=number("JOBS", default.jobs),
            runners=counts("RUNNERS", default.runners),
            samples=number("SAMPLES", default.samples),
            dispatch=counts("DISPATCH", default.dispatch),
            demand=counts("DEMAND", default.demand),
            cancel=number("CANCEL", default.cancel),
            repeats=max(1, number("REPEATS", default.repeats)),
            interleave=bool(number("INTERLEAVE", int(default.interleave))),
            vacuum=bool(number("VACUUM", int(default.vacuum))),
        )


@dataclass(frozen=True)
class Measurement:
    benchmark: str
    title: str
    measure: str  # what compare_side.py calls it
    size: int
    amount: int  # jobs for a lifecycle, samples for a latency
    replicas: int  # how many of a side's replicas it uses


def plan(sizes: Sizes) -> list[Measurement]:
    """One round's measurements, in the order each round takes them."""
    lifecycles = (("HTTP", "http_lifecycle", 1), ("SQL", "sql_lifecycle", 0))
    throughput = [
        Measurement("throughput", f"{kind} lifecycle, {n} runners", measure, n, sizes.jobs, used)
        for n in sizes.runners
        for kind, measure, used in lifecycles
    ]
    dispatch = [
        Measurement(
            "dispatch",
            f"enqueue to runner, {n} parked runners",
            "dispatch",
            n,
            sizes.samples,
            REPLICAS,
        )
        for n in sizes.dispatch
    ]
    if sizes.cancel and sizes.dispatch:
        dispatch.append(
            Measurement("dispatch", "cancel to held heartbeat", "cancel", 1, sizes.cancel, 1)
        )
    demand = [
        Measurement(
            "demand", f"enqueue to grant, {n} provisioners", "demand", n, sizes.samples, REPLICAS
        )
        for n in sizes.demand
    ]
    return [*throughput, *dispatch, *demand]


@dataclass
class Track:
    """One figure of one measurement, on both sides."""

    benchmark: str
    figure: str
    unit: str
    higher_is_better: bool
    digits: int
    values: harness.BeforeAfter = field(default_factory=harness.BeforeAfter)

    def result(self) -> dict[str, Any]:
        found = self.values.summary(self.digits)
        paired = found["paired_after_to_before"]
        # Positive when after is better, negative when worse, whichever way the unit points.
        change = paired - 1 if self.higher_is_better else 1 - paired
        return {
            "benchmark": self.benchmark,
            "figure": self.figure,
            "unit": self.unit,
            "better": "higher" if self.higher_is_better else "lower",
            **found,
            "change": round(change, 3),
            "worse_by_more_than_5_percent": change < -TOLERANCE,
        }


@dataclass(frozen=True)
class Spent:
    """CPU seconds used during one measurement: by the replicas it used, by the database server
    (None when it is not a local process), by the side's measuring process (its runners, or its
    provisioners' clients, and its enqueues)."""

    replicas: float
    database: float | None
    measurer: float

    @staticmethod
    def mean(runs: list[Spent]) -> Spent:
        """What one of `runs` cost on average."""
        databases = [run.database for run in runs]
        return Spent(
            statistics.fmean(run.replicas for run in runs),
            None if None in databases else statistics.fmean(d for d in databases if d is not None),
            statistics.fmean(run.measurer for run in runs),
        )


def record(
    tracks: dict[str, Track],
    costs: dict[str, Track],
    measured: Measurement,
    side: str,
    value: Any,
    spent: Spent,
) -> str:
    """Add one side's run to its figures' tracks, and for a latency its CPU per sample to the
    diagnostic `costs`; a line saying what it measured."""

    def add(
        into: dict[str, Track], unit: str, higher_is_better: bool, digits: int, figure: float
    ) -> str:
        key = f"{measured.benchmark}: {measured.title}: {unit}"
        if key not in into:
            into[key] = Track(measured.benchmark, measured.title, unit, higher_is_better, digits)
        into[key].values.add(side, figure)
        return f"{figure:.{digits}f} {unit}"

    if isinstance(value, list):  # latencies in seconds
        summary = harness.summary_ms(value)
        said = [add(tracks, f"{q} ms", False, 3, summary[f"{q}_ms"]) for q in ("p50", "p99")]
        # Not figures of the verdict: what each sample cost, which a loaded machine moves far
        # less than it moves a latency, to tell where a latency's change comes from.
        per_sample = (
            ("replicas", spent.replicas),
            ("database", spent.database),
            ("measuring process", spent.measurer),
        )
        for who, seconds in per_sample:
            if seconds is not None:
                unit = f"{who} CPU us/sample"
                said.append(add(costs, unit, False, 1, seconds / len(value) * 1e6))
    else:
        said = [add(tracks, "jobs/s", True, 1, value)]
        if measured.replicas:
            per_job = spent.replicas / measured.amount * 1e6
            said.append(add(tracks, "replica CPU us/job", False, 1, per_job))
    return f"{measured.benchmark}, {measured.title}: {side} {', '.join(said)}"


@dataclass
class Side:
    name: str
    tree: Path
    url: str
    replicas: list[harness.Replica]
    process: Process
    answers: BufferedByteReceiveStream
    code: dict[str, Any]

    async def ask(self, measured: Measurement, **extra: Any) -> None:
        """Send the measuring process its request."""
        request = {
            "measure": measured.measure,
            "url": self.url,
            "addresses": [replica.address for replica in self.replicas[: measured.replicas]],
            "size": measured.size,
            "amount": measured.amount,
            **extra,
        }
        await self.tell(json.dumps(request))

    async def tell(self, line: str) -> None:
        assert self.process.stdin is not None
        await self.process.stdin.send(line.encode() + b"\n")

    async def read(self, measured: Measurement) -> dict[str, Any]:
        """The measuring process's next line: an answer, or a turn asked for."""
        with anyio.fail_after(ANSWER_DEADLINE):
            said: dict[str, Any] = json.loads(await self.answers.receive_until(b"\n", 1 << 24))
        if "error" in said:
            raise RuntimeError(f"{self.name} side, {measured.title}:\n{said['error']}")
        return said

    async def measure(self, measured: Measurement) -> tuple[Any, Spent]:
        """What the side's measuring process answered, and the CPU it cost."""
        used = self.replicas[: measured.replicas]
        spent = self.spent(used)
        await self.ask(measured)
        answer = await self.read(measured)
        now = self.spent(used)
        database = None
        if now.database is not None and spent.database is not None:
            database = now.database - spent.database
        return answer["value"], Spent(
            now.replicas - spent.replicas, database, now.measurer - spent.measurer
        )

    def spent(self, used: list[harness.Replica]) -> Spent:
        """CPU used so far (Spent's three parts)."""
        return Spent(
            sum(harness.cpu_seconds(replica.process.pid) for replica in used),
            harness.server_cpu_seconds(self.url),
            harness.cpu_seconds(self.process.pid),
        )


@contextlib.asynccontextmanager
async def open_side(name: str, tree: Path, server: str) -> AsyncIterator[Side]:
    """A side: a database, its replicas and its measuring process, all in `tree`'s code."""
    url = await harness.empty_database(server)
    replicas: list[harness.Replica] = []
    try:
        for _ in range(REPLICAS):  # one after the other: the first migrates the database
            replicas.append(await harness.start_tree_replica(url, tree))
        process = await anyio.open_process(
            [sys.executable, str(SIDE_SCRIPT)],
            env={**os.environ, **harness.tree_env(tree)},
            stderr=None,
        )
        try:
            assert process.stdout is not None
            answers = BufferedByteReceiveStream(process.stdout)
            with anyio.fail_after(60):
                code = json.loads(await answers.receive_until(b"\n", 1 << 16))
            code["replicas"] = [replica.code for replica in replicas]
            yield Side(name, tree, url, replicas, process, answers, code)
        finally:
            with anyio.CancelScope(shield=True):
                assert process.stdin is not None
                await process.stdin.aclose()  # its loop ends with its input
                with anyio.move_on_after(30):
                    await process.wait()
                if process.returncode is None:
                    process.kill()
                    await process.wait()
    finally:
        harness.stop_replicas(replicas)


async def measure_interleaved(
    first: Side, second: Side, measured: Measurement
) -> dict[str, tuple[Any, Spent]]:
    """One dispatch, cancel or demand measurement through both sides at once, their samples
    alternating one by one, `first`'s first: each side's measuring process asks for a turn between
    samples (compare_side.py) and takes its next sample when told to go. A side is told to go when
    it is its turn (or the other side has finished) and no sample of the other side is in flight;
    so at any moment at most one sample is in flight, and a slow spell of the machine falls on
    both sides' samples alike. Both sides' runners (or provisioner sessions) stay connected
    throughout. The database server's CPU cannot be told apart by side here, and is not
    recorded."""
    order = {first.name: second, second.name: first}
    state: dict[str, Any] = {"turn": first.name, "busy": None, "done": set()}
    changed = anyio.Condition()
    values: dict[str, tuple[Any, Spent]] = {}

    async def drive(side: Side) -> None:
        other = order[side.name]
        used = side.replicas[: measured.replicas]
        spent = side.spent(used)
        await side.ask(measured, interleave=True)
        while True:
            said = await side.read(measured)
            async with changed:
                if state["busy"] == side.name:
                    state["busy"] = None  # its sample is over: it is parked again, or done
                if "turn" not in said:
                    state["done"].add(side.name)
                changed.notify_all()
            if "turn" not in said:
                now = side.spent(used)
                values[side.name] = (
                    said["value"],
                    Spent(now.replicas - spent.replicas, None, now.measurer - spent.measurer),
                )
                return
            async with changed:
                while not (
                    state["busy"] is None
                    and (state["turn"] == side.name or other.name in state["done"])
                ):
                    await changed.wait()
                state["busy"], state["turn"] = side.name, other.name
            await side.tell("go")

    async with anyio.create_task_group() as group:
        group.start_soon(drive, first)
        group.start_soon(drive, second)
    return values


@contextlib.contextmanager
def after_tree() -> Iterator[tuple[Path, str]]:
    """The after side's tree and its name: this checkout, unless BENCH_AFTER_TREE or
    BENCH_AFTER_REF names another (harness.baseline_tree's rules)."""
    if not (os.environ.get("BENCH_AFTER_TREE") or os.environ.get("BENCH_AFTER_REF")):
        yield harness.ROOT, "this checkout"
        return
    with harness.baseline_tree("HEAD", role="AFTER") as found:
        yield found


def check_code(before: Side, after: Side) -> None:
    """Stop unless each side's measuring process imported its own tree's code (start_tree_replica
    checked the replicas), and the two sides' files differ."""
    for side in (before, after):
        for name in ("controlplane", "bench"):
            if not harness.within(side.code[name], side.tree):
                raise RuntimeError(f"the {side.name} side imported {side.code[name]}")
        print(f"{side.name}: measures with {side.code['bench']} and {side.code['controlplane']}")
        for replica in side.code["replicas"]:
            print(f"{side.name}: a replica runs {replica}")
    if before.code["controlplane"] == after.code["controlplane"]:
        raise RuntimeError("both sides run the same files")


async def measure_rounds(
    before: Side,
    after: Side,
    measurements: list[Measurement],
    rounds: int,
    tracks: dict[str, Track],
    costs: dict[str, Track] | None = None,
    interleave: bool = False,
    vacuum: bool = False,
    repeats: int = 1,
) -> None:
    """Take every measurement through both sides, `rounds` times, the order alternating round by
    round; each run is added to its figures' `tracks` (and `costs`)."""
    started = time.monotonic()
    costs = {} if costs is None else costs
    for index in range(rounds):
        vacuumed = False
        for measured in measurements:
            if vacuum and not vacuumed and measured.benchmark != "throughput":
                await vacuum_both(before, after)
                vacuumed = True
            began = time.monotonic()
            first, second = harness.alternated(index, (before, after))
            if interleave and measured.measure in INTERLEAVED:
                found = await measure_interleaved(first, second, measured)
                how, note = "interleaved", f", {first.name}'s sample first"
            elif measured.benchmark == "throughput" and repeats > 1:
                found = await measure_repeated(first, second, measured, repeats)
                how, note = f"{repeats} runs a side", ""
            else:
                for side in (first, second):
                    began = time.monotonic()
                    value, spent = await side.measure(measured)
                    said = record(tracks, costs, measured, side.name, value, spent)
                    took = time.monotonic() - began
                    print(f"round {index + 1}/{rounds}, {said} ({took:.1f} s)")
                continue
            for side in (before, after):
                value, spent = found[side.name]
                said = record(tracks, costs, measured, side.name, value, spent)
                print(f"round {index + 1}/{rounds}, {how}, {said}")
            print(f"  ({time.monotonic() - began:.1f} s{note})")
        print(f"round {index + 1} done, {time.monotonic() - started:.0f} s in")


async def measure_repeated(
    first: Side, second: Side, measured: Measurement, repeats: int
) -> dict[str, tuple[float, Spent]]:
    """One lifecycle measurement run `repeats` times, whole, on each side, the sides taking turns:
    `first` first, then swapped run by run (first, second, second, first, ...), so that a slow
    spell of the machine, or the autovacuum one side's rows set off, falls on both sides' runs
    rather than on one side's figure. A side's jobs/s is its jobs over the sum of its runs' times,
    and its CPU that of one run on average (`record` divides it by a run's jobs)."""
    seconds = {first.name: 0.0, second.name: 0.0}
    spent: dict[str, list[Spent]] = {first.name: [], second.name: []}
    for number in range(repeats):
        for side in (first, second) if number % 2 == 0 else (second, first):
            rate, used = await side.measure(measured)
            print(f"  run {number + 1}/{repeats}, {side.name}: {rate:.1f} jobs/s")
            seconds[side.name] += measured.amount / rate
            spent[side.name].append(used)
    return {
        name: (repeats * measured.amount / seconds[name], Spent.mean(spent[name]))
        for name in seconds
    }


async def vacuum_both(before: Side, after: Side) -> None:
    """VACUUM (ANALYZE) both sides' databases, one after the other, before a round's latencies:
    the throughput runs just wrote tens of thousands of rows to each, and the autovacuum they
    trigger otherwise runs inside whichever side's latency samples it happens to meet."""
    began = time.monotonic()
    for side in (before, after):
        conn = await asyncpg.connect(side.url)
        try:
            await conn.execute("VACUUM (ANALYZE)")
        finally:
            await conn.close()
    print(f"  (both databases vacuumed in {time.monotonic() - began:.1f} s)")


async def run(sizes: Sizes | None = None) -> dict[str, Any]:
    sizes = sizes or Sizes.from_env()
    harness.raise_fd_limit()  # up to 1,000 parked runners; the replicas and sides inherit it
    measurements = plan(sizes)
    tracks: dict[str, Track] = {}
    costs: dict[str, Track] = {}
    started = time.monotonic()
    with (
        harness.baseline_tree(BASELINE_REF) as (tree, name),
        after_tree() as (after_tree_path, after_name),
        harness.postgres() as server,
    ):
        async with (
            open_side("before", tree, server) as before,
            open_side("after", after_tree_path, server) as after,
        ):
            check_code(before, after)
            code = {side.name: side.code for side in (before, after)}
            await measure_rounds(
                before,
                after,
                measurements,
                sizes.rounds,
                tracks,
                costs,
                sizes.interleave,
                sizes.vacuum,
                sizes.repeats,
            )
    results: dict[str, Any] = {
        "baseline": name,
        "after": after_name,
        "sizes": asdict(sizes),
        "interleaved": list(INTERLEAVED) if sizes.interleave else [],
        "elapsed_s": round(time.monotonic() - started),
        "code": code,
        "figures": [track.result() for track in tracks.values()],
        # Diagnostics, outside the verdict: CPU per latency sample, by process.
        "costs": [
            {k: v for k, v in track.result().items() if k != "worse_by_more_than_5_percent"}
            for track in costs.values()
        ],
    }
    for figure in results["figures"]:
        print(
            f"{figure['benchmark']}, {figure['figure']}, {figure['unit']}: before "
            f"{figure['before']}, after {figure['after']} ({figure['after_to_before']}; median of "
            f"the rounds' ratios {figure['paired_after_to_before']})"
            + (" WORSE by more than 5%" if figure["worse_by_more_than_5_percent"] else "")
        )
    path = harness.write_result("compare", results)
    print(f"wrote {path} after {results['elapsed_s']} s")
    return results


if __name__ == "__main__":
    anyio.run(run)
