"""Ordering over real HTTP (docs/policies.md, "Ordering"): the enqueue fields and their 400s, the
order a runner's poll sees, a key's slot freed by a completion waking a parked runner, and the
admin route that sets a workspace's ordering."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import asyncpg
import pytest

from tests.web.conftest import Api, open_api, run_daemon
from tests.web.conftest import test_settings as settings_for_tests
from tests.web.test_runner_routes import complete, error_code


async def pending_count(db: asyncpg.Connection) -> int:
    count: int = await db.fetchval("SELECT count(*) FROM pending_jobs")
    return count


def ago(minutes: int) -> str:
    return (datetime.now(UTC) - timedelta(minutes=minutes)).isoformat()


async def poll(api: Api, session: str, wait: float = 0) -> dict[str, Any] | None:
    response = await api.request_job(session, wait)
    if response.status_code == 204:
        return None
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({"priority": 1001}, "validation-error"),
        ({"priority": -1001}, "validation-error"),
        ({"priority": "high"}, "validation-error"),
        ({"priority": 1.5}, "validation-error"),
        ({"concurrency_key": "deploy"}, "concurrency-key-incomplete"),
        ({"concurrency_limit": 2}, "concurrency-key-incomplete"),
        ({"concurrency_key": "deploy", "concurrency_limit": 0}, "validation-error"),
        ({"concurrency_key": "deploy", "concurrency_limit": 10_001}, "validation-error"),
        ({"concurrency_key": "", "concurrency_limit": 1}, "validation-error"),
        ({"concurrency_key": "a\u0000b", "concurrency_limit": 1}, "validation-error"),
        ({"concurrency_key": "a\nb", "concurrency_limit": 1}, "validation-error"),
        ({"concurrency_key": "k" * 201, "concurrency_limit": 1}, "validation-error"),
    ],
    ids=[
        "priority-above",
        "priority-below",
        "priority-string",
        "priority-float",
        "key-without-limit",
        "limit-without-key",
        "limit-zero",
        "limit-above",
        "key-empty",
        "key-nul",
        "key-newline",
        "key-too-long",
    ],
)
async def test_q08_bad_ordering_fields_are_400_and_enqueue_nothing(
    api: Api, db: asyncpg.Connection, fields: dict[str, Any], code: str
) -> None:
    response = await api.enqueue(api.job(), api.job(**fields))
    assert response.status_code == 400, response.text
    assert error_code(response) == code
    assert await pending_count(db) == 0


async def test_q08_narrowed_settings_refuse_with_their_own_codes(
    database_url: str, db: asyncpg.Connection
) -> None:
    config = settings_for_tests(
        queue__priority_min=-5, queue__priority_max=5, queue__max_concurrency_limit=3
    )
    async for daemon in run_daemon(database_url, config):
        async with open_api(daemon, database_url) as api:
            key_over = {"concurrency_key": "k", "concurrency_limit": 4}
            for fields, code in (
                ({"priority": 6}, "priority-out-of-range"),
                ({"priority": -6}, "priority-out-of-range"),
                (key_over, "concurrency-limit-out-of-range"),
            ):
                response = await api.enqueue(api.job(), api.job(**fields))
                assert response.status_code == 400, response.text
                assert error_code(response) == code
            edges = (api.job(priority=5), api.job(concurrency_key="k", concurrency_limit=3))
            assert (await api.enqueue(*edges)).status_code == 200
    assert await pending_count(db) == 2


async def test_q09_the_edges_of_the_ranges_are_accepted(api: Api, db: asyncpg.Connection) -> None:
    response = await api.enqueue(
        api.job(priority=1000),
        api.job(priority=-1000),
        api.job(concurrency_key="release/main ✓", concurrency_limit=10_000),
        api.job(priority=7.0, concurrency_key="k", concurrency_limit=2.0),  # JSON integers
    )
    assert response.status_code == 200, response.text
    assert await pending_count(db) == 4
    stored = await db.fetchrow(
        "SELECT priority, concurrency_limit FROM pending_jobs WHERE concurrency_key = 'k'"
    )
    assert stored is not None and tuple(stored) == (7, 2)


async def test_q20_a_runner_gets_the_higher_priority_job_first(api: Api) -> None:
    old = api.job(queued_at=ago(10))
    urgent = api.job(queued_at=ago(1), priority=10)
    assert (await api.enqueue(old, urgent)).status_code == 200
    session = await api.register()
    first = await poll(api, session)
    assert first is not None and first["job_execution_id"] == urgent["job_execution_id"]


async def test_q21_a_parked_runner_is_woken_when_a_keyed_lease_completes(
    database_url: str,
) -> None:
    # The dispatcher's safety tick is ten minutes here: only the release's wake-up can serve
    # the parked runner within the test's deadline.
    config = settings_for_tests(maintenance__dispatch_safety_tick_seconds=600)
    async for daemon in run_daemon(database_url, config):
        async with open_api(daemon, database_url) as api:
            await _woken_by_a_release(api)


async def _woken_by_a_release(api: Api) -> None:
    first = api.job(queued_at=ago(10), concurrency_key="deploy", concurrency_limit=1)
    second = api.job(queued_at=ago(9), concurrency_key="deploy", concurrency_limit=1)
    assert (await api.enqueue(first, second)).status_code == 200
    holder, waiter = await api.register(), await api.register()
    claimed = await poll(api, holder)
    assert claimed is not None and claimed["job_execution_id"] == first["job_execution_id"]
    assert await poll(api, waiter) is None  # the key is full

    got: list[dict[str, Any] | None] = []

    async def park() -> None:
        got.append(await poll(api, waiter, wait=8))

    replica = api.daemon.replica
    assert replica is not None
    with anyio.fail_after(20):
        async with anyio.create_task_group() as group:
            group.start_soon(park)
            while replica.dispatcher.parked == 0:  # the poll is parked, found nothing
                await anyio.sleep(0.01)
            response = await complete(
                api, first["job_execution_id"], claimed["lease_token"], {"outcome": "succeeded"}
            )
            assert response.status_code == 200, response.text
    assert got and got[0] is not None
    assert got[0]["job_execution_id"] == second["job_execution_id"]


async def test_q33_the_admin_sets_a_workspace_to_fair_and_the_feed_records_it(
    api: Api, db: asyncpg.Connection
) -> None:
    path = f"/v1/admin/workspaces/{api.workspace}/settings"
    headers = api.auth(api.admin_key)
    response = await api.http.put(path, json={"ordering": "fair"}, headers=headers)
    assert response.status_code == 200, response.text
    assert response.json() == {
        "workspace_id": str(api.workspace),
        "ordering": "fair",
        "changed": True,
    }
    again = await api.http.put(path, json={"ordering": "fair"}, headers=headers)
    assert again.json()["changed"] is False
    rows = await db.fetch(
        "SELECT payload FROM events WHERE event_type = 'workspace.settings_changed'"
        " AND workspace_id = $1",
        api.workspace,
    )
    assert len(rows) == 1
    stored = await db.fetchval(
        "SELECT ordering FROM workspace_settings WHERE workspace_id = $1", api.workspace
    )
    assert stored == "fair"
    for body in ({"ordering": "random"}, {"ordering": "fair", "extra": 1}, {}):
        bad = await api.http.put(path, json=body, headers=headers)
        assert bad.status_code == 400, bad.text
        assert error_code(bad) == "validation-error"
    not_uuid = await api.http.put(
        "/v1/admin/workspaces/nope/settings", json={"ordering": "fifo"}, headers=headers
    )
    assert not_uuid.status_code == 400
    orchestrator = await api.http.put(
        path, json={"ordering": "fifo"}, headers=api.auth(api.orchestrator_key)
    )
    assert orchestrator.status_code == 401
    other = await api.http.put(
        f"/v1/admin/workspaces/{uuid.uuid4()}/settings", json={"ordering": "fifo"}, headers=headers
    )
    assert other.json()["changed"] is False  # fifo is every workspace's default


async def test_q28_a_replica_serves_a_changed_ordering_from_its_next_poll(api: Api) -> None:
    # The replica's claims have seen the workspace plain; the setting then changes. Its next
    # immediate poll (a claim of its own) and its next parked one (the dispatcher's batch) each
    # serve in the new order.
    busy, quiet = str(uuid.uuid4()), str(uuid.uuid4())
    busy_jobs = [api.job(queued_at=ago(60 - i), project_id=busy) for i in range(3)]
    quiet_job = api.job(queued_at=ago(1), project_id=quiet)
    assert (await api.enqueue(*busy_jobs, quiet_job)).status_code == 200
    session = await api.register()
    first = await poll(api, session)
    assert first is not None and first["job_execution_id"] == busy_jobs[0]["job_execution_id"]
    path = f"/v1/admin/workspaces/{api.workspace}/settings"
    headers = api.auth(api.admin_key)
    assert (await api.http.put(path, json={"ordering": "fair"}, headers=headers)).json()["changed"]
    fair = await poll(api, await api.register())
    assert fair is not None and fair["job_execution_id"] == quiet_job["job_execution_id"]
    assert (await api.http.put(path, json={"ordering": "fifo"}, headers=headers)).json()["changed"]
    replica = api.daemon.replica
    assert replica is not None and replica.orderings.fair(api.workspace)  # stale now
    parked = await poll(api, await api.register(), wait=5)
    assert parked is not None and parked["job_execution_id"] == busy_jobs[1]["job_execution_id"]
    assert not replica.orderings.fair(api.workspace)
