"""`controlplane runner` as a real process against real daemons (and, for the error paths a real
daemon cannot produce on demand, against a small scripted server)."""

from __future__ import annotations

import contextlib
import signal
import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from controlplane.agent.runner import Runner, RunnerOptions
from tests.system import agents
from tests.system.conftest import SpawnDaemon

pytestmark = pytest.mark.system


async def test_runs_jobs_end_to_end_and_records_the_exit_code(
    spawn_daemon: SpawnDaemon, database_url: str
) -> None:
    creds = await agents.make_credentials(database_url)
    async with (
        spawn_daemon(**agents.DAEMON_KNOBS) as daemon,
        agents.runner(daemon.address, creds.registration_token) as runner,
    ):
        hello = await agents.enqueue(daemon.address, creds, "echo", "hello", wait=True)
        assert hello.returncode == 0, hello.stderr
        # The job's output comes back to whoever enqueued it, as well as to the runner's stdout.
        execution, output, outcome = hello.stdout.splitlines()
        assert (output, outcome) == ("hello", "outcome: succeeded")
        await runner.printed("hello\n")
        state = await agents.execution_state(daemon.address, creds.orchestrator_key, execution)
        assert (state["outcome"], state["ended_by"]) == ("succeeded", "runner")
        assert (state["exit_code"], state["output_tail"]) == (0, "hello\n")

        failing = await agents.enqueue(
            daemon.address, creds, "sh", "-c", "echo oops >&2; exit 3", wait=True
        )
        assert failing.returncode == 3  # the job's own exit code
        failed_execution, output, outcome = failing.stdout.splitlines()
        assert (output, outcome) == ("oops", "outcome: failed (exit code 3)")
        async with httpx.AsyncClient(base_url=daemon.address, timeout=10) as http:
            feed = await http.get(
                "/v1/events",
                params={"workspace_id": str(creds.workspace)},
                headers={"Authorization": f"Bearer {creds.orchestrator_key}"},
            )
        completed = [
            event
            for event in feed.json()["events"]
            if event["type"] == "job.completed" and event["job_execution_id"] == failed_execution
        ]
        assert [
            (e["payload"]["outcome"], e["payload"]["exit_code"], e["payload"]["output_tail"])
            for e in completed
        ] == [("failed", 3, "oops\n")]
        assert runner.process.returncode is None  # still serving
    logged = runner.stderr.decode()
    assert len(runner.logs("runner.registered")) == 1
    assert creds.registration_token not in logged
    assert "cp_rs_" not in logged and "cp_jl_" not in logged


async def test_s116_a_cancel_kills_the_process_group_and_ends_the_lease(
    spawn_daemon: SpawnDaemon, database_url: str, tmp_path: Path
) -> None:
    """We differ: the cancelled job is still completed (`cancelled`, not recorded because the
    orchestrator's outcome came first), which removes the lease at once."""
    creds = await agents.make_credentials(database_url)
    pid_file = tmp_path / "sleep.pid"
    script = f"sleep 60 & echo $! > {pid_file}; wait"
    async with (
        spawn_daemon(**agents.DAEMON_KNOBS) as daemon,
        agents.runner(daemon.address, creds.registration_token) as runner,
    ):
        queued = await agents.enqueue(daemon.address, creds, "sh", "-c", script)
        assert queued.returncode == 0, queued.stderr
        execution = queued.stdout.strip()
        with anyio.fail_after(30):
            while not pid_file.exists() or not pid_file.read_text().strip():
                await anyio.sleep(0.02)
        sleep_pid = int(pid_file.read_text())
        assert agents.alive(sleep_pid)
        await runner.logged("job.started")
        async with httpx.AsyncClient(base_url=daemon.address, timeout=10) as http:
            answer = await http.post(
                f"/v1/jobs/{execution}/outcome",
                json={"status": "cancelled", "reason": "test"},
                headers={"Authorization": f"Bearer {creds.orchestrator_key}"},
            )
        assert answer.json()["was_running"] is True
        with anyio.fail_after(5):
            while agents.alive(sleep_pid):
                await anyio.sleep(0.02)
        await runner.logged("job.completed")
        [completed] = runner.logs("job.completed")
        assert (completed["outcome"], completed["recorded"]) == ("cancelled", False)
        conn = await asyncpg.connect(database_url)
        try:
            leases = await conn.fetchval(
                "SELECT count(*) FROM running_jobs WHERE job_execution_id = $1",
                uuid.UUID(execution),
            )
        finally:
            await conn.close()
        assert leases == 0
        state = await agents.execution_state(daemon.address, creds.orchestrator_key, execution)
        assert (state["outcome"], state["ended_by"]) == ("cancelled", "orchestrator")
        assert runner.process.returncode is None  # back to asking for jobs


async def test_s117_a_lost_lease_kills_the_job_without_completing_it(
    spawn_daemon: SpawnDaemon, database_url: str, tmp_path: Path
) -> None:
    creds = await agents.make_credentials(database_url)
    pid_file = tmp_path / "sleep.pid"
    async with (
        spawn_daemon(**agents.DAEMON_KNOBS) as daemon,
        agents.runner(daemon.address, creds.registration_token) as runner,
    ):
        queued = await agents.enqueue(
            daemon.address, creds, "sh", "-c", f"sleep 60 & echo $! > {pid_file}; wait"
        )
        execution = uuid.UUID(queued.stdout.strip())
        with anyio.fail_after(30):
            while not pid_file.exists() or not pid_file.read_text().strip():
                await anyio.sleep(0.02)
        sleep_pid = int(pid_file.read_text())
        conn = await asyncpg.connect(database_url)
        try:
            # What the reaper does to a lease it finds stale; the next heartbeat gets 404.
            await conn.execute("DELETE FROM running_jobs WHERE job_execution_id = $1", execution)
        finally:
            await conn.close()
        await runner.logged("job.orphaned", within=15)
        with anyio.fail_after(5):
            while agents.alive(sleep_pid):
                await anyio.sleep(0.02)
        assert runner.logs("job.completed") == []
        assert runner.logs("job.complete_lost") == []
        assert runner.process.returncode is None


async def test_s108_errors_past_the_idle_deadline_exit_1() -> None:
    scripted = ScriptedControlPlane([(500, "server-error")])
    async with (
        serving(scripted) as address,
        agents.runner(address, "cp_mrt_scripted", "--max-idle-seconds", "2") as runner,
    ):
        assert await runner.exited(within=30) == 1
    assert len(scripted.requests) >= 2
    assert runner.logs("runner.idle_exit")[0]["failing"] is True


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


async def test_s109_a_refused_session_token_makes_the_runner_register_again(
    spawn_daemon: SpawnDaemon, database_url: str
) -> None:
    creds = await agents.make_credentials(database_url)
    knobs = {**agents.DAEMON_KNOBS, "CONTROLPLANE_SERVER_PORT": str(_free_port())}
    first = spawn_daemon(**knobs)
    daemon = await first.__aenter__()
    address = daemon.address
    try:
        async with agents.runner(address, creds.registration_token) as runner:
            await runner.logged("runner.registered")
            await first.__aexit__(None, None, None)
            # New signing keys: every session token signed before no longer verifies (401).
            conn = await asyncpg.connect(database_url)
            try:
                await conn.execute("DELETE FROM signing_keys")
            finally:
                await conn.close()
            async with spawn_daemon(**knobs) as second:
                assert second.address == address
                done = await agents.enqueue(address, creds, "echo", "after-restart", wait=True)
                assert done.returncode == 0, done.stderr
                await runner.printed("after-restart\n")
            assert len(runner.logs("runner.session_refused")) >= 1
            assert len(runner.logs("runner.registered")) == 2
    finally:
        if daemon.process.poll() is None:
            await first.__aexit__(None, None, None)


async def test_s119_first_sigterm_lets_the_job_finish_and_exits_0(
    spawn_daemon: SpawnDaemon, database_url: str
) -> None:
    creds = await agents.make_credentials(database_url)
    async with (
        spawn_daemon(**agents.DAEMON_KNOBS) as daemon,
        agents.runner(daemon.address, creds.registration_token) as runner,
    ):
        queued = await agents.enqueue(
            daemon.address, creds, "sh", "-c", "echo started; sleep 2; echo done"
        )
        execution = queued.stdout.strip()
        await runner.printed("started\n")
        runner.send_signal(signal.SIGTERM)
        assert await runner.exited(within=20) == 0
        assert b"done\n" in runner.stdout
        state = await agents.execution_state(daemon.address, creds.orchestrator_key, execution)
        assert (state["state"], state["outcome"], state["ended_by"]) == (
            "ended",
            "succeeded",
            "runner",
        )


async def test_s119_second_sigterm_aborts_the_job_and_exits_1(
    spawn_daemon: SpawnDaemon, database_url: str
) -> None:
    creds = await agents.make_credentials(database_url)
    async with (
        spawn_daemon(**agents.DAEMON_KNOBS) as daemon,
        agents.runner(daemon.address, creds.registration_token) as runner,
    ):
        queued = await agents.enqueue(daemon.address, creds, "sh", "-c", "echo started; sleep 60")
        execution = queued.stdout.strip()
        await runner.printed("started\n")
        runner.send_signal(signal.SIGTERM)
        await runner.logged("runner.stopping")
        runner.send_signal(signal.SIGTERM)
        assert await runner.exited(within=20) == 1
        state = await agents.execution_state(daemon.address, creds.orchestrator_key, execution)
        assert (state["state"], state["outcome"], state["ended_by"]) == (
            "ended",
            "cancelled",
            "runner",
        )


async def test_s107_exits_0_after_max_idle_seconds(
    spawn_daemon: SpawnDaemon, database_url: str
) -> None:
    """We differ: a 204 comes after the server's long-poll wait, so the runner asks again at once
    instead of backing off 1 s, 1.5 s, 2.25 s …; the idle deadline is --max-idle-seconds."""
    creds = await agents.make_credentials(database_url)
    async with (
        spawn_daemon(**agents.DAEMON_KNOBS) as daemon,
        agents.runner(daemon.address, creds.registration_token, "--max-idle-seconds", "1") as r,
    ):
        assert await r.exited(within=20) == 0
        assert len(r.logs("runner.idle_exit")) == 1


# The scripted server: register succeeds, then each job request gets the next scripted answer.


class ScriptedControlPlane:
    def __init__(self, answers: list[tuple[int, str]]) -> None:
        self.answers = answers
        self.requests: list[float] = []
        self.registrations: list[tuple[str, Any]] = []

    async def register(self, request: Request) -> Response:
        self.registrations.append((request.headers["authorization"], await request.json()))
        return JSONResponse(
            {
                "session_token": "cp_rs_scripted",
                "session_id": str(uuid.uuid4()),
                "mode": "manual",
                "max_claims": None,
                "labels": ["linux", "x64"],
                "heartbeat_interval_seconds": 1.0,
                "long_poll_max_seconds": 1.0,
            }
        )

    async def request_job(self, _request: Request) -> Response:
        self.requests.append(anyio.current_time())
        status, code = self.answers[min(len(self.requests), len(self.answers)) - 1]
        body = {"error": {"code": code, "message": code, "details": {}}}
        return JSONResponse(body, status_code=status)

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/runners/register", self.register, methods=["POST"]),
                Route("/v1/runners/jobs/request", self.request_job, methods=["POST"]),
            ]
        )

    def gaps(self) -> list[float]:
        return [
            later - earlier
            for earlier, later in zip(self.requests, self.requests[1:], strict=False)
        ]


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@asynccontextmanager
async def serving(scripted: ScriptedControlPlane) -> AsyncIterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = _Server(uvicorn.Config(scripted.app(), log_config=None, lifespan="off"))
    async with anyio.create_task_group() as group:
        group.start_soon(lambda: server.serve(sockets=[sock]))
        with anyio.fail_after(10):
            while not server.started:
                await anyio.sleep(0.01)
        try:
            yield f"http://127.0.0.1:{sock.getsockname()[1]}"
        finally:
            server.should_exit = True


SCRIPT = [(503, "unavailable"), (409, "some-other-conflict"), (409, "runner-session-exhausted")]


async def test_s110_backs_off_on_errors_and_exits_0_when_the_session_is_exhausted() -> None:
    scripted = ScriptedControlPlane(SCRIPT)
    async with (
        serving(scripted) as address,
        agents.runner(address, "cp_mrt_scripted-token") as runner,
    ):
        assert await runner.exited(within=30) == 0
    assert scripted.registrations == [
        ("Bearer cp_mrt_scripted-token", {"labels": ["linux", "x64"]})
    ]
    assert len(scripted.requests) == 3  # the 409 with another code was retried
    # Full jitter: each delay the runner chose is below its ceiling (1 s, then 2 s), and it
    # waited at least that long before asking again (a timer never fires early; how late it
    # fires depends on the machine, so there is no upper bound on the gap).
    delays = [entry["delay"] for entry in runner.logs("runner.retry")]
    assert len(delays) == 2 and 0 <= delays[0] < 1 and 0 <= delays[1] < 2
    for gap, delay in zip(scripted.gaps(), delays, strict=True):
        assert gap >= delay
    assert len(runner.logs("runner.session_exhausted")) == 1


async def test_backoff_delays_grow() -> None:
    """With the jitter pinned at its top, the delays are the ceilings themselves: ~1 s, ~2 s."""
    scripted = ScriptedControlPlane(SCRIPT)
    async with serving(scripted) as address:
        options = RunnerOptions(url=address, token="cp_mrt_x", labels=["linux"])
        with anyio.fail_after(30):
            assert await Runner(options, random=lambda: 0.999, handle_signals=False).run() == 0
    # With the random source at its top, each delay is just below its ceiling: the second wait
    # is longer than the first delay could ever be, whatever the machine adds to either.
    first, second = scripted.gaps()
    assert first >= 0.999
    assert second >= 2 * 0.999
