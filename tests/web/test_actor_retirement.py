"""Workspace dispatch actors on a real daemon: runners that park and then disconnect leave at
once, the actors retire after `maintenance.dispatch_actor_idle_seconds`, and the next runner of
a workspace brings its actor back and is woken by an enqueue (actors/dispatch.py,
"Retirement"). Everything is read from /metrics over HTTP."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable

import anyio
import asyncpg
import httpx

from controlplane.store import credentials
from tests.web import conftest as web
from tests.web.metrics_client import Samples, scrape

WORKSPACES = 4
RUNNERS_EACH = 5
api_context = contextlib.asynccontextmanager(web.api_with)


async def _until(api: web.Api, done: Callable[[Samples], bool]) -> Samples:
    with anyio.fail_after(10):
        while not done(samples := await scrape(api)):
            await anyio.sleep(0.02)
    return samples


def _gauge(name: str) -> Callable[[Samples], float]:
    return lambda samples: samples[(name, ())]


parked = _gauge("controlplane_parked_runners")
actors = _gauge("controlplane_workspace_actors")


async def test_parked_runners_that_disconnect_leave_their_actors_to_retire_and_come_back(
    database_url: str,
) -> None:
    async with api_context(database_url, maintenance__dispatch_actor_idle_seconds=0.2) as api:
        conn = await asyncpg.connect(database_url)
        try:
            _, api.orchestrator_key = await credentials.create_api_key(
                conn, kind="orchestrator", name="o"
            )
            workspaces = [uuid.uuid4() for _ in range(WORKSPACES)]
            registrations = [
                (await credentials.create_manual_token(conn, workspace_id=w, name="r"))[1]
                for w in workspaces
            ]
        finally:
            await conn.close()
        sessions = [
            await api.register(["linux"], token)
            for token in registrations
            for _ in range(RUNNERS_EACH)
        ]
        everyone = WORKSPACES * RUNNERS_EACH

        # The runners' own connections: cancelling their requests is every runner disconnecting.
        async def poll(session: str) -> None:
            await runners.post("/v1/runners/jobs/request?wait=10", headers=api.auth(session))

        async with (
            httpx.AsyncClient(base_url=api.http.base_url, timeout=30) as runners,
            anyio.create_task_group() as group,
        ):
            for session in sessions:
                group.start_soon(poll, session)
            seen = await _until(api, lambda s: parked(s) == everyone)
            assert actors(seen) == WORKSPACES
            group.cancel_scope.cancel()
        # Disconnected mid long-poll: they leave the actors at once, the actors retire 0.2 s on.
        gone = await _until(api, lambda s: parked(s) == 0 and actors(s) == 0)
        assert (parked(gone), actors(gone)) == (0, 0)

        # The next runner of a workspace brings its actor back, and a NOTIFY wakes it.
        api.workspace = workspaces[0]
        async with anyio.create_task_group() as group:
            answered: list[httpx.Response] = []

            async def request() -> None:
                answered.append(await api.request_job(sessions[0], wait=10))

            group.start_soon(request)
            await _until(api, lambda s: parked(s) == 1 and actors(s) == 1)
            job = api.job(["linux"])
            assert (await api.enqueue(job)).status_code == 200
        [response] = answered
        assert response.status_code == 200, response.text
        assert response.json()["job_execution_id"] == job["job_execution_id"]
        await _until(api, lambda s: actors(s) == 0)
