"""The input rules (docs/api.md, "Input rules") on a real `controlplane serve` process: a NUL in
a job payload, a payload nested 10,000 deep and an event cursor past xid8 are refused with 400
on a keep-alive connection that the daemon keeps, nothing is stored, and the daemon logs no
traceback."""

from __future__ import annotations

import json
import uuid
from typing import Any

import asyncpg
import httpx
import pytest

from tests.system.conftest import SpawnDaemon
from tests.system.wire import job_body, orchestrator_and_registration

pytestmark = pytest.mark.system

DEPTH = 64  # server.max_json_depth by default


async def test_refusals_keep_the_connection_store_nothing_and_log_no_traceback(
    spawn_daemon: SpawnDaemon, database_url: str
) -> None:
    workspace = uuid.uuid4()
    orchestrator, _ = await orchestrator_and_registration(database_url, workspace)
    headers = {"Authorization": f"Bearer {orchestrator}"}
    connects: list[str] = []

    async def trace(event: str, _info: dict[str, Any]) -> None:
        if event == "connection.connect_tcp.complete":
            connects.append(event)

    nul = {"jobs": [{**job_body(workspace), "payload": {"env": {"FOO": "a\u0000b"}}}]}
    head = json.dumps({"jobs": [job_body(workspace)]})[: -len("}]}")]
    deep = f'{head}, "payload": {{"a": {"[" * 10_000}{"]" * 10_000}}}}}]}}'
    # {"jobs": [{"payload": {"a": [...]}}]}: the payload object is the fourth level.
    fits = {"jobs": [{**job_body(workspace), "payload": {"a": json.loads("[" * 60 + "]" * 60)}}]}
    json_headers = {**headers, "content-type": "application/json"}

    async with (
        spawn_daemon() as daemon,
        httpx.AsyncClient(base_url=daemon.address, timeout=30) as client,
    ):
        assert (await client.get("/healthz", extensions={"trace": trace})).status_code == 200
        assert connects == ["connection.connect_tcp.complete"]

        refused = await client.post("/v1/jobs", json=nul, headers=headers)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"] == {
            "code": "validation-error",
            "message": "body.jobs[0].payload.env.FOO: strings must not contain NUL",
            "details": {"field": "body.jobs[0].payload.env.FOO"},
        }

        refused = await client.post("/v1/jobs", content=deep, headers=json_headers)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"] == {
            "code": "validation-error",
            "message": f"body nests arrays and objects deeper than {DEPTH} levels",
            "details": {"limit": DEPTH},
        }

        refused = await client.get(
            "/v1/events", params={"after": "18446744073709551616.0"}, headers=headers
        )
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == "invalid-cursor"

        accepted = await client.post("/v1/jobs", json=fits, headers=headers)
        assert accepted.status_code == 200, accepted.text
        assert connects == ["connection.connect_tcp.complete"], "a refusal dropped the connection"

    conn = await asyncpg.connect(database_url)
    try:
        stored = await conn.fetch("SELECT job_execution_id FROM pending_jobs")
    finally:
        await conn.close()
    assert [row["job_execution_id"] for row in stored] == [
        uuid.UUID(fits["jobs"][0]["job_execution_id"])
    ]
    log = daemon.log.read_text()
    assert "Traceback" not in log
    assert "http.unhandled" not in log
