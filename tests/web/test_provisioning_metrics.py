"""The provisioning metrics: each is exposed, and moves when its event happens, driven through
real WebSocket control sessions and real HTTP against one daemon (scraped like Prometheus)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import asyncpg
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import ClientConnection

from tests import provisioning
from tests.web.conftest import Api
from tests.web.control_client import hello, open_session, send
from tests.web.metrics_client import Samples
from tests.web.metrics_client import mover as _mover
from tests.web.metrics_client import scrape as _scrape
from tests.web.provisioning_client import (
    activate,
    advertise,
    boot,
    create_instance,
    next_grant,
    until,
    workspace_provisioner,
)

pytestmark = pytest.mark.anyio

PROVISIONING = {
    "controlplane_runner_reports",
    "controlplane_runner_bootstrap_exchanges",
    "controlplane_runner_activation_not_issued",
    "controlplane_runner_control_heartbeats",
    "controlplane_runner_instances_reaped",
    "controlplane_runner_reconciles",
    "controlplane_runner_instances_absent_terminated",
    "controlplane_terminate_intents_issued",
    "controlplane_terminate_intents_honored",
    "controlplane_runner_activation_outcomes",
    "controlplane_reservation_units_released",
    "controlplane_reservation_promotion_failures",
    "controlplane_reservation_capacity_failures",
    "controlplane_runner_assignments_rejected",
    "controlplane_runner_created_to_control_session_seconds",
    "controlplane_runner_activation_to_first_claim_seconds",
    "controlplane_job_queue_seconds",
    "controlplane_allocation_rounds",
    "controlplane_allocation_round_seconds",
    "controlplane_demand_pushes",
    "controlplane_provisioner_control_sessions",
    "controlplane_runner_instances_by_phase",
    "controlplane_runner_instances_by_phase_oldest_age_seconds",
    "controlplane_runner_control_session_to_assignment_seconds",
    "controlplane_runner_assignment_to_activation_seconds",
    "controlplane_runner_count_divergence",
    "controlplane_rate_limit_checks",
    "controlplane_rate_limit_prune_failures",
    "controlplane_runner_instances_enrolled_without_recent_report",
}


async def _until_moved(api: Api, before: Samples, name: str, **labels: str) -> Samples:
    """Scrape until the sample moved (maintenance and allocation rounds run on their own)."""
    with anyio.fail_after(10):
        while True:
            after = await _scrape(api)
            if _mover(before, after)(name, **labels) > 0:
                return after
            await anyio.sleep(0.05)


async def test_every_provisioning_metric_is_exposed(api: Api) -> None:
    response = await api.http.get("/metrics")
    exposed = {family.name for family in text_string_to_metric_families(response.text)}
    assert exposed >= PROVISIONING


async def _request(ws: ClientConnection, message: dict[str, Any], answer: str) -> dict[str, Any]:
    await send(ws, message)
    return await until(ws, answer, request_id=message["request_id"])


async def test_j32_the_provisioned_path_moves_its_metrics(api: Api, db: asyncpg.Connection) -> None:
    """Grant, create (one refused unit), boot, heartbeat, enroll, a refused assignment,
    activation, the first claim (queue time labelled ec2/demand: J-32), a terminal report and a
    reconcile."""
    before = await _scrape(api)
    _, token = await workspace_provisioner(api, db)
    ws = await open_session(api.daemon, token)
    await hello(ws)
    await advertise(ws)
    await until(ws, "demand")
    during = await _scrape(api)
    assert during[("controlplane_provisioner_control_sessions", ())] >= 1

    job = api.job(["linux"])
    await api.enqueue(job)
    grant = await next_grant(ws)
    missing = str(uuid.uuid4())
    created = await _request(
        ws,
        {
            "type": "create_instances", "request_id": "c1", "provider_kind": "ec2",
            "instances": [{"template_key": "small", "reservation_id": grant["reservation_id"]},
                          {"template_key": "small", "reservation_id": missing}],
        },
        "instances_created",
    )  # fmt: skip
    [instance] = created["runner_instances"]
    attached = await _request(
        ws,
        {
            "type": "attach_provider", "request_id": "p1",
            "runner_instance_id": instance["runner_instance_id"], "provider_runner_id": "vm-1",
        },
        "attached",
    )  # fmt: skip
    assert attached["attached"] is True

    bad = await api.http.post(
        "/v1/runner-enrollment/exchange", json={"bootstrap_token": "cp_rbt_nope"}
    )
    assert bad.status_code == 401
    exchanged = await api.http.post(
        "/v1/runner-enrollment/exchange", json={"bootstrap_token": instance["bootstrap_token"]}
    )
    control = api.auth(exchanged.json()["control_session_token"])
    assert (await api.http.post("/v1/runner-control/heartbeat", headers=control)).is_success
    enrolled = await api.http.post(
        "/v1/runner-control/enrollment",
        json={"labels": ["linux", "x64"], "provider_kind": "ec2", "protocol_version": "1"},
        headers=control,
    )
    activation = enrolled.json()["activation_token"]
    assert activation is not None
    refused = await _request(
        ws,
        {
            "type": "assign", "request_id": "a2", "reservation_id": str(uuid.uuid4()),
            "runner_instance_ids": [instance["runner_instance_id"]],
        },
        "error",
    )  # fmt: skip
    assert refused["code"] == "reservation-not-found"

    session = await activate(api, activation)
    claimed = await api.request_job(session, wait=5)  # a long poll: the dispatcher claims
    assert claimed.status_code == 200, claimed.text
    now = datetime.now(UTC).isoformat()
    reported = await _request(
        ws,
        {
            "type": "report", "request_id": "r1",
            "events": [{"provider_runner_id": "vm-1", "state": "terminated", "reported_at": now}],
        },
        "reported",
    )  # fmt: skip
    assert reported["accepted"] == 1
    reconciled = await _request(
        ws,
        {"type": "reconcile", "request_id": "k1", "observed_provider_runner_ids": ["vm-1"]},
        "reconciled",
    )
    assert reconciled["runners"][0]["desired_intent"] == "terminate"  # it is terminal
    after = await _scrape(api)
    await ws.close()

    moved = _mover(before, after)
    assert (
        moved("controlplane_reservation_capacity_failures_total", reason="reservation-not-found")
        == 1
    )
    assert moved("controlplane_runner_bootstrap_exchanges_total", outcome="rejected") == 1
    assert moved("controlplane_runner_bootstrap_exchanges_total", outcome="accepted") == 1
    labels = {"provider": "ec2", "launch_kind": "demand"}
    assert moved("controlplane_runner_created_to_control_session_seconds_count", **labels) == 1
    assert (
        moved("controlplane_runner_control_session_to_assignment_seconds_count", **labels,
              surface="enrollment")
        == 1
    )  # fmt: skip
    assert moved("controlplane_runner_assignment_to_activation_seconds_count", **labels) == 1
    assert moved("controlplane_runner_control_heartbeats_total") == 1
    assert (
        moved(
            "controlplane_runner_assignments_rejected_total",
            reason="reservation-not-found",
            surface="provisioner",
        )
        == 1
    )
    assert moved("controlplane_job_queue_seconds_count", **labels) == 1
    assert moved("controlplane_runner_activation_to_first_claim_seconds_count", **labels) == 1
    assert moved("controlplane_runner_reports_total", state="terminated") == 1
    assert moved("controlplane_runner_reconciles_total") == 1
    assert (
        moved("controlplane_terminate_intents_issued_total", surface="reconcile",
              reason="terminal-state")
        == 1
    )  # fmt: skip
    assert moved("controlplane_allocation_rounds_total", outcome="ok") >= 2
    assert moved("controlplane_allocation_round_seconds_count") >= 2
    assert moved("controlplane_demand_pushes_total", outcome="sent") >= 2


async def test_j31_queue_time_of_a_manual_runner(api: Api, db: asyncpg.Connection) -> None:
    before = await _scrape(api)
    session = await api.register(["linux"])
    await api.enqueue(api.job(["linux"]))
    await db.execute("UPDATE pending_jobs SET created_at = now() - interval '60 seconds'")
    assert (await api.request_job(session, wait=5)).status_code == 200
    moved = _mover(before, await _scrape(api))
    labels = {"provider": "unknown", "launch_kind": "manual"}
    assert moved("controlplane_job_queue_seconds_count", **labels) == 1
    assert 60 <= moved("controlplane_job_queue_seconds_sum", **labels) < 120
    assert moved("controlplane_job_queue_seconds_bucket", le="30.0", **labels) == 0
    assert moved("controlplane_job_queue_seconds_bucket", le="120.0", **labels) == 1


async def test_a_failed_promotion_then_a_rebound(api: Api, db: asyncpg.Connection) -> None:
    """A demand runner whose reservation expired before it enrolled is not promoted; it stays
    idle and is bound to the next demand of its workspace (activation outcome `rebound`)."""
    before = await _scrape(api)
    _, token = await workspace_provisioner(api, db)
    ws = await open_session(api.daemon, token)
    await hello(ws)
    await advertise(ws)
    await api.enqueue(api.job(["linux"]))
    grant = await next_grant(ws)
    instance = await create_instance(ws, grant["reservation_id"], "vm-r")
    await db.execute("UPDATE reservations SET expires_at = now() - interval '1 second'")
    control, activation = await boot(api, instance["bootstrap_token"])
    assert activation is None
    await api.enqueue(api.job(["linux"]))
    after = await _until_moved(
        api, before, "controlplane_runner_activation_outcomes_total", outcome="rebound"
    )
    await ws.close()
    moved = _mover(before, after)
    failed = {
        reason: moved("controlplane_reservation_promotion_failures_total", reason=reason)
        for reason in ("reservation-expired", "reservation-not-found")
    }
    assert sum(failed.values()) == 1  # expired, or not found once maintenance deleted it
    [reason] = [r for r, n in failed.items() if n]
    rejected = moved("controlplane_runner_assignments_rejected_total", reason=reason,
                     surface="enrollment")  # fmt: skip
    assert rejected == 1
    del control


async def test_maintenance_reaps_stale_runners_and_counts_phases(
    maintained: Api, db: asyncpg.Connection
) -> None:
    api = maintained
    before = await _scrape(api)
    stale = await provisioning.provisioner(db, api.workspace)  # never seen: stale at once
    hour = timedelta(hours=1)
    await provisioning.runner(db, stale.id, age=hour, control_session=None)
    fresh = await provisioning.provisioner(db, api.workspace)
    await db.execute("UPDATE provisioner_tokens SET last_seen_at = now() WHERE id = $1", fresh.id)
    await provisioning.runner(db, fresh.id, state="starting", control_session=None)
    after = await _until_moved(api, before, "controlplane_runner_instances_reaped_total")
    assert _mover(before, after)("controlplane_runner_instances_reaped_total") == 1
    phase = tuple(sorted({"phase": "control_session", "provider": "unknown",
                          "launch_kind": "demand"}.items()))  # fmt: skip
    with anyio.fail_after(10):
        while (after := await _scrape(api)).get(
            ("controlplane_runner_instances_by_phase", phase)
        ) != 1:
            await anyio.sleep(0.05)
    assert after[("controlplane_runner_instances_by_phase_oldest_age_seconds", phase)] >= 0


async def test_p68_activation_timeout_intents_are_repeated_but_counted_reaped_once(
    api: Api, db: asyncpg.Connection
) -> None:
    """We differ in when an intent is told (on a push, not a poll), not in how it is counted: a
    second push still carrying the intent (an advertisement forces one) counts neither `reaped`
    nor `issued` again."""
    before = await _scrape(api)
    _, token = await workspace_provisioner(api, db)
    ws = await open_session(api.daemon, token)
    await hello(ws)
    await advertise(ws)
    job = api.job(["linux"])
    await api.enqueue(job)
    grant = await next_grant(ws)
    instance = await create_instance(ws, grant["reservation_id"], "vm-late")
    _, activation = await boot(api, instance["bootstrap_token"])
    assert activation is not None  # assigned, never activated
    # The job ends: no demand is left to bind the runner to again.
    ended = await api.http.post(
        f"/v1/jobs/{job['job_execution_id']}/outcome",
        json={"status": "cancelled"},
        headers=api.auth(api.orchestrator_key),
    )
    assert ended.status_code == 200, ended.text
    await db.execute("UPDATE reservations SET expires_at = now() - interval '1 second'")
    await db.execute("UPDATE runner_instances SET created_at = now() - interval '1 hour'")
    with anyio.fail_after(10):
        while "vm-late" not in (await until(ws, "demand"))["terminate_provider_runner_ids"]:
            pass
    await advertise(ws)  # a forced push: the same intent again, now a retry
    with anyio.fail_after(10):
        while "vm-late" not in (await until(ws, "demand"))["terminate_provider_runner_ids"]:
            pass
    now = datetime.now(UTC).isoformat()
    await _request(
        ws,
        {
            "type": "report", "request_id": "r1",
            "events": [
                {"provider_runner_id": "vm-late", "state": "terminated", "reported_at": now}
            ],
        },
        "reported",
    )  # fmt: skip
    after = await _scrape(api)
    await ws.close()
    moved = _mover(before, after)
    timeout = "activation-timeout"
    assert (
        moved("controlplane_terminate_intents_issued_total", surface="demand", reason=timeout) == 1
    )
    assert moved("controlplane_runner_activation_outcomes_total", outcome="reaped") == 1
    assert moved("controlplane_terminate_intents_honored_total", reason=timeout) == 1


async def test_reconcile_terminates_absent_runners(api: Api, db: asyncpg.Connection) -> None:
    before = await _scrape(api)
    provisioner_id, token = await workspace_provisioner(api, db)
    await provisioning.runner(
        db, provisioner_id, provider_runner_id="vm-gone", workspace_id=api.workspace,
        age=timedelta(hours=1),
    )  # fmt: skip
    ws = await open_session(api.daemon, token)
    await hello(ws)
    answer = await _request(
        ws, {"type": "reconcile", "request_id": "k1", "observed_provider_runner_ids": ["vm-x"]},
        "reconciled",
    )  # fmt: skip
    await ws.close()
    assert answer["terminated_absent_provider_runner_ids"] == ["vm-gone"]
    moved = _mover(before, await _scrape(api))
    assert moved("controlplane_runner_reconciles_total") == 1
    assert moved("controlplane_runner_instances_absent_terminated_total") == 1
    assert moved("controlplane_reservation_units_released_total", source="reconcile") == 0
