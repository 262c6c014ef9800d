"""Dispatch latency: enqueue to runner-has-job, with runners parked across two replicas.

For N parked runners (half on each replica), jobs are enqueued one at a time with the store's
enqueue transaction on a direct connection; the clock starts just before that transaction and
stops when a runner's long-poll response has arrived in this process. The baseline, measured in
the same run on the same server: a raw INSERT + NOTIFY transaction to a LISTEN callback, the
floor any PostgreSQL-woken dispatcher sits on.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import anyio
import asyncpg
import httpx

from bench import harness, wire
from controlplane.store import credentials, queue

SAMPLES = 200
SIZES = (10, 100, 1000)


async def baseline(url: str, samples: int) -> list[float]:
    listener = await asyncpg.connect(url)
    sender = await asyncpg.connect(url)
    latencies: list[float] = []
    waiting: list[tuple[anyio.Event, list[float]]] = []

    def arrived(*_args: object) -> None:
        event, stamp = waiting[-1]
        stamp.append(time.perf_counter())
        event.set()

    try:
        await sender.execute("CREATE TABLE IF NOT EXISTS bench_notify (id bigserial, v uuid)")
        await listener.add_listener("bench_notify", arrived)
        for _ in range(samples):
            event, stamp = anyio.Event(), list[float]()
            waiting.append((event, stamp))
            start = time.perf_counter()
            async with sender.transaction():
                await sender.execute("INSERT INTO bench_notify (v) VALUES ($1)", uuid.uuid4())
                await sender.execute("SELECT pg_notify('bench_notify', 'x')")
            with anyio.fail_after(10):
                await event.wait()
            latencies.append(stamp[0] - start)
    finally:
        await listener.close()
        await sender.close()
    return latencies


async def _parked(clients: list[httpx.AsyncClient]) -> int:
    total = 0
    for client in clients:
        for line in (await client.get("/metrics")).text.splitlines():
            if line.startswith("controlplane_parked_runners "):
                total += int(float(line.split()[1]))
    return total


async def measure(url: str, addresses: list[str], runners: int, samples: int) -> list[float]:
    workspace = uuid.uuid4()
    conn = await asyncpg.connect(url)
    _, registration = await credentials.create_manual_token(
        conn, workspace_id=workspace, name="bench"
    )
    # /metrics only; each runner has a keep-alive connection of its own (bench/wire.py), as real
    # runners do: one httpx pool shared by 500 runners scanned its connections on every request.
    clients = [httpx.AsyncClient(base_url=address, timeout=120) for address in addresses]
    arrivals: dict[uuid.UUID, tuple[anyio.Event, list[float]]] = {}
    latencies: list[float] = []

    def handed(execution: str, at: float) -> None:
        event, stamp = arrivals[uuid.UUID(execution)]
        stamp.append(at)
        event.set()

    async def runner(address: str) -> None:
        conn = wire.Connection(address)
        status, body = await conn.post("/v1/runners/register", registration, {"labels": ["linux"]})
        assert status == 200, (status, body)
        try:
            await harness.poll_for_jobs(conn, body["session_token"], handed)
        finally:
            await conn.aclose()

    try:
        async with anyio.create_task_group() as group:
            for index in range(runners):
                group.start_soon(runner, addresses[index % len(addresses)])
            with anyio.fail_after(120):
                while await _parked(clients) < runners:
                    await anyio.sleep(0.2)
            for _ in range(samples):
                job = harness.new_job(workspace)
                event, stamp = anyio.Event(), list[float]()
                arrivals[job.identity.job_execution_id] = (event, stamp)
                start = time.perf_counter()
                await queue.enqueue(conn, [job])
                with anyio.fail_after(30):
                    await event.wait()
                latencies.append(stamp[0] - start)
                # Let the runner complete and park again before the next job.
                with anyio.fail_after(30):
                    while await _parked(clients) < runners:
                        await anyio.sleep(0.005)
            group.cancel_scope.cancel()
    finally:
        for client in clients:
            await client.aclose()
        await conn.close()
    return latencies


async def cancel_latency(url: str, address: str, samples: int) -> list[float]:
    """From the orchestrator's cancel request to the held heartbeat's `cancel: true`."""
    workspace = uuid.uuid4()
    conn = await asyncpg.connect(url)
    _, registration = await credentials.create_manual_token(conn, workspace_id=workspace, name="c")
    _, orchestrator = await credentials.create_api_key(conn, kind="orchestrator", name="c")
    latencies: list[float] = []
    async with httpx.AsyncClient(base_url=address, timeout=60) as client:
        response = await client.post(
            "/v1/runners/register",
            json={"labels": ["linux"]},
            headers={"Authorization": f"Bearer {registration}"},
        )
        session = {"Authorization": f"Bearer {response.json()['session_token']}"}
        for _ in range(samples):
            job = harness.new_job(workspace)
            await queue.enqueue(conn, [job])
            body = (await client.post("/v1/runners/jobs/request?wait=5", headers=session)).json()
            path = f"/v1/runners/jobs/{body['job_execution_id']}"
            lease = {"Authorization": f"Bearer {body['lease_token']}"}
            answered: list[float] = []

            async def hold(
                path: str = path, lease: dict[str, str] = lease, answered: list[float] = answered
            ) -> None:
                beat = await client.post(f"{path}/heartbeat?wait=10", headers=lease)
                assert beat.json()["cancel"] is True
                answered.append(time.perf_counter())

            async with anyio.create_task_group() as group:
                group.start_soon(hold)
                # Cancel once the heartbeat is held (its lease shows a first heartbeat).
                with anyio.fail_after(10):
                    while not await conn.fetchval(
                        "SELECT first_heartbeat_at IS NOT NULL FROM running_jobs "
                        "WHERE job_execution_id = $1",
                        job.identity.job_execution_id,
                    ):
                        await anyio.sleep(0.002)
                start = time.perf_counter()
                await client.post(
                    f"/v1/jobs/{job.identity.job_execution_id}/outcome",
                    json={"status": "cancelled"},
                    headers={"Authorization": f"Bearer {orchestrator}"},
                )
            latencies.append(answered[0] - start)
            await client.post(f"{path}/complete", json={"outcome": "cancelled"}, headers=lease)
    await conn.close()
    return latencies


async def run(samples: int = SAMPLES, sizes: tuple[int, ...] = SIZES) -> dict[str, Any]:
    results: dict[str, Any] = {"samples_per_size": samples, "sizes": {}}
    with harness.postgres() as server:
        url = await harness.fresh_database(server)
        base = harness.summary_ms(await baseline(url, samples))
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
                    f"{size:>5} parked runners: p50 {ours['p50_ms']} ms "
                    f"({ours['p50_ratio_to_baseline']}x baseline), p99 {ours['p99_ms']} ms "
                    f"({ours['p99_ratio_to_baseline']}x baseline)"
                )
            cancel = harness.summary_ms(await cancel_latency(url, addresses[0], 50))
            results["cancel_to_held_heartbeat"] = cancel
            print(f"cancel -> held heartbeat: p50 {cancel['p50_ms']} ms, p99 {cancel['p99_ms']} ms")
    path = harness.write_result("dispatch", results)
    print(f"wrote {path}")
    return results


def main() -> None:
    anyio.run(run)


if __name__ == "__main__":
    main()
