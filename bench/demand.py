"""Demand latency: enqueue commit to grant received by a provisioner over its control session.

N workspace provisioners (one workspace each, half on each of two replicas) hold a WebSocket
control session and have advertised one template. Jobs are enqueued one at a time, each into the
next workspace in turn, with the store's enqueue transaction on a direct connection; the clock
starts just before that transaction and stops when the `demand` message carrying the grant for
that workspace has arrived in this process. Baseline, same run, same server: a raw
INSERT + NOTIFY transaction to a LISTEN callback.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import anyio
import asyncpg
from websockets.asyncio.client import ClientConnection, connect

from bench import dispatch, harness
from controlplane.store import provisioners, queue

SAMPLES = 200
SIZES = (1, 10, 100)
SETTLE_SECONDS = 5.0  # before measuring (see `measure`)


class Provisioner:
    def __init__(self, workspace: uuid.UUID, token: str, address: str) -> None:
        self.workspace = workspace
        self.token = token
        self.url = address.replace("http://", "ws://", 1) + "/v1/provisioners/session"
        self.granted: anyio.Event = anyio.Event()
        self.arrived_at = 0.0

    async def run(self, ready: anyio.Event) -> None:
        async with connect(
            self.url, additional_headers={"Authorization": f"Bearer {self.token}"}
        ) as ws:
            await _send(ws, {"type": "hello", "protocol_version": 1, "request_id": "h"})
            await ws.recv()
            await _send(
                ws,
                {
                    "type": "advertise",
                    "request_id": "a",
                    "max_reservations": 1000,
                    "reservation_ttl_seconds": 600,
                    "templates": [
                        {"template_key": "k", "labels": ["linux"], "available_slots": 100_000}
                    ],
                },
            )
            ready.set()
            async for frame in ws:
                message = json.loads(frame)
                if message["type"] == "demand" and message["grants"]:
                    self.arrived_at = time.perf_counter()
                    self.granted.set()


async def _send(ws: ClientConnection, message: dict[str, Any]) -> None:
    await ws.send(json.dumps(message))


async def measure(url: str, addresses: list[str], count: int, samples: int) -> list[float]:
    conn = await asyncpg.connect(url)
    fleet = []
    try:
        for i in range(count):
            workspace = uuid.uuid4()
            _, token = await provisioners.create(conn, name=f"bench-{i}", workspace_id=workspace)
            fleet.append(Provisioner(workspace, token, addresses[i % len(addresses)]))
        latencies: list[float] = []
        async with anyio.create_task_group() as group:
            for member in fleet:
                ready = anyio.Event()
                group.start_soon(member.run, ready)
                with anyio.fail_after(30):
                    await ready.wait()
            # Let the first rounds (empty demand) settle, and the replicas' demand sweep see
            # every new session: its first read of a session wakes it for one round (it cannot
            # know what changed since that session's first round), which belongs to connecting,
            # not to the steady state this measures. 5 s is two of the default sweep's 2 s
            # ticks and a margin; a tree without the sweep (before issue 16) waits the same.
            await anyio.sleep(SETTLE_SECONDS)
            for i in range(samples):
                member = fleet[i % count]
                member.granted = anyio.Event()
                start = time.perf_counter()
                await queue.enqueue(conn, [harness.new_job(member.workspace)])
                with anyio.fail_after(10):
                    await member.granted.wait()
                latencies.append(member.arrived_at - start)
            group.cancel_scope.cancel()
    finally:
        await conn.close()
    return latencies


async def run(samples: int = SAMPLES, sizes: tuple[int, ...] = SIZES) -> dict[str, Any]:
    results: dict[str, Any] = {"samples_per_size": samples, "sizes": {}}
    with harness.postgres() as server:
        url = await harness.fresh_database(server)
        base = harness.summary_ms(await dispatch.baseline(url, samples))
        results["baseline_insert_notify_listen"] = base
        print(f"baseline INSERT+NOTIFY->LISTEN: p50 {base['p50_ms']} ms, p99 {base['p99_ms']} ms")
        async with harness.replicas(url, 2) as started:
            addresses = [replica.address for replica in started]
            for size in sizes:
                ours = harness.summary_ms(await measure(url, addresses, size, samples))
                ours["p50_ratio_to_baseline"] = round(ours["p50_ms"] / base["p50_ms"], 2)
                ours["p99_ratio_to_baseline"] = round(ours["p99_ms"] / base["p99_ms"], 2)
                results["sizes"][str(size)] = ours
                print(
                    f"{size:>4} provisioners: enqueue -> grant p50 {ours['p50_ms']} ms "
                    f"({ours['p50_ratio_to_baseline']}x baseline), p99 {ours['p99_ms']} ms "
                    f"({ours['p99_ratio_to_baseline']}x baseline)"
                )
    path = harness.write_result("demand", results)
    print(f"wrote {path}")
    return results


def main() -> None:
    anyio.run(run)


if __name__ == "__main__":
    main()
