"""`controlplane enqueue`, `status` and `runner` argument handling, as processes."""

from __future__ import annotations

import json
import os
import signal
import uuid

import anyio
import asyncpg
import pytest

from tests import provisioning
from tests.system import agents
from tests.system.conftest import SpawnDaemon

pytestmark = pytest.mark.system


async def test_help_describes_the_client_commands() -> None:
    top = await agents.run_client("--help")
    for command in ("runner", "enqueue", "status"):
        assert command in top.stdout
    runner = await agents.run_client("runner", "--help")
    for option in ("--url", "--token", "--labels", "--once", "--max-idle-seconds"):
        assert option in runner.stdout
    assert "CONTROLPLANE_RUNNER_TOKEN" in runner.stdout
    enqueue = await agents.run_client("enqueue", "--help")
    for option in ("--key", "--workspace", "--wait", "CONTROLPLANE_ORCHESTRATOR_KEY"):
        assert option in enqueue.stdout
    status = await agents.run_client("status", "--help")
    assert "CONTROLPLANE_ADMIN_KEY" in status.stdout


async def test_enqueue_prints_the_execution_id_and_queues_the_quoted_command(
    spawn_daemon: SpawnDaemon, database_url: str
) -> None:
    creds = await agents.make_credentials(database_url)
    async with spawn_daemon() as daemon:
        queued = await agents.enqueue(daemon.address, creds, "echo", "it's", "a test")
        assert queued.returncode == 0, queued.stderr
        execution = uuid.UUID(queued.stdout.strip())
        state = await agents.execution_state(daemon.address, creds.orchestrator_key, str(execution))
        assert (state["state"], state["workspace_id"]) == ("pending", str(creds.workspace))
    conn = await asyncpg.connect(database_url)
    try:
        row = await conn.fetchrow(
            "SELECT payload, required_labels FROM pending_jobs WHERE job_execution_id = $1",
            execution,
        )
    finally:
        await conn.close()
    assert row is not None
    assert json.loads(row["payload"]) == {"script": "echo 'it'\"'\"'s' 'a test'"}
    assert row["required_labels"] == ["linux"]


async def test_enqueue_refuses_without_a_key_or_a_command() -> None:
    no_key = await agents.run_client(
        "enqueue", "--url", "http://127.0.0.1:9", "--workspace", str(uuid.uuid4()),
        "--labels", "linux", "--", "true",
        CONTROLPLANE_ORCHESTRATOR_KEY="",
    )  # fmt: skip
    assert no_key.returncode == 2
    assert "CONTROLPLANE_ORCHESTRATOR_KEY" in no_key.stderr
    no_command = await agents.run_client(
        "enqueue", "--url", "http://127.0.0.1:9", "--workspace", str(uuid.uuid4()),
        "--labels", "linux",
        CONTROLPLANE_ORCHESTRATOR_KEY="cp_oak_x",
    )  # fmt: skip
    assert no_command.returncode == 2
    assert "command" in no_command.stderr


@pytest.mark.parametrize("wait", [[], ["--wait"]])
async def test_enqueue_reports_a_refused_key_without_echoing_it(
    spawn_daemon: SpawnDaemon, database_url: str, wait: list[str]
) -> None:
    async with spawn_daemon() as daemon:
        refused = await agents.run_client(
            "enqueue", "--url", daemon.address, "--workspace", str(uuid.uuid4()),
            "--labels", "linux", *wait, "--", "true",
            CONTROLPLANE_ORCHESTRATOR_KEY="cp_oak_not-a-real-key",
        )  # fmt: skip
    assert refused.returncode == 2
    assert "401 unauthorized" in refused.stderr
    assert "not-a-real-key" not in refused.stderr
    assert "Traceback" not in refused.stderr and len(refused.stderr.strip().splitlines()) == 1


async def test_status_prints_the_queue_per_workspace(
    spawn_daemon: SpawnDaemon, database_url: str
) -> None:
    creds = await agents.make_credentials(database_url)
    other = agents.Credentials(
        uuid.uuid4(), creds.orchestrator_key, creds.admin_key, creds.registration_token
    )
    async with spawn_daemon() as daemon:
        for target in (creds, creds, other):
            queued = await agents.enqueue(daemon.address, target, "true")
            assert queued.returncode == 0, queued.stderr
        shown = await agents.run_client(
            "status", "--url", daemon.address, CONTROLPLANE_ADMIN_KEY=creds.admin_key
        )
    assert shown.returncode == 0, shown.stderr
    queue, stuck, by_labels = [
        [line.split() for line in block.splitlines()] for block in shown.stdout.split("\n\n")
    ]
    # No runner and no provisioner in either workspace: every pending label set is stuck, and
    # since nothing is offered at all, its every label is missing.
    assert [row[:4] for row in stuck] == [
        ["STUCK_IN", "LABELS", "PENDING", "MISSING"],
        [str(creds.workspace), "linux", "2", "linux"],
        [str(other.workspace), "linux", "1", "linux"],
    ]
    assert queue == [
        ["WORKSPACE", "PENDING", "RUNNING"],
        [str(creds.workspace), "2", "0"],
        [str(other.workspace), "1", "0"],
        ["TOTAL", "3", "0"],
    ]
    assert by_labels == [
        ["QUEUED_IN", "LABELS", "PENDING", "RUNNING"],
        [str(creds.workspace), "linux", "2", "0"],
        [str(other.workspace), "linux", "1", "0"],
    ]


async def test_status_adds_the_fleet_when_there_is_one(
    spawn_daemon: SpawnDaemon, database_url: str
) -> None:
    creds = await agents.make_credentials(database_url)
    conn = await asyncpg.connect(database_url)
    try:
        live = await provisioning.provisioner(conn, creds.workspace)
        await provisioning.provisioner(conn, None)  # never seen: not active, not shown
        await conn.execute(
            "UPDATE provisioner_tokens SET last_seen_at = now() WHERE id = $1", live.id
        )
        await provisioning.reservation(
            conn, workspace_id=creds.workspace, provisioner_id=live.id, labels=("linux", "x64"),
            count=2,
        )  # fmt: skip
        for state in ("running", "running", "failed"):
            await provisioning.runner(conn, live.id, state=state)
    finally:
        await conn.close()
    async with spawn_daemon() as daemon:
        shown = await agents.run_client(
            "status", "--url", daemon.address, CONTROLPLANE_ADMIN_KEY=creds.admin_key
        )
    assert shown.returncode == 0, shown.stderr
    tables = [[line.split() for line in block.splitlines()] for block in shown.stdout.split("\n\n")]
    queue, provisioners, reservations, instances = tables
    assert queue == [["WORKSPACE", "PENDING", "RUNNING"], ["TOTAL", "0", "0"]]
    assert provisioners[0] == ["PROVISIONER", "SCOPE", "WORKSPACE", "LAST_SEEN"]
    assert [row[:3] for row in provisioners[1:]] == [[live.name, "workspace", str(creds.workspace)]]
    assert reservations[1][:4] == [str(creds.workspace), "linux,x64", "launch", "2"]
    assert instances == [["INSTANCE_STATE", "COUNT"], ["running", "2"], ["failed", "1"]]


async def test_status_refuses_an_orchestrator_key() -> None:
    wrong = await agents.run_client(
        "status", "--url", "http://127.0.0.1:9", CONTROLPLANE_ADMIN_KEY="cp_oak_x"
    )
    assert wrong.returncode == 2
    assert "cp_adm_" in wrong.stderr


async def test_s105_s106_runner_refuses_empty_labels_or_no_token_before_any_request() -> None:
    """We differ: there is one token kind (a manual registration token), so S-105's both-or-
    neither rule reduces to "a token is required"; bootstrap mode does not exist yet."""
    # Port 9 (discard) has no listener here: a request would fail differently and later.
    empty = await agents.run_client(
        "runner", "--url", "http://127.0.0.1:9", "--labels", " , ",
        CONTROLPLANE_RUNNER_TOKEN="cp_mrt_x",
    )  # fmt: skip
    assert empty.returncode == 2
    assert "--labels needs at least one label" in empty.stderr
    no_token = await agents.run_client(
        "runner", "--url", "http://127.0.0.1:9", "--labels", "linux",
        CONTROLPLANE_RUNNER_TOKEN="",
    )  # fmt: skip
    assert no_token.returncode == 2
    assert "CONTROLPLANE_RUNNER_TOKEN" in no_token.stderr


async def _interrupt_a_wait(address: str, creds: agents.Credentials, *extra: str) -> agents.Ran:
    """`enqueue --wait` for a job no runner takes, Ctrl-C once it printed the job's id."""
    process = await anyio.open_process(
        [*agents.CLI, "--log-level", "warning", "enqueue", "--url", address, "--workspace",
         str(creds.workspace), "--labels", "linux", "--wait", *extra, "--", "true"],
        env={**os.environ, "CONTROLPLANE_ORCHESTRATOR_KEY": creds.orchestrator_key},
    )  # fmt: skip
    async with process:
        assert process.stdout is not None and process.stderr is not None
        with anyio.fail_after(30):
            printed = await process.stdout.receive()
        process.send_signal(signal.SIGINT)
        with anyio.fail_after(30):
            code = await process.wait()
            stderr = b"".join([chunk async for chunk in process.stderr])
    return agents.Ran(code, printed.decode(), stderr.decode())


async def test_ctrl_c_on_wait_leaves_the_job_running_and_says_how_to_cancel_it(
    spawn_daemon: SpawnDaemon, database_url: str
) -> None:
    creds = await agents.make_credentials(database_url)
    async with spawn_daemon() as daemon:
        ran = await _interrupt_a_wait(daemon.address, creds)
        execution = ran.stdout.strip()
        assert ran.returncode == 130
        assert f"stopped waiting; {execution} goes on" in ran.stderr
        assert f"controlplane jobs cancel {execution}" in ran.stderr
        state = await agents.execution_state(daemon.address, creds.orchestrator_key, execution)
        assert state["state"] == "pending"


async def test_ctrl_c_on_wait_with_cancel_on_interrupt_cancels_the_job(
    spawn_daemon: SpawnDaemon, database_url: str
) -> None:
    creds = await agents.make_credentials(database_url)
    async with spawn_daemon() as daemon:
        ran = await _interrupt_a_wait(daemon.address, creds, "--cancel-on-interrupt")
        execution = ran.stdout.strip()
        assert ran.returncode == 130
        assert f"cancelled {execution}" in ran.stderr
        state = await agents.execution_state(daemon.address, creds.orchestrator_key, execution)
        assert (state["state"], state["outcome"], state["ended_by"]) == (
            "ended",
            "cancelled",
            "orchestrator",
        )


async def test_wait_on_a_job_nothing_can_take_says_so(
    spawn_daemon: SpawnDaemon, database_url: str
) -> None:
    creds = await agents.make_credentials(database_url)
    async with spawn_daemon() as daemon:
        ran = await agents.run_client(
            "enqueue", "--url", daemon.address, "--workspace", str(creds.workspace),
            "--labels", "linux,gpu", "--wait", "--timeout", "2", "--", "true",
            CONTROLPLANE_ORCHESTRATOR_KEY=creds.orchestrator_key,
        )  # fmt: skip
    execution = ran.stdout.strip()
    assert ran.returncode == 2  # gave up at the timeout
    assert (
        f"{execution} is stuck: no live runner or connected provisioner offers gpu, linux"
        in ran.stderr
    )
    assert ran.stderr.count("is stuck") == 1
