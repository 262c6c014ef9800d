"""One job on the runner: its script in a process group of its own, the held heartbeat that
renews the lease and hears a cancel at once, the kill, and the completion.

The payload a runner understands is `{"script": "<shell>", "env": {"NAME": "value"}}` (`env`
optional, nothing else allowed). The script runs as `/bin/sh -c <script>` in a fresh temporary
directory, with a minimal environment (a few variables of the runner's own, never its token),
the job's ids, and the payload's `env` on top. Its stdout and stderr go to the runner's stdout,
and the last bytes of them (as many as the server keeps, `output_tail_bytes`) go back with the
completion, so whoever enqueued the job sees how it ended.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import anyio
import httpx
import msgspec
from anyio.abc import Process

from controlplane.agent.api import bearer, describe, error_code
from controlplane.domain.output import OutputTail
from controlplane.retry import Backoff
from controlplane.wire.runners import CompleteResponse, HeartbeatResponse, JobResponse

log = logging.getLogger("controlplane.agent.job")

TERM_GRACE_SECONDS = 2.0
# After the script's group is gone, how long its output may still take to drain: a process that
# left the group (setsid) and kept the pipe open must not hold the completion for ever.
OUTPUT_DRAIN_SECONDS = 2.0
COMPLETE_ATTEMPTS = 5
_TRANSPORT_MARGIN_SECONDS = 10.0
_INHERITED = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "USER", "LOGNAME")
_DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"

EnvName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
EnvValue = Annotated[str, msgspec.Meta(pattern=r"^[^\x00]*$")]


class JobPayload(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    script: str
    env: dict[EnvName, EnvValue] = msgspec.field(default_factory=dict)


class Abort(enum.Enum):
    CANCELLED = "cancelled"  # the orchestrator ended the execution: heartbeat said cancel
    ORPHANED = "orphaned"  # the lease is gone (heartbeat 404): there is nothing to complete
    SHUTDOWN = "shutdown"  # a second SIGTERM/SIGINT to the runner


def job_environment(
    payload_env: Mapping[str, str], job: JobResponse, inherited: Mapping[str, str]
) -> dict[str, str]:
    """The script's whole environment. The runner's own (its token included) is not passed on."""
    env = {name: inherited[name] for name in _INHERITED if name in inherited}
    env.setdefault("PATH", _DEFAULT_PATH)
    env["CI"] = "true"
    env["CONTROLPLANE_JOB_EXECUTION_ID"] = str(job.job_execution_id)
    env["CONTROLPLANE_JOB_ID"] = str(job.job_id)
    env.update(payload_env)
    return env


def exit_code_of(returncode: int) -> int:
    """A shell's convention: killed by signal N reads as 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def _write_out(chunk: bytes) -> None:
    sys.stdout.buffer.write(chunk)
    sys.stdout.buffer.flush()


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # every member has exited already
        os.killpg(pgid, signum)


class JobRun:
    """Runs one claimed job to its end. `abort()` may be called from any task."""

    def __init__(self, http: httpx.AsyncClient, job: JobResponse) -> None:
        self._http = http
        self.job = job
        self._lease = job.lease_token
        self.aborted: Abort | None = None
        self._wake = anyio.Event()
        self._ids = {"job_execution_id": str(job.job_execution_id)}
        self.output = OutputTail(job.output_tail_bytes)

    def abort(self, reason: Abort) -> None:
        if self.aborted is None:
            self.aborted = reason
            log.info("job.aborting", extra={**self._ids, "reason": reason.value})
        self._wake.set()

    async def run(self) -> None:
        try:
            payload = msgspec.convert(self.job.payload, JobPayload)
        except msgspec.ValidationError as error:
            log.warning("job.payload_invalid", extra={**self._ids, "error": str(error)})
            await self._complete("failed", None)
            return
        with tempfile.TemporaryDirectory(prefix="cp-job-") as workdir:
            process = await anyio.open_process(
                ["/bin/sh", "-c", payload.script],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                cwd=workdir,
                env=job_environment(payload.env, self.job, os.environ),
                start_new_session=True,
            )
            log.info("job.started", extra={**self._ids, "pid": process.pid})
            drained = anyio.Event()
            async with anyio.create_task_group() as pumping:
                pumping.start_soon(self._pump, process, drained)
                try:
                    await self._supervise(process)
                finally:
                    # Whatever the script left behind in its group goes with it, also on cancel.
                    _signal_group(process.pid, signal.SIGKILL)
                await process.wait()
                with anyio.move_on_after(OUTPUT_DRAIN_SECONDS):
                    await drained.wait()
                pumping.cancel_scope.cancel()
        if self.aborted is Abort.ORPHANED:
            log.warning("job.orphaned", extra=self._ids)
        elif self.aborted is not None:
            await self._complete("cancelled", None)
        else:
            assert process.returncode is not None
            code = exit_code_of(process.returncode)
            await self._complete("succeeded" if code == 0 else "failed", code)

    async def _pump(self, process: Process, drained: anyio.Event) -> None:
        """The script's output to our stdout as it comes, and into the tail. Written from a
        worker thread: a stdout that blocks (a slow pipe) then holds the script back, as it would
        if the script wrote there itself, but never this event loop and its heartbeats."""
        assert process.stdout is not None
        try:
            async for chunk in process.stdout:
                await anyio.to_thread.run_sync(_write_out, chunk)
                self.output.feed(chunk)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass
        drained.set()

    async def _supervise(self, process: Process) -> None:
        async def watch_exit() -> None:
            await process.wait()
            self._wake.set()

        async with anyio.create_task_group() as group:
            group.start_soon(self._heartbeat)
            group.start_soon(watch_exit)
            await self._wake.wait()
            group.cancel_scope.cancel()
        if self.aborted is not None:
            _signal_group(process.pid, signal.SIGTERM)
            with anyio.move_on_after(TERM_GRACE_SECONDS):
                await process.wait()

    async def _heartbeat(self) -> None:
        """One heartbeat outstanding at all times, each held for one interval: the lease is
        renewed every interval and a cancel is heard as soon as it commits."""
        interval = self.job.heartbeat_interval_seconds
        path = f"/v1/runners/jobs/{self.job.job_execution_id}/heartbeat"
        held = True
        while True:
            started = anyio.current_time()
            wait = interval if held else 0.0
            try:
                response = await self._http.post(
                    path,
                    params={"wait": f"{wait:g}"},
                    headers=bearer(self._lease),
                    timeout=wait + _TRANSPORT_MARGIN_SECONDS,
                )
            except httpx.TransportError as error:
                log.warning(
                    "job.heartbeat_failed", extra={**self._ids, "error": type(error).__name__}
                )
            else:
                if response.status_code == 200:
                    try:
                        answer = msgspec.json.decode(response.content, type=HeartbeatResponse)
                    except (msgspec.DecodeError, msgspec.ValidationError) as error:
                        log.warning(
                            "job.heartbeat_failed", extra={**self._ids, "error": str(error)}
                        )
                    else:
                        self._lease = answer.lease_token
                        if answer.cancel:
                            self.abort(Abort.CANCELLED)
                            return
                elif response.status_code == 404:
                    self.abort(Abort.ORPHANED)
                    return
                elif response.status_code == 400 and held:
                    # This server caps `wait` below our interval: plain heartbeats, then.
                    log.warning("job.heartbeat_unheld", extra={**self._ids})
                    held = False
                    continue
                else:
                    log.warning(
                        "job.heartbeat_failed", extra={**self._ids, "error": describe(response)}
                    )
            # An answer that came early (daemon shutting down, an error) must not make us spin.
            await anyio.sleep(max(0.0, started + interval - anyio.current_time()))

    async def _complete(
        self, outcome: Literal["succeeded", "failed", "cancelled"], exit_code: int | None
    ) -> None:
        path = f"/v1/runners/jobs/{self.job.job_execution_id}/complete"
        body: dict[str, Any] = {"outcome": outcome}
        if exit_code is not None:
            body["exit_code"] = max(-255, min(255, exit_code))
        if self.job.output_tail_bytes > 0:
            body["output_tail"] = self.output.text()
        extra = {**self._ids, "outcome": outcome, "exit_code": exit_code}
        backoff = Backoff.full_jitter()
        for _ in range(COMPLETE_ATTEMPTS):
            try:
                response = await self._http.post(path, json=body, headers=bearer(self._lease))
            except httpx.TransportError as error:
                problem = type(error).__name__
            else:
                if response.status_code == 200:
                    answer = msgspec.json.decode(response.content, type=CompleteResponse)
                    log.info("job.completed", extra={**extra, "recorded": answer.recorded})
                    return
                if response.status_code == 404:
                    log.warning("job.complete_lost", extra={**extra, "code": error_code(response)})
                    return
                problem = describe(response)
                if response.status_code < 500 and response.status_code not in (408, 429):
                    log.error("job.complete_refused", extra={**extra, "error": problem})
                    return
            log.warning("job.complete_retry", extra={**extra, "error": problem})
            await anyio.sleep(backoff.next())
        log.error("job.complete_gave_up", extra=extra)
