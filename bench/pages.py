"""How fast a replica renders the operator pages with a full queue: 10,000 pending jobs over 20
label sets in 10 workspaces, and 1,000 live runner sessions. Each page is fetched by a signed-in
client, round after round, interleaved with the admin API's own reads of the same data (the
pending label sets and a page of jobs), so the two are measured in the same run on the same
load. Target from issue 15: every page's p99 under 50 ms.

The overview's plots are drawn once per sample, by the replica's sampling task on a worker
thread (web/ui/plots.py), and a replica in this run holds only a minute of samples. So the run
also times, in this process, drawing a full hour of samples for every workspace (what each
sample costs the replica in the background, and what a view pays in the rare case it comes
before that drawing is done: a miss) beside reading the drawn charts back (every other view: a
hit).

`python -m bench pages` (named only; not part of the default run)."""

from __future__ import annotations

import re
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import asyncpg
import httpx

from bench.harness import (
    drop_database,
    fresh_database,
    postgres,
    replicas,
    summary_ms,
    write_result,
)
from controlplane.domain.jobs import JobIdentity, NewJob
from controlplane.settings import Pages
from controlplane.store import credentials, queue, sessions
from controlplane.store.ui_reads import QueueSample
from controlplane.web.ui.plots import HOUR, QueueHistory

PENDING = 10_000
RUNNERS = 1_000
WORKSPACES = 10
LABEL_SETS = 20
ROUNDS = 100

PAGES = ["/ui/", "/ui/jobs", "/ui/runners", "/ui/provisioners", "/ui/credentials"]
API = ["/v1/admin/queue/pending", "/v1/admin/jobs?limit=100", "/v1/admin/runners"]


async def _seed(url: str) -> str:
    """The queue and fleet above; returns an admin key."""
    spaces = [uuid.uuid4() for _ in range(WORKSPACES)]
    conn = await asyncpg.connect(url)
    try:
        batch: list[NewJob] = []
        for n in range(PENDING):
            space = spaces[n % WORKSPACES]
            batch.append(
                NewJob(
                    identity=JobIdentity(
                        workspace_id=space,
                        workflow_run_id=uuid.uuid4(),
                        workflow_run_attempt_id=uuid.uuid4(),
                        job_id=uuid.uuid4(),
                        job_execution_id=uuid.uuid4(),
                        project_id=uuid.uuid4(),
                    ),
                    required_labels=("linux", f"pool-{n % LABEL_SETS}"),
                    queued_at=datetime.now(UTC),
                    payload={"script": "true", "env": {"SECRET": "x"}},
                )
            )
            if len(batch) == 500:
                await queue.enqueue(conn, batch)
                batch = []
        for n in range(RUNNERS):
            await sessions.create(
                conn,
                workspace_id=spaces[n % WORKSPACES],
                registration_token_id=uuid.uuid4(),
                kind="manual",
                labels=("linux", f"pool-{n % (LABEL_SETS // 2)}"),
            )
        _, admin = await credentials.create_api_key(conn, kind="admin", name="bench")
    finally:
        await conn.close()
    return admin


async def _signed_in(client: httpx.AsyncClient, admin: str) -> None:
    form = await client.get("/ui/sign-in")
    pair = re.search(r'name="pair" value="([^"]+)"', form.text)
    assert pair is not None
    signed = await client.post("/ui/sign-in", data={"pair": pair.group(1), "key": admin})
    assert signed.status_code == 303, signed.text


def plot_draws(rounds: int = ROUNDS) -> dict[str, Any]:
    """A full hour of samples at the default sampling for every workspace: the time drawing
    them takes after a new sample (miss), and reading them back (hit)."""
    every = Pages().plot_sample_seconds
    history = QueueHistory(cast(asyncpg.Pool, None), every_seconds=every, workspaces=WORKSPACES)
    spaces = [uuid.uuid4() for _ in range(WORKSPACES)]
    points = int(HOUR.total_seconds() // every) + 1
    start = datetime.now(UTC) - HOUR
    misses: list[float] = []
    hits: list[float] = []
    for n in range(points + rounds):
        at = start + timedelta(seconds=n * every)
        history.record(at, [QueueSample(w, PENDING // WORKSPACES + n, 1.0 + n % 7) for w in spaces])
        if n < points:
            continue
        started = time.perf_counter()
        drawn = history.drawn()
        misses.append(time.perf_counter() - started)
        started = time.perf_counter()
        assert history.drawn() is drawn
        hits.append(time.perf_counter() - started)
    return {
        "workspaces": WORKSPACES,
        "points_per_series": points,
        "miss": summary_ms(misses),
        "hit": summary_ms(hits),
    }


async def measure(rounds: int = ROUNDS) -> dict[str, Any]:
    with postgres() as server:
        url = await fresh_database(server)
        try:
            admin = await _seed(url)
            async with replicas(url, 1) as (replica,):
                samples: dict[str, list[float]] = {path: [] for path in PAGES + API}
                async with (
                    httpx.AsyncClient(base_url=replica.address, timeout=60) as browser,
                    httpx.AsyncClient(
                        base_url=replica.address,
                        timeout=60,
                        headers={"Authorization": f"Bearer {admin}"},
                    ) as api,
                ):
                    await _signed_in(browser, admin)
                    for round_ in range(rounds + 1):
                        for path in PAGES + API:
                            client = api if path.startswith("/v1/") else browser
                            started = time.perf_counter()
                            response = await client.get(path)
                            elapsed = time.perf_counter() - started
                            assert response.status_code == 200, (path, response.text[:300])
                            if round_:  # the first round warms caches and the pool
                                samples[path].append(elapsed)
        finally:
            await drop_database(url)
    return {
        "pending": PENDING,
        "runners": RUNNERS,
        "workspaces": WORKSPACES,
        "label_sets": LABEL_SETS,
        "rounds": rounds,
        "latency": {path: summary_ms(values) for path, values in samples.items()},
        "plots_drawn": plot_draws(rounds),
    }


async def run() -> None:
    result = await measure()
    write_result("pages", result)
    for path, row in result["latency"].items():
        print(f"{path:32} p50 {row['p50_ms']:8.1f} ms  p99 {row['p99_ms']:8.1f} ms")
    plots = result["plots_drawn"]
    for kind in ("miss", "hit"):
        row = plots[kind]
        print(
            f"plots, {kind} ({plots['workspaces']} x {plots['points_per_series']} points)"
            f"  p50 {row['p50_ms']:8.3f} ms  p99 {row['p99_ms']:8.3f} ms"
        )
