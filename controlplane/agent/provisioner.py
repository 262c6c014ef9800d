"""`controlplane provisioner local`: a provisioner that launches reference runners as local
subprocesses, over a real control session (docs/provisioner-protocol.md).

It advertises one template (labels, N slots, an optional idle target). For each grant and warm
launch the server pushes, it creates runner instances, attaches a provider identity
(`local-<hex>`) and starts `controlplane runner --bootstrap-token …` with that identity; each child
enrolls, is activated, runs one job and exits. The provisioner reports every child's state
(starting, running, then stopped or failed by exit status), re-advertises its free slots when
they change, and stops the children the server names in terminate intents.

Children run in their own sessions and survive the provisioner: their pids are kept in a state
file, and after a restart the provisioner adopts the ones still alive and sends `reconcile` with
them as the observed set, so the server terminates only what is really gone.

Connection: reconnects with back-off after a lost socket or a server restart; stops (exit 1) on
4401/4403/4404/4406 (credentials) and 4409 (another process took the token over).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from controlplane.retry import Backoff

log = logging.getLogger("controlplane.agent.provisioner")

FATAL_CLOSE_CODES = {4401, 4403, 4404, 4406, 4409, 4426}
_CREDENTIAL_VARIABLES = (
    "CONTROLPLANE_PROVISIONER_TOKEN",
    "CONTROLPLANE_RUNNER_TOKEN",
    "CONTROLPLANE_BOOTSTRAP_TOKEN",
    "CONTROLPLANE_ORCHESTRATOR_KEY",
    "CONTROLPLANE_ADMIN_KEY",
)
QUICK_EXIT_SECONDS = 10.0  # a runner failing sooner than this backs launches off
PING_SECONDS = 20.0
REQUEST_TIMEOUT_SECONDS = 30.0


@dataclass(frozen=True)
class ProvisionerOptions:
    url: str
    token: str = field(repr=False)
    labels: list[str]
    slots: int
    idle_target: int = 0
    template_key: str = "local"
    state_file: Path | None = None
    stop_runners_on_exit: bool = False  # `controlplane dev`: take the runners down with us
    runner_command: list[str] = field(
        default_factory=lambda: [sys.executable, "-m", "controlplane.cli"]
    )


@dataclass
class Child:
    provider_runner_id: str
    pid: int
    process: subprocess.Popen[bytes] | None = None  # None: adopted after a restart
    state: str = "starting"
    started_at: float = 0.0


class Refused(Exception):
    """The server closed the session for a reason a reconnect cannot fix."""


def _now() -> str:
    return datetime.now(UTC).isoformat()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LocalProvisioner:
    def __init__(self, options: ProvisionerOptions) -> None:
        self.options = options
        self.children: dict[str, Child] = {}
        self._ws: ClientConnection | None = None
        self._waiting: dict[str, tuple[anyio.Event, list[dict[str, Any]]]] = {}
        self._requests = 0
        self._changed = anyio.Event()
        self._launching = anyio.Lock()
        self._spawn: Callable[..., object] = lambda *_args: None
        # Runners failing right after their start (a broken image, a bad URL) back launches off
        # instead of relaunching them every second.
        self._failures = Backoff.full_jitter(cap=60.0)
        self._launch_after = 0.0
        self.sessions = 0
        self._load_state()

    # -- state file ------------------------------------------------------------------------------

    def _load_state(self) -> None:
        path = self.options.state_file
        if path is None or not path.exists():
            return
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError):
            log.warning("provisioner.state_unreadable", extra={"path": str(path)})
            return
        for provider_runner_id, pid in saved.get("children", {}).items():
            if isinstance(pid, int) and _alive(pid):
                self.children[provider_runner_id] = Child(provider_runner_id, pid, state="running")
        log.info("provisioner.adopted", extra={"children": len(self.children)})

    def _save_state(self) -> None:
        path = self.options.state_file
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(".tmp")
        temporary.write_text(
            json.dumps({"children": {c.provider_runner_id: c.pid for c in self.children.values()}})
        )
        temporary.replace(path)

    # -- session -----------------------------------------------------------------------------------

    async def run(self) -> int:
        backoff = Backoff.full_jitter()
        async with anyio.create_task_group() as group:
            group.start_soon(self._watch_children)
            try:
                while True:
                    try:
                        await self._session()
                        backoff.reset()
                    except Refused as error:
                        log.error("provisioner.refused", extra={"why": str(error)})
                        return 1
                    except (OSError, ConnectionClosed, InvalidStatus, TimeoutError) as error:
                        log.warning("provisioner.reconnect", extra={"error": repr(error)[:200]})
                    await anyio.sleep(backoff.next())
            finally:
                group.cancel_scope.cancel()
                if self.options.stop_runners_on_exit:
                    for provider_runner_id in list(self.children):
                        self._terminate(provider_runner_id)
                self._save_state()
        return 1  # not reached: the loop only ends by a refusal or a cancellation

    async def _session(self) -> None:
        url = self.options.url.rstrip("/").replace("http", "ws", 1) + "/v1/provisioners/session"
        headers = {"Authorization": f"Bearer {self.options.token}"}
        async with connect(url, additional_headers=headers, close_timeout=2) as ws:
            self._ws = ws
            try:
                await self._send({"type": "hello", "protocol_version": 1, "request_id": "hello"})
                welcome = json.loads(await ws.recv())
                if welcome.get("type") != "welcome":
                    raise Refused(f"unexpected first answer {welcome.get('type')!r}")
                self.sessions += 1
                log.info("provisioner.connected", extra={"generation": welcome["generation"]})
                try:
                    async with anyio.create_task_group() as group:
                        self._spawn = group.start_soon
                        group.start_soon(self._read, ws)
                        group.start_soon(self._ping)
                        await self._reconcile()
                        await self._advertise()
                        outstanding = welcome.get("outstanding", [])
                        if outstanding:
                            units = sum(g["count"] for g in outstanding)
                            log.info("provisioner.outstanding", extra={"grants": units})
                        for grant in outstanding:
                            group.start_soon(self._launch, grant["count"], grant["reservation_id"])
                        group.start_soon(self._readvertise_on_change)
                except BaseExceptionGroup as errors:
                    raise _first(errors) from None
            finally:
                self._ws = None
                for event, _ in self._waiting.values():
                    event.set()
                self._waiting.clear()

    async def _read(self, ws: ClientConnection) -> None:
        try:
            async for frame in ws:
                message = json.loads(frame)
                kind = message.get("type")
                if kind == "demand":
                    self._on_demand(message)
                elif "request_id" in message and message["request_id"] in self._waiting:
                    event, box = self._waiting.pop(message["request_id"])
                    box.append(message)
                    event.set()
        except ConnectionClosed as closed:
            close = closed.rcvd
            if close is not None and close.code in FATAL_CLOSE_CODES:
                raise Refused(f"closed {close.code} {close.reason}") from closed
            raise

    async def _ping(self) -> None:
        while True:
            await anyio.sleep(PING_SECONDS)
            await self._request({"type": "ping"})

    async def _send(self, message: dict[str, Any]) -> None:
        if self._ws is None:
            raise ConnectionError("no control session")
        await self._ws.send(json.dumps(message))

    async def _request(self, message: dict[str, Any]) -> dict[str, Any]:
        self._requests += 1
        request_id = f"r{self._requests}"
        event, box = anyio.Event(), list[dict[str, Any]]()
        self._waiting[request_id] = (event, box)
        await self._send({**message, "request_id": request_id})
        with anyio.fail_after(REQUEST_TIMEOUT_SECONDS):
            await event.wait()
        if not box:
            raise ConnectionError("control session lost before the answer")
        answer = box[0]
        if answer["type"] == "error":
            log.warning(
                "provisioner.request_refused",
                extra={"request": message["type"], "code": answer["code"]},
            )
        return answer

    # -- what the server says ----------------------------------------------------------------------

    def _on_demand(self, message: dict[str, Any]) -> None:
        news = ("grants", "warm", "terminate_provider_runner_ids")
        if any(message.get(key) for key in news):
            log.info(
                "provisioner.demand",
                extra={
                    "seq": message.get("seq"),
                    "grants": sum(g["count"] for g in message.get("grants", [])),
                    "warm": sum(w["count"] for w in message.get("warm", [])),
                    "terminate": len(message.get("terminate_provider_runner_ids", [])),
                },
            )
        for provider_runner_id in message.get("terminate_provider_runner_ids", []):
            self._terminate(provider_runner_id)
        for grant in message.get("grants", []):
            self._spawn(self._launch, grant["count"], grant["reservation_id"])
        for warm in message.get("warm", []):
            if warm["template_key"] == self.options.template_key:
                self._spawn(self._launch, warm["count"], None)

    async def _readvertise_on_change(self) -> None:
        while True:
            await self._changed.wait()
            self._changed = anyio.Event()
            await self._advertise()

    def _counts(self) -> tuple[int, int, int]:
        starting = sum(1 for c in self.children.values() if c.state == "starting")
        running = len(self.children) - starting
        return max(0, self.options.slots - len(self.children)), starting, running

    async def _advertise(self) -> None:
        free, starting, running = self._counts()
        await self._request(
            {
                "type": "advertise",
                "max_reservations": min(free, 1000),
                "templates": [
                    {
                        "template_key": self.options.template_key,
                        "labels": self.options.labels,
                        "available_slots": free,
                        "starting": starting,
                        "running": running,
                        "idle_target": self.options.idle_target,
                    }
                ],
            }
        )

    async def _reconcile(self) -> None:
        answer = await self._request(
            {"type": "reconcile", "observed_provider_runner_ids": sorted(self.children)}
        )
        for runner in answer.get("runners", []):
            if runner["desired_intent"] == "terminate":
                self._terminate(runner["provider_runner_id"])

    # -- children ----------------------------------------------------------------------------------

    async def _launch(self, count: int, reservation_id: str | None) -> None:
        async with self._launching:  # slots are counted one launch at a time
            delay = self._launch_after - anyio.current_time()
            if delay > 0:
                log.info("provisioner.launch_delayed", extra={"seconds": round(delay, 1)})
                await anyio.sleep(delay)
            free, _, _ = self._counts()
            count = min(count, free)
            if count <= 0:
                return
            entry: dict[str, Any] = {"template_key": self.options.template_key}
            if reservation_id is not None:
                entry["reservation_id"] = reservation_id
            created = await self._request(
                {"type": "create_instances", "provider_kind": "local", "instances": [entry] * count}
            )
            if created["type"] != "instances_created":
                return
            for instance in created["runner_instances"]:
                provider_runner_id = f"local-{uuid.uuid4().hex[:12]}"
                await self._request(
                    {
                        "type": "attach_provider",
                        "runner_instance_id": instance["runner_instance_id"],
                        "provider_runner_id": provider_runner_id,
                    }
                )
                self._start_child(provider_runner_id, instance["bootstrap_token"])
                await self._report(provider_runner_id, "starting")
        self._changed.set()

    def _start_child(self, provider_runner_id: str, bootstrap_token: str) -> None:
        command = [
            *self.options.runner_command,
            "runner",
            "--url",
            self.options.url,
            "--labels",
            ",".join(self.options.labels),
            "--provider-runner-id",
            provider_runner_id,
        ]
        # The runner gets its own bootstrap token and nothing of ours: no inherited credential.
        env = {k: v for k, v in os.environ.items() if not k.startswith(_CREDENTIAL_VARIABLES)}
        process = subprocess.Popen(
            command,
            env={**env, "CONTROLPLANE_BOOTSTRAP_TOKEN": bootstrap_token},
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # survives our restart; reconcile finds it again
        )
        self.children[provider_runner_id] = Child(
            provider_runner_id, process.pid, process, started_at=anyio.current_time()
        )
        self._save_state()
        log.info(
            "provisioner.launched",
            extra={"provider_runner_id": provider_runner_id, "pid": process.pid},
        )

    def _terminate(self, provider_runner_id: str) -> None:
        child = self.children.get(provider_runner_id)
        if child is None:
            return
        log.info("provisioner.terminating", extra={"provider_runner_id": provider_runner_id})
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGTERM)

    async def _report(self, provider_runner_id: str, state: str, reason: str | None = None) -> None:
        event: dict[str, Any] = {
            "provider_runner_id": provider_runner_id,
            "state": state,
            "reported_at": _now(),
            "template_key": self.options.template_key,
            "labels": self.options.labels,
            "provider_kind": "local",
        }
        if reason:
            event["reason"] = reason
        if self._ws is not None:
            with contextlib.suppress(ConnectionError, TimeoutError):
                await self._request({"type": "report", "events": [event]})

    async def _watch_children(self) -> None:
        """Once a second: report children that came up or went away."""
        while True:
            for child in list(self.children.values()):
                code = child.process.poll() if child.process is not None else None
                gone = code is not None or (child.process is None and not _alive(child.pid))
                if gone:
                    del self.children[child.provider_runner_id]
                    self._save_state()
                    state = "stopped" if code in (0, None) else "failed"
                    quick = anyio.current_time() - child.started_at < QUICK_EXIT_SECONDS
                    if state == "failed" and quick and child.process is not None:
                        self._launch_after = anyio.current_time() + self._failures.ceiling
                        self._failures.next()
                    elif state == "stopped":
                        self._failures.reset()
                    await self._report(child.provider_runner_id, state, f"exit {code}")
                    self._changed.set()
                elif child.state == "starting":
                    child.state = "running"
                    await self._report(child.provider_runner_id, "running")
            await anyio.sleep(1.0)


def _first(errors: BaseExceptionGroup[BaseException]) -> BaseException:
    """The exception that ended a session's task group: a refusal first, else the first."""
    flat: list[BaseException] = []

    def walk(group: BaseExceptionGroup[BaseException]) -> None:
        for error in group.exceptions:
            if isinstance(error, BaseExceptionGroup):
                walk(error)
            else:
                flat.append(error)

    walk(errors)
    return next((e for e in flat if isinstance(e, Refused)), flat[0])


async def run(options: ProvisionerOptions) -> int:
    """Run until SIGTERM/SIGINT (exit 0; the children keep running) or a refusal (exit 1)."""
    provisioner = LocalProvisioner(options)
    code = 0
    async with anyio.create_task_group() as group:

        async def stop_on_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    log.info("provisioner.stopping")
                    group.cancel_scope.cancel()
                    return

        group.start_soon(stop_on_signal)
        code = await provisioner.run()
        group.cancel_scope.cancel()
    return code
