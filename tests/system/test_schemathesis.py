"""Schemathesis against a daemon process, every check on, one credential of each kind.

The published document must describe what the server enforces: no 5xx, every response as
documented, every schema-valid request accepted and every schema-violating one refused. One run
covers every operation; each is sent with the credential its route takes (the config file's
per-operation headers), with real ids where a route acts on one (revoke, heartbeat, complete)
and a real page cursor (an opaque cursor cannot be generated). Generation is deterministic and
capped per operation (MAX_EXAMPLES) so that the run stays near a minute on two cores; the long-poll
maxima of the daemon are 1 s so that a held request costs at most that, and the document it
serves says so.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import anyio
import asyncpg
import httpx
import pytest

from controlplane.store import credentials, provisioners
from tests.provisioning import open_control_session, runner
from tests.system.conftest import SpawnDaemon

pytestmark = [pytest.mark.system, pytest.mark.schemathesis]

MAX_EXAMPLES = 5  # per operation: about 1,600 requests, 45 s of the run on two cores
SEED = 20261201  # deterministic generation needs none; fixed for whatever still draws on one
ROOT = Path(__file__).resolve().parents[2]
SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")
HELD_FOR_A_SECOND = {
    "CONTROLPLANE_RUNNERS_LONG_POLL_MAX_SECONDS": "1",
    "CONTROLPLANE_RUNNERS_CANCEL_WAIT_MAX_SECONDS": "1",
    "CONTROLPLANE_PROVISIONERS_ASSIGNMENT_POLL_MAX_WAIT_SECONDS": "1",
}


@dataclass
class Fixture:
    """Credentials of every kind and the ids the fuzzed routes act on."""

    admin: str
    orchestrator: str
    registration: str
    session: str
    heartbeat_lease: str
    heartbeat_execution: str
    complete_lease: str
    complete_execution: str
    provisioner: str
    control_session: str
    api_key_id: str
    registration_token_id: str
    provisioner_token_id: str
    page_cursor: str
    workspace: str  # the fuzz workspace, and its admin key and spare tokens
    workspace_admin: str
    workspace_registration_token_id: str
    workspace_provisioner_token_id: str


def _job(workspace: uuid.UUID) -> dict[str, object]:
    return {
        "job_execution_id": str(uuid.uuid4()),
        "job_id": str(uuid.uuid4()),
        "workflow_run_id": str(uuid.uuid4()),
        "workflow_run_attempt_id": str(uuid.uuid4()),
        "workspace_id": str(workspace),
        "project_id": str(uuid.uuid4()),
        "required_labels": ["linux"],
        "queued_at": datetime.now(UTC).isoformat(),
    }


async def _fixture(database_url: str, address: str) -> Fixture:
    workspace = uuid.uuid4()
    conn = await asyncpg.connect(database_url)
    try:
        _, admin = await credentials.create_api_key(conn, kind="admin", name="fuzz admin")
        _, orchestrator = await credentials.create_api_key(conn, kind="orchestrator", name="o")
        _, registration = await credentials.create_manual_token(
            conn, workspace_id=workspace, name="fuzz runners"
        )
        # Revoked by the fuzzer: none of them is a credential the run uses.
        spare_key, _ = await credentials.create_api_key(conn, kind="orchestrator", name="spare")
        spare_token, _ = await credentials.create_manual_token(
            conn, workspace_id=workspace, name="spare"
        )
        spare_provisioner, _ = await provisioners.create(conn, name="spare", workspace_id=None)
        _, workspace_admin = await credentials.create_api_key(
            conn, kind="workspace-admin", name="fuzz team", workspace_id=workspace
        )
        own_token, _ = await credentials.create_manual_token(
            conn, workspace_id=workspace, name="own spare"
        )
        own_provisioner, _ = await provisioners.create(conn, name="own", workspace_id=workspace)
        found, provisioner = await provisioners.create(conn, name="fuzz", workspace_id=None)
        instance = await runner(conn, found.id, control_session=None)
        control_session = await open_control_session(conn, instance, found.id)
    finally:
        await conn.close()
    async with httpx.AsyncClient(base_url=address, timeout=30) as http:

        def auth(token: str) -> dict[str, str]:
            return {"Authorization": f"Bearer {token}"}

        registered = await http.post(
            "/v1/runners/register", json={"labels": ["linux"]}, headers=auth(registration)
        )
        session = registered.json()["session_token"]
        enqueued = await http.post(
            "/v1/jobs",
            json={"jobs": [_job(workspace), _job(workspace)]},
            headers=auth(orchestrator),
        )
        assert enqueued.status_code == 200, enqueued.text
        leases = []
        for _ in range(2):
            claimed = await http.post("/v1/runners/jobs/request?wait=0", headers=auth(session))
            assert claimed.status_code == 200, claimed.text
            leases.append((claimed.json()["lease_token"], claimed.json()["job_execution_id"]))
        page = await http.get("/v1/admin/api-keys?limit=1", headers=auth(admin))
        cursor = page.json()["next_cursor"]
        assert cursor is not None
    return Fixture(
        admin=admin,
        orchestrator=orchestrator,
        registration=registration,
        session=session,
        heartbeat_lease=leases[0][0],
        heartbeat_execution=leases[0][1],
        complete_lease=leases[1][0],
        complete_execution=leases[1][1],
        provisioner=provisioner,
        control_session=control_session,
        api_key_id=str(spare_key.id),
        registration_token_id=str(spare_token.id),
        provisioner_token_id=str(spare_provisioner.id),
        page_cursor=cursor,
        workspace=str(workspace),
        workspace_admin=workspace_admin,
        workspace_registration_token_id=str(own_token.id),
        workspace_provisioner_token_id=str(own_provisioner.id),
    )


def _operations(found: Fixture) -> list[tuple[str, str, dict[str, str]]]:
    """(path regex, token, fixed parameters) per group of operations."""
    own = {"path.workspace_id": found.workspace}
    return [
        (
            "^/v1/admin/provisioner-tokens/[{]id[}]/eligibility$",
            found.admin,
            {"path.id": found.provisioner_token_id},
        ),
        ("^/v1/admin/(?!.*/revoke$)", found.admin, {"query.cursor": found.page_cursor}),
        ("^/v1/admin/api-keys/[{]id[}]/revoke$", found.admin, {"path.id": found.api_key_id}),
        (
            "^/v1/admin/registration-tokens/[{]id[}]/revoke$",
            found.admin,
            {"path.id": found.registration_token_id},
        ),
        (
            "^/v1/admin/provisioner-tokens/[{]id[}]/revoke$",
            found.admin,
            {"path.id": found.provisioner_token_id},
        ),
        (
            "^/v1/workspaces/[{]workspace_id[}]/registration-tokens/[{]id[}]/revoke$",
            found.workspace_admin,
            {**own, "path.id": found.workspace_registration_token_id},
        ),
        (
            "^/v1/workspaces/[{]workspace_id[}]/provisioner-tokens/[{]id[}]/revoke$",
            found.workspace_admin,
            {**own, "path.id": found.workspace_provisioner_token_id},
        ),
        ("^/v1/workspaces/", found.workspace_admin, {**own, "query.cursor": found.page_cursor}),
        ("^/v1/(jobs|events|job-counts)", found.orchestrator, {}),
        ("^/v1/runners/register$", found.registration, {}),
        ("^/v1/runners/jobs/request$", found.session, {}),
        (
            "^/v1/runners/jobs/[{]job_execution_id[}]/heartbeat$",
            found.heartbeat_lease,
            {"path.job_execution_id": found.heartbeat_execution},
        ),
        (
            "^/v1/runners/jobs/[{]job_execution_id[}]/complete$",
            found.complete_lease,
            {"path.job_execution_id": found.complete_execution},
        ),
        ("^/v1/provisioners/", found.provisioner, {}),
        ("^/v1/runner-control/", found.control_session, {}),
    ]


def _config(found: Fixture) -> str:
    lines = ["[generation]", "allow-x00 = false", ""]
    for regex, token, parameters in _operations(found):
        # The groups are disjoint: the first entry an operation matches is the one it takes.
        lines += [
            "[[operations]]",
            f"include-path-regex = {json.dumps(regex)}",
            f"headers = {{ Authorization = {json.dumps('Bearer ' + token)} }}",
        ]
        if parameters:
            pairs = ", ".join(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in parameters.items())
            lines.append(f"parameters = {{ {pairs} }}")
        lines.append("")
    return "\n".join(lines)


async def test_schemathesis_finds_nothing_with_every_check_and_every_credential(
    database_url: str, spawn_daemon: SpawnDaemon, tmp_path: Path
) -> None:
    async with spawn_daemon(**HELD_FOR_A_SECOND) as daemon:
        found = await _fixture(database_url, daemon.address)
        config = tmp_path / "schemathesis.toml"
        config.write_text(_config(found))
        command = [
            str(SCHEMATHESIS),
            "--config-file",
            str(config),
            "run",
            f"{daemon.address}/openapi.json",
            "--checks",
            "all",
            "--seed",
            str(SEED),
            "--generation-deterministic",
            "--max-examples",
            str(MAX_EXAMPLES),
            "--generation-allow-x00",
            "false",
            "--workers",
            "1",
            "--request-timeout",
            "20",
            "--no-color",
        ]
        environment = {
            **os.environ,
            "SCHEMATHESIS_HOOKS": "tests.system.schemathesis_hooks",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        with anyio.fail_after(600):
            ran = await anyio.run_process(
                command, env=environment, check=False, cwd=tmp_path, stderr=None
            )
    report = ran.stdout.decode()
    print(report)  # shown by pytest on failure: every finding with a curl line to reproduce it
    assert ran.returncode == 0, report
    assert "Tested: 54" in report, report  # every HTTP operation of the document
    # Each kind of credential was taken: an operation that answered only 401 would say so.
    assert "Authentication failed" not in report, report
