"""Soak: several replicas, hundreds of runners, provisioners, random kills; then an audit.

For `--minutes` the soak enqueues jobs at a steady rate (store's `queue.enqueue`, a few of them
replays of earlier executions) into workspaces served by manual runners and into the workspaces
of workspace provisioners, while a chaos loop SIGKILLs a random replica (restarted a few seconds
later on a new port) or drops a few runners in the middle of whatever they were doing (a killed
runner is replaced by a freshly registered one). Everything but the daemons runs in this
process:

* manual runners: one HTTP connection each; long poll, heartbeat every 2 s while "working"
  (0.2 to 3 s), complete; a request that fails on a dead replica is sent again to another one;
* provisioners: a WebSocket control session each (hello, advertise, grants -> create_instances
  -> attach_provider), reconnecting to another replica when theirs dies (`welcome.outstanding`
  says which grants still need machines); every instance is a "machine" task that exchanges its
  bootstrap token, enrolls, is activated, registers its one-claim session and runs one job.

Leases are short for the soak (20 s, 10 s before a first heartbeat; reaper every second) so
killed runners' jobs expire within the run. After the chaos, enqueueing stops, dead replicas are
restarted and the runners drain the queue; then the audit reads the database:

* lost: enqueued (by this process's own record) with no tombstone and neither pending nor
  running. Must be 0.
* run twice: handed to more than one runner (this process saw two deliveries), or with more
  `job.claimed` than `job.requeued` + 1 events in the feed. Must be 0.
* deadlocks: `pg_stat_database.deadlocks` delta over the soak. Must be 0.
* resurrected: a replayed enqueue of an execution that had been claimed or had ended came back
  as `enqueued`. Must be 0.

The jobs are a mix (issue 14's policies): a priority from PRIORITIES; KEYED_SHARE of them a
concurrency key of their workspace (KEYS of them, key i with limit 1 + i % 3); TIMEOUT_SHARE a
run timeout of TIMEOUT_S whose runner overruns it on purpose (it ignores `cancel: true` and keeps
heartbeating until the lease is gone, so the leader must end it); RETRY_SHARE `retries_on_lost`
of RETRIES, and the chaos loop kills the runners holding those first. For these:

* run twice is counted per attempt: an execution may be delivered to 1 + (its `job.retried`
  events) runners, and may have that many more `job.claimed` than `job.requeued` events.
* key over limit: executions of one key leased at once beyond its limit, seen either way:
  (a) sampled every SAMPLE_S during the run: keys with more `running_jobs` rows, or a larger
  `concurrency_keys.running`, than their limit; (b) the feed replayed per key in `seq` order,
  +1 for each `job.claimed`, -1 for each `job.completed`, `job.lease_expired`, `job.timed_out`,
  `job.retried` or `job.requeued` (the soak cancels nothing): times the count went above the
  limit. `seq` order is commit order within one key because a claim's admission and a lease's
  end both hold the key's `concurrency_keys` row when they write their event. Must be 0.
* timed out late: executions with outcome `timed_out` whose tombstone's `ended_at` is later
  than their last lease's start (the `job.claimed` event's `claimed_at`) + timeout + the grace +
  one reaper interval + LATE_SLACK_S (the leader's try-locks skipping a busy row and a leader
  failover after a replica is SIGKILLed); plus heartbeats sent after the runner's own deadline
  (its receipt of the claim + the timeout, never earlier than the lease's real deadline) that
  were answered 200 without `cancel: true`. Must be 0; `timed_out_lateness_max_s` records the
  largest lateness past the deadline + grace.
* retried beyond limit: executions with more `job.retried` events than their `retries_on_lost`,
  an attempt (pending, running or kept in `execution_attempts`) above `retries_on_lost` + 1, or
  a `job.retried` event after their terminal event. Must be 0.

`python -m bench.soak --minutes 1` is a smoke run; results in bench/results/soak.json (or
$BENCH_RESULTS/soak.json).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import anyio
import asyncpg
import httpx
from anyio.abc import TaskGroup
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import WebSocketException

from bench import harness
from controlplane.domain.jobs import EnqueueResult, NewJob
from controlplane.store import credentials, provisioners, queue

MINUTES = 10.0
REPLICAS = 3
RUNNERS = 200
PROVISIONERS = 2
JOBS_PER_S = 20.0
PROVISIONED_SHARE = 0.1
CHAOS_EVERY_S = 10.0
DRAIN_S = 120.0
MANUAL_WORKSPACES = 4
PRIORITIES = (-10, 0, 0, 0, 5, 10)
KEYED_SHARE = 0.3
KEYS = 6
TIMEOUT_SHARE = 0.05
TIMEOUT_S = 4
RETRY_SHARE = 0.15
RETRIES = 2
SAMPLE_S = 0.5
GRACE_S = 6  # queue.timeout_grace_seconds: must exceed the heartbeat interval (5 s)
REAPER_S = 1
LATE_SLACK_S = 10.0
DAEMON = {
    "CONTROLPLANE_RUNNERS_STALE_LEASE_THRESHOLD_SECONDS": "20",
    "CONTROLPLANE_RUNNERS_NO_FIRST_HEARTBEAT_GRACE_SECONDS": "10",
    "CONTROLPLANE_RUNNERS_HEARTBEAT_INTERVAL_SECONDS": "5",
    "CONTROLPLANE_RUNNERS_LONG_POLL_MAX_SECONDS": "20",
    "CONTROLPLANE_MAINTENANCE_REAPER_INTERVAL_SECONDS": str(REAPER_S),
    "CONTROLPLANE_QUEUE_TIMEOUT_GRACE_SECONDS": str(GRACE_S),
}
GONE = {401, 403, 404, 409, 410}  # the lease, session or token is no longer ours


@dataclass
class Ledger:
    """What this process saw; the audit holds the database against it."""

    enqueued: set[uuid.UUID] = field(default_factory=set)
    jobs: dict[uuid.UUID, NewJob] = field(default_factory=dict)
    deliveries: dict[uuid.UUID, list[str]] = field(default_factory=dict)
    completed: set[uuid.UUID] = field(default_factory=set)
    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    chaos: list[tuple[float, str]] = field(default_factory=list)
    holding: dict[str, uuid.UUID] = field(default_factory=dict)  # runner -> its execution now
    late_heartbeats: int = 0  # answered without cancel after the runner's own run deadline
    key_over_limit_sampled: int = 0
    samples: int = 0
    errors: list[str] = field(default_factory=list)  # the first few, for the record


class Cluster:
    """Replica slots; a killed one is restarted on a new port."""

    def __init__(self, url: str, size: int) -> None:
        self._url = url
        self.slots: list[harness.Replica | None] = [None] * size
        self._all: list[harness.Replica] = []

    async def start(self, index: int) -> None:
        replica = await harness.start_replica(self._url, **DAEMON)
        self._all.append(replica)
        self.slots[index] = replica

    def kill(self, index: int) -> None:
        replica = self.slots[index]
        if replica is not None:
            replica.process.kill()
            replica.process.wait()
            self.slots[index] = None

    def live(self) -> list[int]:
        return [
            index
            for index, replica in enumerate(self.slots)
            if replica is not None and replica.process.poll() is None
        ]

    def pick(self, rng: random.Random) -> str:
        live = self.live()
        if not live:
            raise ConnectionError("no replica is running")
        replica = self.slots[rng.choice(live)]
        assert replica is not None
        return replica.address

    def stop(self) -> None:
        harness.stop_replicas(self._all)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


class Endpoint:
    """One runner's HTTP connection to some live replica; moves on when that replica dies."""

    def __init__(self, cluster: Cluster, rng: random.Random) -> None:
        self._cluster = cluster
        self._rng = rng
        self._client: httpx.AsyncClient | None = None

    async def call(
        self, method: str, path: str, token: str, body: Any = None, attempts: int = 30
    ) -> httpx.Response:
        last = "nothing"
        for attempt in range(attempts):
            try:
                if self._client is None:
                    self._client = httpx.AsyncClient(
                        base_url=self._cluster.pick(self._rng), timeout=60
                    )
                response = await self._client.request(
                    method, path, headers=bearer(token), json=body
                )
                if response.status_code not in (502, 503):
                    return response
                last = f"{response.status_code} {response.text[:120]}"
            except (httpx.TransportError, ConnectionError) as error:
                last = repr(error)
            await self.aclose()
            await anyio.sleep(min(2.0, 0.05 * 2**attempt))
        raise ConnectionError(f"{method} {path.split('?')[0]}: no replica answered; last: {last}")

    async def aclose(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            with anyio.CancelScope(shield=True):
                await client.aclose()


async def run_job(
    endpoint: Endpoint, body: dict[str, Any], name: str, ledger: Ledger, rng: random.Random
) -> None:
    execution = uuid.UUID(body["job_execution_id"])
    received = time.monotonic()
    ledger.deliveries.setdefault(execution, []).append(name)
    ledger.holding[name] = execution
    try:
        await _work(endpoint, body, execution, received, ledger, rng)
    finally:
        ledger.holding.pop(name, None)


async def _work(
    endpoint: Endpoint,
    body: dict[str, Any],
    execution: uuid.UUID,
    received: float,
    ledger: Ledger,
    rng: random.Random,
) -> None:
    lease = body["lease_token"]
    path = f"/v1/runners/jobs/{execution}"
    timeout = ledger.jobs[execution].timeout_seconds if execution in ledger.jobs else None
    if timeout is None:
        work_until = received + rng.uniform(0.2, 3.0)
    else:  # overrun on purpose, ignoring cancel, until the leader ends the lease
        work_until = received + timeout + GRACE_S + REAPER_S + LATE_SLACK_S + 30
    while (left := work_until - time.monotonic()) > 0:
        await anyio.sleep(min(2.0, left))
        sent = time.monotonic()
        beat = await endpoint.call("POST", f"{path}/heartbeat", lease)
        if beat.status_code in GONE:
            ledger.counts["timed_out_runner_told_gone" if timeout else "leases_lost"] += 1
            ledger.counts[f"heartbeat_{beat.status_code}"] += 1
            return
        if beat.status_code == 200:
            answer = beat.json()
            lease = answer["lease_token"]
            if timeout is not None and sent >= received + timeout:
                if answer["cancel"]:
                    ledger.counts["timeout_cancel_heard"] += 1
                else:
                    ledger.late_heartbeats += 1
    done = await endpoint.call("POST", f"{path}/complete", lease, {"outcome": "succeeded"})
    if done.status_code == 200:
        ledger.completed.add(execution)
    else:
        ledger.counts[f"complete_{done.status_code}"] += 1


async def manual_runner(
    name: str, cluster: Cluster, registration: str, ledger: Ledger, rng: random.Random
) -> None:
    endpoint = Endpoint(cluster, rng)
    try:
        made = await endpoint.call(
            "POST", "/v1/runners/register", registration, {"labels": ["linux"]}
        )
        made.raise_for_status()
        session = made.json()["session_token"]
        while True:
            got = await endpoint.call("POST", "/v1/runners/jobs/request?wait=20", session)
            if got.status_code == 200:
                await run_job(endpoint, got.json(), name, ledger, rng)
            elif got.status_code != 204:
                ledger.counts[f"request_{got.status_code}"] += 1
                await anyio.sleep(0.5)
    finally:
        await endpoint.aclose()


async def machine(
    name: str, cluster: Cluster, bootstrap: str, ledger: Ledger, rng: random.Random
) -> None:
    """A provisioned runner: bootstrap exchange, enrollment, activation, one job."""
    endpoint = Endpoint(cluster, rng)
    try:
        exchanged = await endpoint.call(
            "POST", "/v1/runner-enrollment/exchange", "", {"bootstrap_token": bootstrap}
        )
        if exchanged.status_code != 200:
            ledger.counts["machines_refused_bootstrap"] += 1
            return
        control = exchanged.json()["control_session_token"]
        enrolled = await endpoint.call(
            "POST",
            "/v1/runner-control/enrollment",
            control,
            {"labels": ["linux"], "provider_kind": "local", "protocol_version": "1"},
        )
        if enrolled.status_code != 200:
            ledger.counts[f"machines_enroll_{enrolled.status_code}"] += 1
            return
        activation = enrolled.json()["activation_token"]
        with anyio.move_on_after(120):
            while activation is None:
                polled = await endpoint.call(
                    "GET", "/v1/runner-control/assignment?wait_seconds=20", control
                )
                if polled.status_code == 200:
                    activation = polled.json()["activation_token"]
        if activation is None:
            ledger.counts["machines_never_activated"] += 1
            return
        made = await endpoint.call(
            "POST", "/v1/runners/register", activation, {"labels": ["linux"]}
        )
        if made.status_code != 200:
            ledger.counts[f"machines_register_{made.status_code}"] += 1
            return
        session = made.json()["session_token"]
        for _ in range(10):
            got = await endpoint.call("POST", "/v1/runners/jobs/request?wait=20", session)
            if got.status_code == 200:
                await run_job(endpoint, got.json(), name, ledger, rng)
                ledger.counts["machines_ran_a_job"] += 1
                return
            if got.status_code != 204:
                break
        ledger.counts["machines_found_no_job"] += 1
    finally:
        await endpoint.aclose()


class Crew:
    """Every runner and machine task, each in a cancel scope of its own so that chaos can kill
    it; manual runners come back (a new registration) a second after being killed."""

    def __init__(self, group: TaskGroup, ledger: Ledger, rng: random.Random) -> None:
        self._group = group
        self._ledger = ledger
        self._rng = rng
        self.live: dict[str, anyio.CancelScope] = {}
        self._serial = 0

    def start(self, prefix: str, body: Callable[[str], Awaitable[None]], revive: bool) -> None:
        self._serial += 1
        self._group.start_soon(self._run, f"{prefix}-{self._serial}", body, revive, prefix)

    async def _run(
        self, name: str, body: Callable[[str], Awaitable[None]], revive: bool, prefix: str
    ) -> None:
        with anyio.CancelScope() as scope:
            self.live[name] = scope
            try:
                await body(name)
            except Exception as error:  # counted in the audit; the soak goes on
                self._ledger.counts[f"task_error_{type(error).__name__}"] += 1
                if len(self._ledger.errors) < 50:
                    self._ledger.errors.append(f"{name}: {error}")
            finally:
                self.live.pop(name, None)
        if revive:  # killed or crashed: a new runner takes its place, as a supervisor would
            await anyio.sleep(1)
            self.start(prefix, body, revive)

    def kill(self, count: int, first: list[str]) -> int:
        """Kill `count` tasks, those named in `first` (still live) before any others."""
        preferred = [name for name in first if name in self.live][:count]
        others = sorted(set(self.live) - set(preferred))
        victims = preferred + self._rng.sample(others, min(count - len(preferred), len(others)))
        for name in victims:
            self.live[name].cancel()
        return len(victims)


class Provisioner:
    """One workspace provisioner over the control session, launching a machine per unit."""

    def __init__(
        self, name: str, token: str, cluster: Cluster, crew: Crew, ledger: Ledger, seed: int
    ) -> None:
        self.name = name
        self._token = token
        self._cluster = cluster
        self._crew = crew
        self._ledger = ledger
        self._rng = random.Random(seed)
        self._serial = 0
        self._backlog: list[dict[str, Any]] = []

    async def run(self) -> None:
        while True:
            try:
                address = self._cluster.pick(self._rng)
                await self._session(address.replace("http://", "ws://", 1))
            except (WebSocketException, OSError, ConnectionError, TimeoutError):
                pass
            self._ledger.counts["provisioner_reconnects"] += 1
            await anyio.sleep(0.5)

    async def _session(self, url: str) -> None:
        async with connect(
            f"{url}/v1/provisioners/session", additional_headers=bearer(self._token)
        ) as ws:
            welcome = await self._ask(ws, {"type": "hello", "protocol_version": 1}, "welcome")
            for grant in welcome["outstanding"]:
                await self._launch(ws, grant)
            await self._ask(
                ws,
                {
                    "type": "advertise",
                    "max_reservations": 100,
                    "templates": [
                        {"template_key": "small", "labels": ["linux"], "available_slots": 40}
                    ],
                },
                "advertised",
            )
            while True:
                while self._backlog:
                    for grant in self._backlog.pop(0)["grants"]:
                        await self._launch(ws, grant)
                with anyio.move_on_after(20):
                    message = json.loads(await ws.recv())
                    if message["type"] == "demand":
                        self._backlog.append(message)
                    continue
                await self._ask(ws, {"type": "ping"}, "pong")

    async def _ask(
        self, ws: ClientConnection, message: dict[str, Any], answer: str
    ) -> dict[str, Any]:
        """Send one request and read up to its answer, keeping demand pushes for later."""
        self._serial += 1
        request_id = f"r{self._serial}"
        await ws.send(json.dumps({**message, "request_id": request_id}))
        with anyio.fail_after(30):
            while True:
                reply: dict[str, Any] = json.loads(await ws.recv())
                if reply["type"] == "demand":
                    self._backlog.append(reply)
                elif reply.get("request_id") == request_id:
                    if reply["type"] != answer:
                        self._ledger.counts[f"provisioner_{reply.get('code', reply['type'])}"] += 1
                    return reply

    async def _launch(self, ws: ClientConnection, grant: dict[str, Any]) -> None:
        for start in range(0, grant["count"], 500):
            units = min(500, grant["count"] - start)
            created = await self._ask(
                ws,
                {
                    "type": "create_instances",
                    "provider_kind": "local",
                    "instances": [
                        {"template_key": "small", "reservation_id": grant["reservation_id"]}
                    ]
                    * units,
                },
                "instances_created",
            )
            if created["type"] != "instances_created":
                return
            if created["reservation_unavailable"]:
                self._ledger.counts["grants_unavailable"] += 1
            for instance in created["runner_instances"]:
                self._serial += 1
                attached = await self._ask(
                    ws,
                    {
                        "type": "attach_provider",
                        "runner_instance_id": instance["runner_instance_id"],
                        "provider_runner_id": f"{self.name}-vm-{self._serial}",
                    },
                    "attached",
                )
                if attached.get("attached"):
                    self._start_machine(instance["bootstrap_token"])

    def _start_machine(self, bootstrap: str) -> None:
        self._ledger.counts["machines_started"] += 1
        rng = random.Random(self._rng.random())

        async def body(name: str) -> None:
            await machine(name, self._cluster, bootstrap, self._ledger, rng)

        self._crew.start(f"{self.name}-machine", body, revive=False)


async def enqueue_load(
    url: str,
    manual: list[uuid.UUID],
    provisioned: list[uuid.UUID],
    rate: float,
    ledger: Ledger,
    rng: random.Random,
) -> None:
    conn = await asyncpg.connect(url)
    owed = 0.0
    try:
        while True:
            await anyio.sleep(0.2)
            owed += rate * 0.2
            jobs = []
            while owed >= 1:
                owed -= 1
                share = rng.random() < PROVISIONED_SHARE
                jobs.append(mixed_job(rng.choice(provisioned if share else manual), rng, ledger))
            if not jobs:
                continue
            for job, result in zip(jobs, await queue.enqueue(conn, jobs), strict=True):
                if result is EnqueueResult.ENQUEUED:
                    ledger.enqueued.add(job.identity.job_execution_id)
                    ledger.jobs[job.identity.job_execution_id] = job
            if ledger.deliveries and rng.random() < 0.2:
                # An at-least-once replay of an execution a runner already had.
                [result] = await queue.enqueue(
                    conn, [ledger.jobs[rng.choice(list(ledger.deliveries))]]
                )
                ledger.counts["replays"] += 1
                if result is EnqueueResult.ENQUEUED:
                    ledger.counts["resurrected"] += 1
    finally:
        with anyio.CancelScope(shield=True):
            await conn.close()


def mixed_job(workspace: uuid.UUID, rng: random.Random, ledger: Ledger) -> NewJob:
    """A job with a priority and, by the shares above, a concurrency key, a run timeout its
    runner will overrun, or retries on a lost runner."""
    job = dataclasses.replace(harness.new_job(workspace), priority=rng.choice(PRIORITIES))
    if rng.random() < KEYED_SHARE:
        key = rng.randrange(KEYS)
        job = dataclasses.replace(job, concurrency_key=f"key-{key}", concurrency_limit=1 + key % 3)
        ledger.counts["keyed_jobs"] += 1
    draw = rng.random()
    if draw < TIMEOUT_SHARE:
        job = dataclasses.replace(job, timeout_seconds=TIMEOUT_S)
        ledger.counts["timeout_jobs"] += 1
    elif draw < TIMEOUT_SHARE + RETRY_SHARE:
        job = dataclasses.replace(job, retries_on_lost=RETRIES)
        ledger.counts["retry_jobs"] += 1
    return job


KEY_SAMPLE = """
SELECT count(*) FROM (
    SELECT workspace_id, concurrency_key FROM running_jobs WHERE concurrency_key IS NOT NULL
    GROUP BY 1, 2 HAVING count(*) > min(concurrency_limit)
    UNION ALL
    SELECT k.workspace_id, k.concurrency_key FROM concurrency_keys k
    WHERE k.running > (SELECT min(r.concurrency_limit) FROM running_jobs r
                       WHERE r.workspace_id = k.workspace_id
                         AND r.concurrency_key = k.concurrency_key)
) over_limit
"""


async def sample_keys(url: str, ledger: Ledger) -> None:
    """Every SAMPLE_S: keys leased beyond their limit right now (one snapshot)."""
    conn = await asyncpg.connect(url)
    try:
        while True:
            ledger.key_over_limit_sampled += int(await conn.fetchval(KEY_SAMPLE))
            ledger.samples += 1
            await anyio.sleep(SAMPLE_S)
    finally:
        with anyio.CancelScope(shield=True):
            await conn.close()


async def chaos(
    cluster: Cluster, crew: Crew, ledger: Ledger, rng: random.Random, every: float, group: TaskGroup
) -> None:
    """Forever: after an exponential pause, SIGKILL a replica (restarted 2-6 s later; at least
    one stays up) or kill one to five runners or machines."""
    began = time.monotonic()

    async def restart(index: int) -> None:
        await anyio.sleep(rng.uniform(2, 6))
        await cluster.start(index)
        ledger.chaos.append((round(time.monotonic() - began, 1), f"replica {index} restarted"))

    while True:
        await anyio.sleep(rng.expovariate(1 / every))
        live = cluster.live()
        at = round(time.monotonic() - began, 1)
        if rng.random() < 0.4 and len(live) >= 2:
            index = rng.choice(live)
            cluster.kill(index)
            ledger.counts["replica_kills"] += 1
            ledger.chaos.append((at, f"replica {index} SIGKILLed"))
            group.start_soon(restart, index)
        else:
            retrying = sorted(
                name
                for name, execution in ledger.holding.items()
                if execution in ledger.jobs and ledger.jobs[execution].retries_on_lost
            )
            killed = crew.kill(rng.randint(1, 5), first=retrying)
            ledger.counts["runner_kills"] += killed
            ledger.chaos.append((at, f"{killed} runner(s) killed"))


AUDIT = """
WITH e AS (SELECT unnest($1::uuid[]) AS ex),
claims AS (
    SELECT job_execution_id AS ex,
           count(*) FILTER (WHERE event_type = 'job.claimed') AS claimed,
           count(*) FILTER (WHERE event_type = 'job.requeued') AS requeued,
           count(*) FILTER (WHERE event_type = 'job.retried') AS retried,
           count(*) FILTER (WHERE event_type IN ('job.completed', 'job.cancelled',
                                                 'job.lease_expired', 'job.timed_out',
                                                 'job.queue_expired')) AS terminal
    FROM events WHERE job_execution_id = ANY($1::uuid[]) GROUP BY 1
)
SELECT
    (SELECT count(*) FROM e) AS enqueued,
    (SELECT count(*) FROM ended_executions t JOIN e ON t.job_execution_id = e.ex
      WHERE t.outcome IN ('succeeded', 'failed')) AS completed,
    (SELECT count(*) FROM ended_executions t JOIN e ON t.job_execution_id = e.ex
      WHERE t.outcome = 'expired') AS expired,
    (SELECT count(*) FROM ended_executions t JOIN e ON t.job_execution_id = e.ex
      WHERE t.outcome = 'cancelled') AS cancelled,
    (SELECT count(*) FROM ended_executions t JOIN e ON t.job_execution_id = e.ex
      WHERE t.outcome = 'timed_out') AS timed_out,
    (SELECT count(*) FROM ended_executions t JOIN e ON t.job_execution_id = e.ex
      WHERE t.outcome = 'queue_expired') AS queue_expired,
    (SELECT coalesce(sum(retried), 0) FROM claims) AS retries,
    (SELECT count(*) FROM pending_jobs p JOIN e ON p.job_execution_id = e.ex) AS pending,
    (SELECT count(*) FROM running_jobs r JOIN e ON r.job_execution_id = e.ex) AS running,
    (SELECT count(*) FROM e
      WHERE NOT EXISTS (SELECT 1 FROM ended_executions t WHERE t.job_execution_id = e.ex)
        AND NOT EXISTS (SELECT 1 FROM pending_jobs p WHERE p.job_execution_id = e.ex)
        AND NOT EXISTS (SELECT 1 FROM running_jobs r WHERE r.job_execution_id = e.ex)) AS lost,
    (SELECT count(*) FROM claims WHERE claimed - requeued - retried > 1) AS run_twice_feed,
    (SELECT count(*) FROM claims WHERE terminal > 1) AS terminal_events_twice,
    (SELECT count(*) FROM e
      WHERE EXISTS (SELECT 1 FROM ended_executions t WHERE t.job_execution_id = e.ex)
        AND NOT EXISTS (SELECT 1 FROM claims c WHERE c.ex = e.ex AND c.terminal = 1))
        AS tombstones_without_event,
    (SELECT count(*) FROM e
      WHERE EXISTS (SELECT 1 FROM ended_executions t WHERE t.job_execution_id = e.ex)
        AND (EXISTS (SELECT 1 FROM pending_jobs p WHERE p.job_execution_id = e.ex)
             OR EXISTS (SELECT 1 FROM running_jobs r WHERE r.job_execution_id = e.ex)))
        AS ended_but_queued
"""


# Each execution's feed, in commit order per key (see the module docstring).
FEED = """
SELECT job_execution_id AS ex, event_type, payload->>'claimed_at' AS claimed_at, seq
FROM events WHERE job_execution_id = ANY($1::uuid[]) ORDER BY seq
"""
RELEASES = {"job.completed", "job.lease_expired", "job.timed_out", "job.retried", "job.requeued"}
TERMINAL = {"job.completed", "job.cancelled", "job.lease_expired", "job.timed_out"}
ATTEMPTS = """
SELECT job_execution_id AS ex, max(attempt) AS attempt FROM (
    SELECT job_execution_id, attempt FROM pending_jobs
    UNION ALL SELECT job_execution_id, attempt FROM running_jobs
    UNION ALL SELECT job_execution_id, attempt FROM execution_attempts
) a WHERE job_execution_id = ANY($1::uuid[]) GROUP BY 1
"""


async def audit_policies(conn: asyncpg.Connection, ledger: Ledger) -> dict[str, Any]:
    """Key over limit (feed), timed out late and retried beyond limit, as the docstring says."""
    executions = list(ledger.enqueued)
    feed = await conn.fetch(FEED, executions)
    found: dict[str, Any] = {}
    # Key over limit, replaying the feed per key.
    running: collections.Counter[tuple[uuid.UUID, str]] = collections.Counter()
    over = 0
    retried: collections.Counter[uuid.UUID] = collections.Counter()
    ended: set[uuid.UUID] = set()
    retried_after_end = 0
    last_claim: dict[uuid.UUID, datetime] = {}
    for event in feed:
        job = ledger.jobs[event["ex"]]
        kind = event["event_type"]
        if kind == "job.claimed":
            last_claim[event["ex"]] = datetime.fromisoformat(event["claimed_at"])
        if kind == "job.retried":
            retried[event["ex"]] += 1
            retried_after_end += event["ex"] in ended
        if kind in TERMINAL:
            ended.add(event["ex"])
        if job.concurrency_key is None or job.concurrency_limit is None:
            continue
        key = (job.identity.workspace_id, job.concurrency_key)
        if kind == "job.claimed":
            running[key] += 1
            over += running[key] > job.concurrency_limit
        elif kind in RELEASES:
            running[key] -= 1
    found["key_over_limit_feed"] = over
    found["key_over_limit_sampled"] = ledger.key_over_limit_sampled
    found["key_samples"] = ledger.samples
    found["key_over_limit"] = over + ledger.key_over_limit_sampled
    # Timed out late.
    allowed = GRACE_S + REAPER_S + LATE_SLACK_S
    lateness = []
    for row in await conn.fetch(
        "SELECT job_execution_id AS ex, ended_at FROM ended_executions "
        "WHERE outcome = 'timed_out' AND job_execution_id = ANY($1::uuid[])",
        executions,
    ):
        timeout = ledger.jobs[row["ex"]].timeout_seconds or 0
        past = (row["ended_at"] - last_claim[row["ex"]]).total_seconds() - timeout - GRACE_S
        lateness.append(past)
    found["timed_out_ended_late"] = sum(1 for past in lateness if past > allowed - GRACE_S)
    found["timed_out_lateness_max_s"] = round(max(lateness, default=0.0), 2)
    found["late_heartbeats_without_cancel"] = ledger.late_heartbeats
    found["timed_out_late"] = found["timed_out_ended_late"] + ledger.late_heartbeats
    # Retried beyond limit.
    attempts = {row["ex"]: row["attempt"] for row in await conn.fetch(ATTEMPTS, executions)}
    beyond = {ex for ex, count in retried.items() if count > ledger.jobs[ex].retries_on_lost}
    beyond |= {ex for ex, n in attempts.items() if n > ledger.jobs[ex].retries_on_lost + 1}
    found["retried_after_end"] = retried_after_end
    found["retried_beyond_limit"] = len(beyond) + retried_after_end
    found["executions_retried"] = len(retried)
    return found


async def audit(conn: asyncpg.Connection, ledger: Ledger) -> dict[str, Any]:
    row = await conn.fetchrow(AUDIT, list(ledger.enqueued))
    assert row is not None
    found: dict[str, Any] = {key: int(value) for key, value in row.items()}
    found.update(await audit_policies(conn, ledger))
    retried = {
        row["ex"]: row["n"]
        for row in await conn.fetch(
            "SELECT job_execution_id AS ex, count(*) AS n FROM events "
            "WHERE event_type = 'job.retried' "
            "AND job_execution_id = ANY($1::uuid[]) GROUP BY 1",
            list(ledger.deliveries),
        )
    }
    # Per attempt: a retried execution may reach one more runner per retry.
    found["run_twice_seen"] = sum(
        1 for ex, runners in ledger.deliveries.items() if len(runners) > 1 + retried.get(ex, 0)
    )
    found["run_twice"] = max(found["run_twice_seen"], found["run_twice_feed"])
    ended = await conn.fetch(
        "SELECT job_execution_id, outcome FROM ended_executions "
        "WHERE job_execution_id = ANY($1::uuid[])",
        list(ledger.completed),
    )
    found["acked_but_not_succeeded"] = len(ledger.completed) - sum(
        1 for row in ended if row["outcome"] == "succeeded"
    )
    found["resurrected"] = ledger.counts["resurrected"]
    return found


async def _drained(conn: asyncpg.Connection, ledger: Ledger) -> bool:
    left = await conn.fetchval(
        """
        SELECT (SELECT count(*) FROM pending_jobs WHERE job_execution_id = ANY($1::uuid[]))
             + (SELECT count(*) FROM running_jobs WHERE job_execution_id = ANY($1::uuid[]))
        """,
        list(ledger.enqueued),
    )
    return int(left) == 0


async def run(
    minutes: float = MINUTES,
    replicas: int = REPLICAS,
    runners: int = RUNNERS,
    provisioner_count: int = PROVISIONERS,
    rate: float = JOBS_PER_S,
    chaos_every: float = CHAOS_EVERY_S,
    seed: int | None = None,
) -> dict[str, Any]:
    harness.raise_fd_limit()
    seed = random.randrange(2**32) if seed is None else seed
    rng = random.Random(seed)
    ledger = Ledger()
    with harness.postgres() as server:
        url = await harness.fresh_database(server)
        conn = await asyncpg.connect(url)
        manual_ws = [uuid.uuid4() for _ in range(MANUAL_WORKSPACES)]
        registrations = [
            (await credentials.create_manual_token(conn, workspace_id=ws, name="soak"))[1]
            for ws in manual_ws
        ]
        provisioned_ws = [uuid.uuid4() for _ in range(provisioner_count)]
        tokens = [
            (await provisioners.create(conn, name=f"soak-{i}", workspace_id=ws))[1]
            for i, ws in enumerate(provisioned_ws)
        ]
        deadlocks_before = (await harness.database_counters(conn))["deadlocks"]
        cluster = Cluster(url, replicas)
        began = time.monotonic()
        try:
            for index in range(replicas):
                await cluster.start(index)
            async with anyio.create_task_group() as group:
                crew = Crew(group, ledger, random.Random(rng.random()))
                for index in range(runners):
                    registration = registrations[index % len(registrations)]
                    runner_rng = random.Random(rng.random())

                    async def body(
                        name: str, registration: str = registration, r: random.Random = runner_rng
                    ) -> None:
                        await manual_runner(name, cluster, registration, ledger, r)

                    crew.start("runner", body, revive=True)
                group.start_soon(sample_keys, url, ledger)
                for index, token in enumerate(tokens):
                    member = Provisioner(
                        f"prov{index}", token, cluster, crew, ledger, rng.randrange(2**32)
                    )
                    group.start_soon(member.run)
                with anyio.CancelScope() as load:
                    async with anyio.create_task_group() as chaos_group:
                        chaos_group.start_soon(
                            enqueue_load, url, manual_ws, provisioned_ws, rate, ledger, rng
                        )
                        chaos_group.start_soon(
                            chaos, cluster, crew, ledger, rng, chaos_every, group
                        )
                        with anyio.move_on_after(minutes * 60):
                            await anyio.sleep_forever()
                        chaos_group.cancel_scope.cancel()
                load.cancel()
                print(f"chaos over after {time.monotonic() - began:.0f} s; draining")
                with anyio.move_on_after(DRAIN_S):
                    while len(cluster.live()) < replicas or not await _drained(conn, ledger):
                        await anyio.sleep(1)
                drained_s = time.monotonic() - began
                group.cancel_scope.cancel()
            found = await audit(conn, ledger)
            found["deadlocks"] = (await harness.database_counters(conn))[
                "deadlocks"
            ] - deadlocks_before
        finally:
            cluster.stop()
            await conn.close()
    results: dict[str, Any] = {
        "parameters": {
            "minutes": minutes,
            "replicas": replicas,
            "runners": runners,
            "provisioners": provisioner_count,
            "jobs_per_s": rate,
            "provisioned_share": PROVISIONED_SHARE,
            "chaos_every_s": chaos_every,
            "seed": seed,
            "daemon_settings": DAEMON,
            "mix": {
                "priorities": PRIORITIES,
                "keyed_share": KEYED_SHARE,
                "keys_per_workspace": KEYS,
                "timeout_share": TIMEOUT_SHARE,
                "timeout_s": TIMEOUT_S,
                "retry_share": RETRY_SHARE,
                "retries_on_lost": RETRIES,
                "late_slack_s": LATE_SLACK_S,
            },
        },
        "elapsed_s": round(drained_s, 1),
        "audit": found,
        "activity": dict(sorted(ledger.counts.items())),
        "delivered": len(ledger.deliveries),
        "completions_acknowledged": len(ledger.completed),
        "chaos": ledger.chaos,
        "errors": ledger.errors,
    }
    print(table(results))
    path = harness.write_result("soak", results)
    print(f"wrote {path}")
    return results


MUST_BE_ZERO = (
    "lost",
    "run_twice",
    "deadlocks",
    "resurrected",
    "terminal_events_twice",
    "tombstones_without_event",
    "ended_but_queued",
    "acked_but_not_succeeded",
    "key_over_limit",
    "timed_out_late",
    "retried_beyond_limit",
)


def table(results: dict[str, Any]) -> str:
    found = results["audit"]
    rows = [
        ("jobs enqueued", found["enqueued"], ""),
        ("completed", found["completed"], ""),
        ("expired", found["expired"], ""),
        ("cancelled", found["cancelled"], ""),
        ("timed out", found["timed_out"], ""),
        ("queue expired", found["queue_expired"], ""),
        ("retries (job.retried)", found["retries"], ""),
        ("still pending", found["pending"], ""),
        ("still running", found["running"], ""),
    ] + [(name.replace("_", " "), found[name], "must be 0") for name in MUST_BE_ZERO]
    width = max(len(name) for name, _, _ in rows)
    lines = [f"{'audit':<{width}}  {'count':>8}", "-" * (width + 10)]
    for name, value, note in rows:
        flag = "" if not note else ("  ok" if value == 0 else "  FAILED (must be 0)")
        lines.append(f"{name:<{width}}  {value:>8}{flag}")
    activity = results["activity"]
    lines.append(
        f"kills: {activity.get('replica_kills', 0)} replicas, {activity.get('runner_kills', 0)} "
        f"runners/machines; provisioner reconnects {activity.get('provisioner_reconnects', 0)}; "
        f"machines started {activity.get('machines_started', 0)}"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--minutes", type=float, default=MINUTES)
    parser.add_argument("--replicas", type=int, default=REPLICAS)
    parser.add_argument("--runners", type=int, default=RUNNERS)
    parser.add_argument("--provisioners", type=int, default=PROVISIONERS)
    parser.add_argument("--rate", type=float, default=JOBS_PER_S, help="jobs enqueued per second")
    parser.add_argument(
        "--chaos-every", type=float, default=CHAOS_EVERY_S, help="mean seconds between kills"
    )
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()

    async def go() -> None:
        await run(
            args.minutes,
            args.replicas,
            args.runners,
            args.provisioners,
            args.rate,
            args.chaos_every,
            args.seed,
        )

    anyio.run(go)


if __name__ == "__main__":
    main()
