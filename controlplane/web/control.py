"""WS /v1/provisioners/session: the provisioner control session (protocol version 1).

The bearer `cp_pt_` token is authenticated from the upgrade request's headers before the socket is
accepted. A refused token is answered by accepting and closing at once with its close code: no
message is read or sent, nothing is written. Then the client must say hello; the hello takes the
provisioner's session over cluster-wide (actors/control.py).
Close codes: docs/provisioner-protocol.md.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from dataclasses import dataclass
from datetime import timedelta

import anyio
import anyio.abc
import msgspec
from starlette.routing import BaseRoute, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from controlplane.actors.control import LocalSession
from controlplane.actors.provisioning import DemandPush, Limits, ProvisionerActor
from controlplane.domain.provisioners import Provisioner
from controlplane.errors import ControlPlaneError, Fenced, InvalidInput, Unauthorized, Unavailable
from controlplane.store.provisioning import open_session
from controlplane.web import control_requests as handlers
from controlplane.web import edge
from controlplane.web.control_deps import Deps
from controlplane.web.endpoints import bound
from controlplane.wire import control as wire

log = logging.getLogger("controlplane.control")

MAX_FRAME_BYTES = 64 * 1024
# The session cannot go on for now: DatabaseUnavailable (store/pool.py turns every database
# fault into it) or any other Unavailable, and OSError, which a send to a socket that is gone
# raises (uvicorn's ClientDisconnected is one). Closing a socket already gone is harmless.
_UNAVAILABLE: tuple[type[Exception], ...] = (Unavailable, OSError)
# The peer or the server's transport went away: nothing left to answer.
_GONE: tuple[type[Exception], ...] = (
    WebSocketDisconnect,
    anyio.ClosedResourceError,
    anyio.BrokenResourceError,
)
_GONE_OR_CLOSED: tuple[type[Exception], ...] = (*_GONE, RuntimeError)

# Close codes (docs/provisioner-protocol.md). 1xxx are the standard ones.
GOING_AWAY = 1001
TOO_BIG = 1009
INTERNAL_ERROR = 1011
TRY_AGAIN_LATER = 1013
BAD_FRAME = 4400
UNAUTHORIZED = 4401
REVOKED = 4403
EXPIRED = 4404
IDLE = 4408
SUPERSEDED = 4409
HELLO_FIRST = 4412
UNSUPPORTED_VERSION = 4426
FORBIDDEN = 4406

_AUTH_CLOSE = {"provisioner-token-revoked": REVOKED, "provisioner-token-expired": EXPIRED}
_FENCE_CLOSE = {  # errors.Fenced.verdict -> close
    "superseded": (SUPERSEDED, "superseded"),
    "revoked": (REVOKED, "provisioner-token-revoked"),
    "expired": (EXPIRED, "provisioner-token-expired"),
}


@dataclass(frozen=True, slots=True)
class Close:
    code: int
    reason: str


def _reason(text: str) -> str:
    """A close reason is at most 123 bytes of UTF-8."""
    return text.encode()[:123].decode(errors="ignore")


async def session(svc: Deps, websocket: WebSocket) -> None:
    try:
        # The provisioner check reads only what every HTTPConnection has (.headers).
        found = await svc.auth.provisioner(websocket)
    except Unauthorized as error:
        await _refuse(websocket, Close(_AUTH_CLOSE.get(error.code, UNAUTHORIZED), error.code))
        return
    except _UNAVAILABLE as error:
        log.warning("control.auth_unavailable", extra={"error": type(error).__name__})
        await _refuse(websocket, Close(TRY_AGAIN_LATER, "unavailable"))
        return
    await websocket.accept()
    try:
        outcome = await _converse(websocket, svc, found)
    except _GONE:
        return
    except _UNAVAILABLE as error:
        log.warning("control.database_unavailable", extra={"error": type(error).__name__})
        outcome = Close(TRY_AGAIN_LATER, "unavailable")
    except Exception:
        log.exception("control.unhandled", extra={"provisioner_id": str(found.id)})
        outcome = Close(INTERNAL_ERROR, "internal error")
    if outcome is not None:
        await _close(websocket, outcome)


async def _refuse(websocket: WebSocket, outcome: Close) -> None:
    await websocket.accept()
    await _close(websocket, outcome)


async def _close(websocket: WebSocket, outcome: Close) -> None:
    if websocket.client_state is not WebSocketState.CONNECTED:
        return
    if websocket.application_state is not WebSocketState.CONNECTED:
        return
    with contextlib.suppress(RuntimeError, OSError, *_GONE):
        await websocket.close(outcome.code, _reason(outcome.reason))


async def _converse(websocket: WebSocket, svc: Deps, found: Provisioner) -> Close | None:
    """Run the session until it ends; the close to send, or None when the client went away."""
    registry = svc.control
    conversation = _Conversation(websocket, svc, found)
    outcome: Close | None = None
    try:
        with anyio.CancelScope() as scope:
            conversation.scope = scope
            try:
                async with anyio.create_task_group() as tasks:
                    conversation.tasks = tasks
                    outcome = await conversation.read()
                    tasks.cancel_scope.cancel()
            except BaseExceptionGroup as errors:
                # The task group wraps what the reader raised; `session` maps the exception
                # itself (a vanished peer, a database fault) to its close.
                raise _first(errors) from None
            # The actor may have ended the session first (fenced, or a failed round).
            return conversation.fenced or outcome
    finally:
        conversation.end()
        if conversation.local is not None:
            registry.unregister(conversation.local)
    # Only a newer generation cancels the scope: a takeover, or a revocation of the token.
    local = conversation.local
    if local is not None and local.superseded:
        why = await conversation.why_superseded()
        log.info(
            "control.session_superseded",
            extra={"provisioner_id": str(found.id), "generation": local.generation, "why": why},
        )
        return Close(*_FENCE_CLOSE.get(why, (SUPERSEDED, "superseded")))
    return Close(GOING_AWAY, "going away")


def _first(errors: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first exception of a (nested) exception group."""
    first: BaseException = errors
    while isinstance(first, BaseExceptionGroup):
        first = first.exceptions[0]
    return first


class _Conversation:
    """One session's state: its fencing generation, its actor, and a lock serialising sends
    (the reader answers requests while the actor pushes demand)."""

    def __init__(self, websocket: WebSocket, svc: Deps, found: Provisioner) -> None:
        self.websocket = websocket
        self.svc = svc
        self.found = found
        self.local: LocalSession | None = None
        self.actor: ProvisionerActor | None = None
        self.scope: anyio.CancelScope | None = None
        self.tasks: anyio.abc.TaskGroup | None = None
        self.fenced: Close | None = None
        self._send_lock = anyio.Lock()

    def end(self) -> None:
        if self.actor is not None:
            self.svc.demand.remove(self.actor)

    async def send(self, message: wire.ServerMessage) -> None:
        async with self._send_lock:
            await self.websocket.send_text(wire.encode_server(message))

    async def push(self, demand: DemandPush) -> None:
        await self.send(handlers.demand(demand))

    async def why_superseded(self) -> str:
        """The fence's verdict on a session cancelled by a newer generation ("current" when the
        session still holds its generation after all)."""
        if self.actor is None:
            return "superseded"
        try:
            await self.actor.ping()
        except Fenced as error:
            return error.verdict
        return "current"

    async def read(self) -> Close | None:
        registry = self.svc.control
        while True:
            with anyio.move_on_after(registry.idle_seconds) as timer:
                message = await self.websocket.receive()
            if timer.cancelled_caught:
                return Close(IDLE, "idle timeout")
            if message["type"] == "websocket.disconnect":
                return None
            frame = message.get("text")
            if frame is None:
                return Close(BAD_FRAME, "frames must be JSON text")
            if len(frame) > MAX_FRAME_BYTES:
                return Close(TOO_BIG, f"frame exceeds {MAX_FRAME_BYTES} bytes")
            text = frame.encode()
            if len(text) > MAX_FRAME_BYTES:
                return Close(TOO_BIG, f"frame exceeds {MAX_FRAME_BYTES} bytes")
            decoded = self._decode(text)
            if isinstance(decoded, Close):
                return decoded
            if self.local is None:
                if not isinstance(decoded, wire.Hello):
                    return Close(HELLO_FIRST, "hello expected first")
                refused = await self._hello(decoded)
                if refused is not None:
                    return refused
                continue
            if isinstance(decoded, wire.Hello):
                return Close(BAD_FRAME, "hello was already received")
            try:
                await self._request(decoded)
            except Fenced as error:
                return Close(*_FENCE_CLOSE[error.verdict])

    def _decode(self, text: bytes) -> wire.ClientMessage | Close:
        """A frame refused by the input rules of the edge (too deep, NUL, a time with no UTC
        value) or by the schema closes 4400, like any malformed frame, and changes nothing."""
        try:
            edge.screen(text, self.svc.settings.server.max_json_depth, where="frame")
            decoded = wire.decode_client(text)
            edge.screen_decoded(decoded, text, where="frame")
        except InvalidInput as error:
            return Close(BAD_FRAME, error.message)
        except msgspec.DecodeError as error:
            return Close(BAD_FRAME, str(error))
        return decoded

    async def _hello(self, hello: wire.Hello) -> Close | None:
        if hello.protocol_version != wire.PROTOCOL_VERSION:
            return Close(
                UNSUPPORTED_VERSION,
                f"protocol_version {wire.PROTOCOL_VERSION} is the only one supported",
            )
        svc, found = self.svc, self.found
        if found.scope == "installation" and not svc.settings.provisioners.installation_enabled:
            return Close(FORBIDDEN, "forbidden: installation provisioning is disabled")
        session_id = uuid.uuid4()
        store = await open_session(svc.pool, found, session_id)
        if store is None:
            return Close(REVOKED, "provisioner-token-revoked")
        generation = store.generation
        actor = ProvisionerActor(store, found, _limits(svc), self.push, clock=lambda: svc.clock())
        outstanding = await actor.outstanding()
        assert self.scope is not None
        assert self.tasks is not None
        self.local = LocalSession(found.id, session_id, generation, self.scope)
        self.actor = actor
        svc.control.register(self.local)
        log.info(
            "control.session_started",
            extra={"provisioner_id": str(found.id), "generation": generation},
        )
        await self.send(
            wire.Welcome(
                session_id=session_id,
                generation=generation,
                request_id=hello.request_id,
                idle_timeout_seconds=svc.control.idle_seconds,
                outstanding=[handlers.grant(g) for g in outstanding],
            )
        )
        svc.demand.add(actor)
        self.tasks.start_soon(self._run_actor, actor)
        return None

    async def _run_actor(self, actor: ProvisionerActor) -> None:
        try:
            await actor.run()
        except Fenced as error:
            self.fenced = Close(*_FENCE_CLOSE[error.verdict])
        except _UNAVAILABLE as error:
            log.warning("control.database_unavailable", extra={"error": type(error).__name__})
            self.fenced = Close(TRY_AGAIN_LATER, "unavailable")
        except _GONE_OR_CLOSED:
            pass  # the socket went away under a push; the reader sees it too
        except Exception:
            log.exception("control.actor_failed", extra={"provisioner_id": str(self.found.id)})
            self.fenced = Close(INTERNAL_ERROR, "internal error")
        assert self.tasks is not None
        self.tasks.cancel_scope.cancel()

    async def _request(self, message: wire.ClientMessage) -> None:
        """Answer one request. Each write runs in one transaction whose first lock is the
        session's fencing row; a refused request changes nothing and leaves the session open.
        A fenced session (`Fenced`) or an unavailable database ends it instead."""
        assert self.actor is not None
        if isinstance(message, wire.Ping) and self.local is not None:
            self.local.seen = True  # stamped with the replica's next batch (actors/control.py)
        try:
            answer = await handlers.handle(self.actor, message)
        except ControlPlaneError as error:
            if isinstance(error, Fenced | Unavailable):
                raise
            answer = wire.Error(
                request_id=message.request_id, code=error.code, message=error.message
            )
        await self.send(answer)


def _limits(svc: Deps) -> Limits:
    knobs = svc.settings.provisioners
    return Limits(
        activation_grace=timedelta(seconds=knobs.reservation_ttl_seconds),
        activation_timeout=timedelta(seconds=knobs.demand_activation_timeout_seconds),
        covering_window=timedelta(seconds=knobs.active_window_seconds),
        reservation_ttl_seconds=knobs.reservation_ttl_seconds,
        reservation_ttl_max_seconds=knobs.reservation_ttl_max_seconds,
        bootstrap_ttl=timedelta(seconds=knobs.bootstrap_token_ttl_seconds),
        reconcile_grace=timedelta(seconds=knobs.reconcile_terminate_grace_seconds),
        ephemeral_ttl=timedelta(seconds=knobs.ephemeral_token_ttl_seconds),
        reserved_labels=svc.reserved_labels,
        installation_fair_share=knobs.installation_fair_share,
        full_walk_seconds=knobs.demand_full_walk_seconds,
        divergence_by_template=knobs.divergence_by_template,
    )


def routes(svc: Deps | None) -> list[BaseRoute]:
    return [WebSocketRoute("/v1/provisioners/session", bound(session, svc))]
