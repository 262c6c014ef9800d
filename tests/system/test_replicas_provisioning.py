"""Provisioners across real daemon processes sharing one PostgreSQL.

* A burst of 500 jobs with mixed labels over three workspaces, served by two installation
  provisioners connected to two replicas: afterwards the tables and every grant received are
  audited: no unit of demand granted twice, no advertised capacity exceeded.
* SIGKILL of the replica holding a provisioner's socket: the provisioner reconnects to the other
  replica, finds its grants in `welcome.outstanding`, and new demand keeps being granted; no
  reservation is lost or doubled.
"""

from __future__ import annotations

import json
import signal
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import anyio
import asyncpg
import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from controlplane.domain import tokens
from controlplane.store import provisioners
from tests.system.conftest import DaemonProcess, SpawnDaemon
from tests.system.wire import job_body, orchestrator_and_registration

pytestmark = pytest.mark.system


@dataclass
class Fleet:
    """One provisioner's side of the conversation: what it advertised and every grant."""

    token: str
    templates: list[dict[str, Any]]
    grants: list[dict[str, Any]] = field(default_factory=list)
    outstanding: list[dict[str, Any]] = field(default_factory=list)
    sessions: int = 0
    granted: anyio.Event = field(default_factory=anyio.Event)

    @property
    def slots(self) -> int:
        return sum(t["available_slots"] for t in self.templates)

    async def serve(self, replica: DaemonProcess) -> None:
        """Hold a session with the replica until it goes away; record every grant."""
        url = replica.address.replace("http://", "ws://", 1) + "/v1/provisioners/session"
        async with connect(
            url, additional_headers={"Authorization": f"Bearer {self.token}"}, close_timeout=2
        ) as ws:
            await _send(ws, {"type": "hello", "protocol_version": 1, "request_id": "h"})
            welcome = json.loads(await ws.recv())
            assert welcome["type"] == "welcome", welcome
            self.sessions += 1
            self.outstanding = welcome["outstanding"]
            await _send(
                ws,
                {
                    "type": "advertise",
                    "request_id": "a",
                    "templates": self.templates,
                    "max_reservations": 1000,
                    "reservation_ttl_seconds": 600,
                },
            )
            try:
                async for frame in ws:
                    message = json.loads(frame)
                    if message["type"] == "demand" and message["grants"]:
                        self.grants.extend(message["grants"])
                        self.granted.set()
                        self.granted = anyio.Event()
            except ConnectionClosed:
                return


async def _send(ws: ClientConnection, message: dict[str, Any]) -> None:
    await ws.send(json.dumps(message))


async def _enqueue(http: httpx.AsyncClient, key: str, jobs: list[dict[str, Any]]) -> None:
    for start in range(0, len(jobs), 100):
        response = await http.post(
            "/v1/jobs", json={"jobs": jobs[start : start + 100]}, headers={"Authorization": key}
        )
        assert response.status_code == 200, response.text


async def _units(db: asyncpg.Connection) -> int:
    units: int = await db.fetchval(
        "SELECT coalesce(sum(count), 0) FROM reservations WHERE expires_at > now()"
    )
    return units


ROUNDS_DONE = 'controlplane_allocation_rounds_total{outcome="ok"}'
# An idle actor sleeps (issue 16); a full round every second lets `_settled` count rounds.
ROUNDS = {"CONTROLPLANE_PROVISIONERS_DEMAND_FULL_ROUND_SECONDS": "1"}


async def _rounds(replica: httpx.AsyncClient) -> float:
    """Allocation rounds the replica's provisioner actors have finished."""
    for line in (await replica.get("/metrics")).text.splitlines():
        name, _, value = line.rpartition(" ")
        if name == ROUNDS_DONE:
            return float(value)
    return 0.0


async def _settled(db: asyncpg.Connection, replicas: list[httpx.AsyncClient], at_least: int) -> int:
    """Until at least `at_least` units are reserved and two whole allocation rounds on every
    replica left the figure where it was: granting has stopped because nothing is left to grant,
    not because a round was slow. The figure."""
    with anyio.fail_after(120):
        while True:
            units = await _units(db)
            start = [await _rounds(replica) for replica in replicas]
            for replica, before in zip(replicas, start, strict=True):
                # A round in progress now may have read the tables before `units`: wait for it
                # and one more that starts after.
                while await _rounds(replica) < before + 2:
                    await anyio.sleep(0.05)
            if units >= at_least and await _units(db) == units:
                return units


async def _pushed_all(db: asyncpg.Connection, fleets: list[Fleet]) -> None:
    """Until every reservation in the table has reached its provisioner's socket: a grant is
    pushed after the round that made it commits."""
    with anyio.fail_after(30):
        while True:
            rows = await db.fetch("SELECT id FROM reservations")
            pushed = {g["reservation_id"] for f in fleets for g in f.grants}
            if {str(row["id"]) for row in rows} <= pushed:
                return
            await anyio.sleep(0.05)


async def _provisioner_id(db: asyncpg.Connection, raw: str) -> uuid.UUID:
    found = await provisioners.by_digest(db, tokens.digest(raw))
    assert found is not None
    return found.id


async def test_two_replicas_two_installation_provisioners_500_jobs_audit(
    spawn_daemon: SpawnDaemon, database_url: str
) -> None:
    workspaces = [uuid.uuid4() for _ in range(3)]
    orchestrator, _ = await orchestrator_and_registration(database_url, workspaces[0])
    db = await asyncpg.connect(database_url)
    try:
        fleets = []
        for name, templates in (
            ("a", [{"template_key": "big", "labels": ["linux", "x64"], "available_slots": 220}]),
            (
                "b",
                [
                    {"template_key": "gpu", "labels": ["gpu", "linux"], "available_slots": 60},
                    {"template_key": "arm", "labels": ["arm", "linux"], "available_slots": 150},
                ],
            ),
        ):
            _, raw = await provisioners.create(db, name=name, workspace_id=None)
            fleets.append(Fleet(raw, templates))
        label_sets = [["linux"], ["linux", "x64"], ["gpu", "linux"], ["arm", "linux"]]
        jobs = [
            job_body(workspaces[i % 3], label_sets[(i // 3) % len(label_sets)]) for i in range(500)
        ]
        async with (
            spawn_daemon(**ROUNDS) as replica_a,
            spawn_daemon(**ROUNDS) as replica_b,
            httpx.AsyncClient(base_url=replica_a.address, timeout=30) as a,
            httpx.AsyncClient(base_url=replica_b.address, timeout=30) as b,
            anyio.create_task_group() as group,
        ):
            group.start_soon(fleets[0].serve, replica_a)
            group.start_soon(fleets[1].serve, replica_b)
            with anyio.fail_after(20):
                while sum(f.sessions for f in fleets) < 2:
                    await anyio.sleep(0.05)
            await _enqueue(b, f"Bearer {orchestrator}", jobs)
            # Capacity (430 slots) is below demand (500); wait until granting has stopped.
            await _settled(db, [a, b], 1)
            await _pushed_all(db, fleets)
            group.cancel_scope.cancel()

        queued = Counter(
            (row["workspace_id"], tuple(row["required_labels"]))
            for row in await db.fetch("SELECT workspace_id, required_labels FROM pending_jobs")
        )
        rows = await db.fetch(
            "SELECT id, workspace_id, provisioner_id, required_labels, count, kind"
            " FROM reservations"
        )
        reserved: Counter[tuple[uuid.UUID, tuple[str, ...]]] = Counter()
        by_provisioner: Counter[uuid.UUID] = Counter()
        for row in rows:
            assert row["kind"] == "launch"
            reserved[(row["workspace_id"], tuple(row["required_labels"]))] += row["count"]
            by_provisioner[row["provisioner_id"]] += row["count"]
        # No unit of demand granted twice: per workspace and label set, reserved <= queued.
        for group_key, units in reserved.items():
            assert units <= queued[group_key], (group_key, units, queued[group_key])
        # No advertised capacity exceeded, in the table and in what was pushed.
        slots = {await _provisioner_id(db, f.token): f.slots for f in fleets}
        for provisioner_id, units in by_provisioner.items():
            assert units <= slots[provisioner_id]
        for fleet in fleets:
            ids = [g["reservation_id"] for g in fleet.grants]
            assert len(ids) == len(set(ids)), "a grant was pushed twice"
            assert sum(g["count"] for g in fleet.grants) <= fleet.slots
        pushed = {g["reservation_id"]: g["count"] for f in fleets for g in f.grants}
        assert pushed == {str(row["id"]): row["count"] for row in rows}
        # Nothing left idle that could serve: provisioner "a" (linux+x64 only) is full, or
        # every group it could serve is fully reserved.
        big = await _provisioner_id(db, fleets[0].token)
        assert by_provisioner[big] == fleets[0].slots or all(
            reserved[key] == count
            for key, count in queued.items()
            if set(key[1]) <= {"linux", "x64"}
        )
        assert len(queued) == 12
    finally:
        await db.close()


async def test_sigkill_replica_holding_the_socket_provisioner_moves_on(
    spawn_daemon: SpawnDaemon, database_url: str
) -> None:
    workspace = uuid.uuid4()
    orchestrator, _ = await orchestrator_and_registration(database_url, workspace)
    db = await asyncpg.connect(database_url)
    try:
        _, raw = await provisioners.create(db, name="fleet", workspace_id=workspace)
        fleet = Fleet(raw, [{"template_key": "k", "labels": ["linux"], "available_slots": 100}])
        async with (
            spawn_daemon(**ROUNDS) as replica_a,
            spawn_daemon(**ROUNDS) as replica_b,
            httpx.AsyncClient(base_url=replica_a.address, timeout=30) as a,
            httpx.AsyncClient(base_url=replica_b.address, timeout=30) as b,
        ):
            key = f"Bearer {orchestrator}"
            async with anyio.create_task_group() as group:
                group.start_soon(fleet.serve, replica_a)
                await _enqueue(b, key, [job_body(workspace) for _ in range(5)])
                assert await _settled(db, [a], 5) == 5
                await _pushed_all(db, [fleet])
                replica_a.signal(signal.SIGKILL)
            before = {g["reservation_id"]: g["count"] for g in fleet.grants}
            assert sum(before.values()) == 5

            async with anyio.create_task_group() as group:
                group.start_soon(fleet.serve, replica_b)
                with anyio.fail_after(20):
                    while fleet.sessions < 2:
                        await anyio.sleep(0.05)
                # Its grants continue: all five units are still its own, outstanding.
                assert {g["reservation_id"]: g["count"] for g in fleet.outstanding} == before
                await _enqueue(b, key, [job_body(workspace) for _ in range(3)])
                assert await _settled(db, [b], 8) == 8
                await _pushed_all(db, [fleet])
                group.cancel_scope.cancel()
        rows = await db.fetch("SELECT id, count FROM reservations WHERE expires_at > now()")
        assert sum(row["count"] for row in rows) == 8
        assert await db.fetchval("SELECT count(*) FROM pending_jobs") == 8
        granted: defaultdict[str, int] = defaultdict(int)
        for grant in fleet.grants:
            granted[grant["reservation_id"]] += grant["count"]
        assert dict(granted) == {str(row["id"]): row["count"] for row in rows}
    finally:
        await db.close()
