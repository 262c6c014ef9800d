"""The cheap clients of bench/installation.py, all in the measuring process: an orchestrator that
enqueues over HTTP, a provisioner that holds a control session (hello, advertise, read demand,
ping), a runner parked on a long poll, and readers of a replica's /proc figures, its /metrics and
the database's backends.

They speak only the public protocol (docs/api.md, docs/provisioner-protocol.md), so the same
bench drives a replica of any tree. Each client is as small as the protocol lets it be: the
provisioner is one `websockets` connection and one task; the runner is bench/wire.py's raw
HTTP/1.1 connection, not an httpx client.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import anyio
import asyncpg
import httpx
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from bench import harness, wire
from controlplane.agent.queue_client import enqueue_body
from controlplane.store import credentials

PING_SECONDS = 20.0  # well inside the server's 60 s idle timeout, as the protocol asks


def job(workspace: uuid.UUID, labels: list[str]) -> dict[str, Any]:
    """One execution in the enqueue body's shape, with fresh ids (the CLI's own builder)."""
    body = enqueue_body(workspace, labels, ["true"], datetime.now(UTC))
    return cast(list[dict[str, Any]], body["jobs"])[0]


async def enqueue(conn: wire.Connection, token: str, jobs: list[dict[str, Any]]) -> None:
    status, body = await conn.post("/v1/jobs", token, {"jobs": jobs})
    if status != 200:
        raise RuntimeError(f"enqueue answered {status}: {body}")


# --- provisioners --------------------------------------------------------------------------------


@dataclass
class Template:
    key: str
    labels: list[str]
    slots: int


@dataclass
class Provisioner:
    """One control session. `demands` receives every `demand` push as (arrival, message);
    `on_grant` (if set) is called with each push that carries grants."""

    address: str
    token: str
    workspace: uuid.UUID | None = None
    ws: ClientConnection | None = None
    answers: deque[dict[str, Any]] = field(default_factory=deque)
    answered: anyio.Event = field(default_factory=anyio.Event)
    demands: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    pushed: anyio.Event = field(default_factory=anyio.Event)
    started: deque[float] = field(default_factory=deque)  # enqueue stamps awaiting a grant
    latencies: list[float] = field(default_factory=list)
    closed: str = ""

    async def _send(self, message: dict[str, Any]) -> None:
        assert self.ws is not None
        await self.ws.send(json.dumps(message))

    async def request(self, message: dict[str, Any], answer: str) -> dict[str, Any]:
        """Send one request and wait for its answer (an `error` raises)."""
        self.answered = anyio.Event()
        await self._send(message)
        with anyio.fail_after(120):
            while True:
                while self.answers:
                    got = self.answers.popleft()
                    if got["type"] == answer:
                        return got
                    if got["type"] == "error":
                        raise RuntimeError(f"provisioner request refused: {got}")
                await self.answered.wait()
                self.answered = anyio.Event()

    async def advertise(
        self, templates: list[Template], max_reservations: int, ttl_seconds: int
    ) -> tuple[float, dict[str, Any]]:
        """Advertise, and wait for the round's `demand` push that follows the answer (a push that
        arrives before the answer is an earlier round's); the seconds from sending to that push,
        and the push."""
        start = time.perf_counter()
        answer = await self.request(
            {
                "type": "advertise",
                "request_id": uuid.uuid4().hex,
                "max_reservations": max_reservations,
                "reservation_ttl_seconds": ttl_seconds,
                "templates": [
                    {"template_key": t.key, "labels": t.labels, "available_slots": t.slots}
                    for t in templates
                ],
            },
            "advertised",
        )
        seen = answer["demands_before"]
        with anyio.fail_after(300):
            while len(self.demands) == seen:
                if self.closed:
                    raise RuntimeError(f"session closed before its push: {self.closed}")
                self.pushed = anyio.Event()
                await self.pushed.wait()
        arrived, message = self.demands[seen]
        return arrived - start, message

    async def run(self, ready: anyio.Event) -> None:
        """Connect, say hello, then read every frame until cancelled; ping every PING_SECONDS."""
        url = self.address.replace("http://", "ws://", 1) + "/v1/provisioners/session"
        async with (
            connect(
                url,
                additional_headers={"Authorization": f"Bearer {self.token}"},
                ping_interval=None,  # the protocol's own ping keeps the session alive
                max_queue=None,
            ) as ws,
            anyio.create_task_group() as group,
        ):
            self.ws = ws
            group.start_soon(self._read)
            await self.request(
                {"type": "hello", "protocol_version": 1, "request_id": "h"}, "welcome"
            )
            ready.set()
            # A session the server closes later is recorded in `closed` and left closed: the
            # parts count those, rather than stopping the whole run.
            with contextlib.suppress(ConnectionClosed):
                while not self.closed:
                    await anyio.sleep(PING_SECONDS)
                    await self._send({"type": "ping", "request_id": "p"})

    async def _read(self) -> None:
        assert self.ws is not None
        try:
            async for frame in self.ws:
                message = json.loads(frame)
                if message["type"] == "demand":
                    now = time.perf_counter()
                    self.demands.append((now, message))
                    self.pushed.set()
                    units = sum(grant["count"] for grant in message["grants"])
                    for _ in range(min(units, len(self.started))):
                        self.latencies.append(now - self.started.popleft())
                elif message["type"] != "pong":
                    message["demands_before"] = len(self.demands)  # pushes that preceded it
                    self.answers.append(message)
                    self.answered.set()
        except ConnectionClosed:
            pass  # closed with an error code: recorded below
        finally:
            self.closed = f"{self.ws.close_code} {self.ws.close_reason}"
            self.answered.set()
            self.pushed.set()


def granted_units(message: dict[str, Any], label: str | None = None) -> int:
    return sum(
        grant["count"] for grant in message["grants"] if label is None or label in grant["labels"]
    )


# --- runners -------------------------------------------------------------------------------------


@dataclass
class Arrivals:
    """Enqueue stamps by execution id, and the latency of each one a runner was handed."""

    started: dict[str, float] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    events: dict[str, anyio.Event] = field(default_factory=dict)

    def arrived(self, execution: str, at: float) -> None:
        started = self.started.pop(execution, None)
        if started is not None:
            self.latencies.append(at - started)
            self.events.pop(execution, anyio.Event()).set()


async def parked_runner(address: str, session: str, handed: Callable[[str, float], None]) -> None:
    """A runner on a long poll over a connection of its own (harness.poll_for_jobs)."""
    conn = wire.Connection(address)
    try:
        await harness.poll_for_jobs(conn, session, handed)
    finally:
        await conn.aclose()


# --- what the processes and the database do --------------------------------------------------


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def rss_mib(pids: Sequence[int]) -> list[float]:
    return [round(rss_kib(pid) / 1024, 1) for pid in pids]


async def metrics(address: str) -> dict[str, float]:
    """A replica's /metrics, each series name (labels dropped) to the sum of its samples."""
    async with httpx.AsyncClient(base_url=address, timeout=60) as client:
        text = (await client.get("/metrics")).text
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        with contextlib.suppress(ValueError):
            found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


async def backend_cpu(conn: asyncpg.Connection) -> dict[int, float]:
    """CPU seconds so far of each of the server's backends (this machine's /proc)."""
    rows = await conn.fetch("SELECT pid FROM pg_stat_activity WHERE pid IS NOT NULL")
    found: dict[int, float] = {}
    for row in rows:
        with contextlib.suppress(OSError, IndexError, ValueError):
            found[int(row["pid"])] = harness.cpu_seconds(int(row["pid"]))
    return found


def cpu_spent(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds the backends spent between two reads: those alive at both, plus the whole of
    those started since (a backend that left in between is not counted)."""
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())


async def orchestrator_key(conn: asyncpg.Connection) -> str:
    return (await credentials.create_api_key(conn, kind="orchestrator", name="bench"))[1]


def proc_window(pids: Sequence[int]) -> tuple[float, list[float]]:
    return time.monotonic(), [harness.cpu_seconds(pid) for pid in pids]


def cpu_percent(pids: Sequence[int], before: tuple[float, list[float]]) -> list[float]:
    at, cpu = before
    elapsed = time.monotonic() - at
    return [
        round(100 * (harness.cpu_seconds(pid) - spent) / elapsed, 2)
        for pid, spent in zip(pids, cpu, strict=True)
    ]
