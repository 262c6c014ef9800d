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

Interleaved dispatch and demand (a request with `"interleave": true`; compare.py runs both
sides' at once): between samples the process writes `{"turn": true}` and waits for a line `go`
on stdin, so that the two sides' samples alternate one by one. The hooks are outside the clock
and have been in both benchmarks since 1089cdd: dispatch's module function `_parked`, called
between samples (the turn is taken once all runners are parked again), and demand's
`Provisioner.granted` event, whose wait follows the grant's arrival stamp. The cancel takes its
turn before each sample's enqueue, through the `queue` module dispatch.py has called since then.

Demand's provisioners (bench/demand.py) never write after their advertisement, so a session the
measurement keeps longer than the server's control-session idle timeout (60 s) is closed with
4408: 1,000 samples at one provisioner take longer than that once interleaved. Here every
session also sends a protocol `ping` every PING_SECONDS, through the websockets `connect` that
demand.py has imported since 1089cdd, on both sides alike; the `pong` goes past its read loop,
which looks only at `demand` messages.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sys
import traceback
from collections.abc import AsyncIterator, Iterator
from typing import Any, TextIO

import anyio

import controlplane
from bench import demand, dispatch, throughput

PING_SECONDS = 20.0  # a third of the server's 60 s control-session idle timeout

_ANSWERS: TextIO = sys.stdout  # the real stdout, once main() has moved print's out of the way


def answer(value: dict[str, Any]) -> None:
    _ANSWERS.write(json.dumps(value) + "\n")
    _ANSWERS.flush()


async def take_turn() -> None:
    """Say this side is ready for its next sample and wait until compare.py says go."""
    answer({"turn": True})
    line = await anyio.to_thread.run_sync(sys.stdin.readline)
    if line.strip() != "go":
        raise RuntimeError(f"expected go, read {line!r}")


async def interleaved_dispatch(
    url: str, addresses: list[str], size: int, amount: int
) -> list[float]:
    """`dispatch.measure`, taking a turn whenever all `size` runners are parked."""
    original = dispatch._parked

    async def parked(clients: Any) -> int:
        count: int = await original(clients)
        if count >= size:
            await take_turn()
        return count

    with swapped(vars(dispatch), "_parked", parked):
        latencies: list[float] = await dispatch.measure(url, addresses, size, amount)
    return latencies


@contextlib.contextmanager
def swapped(namespace: dict[str, Any], name: str, value: Any) -> Iterator[None]:
    """`namespace[name]` (a module's globals, where its functions look names up) is `value`
    inside, and its own again after."""
    original = namespace[name]
    namespace[name] = value
    try:
        yield
    finally:
        namespace[name] = original


class _TurnAfterWait:
    """A provisioner's `granted` event (bench/demand.py) whose `wait`, once the grant is in,
    also waits for this side's next turn. demand.measure stops a sample's clock at the grant's
    arrival stamp, not when the wait returns, so the turn is outside the clock."""

    def __init__(self, event: anyio.Event) -> None:
        self._event = event

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    async def wait(self) -> None:
        await self._event.wait()
        await take_turn()


async def interleaved_demand(url: str, addresses: list[str], size: int, amount: int) -> list[float]:
    """`demand.measure`, taking a turn after each sample. Its first sample has no turn before
    it (the loop has no hook there), so the two sides' first samples may overlap."""
    cls = demand.Provisioner
    original = cls.__dict__.get("granted")

    def get(self: Any) -> _TurnAfterWait:
        event: _TurnAfterWait = self.__dict__["_granted"]
        return event

    def put(self: Any, event: anyio.Event) -> None:
        self.__dict__["_granted"] = _TurnAfterWait(event)

    # `granted` is an instance attribute of each tree's Provisioner: a property on the class
    # takes over its assignments (measure's `member.granted = anyio.Event()`) and reads.
    name = "granted"
    setattr(cls, name, property(get, put))
    try:
        latencies: list[float] = await demand.measure(url, addresses, size, amount)
        return latencies
    finally:
        if original is None:
            delattr(cls, name)
        else:
            setattr(cls, name, original)


async def interleaved_cancel(url: str, address: str, amount: int) -> list[float]:
    """`dispatch.cancel_latency`, taking a turn before each sample's enqueue, which comes before
    its clock starts (the clock runs from the cancel request to the held heartbeat's answer)."""
    original = vars(dispatch)["queue"]

    class Queue:
        @staticmethod
        async def enqueue(*args: Any, **kwargs: Any) -> Any:
            await take_turn()
            return await original.enqueue(*args, **kwargs)

    with swapped(vars(dispatch), "queue", Queue):
        latencies: list[float] = await dispatch.cancel_latency(url, address, amount)
    return latencies


async def _ping(ws: Any) -> None:
    for number in itertools.count():
        await anyio.sleep(PING_SECONDS)
        await ws.send(json.dumps({"type": "ping", "request_id": f"bench-ping-{number}"}))


def _pinging(connect: Any) -> Any:
    """websockets' `connect`, whose connections also send a control-session ping every
    PING_SECONDS once opened (the first after the hello and advertisement are long done)."""

    @contextlib.asynccontextmanager
    async def opened(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        async with connect(*args, **kwargs) as ws, anyio.create_task_group() as group:
            group.start_soon(_ping, ws)
            try:
                yield ws
            finally:
                group.cancel_scope.cancel()

    return opened


async def measure(request: dict[str, Any]) -> float | list[float]:
    url, addresses = request["url"], request["addresses"]
    size, amount = request["size"], request["amount"]
    if request.get("interleave"):
        match request["measure"]:
            case "dispatch":
                return await interleaved_dispatch(url, addresses, size, amount)
            case "demand":
                return await interleaved_demand(url, addresses, size, amount)
            case "cancel":
                return await interleaved_cancel(url, addresses[0], amount)
        raise ValueError(f"{request['measure']} does not interleave")
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
    global _ANSWERS
    _ANSWERS = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    answer({"controlplane": controlplane.__file__, "bench": throughput.__file__})
    vars(demand)["connect"] = _pinging(vars(demand)["connect"])
    for line in sys.stdin:  # take_turn reads the same stream, between these lines
        try:
            answer({"value": anyio.run(measure, json.loads(line))})
        except Exception:
            answer({"error": traceback.format_exc()})


if __name__ == "__main__":
    main()
