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

import anyio
import msgspec
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from controlplane.actors.control import LocalSession
from controlplane.errors import Unauthorized, Unavailable
from controlplane.store import provisioner_sessions
from controlplane.store.provisioner_sessions import Fence
from controlplane.store.provisioners import Provisioner
from controlplane.web import auth
from controlplane.web.errors import DATABASE_FAULTS
from controlplane.web.services import Services
from controlplane.wire import control as wire

log = logging.getLogger("controlplane.control")

MAX_FRAME_BYTES = 64 * 1024
_UNAVAILABLE: tuple[type[Exception], ...] = (Unavailable, *DATABASE_FAULTS)

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

_AUTH_CLOSE = {"provisioner-token-revoked": REVOKED, "provisioner-token-expired": EXPIRED}
_FENCE_CLOSE = {
    Fence.SUPERSEDED: (SUPERSEDED, "superseded"),
    Fence.REVOKED: (REVOKED, "provisioner-token-revoked"),
    Fence.EXPIRED: (EXPIRED, "provisioner-token-expired"),
}


@dataclass(frozen=True, slots=True)
class Close:
    code: int
    reason: str


def _reason(text: str) -> str:
    """A close reason is at most 123 bytes of UTF-8."""
    return text.encode()[:123].decode(errors="ignore")


async def session(websocket: WebSocket) -> None:
    svc: Services = websocket.app.state.services
    try:
        # auth.provisioner reads only what every HTTPConnection has (.app, .headers).
        found = await auth.provisioner(websocket)
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
    except (WebSocketDisconnect, OSError):
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
    with contextlib.suppress(RuntimeError, WebSocketDisconnect, OSError):
        await websocket.close(outcome.code, _reason(outcome.reason))


async def _converse(websocket: WebSocket, svc: Services, found: Provisioner) -> Close | None:
    """Run the session until it ends; the close to send, or None when the client went away."""
    registry = svc.control
    local: LocalSession | None = None
    try:
        with anyio.CancelScope() as scope:
            while True:
                with anyio.move_on_after(registry.idle_seconds) as timer:
                    message = await websocket.receive()
                if timer.cancelled_caught:
                    return Close(IDLE, "idle timeout")
                if message["type"] == "websocket.disconnect":
                    return None
                frame = message.get("text")
                if frame is None:
                    return Close(BAD_FRAME, "frames must be JSON text")
                if len(frame) > MAX_FRAME_BYTES or len(frame.encode()) > MAX_FRAME_BYTES:
                    return Close(TOO_BIG, f"frame exceeds {MAX_FRAME_BYTES} bytes")
                try:
                    decoded = wire.decode_client(frame)
                except msgspec.DecodeError as error:
                    return Close(BAD_FRAME, str(error))
                if local is None:
                    if not isinstance(decoded, wire.Hello):
                        return Close(HELLO_FIRST, "hello expected first")
                    if decoded.protocol_version != wire.PROTOCOL_VERSION:
                        return Close(
                            UNSUPPORTED_VERSION,
                            f"protocol_version {wire.PROTOCOL_VERSION} is the only one supported",
                        )
                    session_id = uuid.uuid4()
                    async with svc.pool.acquire() as conn:
                        generation = await provisioner_sessions.take_over(
                            conn, found.id, session_id
                        )
                    if generation is None:
                        return Close(REVOKED, "provisioner-token-revoked")
                    local = LocalSession(found.id, session_id, generation, scope)
                    registry.register(local)
                    log.info(
                        "control.session_started",
                        extra={"provisioner_id": str(found.id), "generation": generation},
                    )
                    await _send(
                        websocket,
                        wire.Welcome(
                            session_id=session_id,
                            generation=generation,
                            request_id=decoded.request_id,
                            idle_timeout_seconds=registry.idle_seconds,
                        ),
                    )
                elif isinstance(decoded, wire.Hello):
                    return Close(BAD_FRAME, "hello was already received")
                else:
                    async with svc.pool.acquire() as conn:
                        verdict = await provisioner_sessions.fence(conn, found.id, local.generation)
                    if verdict is not Fence.CURRENT:
                        return Close(*_FENCE_CLOSE[verdict])
                    await _send(websocket, wire.Pong(request_id=decoded.request_id))
    finally:
        if local is not None:
            registry.unregister(local)
    # Only a newer generation cancels the scope: a takeover, or a revocation of the token.
    if local is not None and local.superseded:
        async with svc.pool.acquire() as conn:
            verdict = await provisioner_sessions.fence(conn, found.id, local.generation)
        log.info(
            "control.session_superseded",
            extra={
                "provisioner_id": str(found.id),
                "generation": local.generation,
                "why": verdict.value,
            },
        )
        return Close(*_FENCE_CLOSE.get(verdict, (SUPERSEDED, "superseded")))
    return Close(GOING_AWAY, "going away")


async def _send(websocket: WebSocket, message: wire.ServerMessage) -> None:
    await websocket.send_text(wire.encode_server(message))


routes = [WebSocketRoute("/v1/provisioners/session", session)]
