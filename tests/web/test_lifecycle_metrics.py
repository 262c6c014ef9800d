"""Metrics of issue 17 that move with their events, over a real control session and real HTTP:
count divergence (spec provisioning 3.7), the assignment lag on the provisioner surface, and the
enrolled-without-recent-report gauge that maintenance keeps."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import anyio
import asyncpg
import pytest

from tests import provisioning
from tests.web import conftest
from tests.web.conftest import Api
from tests.web.control_client import hello, open_session, send
from tests.web.metrics_client import mover, scrape
from tests.web.provisioning_client import (
    TEMPLATE,
    advertise,
    create_instance,
    granted,
    until,
    workspace_provisioner,
)

pytestmark = pytest.mark.anyio

DIVERGENCE = "controlplane_runner_count_divergence_total"


def _ad(starting: int, running: int) -> dict[str, Any]:
    return {**TEMPLATE, "starting": starting, "running": running}


async def test_p58_divergence_is_counted_once_per_advertisement(
    api: Api, db: asyncpg.Connection
) -> None:
    """The advertisement is the provisioner's snapshot: it is compared when it arrives, and the
    rounds that follow (an enqueue, a grant) compare nothing again."""
    before = await scrape(api)
    ws, grant = await granted(api, db, templates=[_ad(starting=2, running=1)])
    moved = mover(before, await scrape(api))
    assert moved(DIVERGENCE, state="starting", direction="advertised-higher", template_key="") == 2
    assert moved(DIVERGENCE, state="running", direction="advertised-higher", template_key="") == 1
    assert moved(DIVERGENCE, state="starting", direction="backend-higher", template_key="") == 0

    await create_instance(ws, grant["reservation_id"], "vm-58")  # one stored `starting`
    before = await scrape(api)
    await advertise(ws, templates=[_ad(starting=0, running=0)])
    moved = mover(before, await scrape(api))
    assert moved(DIVERGENCE, state="starting", direction="backend-higher", template_key="") == 1
    assert moved(DIVERGENCE, state="running", direction="advertised-higher", template_key="") == 0

    before = await scrape(api)
    await advertise(ws, templates=[_ad(starting=1, running=0)])  # agrees: nothing counted
    after = await scrape(api)
    assert {k: v for k, v in after.items() if k[0] == DIVERGENCE} == {
        k: v for k, v in before.items() if k[0] == DIVERGENCE
    }
    await ws.close()


@pytest.fixture
async def by_template(database_url: str) -> AsyncIterator[Api]:
    async for api in conftest.api_with(database_url, provisioners__divergence_by_template=True):
        yield api


async def test_p59_s103_the_template_key_label_only_with_the_flag(
    by_template: Api, db: asyncpg.Connection
) -> None:
    """With `provisioners.divergence_by_template` the label names the template; without it
    (the test above) it is empty, which Prometheus reads as no label."""
    api = by_template
    _, token = await workspace_provisioner(api, db)
    ws = await open_session(api.daemon, token)
    await hello(ws)
    before = await scrape(api)
    await advertise(ws, templates=[_ad(starting=3, running=0)])
    moved = mover(before, await scrape(api))
    labels = {"state": "starting", "direction": "advertised-higher"}
    assert moved(DIVERGENCE, **labels, template_key="small") == 3
    assert moved(DIVERGENCE, **labels, template_key="") == 0
    await ws.close()


async def test_an_assign_request_observes_its_lag_once_and_a_replay_not_again(
    api: Api, db: asyncpg.Connection
) -> None:
    p, token = await workspace_provisioner(api, db)
    ws = await open_session(api.daemon, token)
    await hello(ws)
    runner_id = await provisioning.runner(db, p, launch_kind="warm")  # enrolled, idle
    reservation = await provisioning.reservation(db, workspace_id=api.workspace, provisioner_id=p)
    before = await scrape(api)
    frame = {"type": "assign", "reservation_id": str(reservation),
             "runner_instance_ids": [str(runner_id)]}  # fmt: skip
    for request_id in ("first", "replay"):
        await send(ws, {**frame, "request_id": request_id})
        assigned = await until(ws, "assigned", request_id=request_id)
        assert assigned["runner_instance_ids"] == [str(runner_id)]
    moved = mover(before, await scrape(api))
    labels = {"provider": "unknown", "launch_kind": "warm"}
    histogram = "controlplane_runner_control_session_to_assignment_seconds_count"
    assert moved(histogram, **labels, surface="provisioner") == 1
    assert moved(histogram, **labels, surface="enrollment") == 0
    await ws.close()


async def test_the_enrolled_without_recent_report_gauge_follows_its_runners(
    maintained: Api, db: asyncpg.Connection
) -> None:
    api = maintained
    p = await provisioning.provisioner(db, api.workspace)
    await db.execute("UPDATE provisioner_tokens SET last_seen_at = now() WHERE id = $1", p.id)
    quiet = timedelta(hours=1)  # past the 300 s stale-runner threshold
    await provisioning.runner(db, p.id, reported_age=quiet)  # counted
    await provisioning.runner(db, p.id)  # reported just now
    await provisioning.runner(db, p.id, reported_age=quiet, workspace_id=api.workspace)
    await provisioning.runner(db, p.id, reported_age=quiet, control_session="expired")
    await provisioning.runner(db, p.id, reported_age=quiet, state="starting")
    gauge = ("controlplane_runner_instances_enrolled_without_recent_report", ())
    with anyio.fail_after(10):
        while (await scrape(api)).get(gauge) != 1:
            await anyio.sleep(0.05)
    await db.execute("UPDATE runner_instances SET reported_at = now()")
    with anyio.fail_after(10):
        while (await scrape(api)).get(gauge) != 0:
            await anyio.sleep(0.05)
