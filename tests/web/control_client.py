"""A WebSocket client of the provisioner control session, for tests."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from controlplane import app
from controlplane.actors.control import ControlSessions

PATH = "/v1/provisioners/session"


def url(daemon: app.Daemon) -> str:
    return daemon.address.replace("http://", "ws://", 1) + PATH


def registry(daemon: app.Daemon) -> ControlSessions:
    assert daemon.replica is not None
    return daemon.replica.control


async def open_session(daemon: app.Daemon, token: str | None) -> ClientConnection:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    with anyio.fail_after(10):
        return await connect(url(daemon), additional_headers=headers, close_timeout=2)


async def send(ws: ClientConnection, message: dict[str, Any]) -> None:
    await ws.send(json.dumps(message))


async def receive(ws: ClientConnection) -> dict[str, Any]:
    with anyio.fail_after(10):
        frame = await ws.recv()
    found: dict[str, Any] = json.loads(frame)
    return found


async def _drain(ws: ClientConnection) -> None:
    while True:
        await ws.recv()


async def closed_with(ws: ClientConnection) -> tuple[int, str]:
    """Read until the server closes; its close code and reason."""
    with anyio.fail_after(10), pytest.raises(ConnectionClosed) as closed:
        await _drain(ws)
    frame = closed.value.rcvd
    assert frame is not None, "closed without a close frame from the server"
    return frame.code, frame.reason


async def hello(ws: ClientConnection, request_id: str = "h1") -> dict[str, Any]:
    await send(ws, {"type": "hello", "protocol_version": 1, "request_id": request_id})
    welcome = await receive(ws)
    assert welcome["type"] == "welcome", welcome
    return welcome
