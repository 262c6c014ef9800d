"""The reference runner: register with a manual registration token, long-poll for jobs, run each.

In managed mode (`--bootstrap-token`, launched by a provisioner) it first trades the bootstrap
token for an activation token (agent/managed.py), registers a one-claim session with it, runs its
one job and exits 0 when the session is exhausted.

How it treats each answer (spec/surface.md §7, adapted to the long-poll):

* job request 200: run the job (agent/job.py), then ask again.
* job request 204: the server already waited; ask again at once (after `Retry-After`, which is
  0 except while the daemon shuts down).
* job request 204 with `Controlplane-Paused`: an operator paused this runner session; ask again
  after its `Retry-After` (runners.paused_retry_seconds on the server, at most an hour here).
* job request 401: the session token is no longer accepted (expired, or signed by a key the
  daemon no longer has): register again with the same registration token.
* job request 409 `runner-session-exhausted`: exit 0.
* 5xx, any other 4xx, a transport error or a malformed body: back off (full jitter, 1 s doubling
  up to 5 s) and try again.
* register 400/401/403: the token or the labels are refused; retrying cannot help, exit 1.

Signals: the first SIGTERM/SIGINT stops asking for jobs (an outstanding request is dropped), lets
a running job finish and complete, and exits 0. A second one aborts the job (its process group
is killed and it completes `cancelled`) and exits 1.
"""

from __future__ import annotations

import logging
import random as _random
import signal
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import httpx
import msgspec

from controlplane.agent import api, managed
from controlplane.agent.job import Abort, JobRun
from controlplane.retry import Backoff
from controlplane.wire.runners import PAUSED_HEADER, JobResponse, RegisterResponse

log = logging.getLogger("controlplane.agent.runner")

_TRANSPORT_MARGIN_SECONDS = 15.0
_MAX_RETRY_AFTER_SECONDS = 5.0
_MAX_PAUSED_RETRY_SECONDS = 3600.0  # the most runners.paused_retry_seconds can be


@dataclass(frozen=True)
class RunnerOptions:
    url: str
    token: str = field(repr=False)  # a manual registration token; empty in managed mode
    labels: list[str]
    once: bool = False
    max_idle_seconds: float = 0.0  # 0: wait for jobs for ever
    # Managed mode (launched by a provisioner): the one-use bootstrap token it was given.
    bootstrap_token: str | None = field(default=None, repr=False)
    provider_runner_id: str | None = None


class Transient(Exception):
    """Worth another try after a back-off."""


class Fatal(Exception):
    """Another try cannot help."""


class Exhausted(Exception):
    """The session may take no more jobs."""


def _retry_after(response: httpx.Response, ceiling: float = _MAX_RETRY_AFTER_SECONDS) -> float:
    try:
        seconds = float(response.headers.get("retry-after", "0"))
    except ValueError:
        return 0.0
    return max(0.0, min(seconds, ceiling))


class Runner:
    def __init__(
        self,
        options: RunnerOptions,
        *,
        random: Callable[[], float] = _random.random,
        handle_signals: bool = True,
    ) -> None:
        self.options = options
        self._random = random
        self._handle_signals = handle_signals
        self._session: RegisterResponse | None = None
        self._fresh_session = False  # registered, and no job request has been answered since
        self._stopping = False
        self._forced = False
        self._asking: anyio.CancelScope | None = None
        self._job: JobRun | None = None
        self._main: anyio.CancelScope | None = None
        self.registrations = 0

    def stop(self) -> None:
        """What a signal does: the first stops gracefully, the second aborts."""
        if not self._stopping:
            self._stopping = True
            log.info("runner.stopping")
            if self._asking is not None:
                self._asking.cancel()
            return
        self._forced = True
        log.info("runner.aborting")
        if self._job is not None:
            self._job.abort(Abort.SHUTDOWN)
        elif self._main is not None:
            self._main.cancel()

    async def run(self) -> int:
        async with api.client(self.options.url) as http, anyio.create_task_group() as group:
            if self._handle_signals:
                group.start_soon(self._watch_signals)
            code = 1
            with anyio.CancelScope() as self._main:
                code = await self._loop(http)
            group.cancel_scope.cancel()
        return 1 if self._forced else code

    async def _watch_signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("runner.signal", extra={"signal": int(signum)})
                self.stop()

    async def _loop(self, http: httpx.AsyncClient) -> int:
        options = self.options
        backoff = Backoff.full_jitter(random=self._random)
        idle_since = anyio.current_time()
        failing = False
        while not self._stopping:
            remaining: float | None = None
            if options.max_idle_seconds > 0:
                remaining = options.max_idle_seconds - (anyio.current_time() - idle_since)
                if remaining <= 0:
                    log.info("runner.idle_exit", extra={"failing": failing})
                    return 1 if failing else 0
            job: JobResponse | None = None
            with anyio.CancelScope() as self._asking:
                try:
                    job, pause = await self._ask(http, remaining)
                    failing = False
                    backoff.reset()
                except Exhausted:
                    log.info("runner.session_exhausted")
                    return 0
                except Fatal as error:
                    log.error("runner.fatal", extra={"error": str(error)})
                    return 1
                except Transient as error:
                    failing = True
                    pause = backoff.next()
                    log.warning("runner.retry", extra={"error": str(error), "delay": pause})
                if pause > 0:
                    await anyio.sleep(pause if remaining is None else min(pause, remaining))
            self._asking = None
            if job is None:
                continue
            self._job = JobRun(http, job)
            try:
                await self._job.run()
            finally:
                self._job = None
            idle_since = anyio.current_time()
            if options.once:
                return 0
        return 0

    async def _ask(
        self, http: httpx.AsyncClient, remaining: float | None
    ) -> tuple[JobResponse | None, float]:
        """One job request (registering first when needed): the job, and how long to pause."""
        if self._session is None:
            self._session = await self._register(http)
            self._fresh_session = True
        session = self._session
        wait = session.long_poll_max_seconds
        if remaining is not None:
            wait = max(0.0, min(wait, remaining))
        try:
            response = await http.post(
                "/v1/runners/jobs/request",
                params={"wait": f"{wait:g}"},
                headers=api.bearer(session.session_token),
                timeout=wait + _TRANSPORT_MARGIN_SECONDS,
            )
        except httpx.TransportError as error:
            raise Transient(f"job request: {api.unreachable(self.options.url, error)}") from error
        status = response.status_code
        if status == 401:
            self._session = None
            log.info("runner.session_refused", extra={"session_id": str(session.session_id)})
            if self._fresh_session:
                raise Transient("a session refused right after it was registered")
            return None, 0.0
        self._fresh_session = False
        if status == 204:
            if PAUSED_HEADER in response.headers:
                pause = _retry_after(response, _MAX_PAUSED_RETRY_SECONDS)
                log.info("runner.paused", extra={"retry_after_seconds": pause})
                return None, pause
            return None, _retry_after(response)
        if status == 200:
            try:
                job = msgspec.json.decode(response.content, type=JobResponse)
            except (msgspec.DecodeError, msgspec.ValidationError) as error:
                raise Transient(f"job request: malformed job: {error}") from error
            log.info(
                "runner.job_received",
                extra={"job_execution_id": str(job.job_execution_id), "job_id": str(job.job_id)},
            )
            return job, 0.0
        if status == 409 and api.error_code(response) == "runner-session-exhausted":
            raise Exhausted()
        raise Transient(f"job request: {api.describe(response)}")

    async def _credential(self, http: httpx.AsyncClient) -> str:
        """The registration token: the manual one, or in managed mode an activation token
        obtained once through the bootstrap flow (a second registration cannot happen)."""
        options = self.options
        if options.bootstrap_token is None:
            return options.token
        if self.registrations:
            raise Fatal("the one-claim session was refused; a managed runner registers once")
        try:
            return await managed.activate(
                http,
                options.bootstrap_token,
                options.labels,
                provider_runner_id=options.provider_runner_id,
            )
        except managed.BootstrapRefused as error:
            raise Fatal(str(error)) from error

    async def _register(self, http: httpx.AsyncClient) -> RegisterResponse:
        token = await self._credential(http)
        try:
            response = await http.post(
                "/v1/runners/register",
                json={"labels": self.options.labels},
                headers=api.bearer(token),
            )
        except httpx.TransportError as error:
            raise Transient(f"register: {api.unreachable(self.options.url, error)}") from error
        if response.status_code in (400, 401, 403):
            raise Fatal(f"register: {api.describe(response)}")
        if response.status_code != 200:
            raise Transient(f"register: {api.describe(response)}")
        try:
            session = msgspec.json.decode(response.content, type=RegisterResponse)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            raise Transient(f"register: malformed answer: {error}") from error
        self.registrations += 1
        log.info(
            "runner.registered",
            extra={"session_id": str(session.session_id), "labels": ",".join(session.labels)},
        )
        return session
