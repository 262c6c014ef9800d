"""A concurrency key's last slot across two daemon processes (docs/policies.md Q-26): two
replicas admitting it at once lease it once, and the key's next job waits for the release."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable

import anyio
import asyncpg
import httpx
import pytest

from tests.system.conftest import SpawnDaemon
from tests.system.wire import job_body, orchestrator_and_registration

pytestmark = pytest.mark.system

KEY_FULL = "controlplane_claim_key_full_steps_total"


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def _register(client: httpx.AsyncClient, token: str) -> str:
    response = await client.post(
        "/v1/runners/register", json={"labels": ["linux"]}, headers=_bearer(token)
    )
    assert response.status_code == 200, response.text
    session: str = response.json()["session_token"]
    return session


async def _sample(client: httpx.AsyncClient, name: str) -> float:
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    return 0.0


async def _until(check: Callable[[], Awaitable[bool]], seconds: float = 20) -> None:
    """Until `check()` is true: a deadline, not a sleep standing in for an event."""
    with anyio.fail_after(seconds):
        while not await check():
            await anyio.sleep(0.02)


async def test_q26_two_replicas_admitting_a_keys_last_slot_at_once_lease_it_once(
    spawn_daemon: SpawnDaemon, database_url: str
) -> None:
    workspace = uuid.uuid4()
    orchestrator, registration = await orchestrator_and_registration(database_url, workspace)
    jobs = [
        {**job_body(workspace), "concurrency_key": "deploy", "concurrency_limit": 1}
        for _ in range(2)
    ]
    ids = {job["job_execution_id"] for job in jobs}
    holder = await asyncpg.connect(database_url)
    observer = await asyncpg.connect(database_url)
    answers: dict[str, httpx.Response] = {}

    async def count(table: str) -> int:
        value: int = await observer.fetchval(
            f"SELECT count(*) FROM {table} WHERE workspace_id = $1",  # noqa: S608 -- a constant
            workspace,
        )
        return value

    try:
        async with (
            spawn_daemon() as replica_a,
            spawn_daemon() as replica_b,
            httpx.AsyncClient(base_url=replica_a.address, timeout=60) as a,
            httpx.AsyncClient(base_url=replica_b.address, timeout=60) as b,
        ):
            parked = {"a": await _register(a, registration), "b": await _register(b, registration)}
            clients = {"a": a, "b": b}

            async def poll(name: str) -> None:
                # `wait` longer than every deadline below: only a job can end it in time.
                answers[name] = await clients[name].post(
                    "/v1/runners/jobs/request?wait=50", headers=_bearer(parked[name])
                )

            # The key's count row exists and is held, as by a claim on a third replica that
            # is admitting the key's last slot and has not committed.
            await holder.execute(
                "INSERT INTO concurrency_keys (workspace_id, concurrency_key)"
                " VALUES ($1, 'deploy')",
                workspace,
            )
            held = holder.transaction()
            await held.start()
            await holder.execute(
                "SELECT 1 FROM concurrency_keys"
                " WHERE workspace_id = $1 AND concurrency_key = 'deploy' FOR UPDATE",
                workspace,
            )
            async with anyio.create_task_group() as group:
                for name in parked:
                    group.start_soon(poll, name)

                async def both_parked() -> bool:
                    texts = [(await c.get("/metrics")).text for c in (a, b)]
                    return all("controlplane_parked_runners 1.0" in t for t in texts)

                await _until(both_parked)
                enqueued = await a.post(
                    "/v1/jobs", json={"jobs": jobs}, headers=_bearer(orchestrator)
                )
                assert enqueued.status_code == 200, enqueued.text
                assert [r["result"] for r in enqueued.json()["results"]] == ["enqueued"] * 2

                # Each replica's claim locks a keyed job, finds the key row held, and steps over
                # it (counted) without waiting for the row: nothing waits on a lock, nothing ran.
                async def both_stepped_over() -> bool:
                    return all([await _sample(c, KEY_FULL) >= 1 for c in (a, b)])

                await _until(both_stepped_over)
                waiting = await observer.fetchval(
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND wait_event_type = 'Lock'"
                )
                assert waiting == 0
                assert await count("running_jobs") == 0
                assert not answers

                # Released: both replicas claim again (the enqueue's wake was spent; their safety
                # tick, 1 s here, runs the claims), and exactly one of them admits.
                await held.rollback()
                await _until(lambda: _answered(answers))
                (winner,) = answers
                loser = "b" if winner == "a" else "a"
                first = answers[winner]
                assert first.status_code == 200, first.text
                assert first.json()["job_execution_id"] in ids
                assert await count("running_jobs") == 1
                assert await count("pending_jobs") == 1
                running = await observer.fetchval(
                    "SELECT running FROM concurrency_keys WHERE workspace_id = $1", workspace
                )
                assert running == 1
                # The other job stays pending: an immediate claim on either replica takes
                # nothing, and the runner parked on the loser is still waiting.
                for client in (a, b):
                    extra = await _register(client, registration)
                    now = await client.post(
                        "/v1/runners/jobs/request?wait=0", headers=_bearer(extra)
                    )
                    assert now.status_code == 204, now.text
                assert loser not in answers
                assert await count("pending_jobs") == 1

                # Completing the first hands the second to the runner still parked.
                completed = await clients[winner].post(
                    f"/v1/runners/jobs/{first.json()['job_execution_id']}/complete",
                    json={"outcome": "succeeded"},
                    headers=_bearer(first.json()["lease_token"]),
                )
                assert completed.status_code == 200, completed.text
                await _until(lambda: _answered(answers, 2))
            second = answers[loser]
            assert second.status_code == 200, second.text
            assert (
                second.json()["job_execution_id"]
                == (ids - {first.json()["job_execution_id"]}).pop()
            )
            assert await count("running_jobs") == 1
            assert await count("pending_jobs") == 0
    finally:
        await holder.close()
        await observer.close()


async def _answered(answers: dict[str, httpx.Response], how_many: int = 1) -> bool:
    return len(answers) >= how_many
