"""The provisioned runner's whole path, over a real WebSocket and real HTTP against one daemon:
a provisioner advertises, a job is enqueued, the grant is pushed, the provisioner creates an
instance, the runner boots with its bootstrap token, enrolls, is activated, registers, claims the
job and completes it, and the reservation unit is released exactly once."""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest

from tests.web.conftest import Api
from tests.web.control_client import closed_with, hello, open_session, send
from tests.web.provisioning_client import (
    TEMPLATE,
    activate,
    advertise,
    boot,
    create_instance,
    granted,
    instance_row,
    next_grant,
    until,
    workspace_provisioner,
)

pytestmark = pytest.mark.anyio


async def test_a_grant_becomes_a_runner_that_runs_the_job(api: Api, db: asyncpg.Connection) -> None:
    _, token = await workspace_provisioner(api, db)
    ws = await open_session(api.daemon, token)
    await hello(ws)
    await advertise(ws)
    first = await until(ws, "demand")
    assert first["grants"] == []
    assert first["stats"] == []

    job = api.job(["linux"])
    assert (await api.enqueue(job)).json()["results"][0]["result"] == "enqueued"
    grant = await next_grant(ws)
    assert grant["count"] == 1
    assert grant["labels"] == ["linux"]
    assert grant["workspace_id"] == str(api.workspace)

    instance = await create_instance(ws, grant["reservation_id"], "vm-1")
    # The machine boots: bootstrap token -> control session -> enrollment -> activation.
    _, activation = await boot(api, instance["bootstrap_token"])
    assert activation is not None
    session = await activate(api, activation)

    claimed = await api.request_job(session, wait=5)
    assert claimed.status_code == 200, claimed.text
    assert claimed.json()["job_execution_id"] == job["job_execution_id"]
    done = await api.http.post(
        f"/v1/runners/jobs/{job['job_execution_id']}/complete",
        json={"outcome": "succeeded", "exit_code": 0},
        headers=api.auth(claimed.json()["lease_token"]),
    )
    assert done.status_code == 200, done.text

    row = await instance_row(db, instance["runner_instance_id"])
    assert row["reservation_released_at"] is not None
    assert row["first_claimed_at"] is not None
    assert row["runner_session_id"] is not None
    # One unit, released once: the count-1 reservation is gone, nothing else was touched.
    assert await db.fetchval("SELECT count(*) FROM reservations") == 0
    assert await db.fetchval("SELECT outcome FROM ended_executions") == "succeeded"
    # The one-claim session takes no second job and releases nothing more.
    again = await api.request_job(session, wait=0)
    assert again.status_code == 409
    await ws.close()


async def test_p57_an_idle_warm_runner_is_bound_to_new_demand(
    api: Api, db: asyncpg.Connection
) -> None:
    """Warm pool: the server asks for an idle runner; when a job arrives it binds that runner
    (no launch grant) and the runner's assignment long-poll hands it an activation token."""
    _, token = await workspace_provisioner(api, db)
    ws = await open_session(api.daemon, token)
    await hello(ws)
    await advertise(ws, templates=[{**TEMPLATE, "idle_target": 1}])
    demand = await until(ws, "demand")
    assert demand["warm"] == [{"template_key": "small", "labels": ["linux", "x64"], "count": 1}]
    instance = await create_instance(ws, None, "warm-1")
    control, activation = await boot(api, instance["bootstrap_token"])
    assert activation is None  # warm: nothing to do yet

    job = api.job(["linux"])
    await api.enqueue(job)
    bound = await until(ws, "demand", newly_reserved=1)
    assert bound["grants"] == []
    polled = await api.http.get(
        "/v1/runner-control/assignment", params={"wait_seconds": 5}, headers=api.auth(control)
    )
    assert polled.status_code == 200, polled.text
    activation = polled.json()["activation_token"]
    assert activation is not None
    session = await activate(api, activation)
    claimed = await api.request_job(session, wait=5)
    assert claimed.json()["job_execution_id"] == job["job_execution_id"]
    row = await instance_row(db, instance["runner_instance_id"])
    assert row["launch_kind"] == "warm"
    assert row["reservation_released_at"] is not None
    assert await db.fetchval("SELECT count(*) FROM reservations") == 0
    await ws.close()


async def test_reconnecting_provisioner_finds_its_outstanding_grants(
    api: Api, db: asyncpg.Connection
) -> None:
    _, token = await workspace_provisioner(api, db)
    first = await open_session(api.daemon, token)
    await hello(first)
    await advertise(first)
    await api.enqueue(api.job(["linux"]), api.job(["linux"]))
    grant = await next_grant(first)

    second = await open_session(api.daemon, token)
    welcome = await hello(second, "h2")
    outstanding = {g["reservation_id"]: g["count"] for g in welcome["outstanding"]}
    assert outstanding.get(grant["reservation_id"]) == grant["count"]
    code, _ = await closed_with(first)
    assert code == 4409
    # The new session's rounds count the old grants as its own: nothing is granted twice.
    await advertise(second)
    demand = await until(second, "demand")
    granted = sum(g["count"] for g in demand["grants"]) + sum(outstanding.values())
    assert granted == 2
    assert await db.fetchval("SELECT sum(count) FROM reservations") == 2
    await second.close()


async def test_requests_before_hello_and_bad_requests_change_nothing(
    api: Api, db: asyncpg.Connection
) -> None:
    _, token = await workspace_provisioner(api, db)
    ws = await open_session(api.daemon, token)
    await send(
        ws,
        {"type": "advertise", "request_id": "a0", "templates": [TEMPLATE], "max_reservations": 1},
    )
    code, _ = await closed_with(ws)
    assert code == 4412
    assert await db.fetchval("SELECT count(*) FROM provisioner_templates") == 0

    ws = await open_session(api.daemon, token)
    await hello(ws)
    # Duplicate template keys: an error answer, nothing written, the session stays open.
    await send(
        ws,
        {
            "type": "advertise",
            "request_id": "dup",
            "templates": [TEMPLATE, TEMPLATE],
            "max_reservations": 1,
        },
    )
    error = await until(ws, "error")
    assert error["request_id"] == "dup"
    assert error["code"] == "validation-error"
    assert await db.fetchval("SELECT count(*) FROM provisioner_templates") == 0
    # Assignment to a reservation that does not exist.
    await send(
        ws,
        {
            "type": "assign",
            "request_id": "as1",
            "reservation_id": "00000000-0000-7000-8000-000000000000",
            "runner_instance_ids": ["00000000-0000-7000-8000-000000000001"],
        },
    )
    error = await until(ws, "error")
    assert error["code"] == "reservation-not-found"
    # Creating instances for an unknown reservation: nothing created, flagged unavailable.
    await send(
        ws,
        {
            "type": "create_instances",
            "request_id": "ci",
            "instances": [{"reservation_id": "00000000-0000-7000-8000-000000000000"}],
        },
    )
    created = await until(ws, "instances_created")
    assert created["runner_instances"] == []
    assert created["reservation_unavailable"] is True
    assert await db.fetchval("SELECT count(*) FROM runner_instances") == 0
    await ws.close()


@pytest.mark.parametrize(
    "frame",
    [
        {"type": "advertise", "request_id": "x", "templates": [], "max_reservations": 1001},
        {
            "type": "advertise",
            "request_id": "x",
            "templates": [{**TEMPLATE, "template_key": f"k{i}"} for i in range(1001)],
            "max_reservations": 1,
        },
        {
            "type": "advertise",
            "request_id": "x",
            "templates": [{**TEMPLATE, "labels": [f"l{i}" for i in range(21)]}],
            "max_reservations": 1,
        },
        {"type": "advertise", "request_id": "x", "templates": [], "max_reservations": 1, "z": 1},
        {"type": "create_instances", "request_id": "x", "instances": []},
        {"type": "create_instances", "request_id": "x", "instances": [{}] * 501},
        {"type": "report", "request_id": "x", "events": []},
        {"type": "launch_everything", "request_id": "x"},
    ],
    ids=[
        "max-over-1000",
        "templates-over-1000",
        "21-labels",
        "unknown-field",
        "empty-batch",
        "batch-of-501",
        "no-events",
        "type",
    ],
)
async def test_p69_s90_s93_out_of_range_and_unknown_frames_close_4400_and_change_nothing(
    api: Api, db: asyncpg.Connection, frame: dict[str, Any]
) -> None:
    _, token = await workspace_provisioner(api, db)
    ws = await open_session(api.daemon, token)
    await hello(ws)
    await send(ws, frame)
    code, _ = await closed_with(ws)
    assert code in (4400, 1009)  # 1001 templates are over the frame limit
    assert await db.fetchval("SELECT count(*) FROM provisioner_templates") == 0
    assert await db.fetchval("SELECT count(*) FROM runner_instances") == 0


async def test_s90_an_exhausted_reservation_gives_fewer_instances_and_says_so(
    api: Api, db: asyncpg.Connection
) -> None:
    ws, grant = await granted(api, db)
    assert grant["count"] == 1
    entry = {"reservation_id": grant["reservation_id"], "template_key": "small"}
    await send(ws, {"type": "create_instances", "request_id": "ci", "instances": [entry] * 3})
    created = await until(ws, "instances_created", request_id="ci")
    assert len(created["runner_instances"]) == 1
    assert created["reservation_unavailable"] is True
    assert await db.fetchval("SELECT count(*) FROM runner_instances") == 1
    await ws.close()


async def test_s91_assign_refuses_duplicates_and_unknown_expired_or_unenrolled_targets(
    api: Api, db: asyncpg.Connection
) -> None:
    """Refusals are error answers on the session (the request's id, the catalogue's code); the
    session stays open and nothing is assigned."""
    ws, grant = await granted(api, db)
    reservation = grant["reservation_id"]
    instance = await create_instance(ws, reservation, "vm-s91")  # created, never enrolled

    async def refused(request_id: str, reservation_id: str, runner_ids: list[str]) -> str:
        frame = {"type": "assign", "request_id": request_id, "reservation_id": reservation_id,
                 "runner_instance_ids": runner_ids}  # fmt: skip
        await send(ws, frame)
        error = await until(ws, "error", request_id=request_id)
        return str(error["code"])

    unknown = "00000000-0000-7000-8000-000000000000"
    ids = [instance["runner_instance_id"]]
    assert await refused("dup", reservation, ids * 2) == "validation-error"
    assert await refused("unknown", unknown, ids) == "reservation-not-found"
    assert await refused("unenrolled", reservation, ids) == "runner-instance-not-assignable"
    await db.execute("UPDATE reservations SET expires_at = now() - interval '1 second'")
    assert await refused("expired", reservation, ids) == "reservation-expired"
    assigned = "SELECT count(*) FROM runner_instances WHERE assigned_at IS NOT NULL"
    assert await db.fetchval(assigned) == 0
    await ws.close()


async def test_p69_no_or_wrong_credentials_close_4401(api: Api) -> None:
    for token in (None, api.orchestrator_key):
        ws = await open_session(api.daemon, token)
        code, _ = await closed_with(ws)
        assert code == 4401
