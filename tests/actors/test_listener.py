"""The LISTEN connection's reconnects with a fake session, on trio with a mock clock."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import trio.testing

from controlplane.actors.listener import Handler, Listener
from controlplane.store.pool import PoolSettings


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})


class FakeSession:
    def __init__(self) -> None:
        self.channels: dict[str, Handler] = {}
        self.lost = anyio.Event()
        self.closed = False

    async def listen(self, channel: str, deliver: Handler) -> None:
        self.channels[channel] = deliver

    async def wait_lost(self) -> None:
        await self.lost.wait()

    async def probe(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


class FakeServer:
    """Refuses the next `refusals` connections, then opens sessions."""

    def __init__(self) -> None:
        self.refusals = 0
        self.attempts: list[float] = []
        self.sessions: list[FakeSession] = []

    async def connect(self) -> FakeSession:
        self.attempts.append(anyio.current_time())
        if self.refusals:
            self.refusals -= 1
            raise ConnectionRefusedError("down")
        self.sessions.append(FakeSession())
        return self.sessions[-1]


async def test_reconnects_back_off_from_50_ms_doubling_to_2_s_and_start_over_after_success() -> (
    None
):
    server = FakeServer()
    received: list[str] = []
    connects: list[float] = []
    listener = Listener(
        PoolSettings(url="postgresql://unused"),
        {"cp_enqueued": received.append},
        lambda: connects.append(anyio.current_time()),
        connect=server.connect,
    )
    async with anyio.create_task_group() as group:
        start = anyio.current_time()
        await group.start(listener.run)
        assert listener.connected and connects == [start]
        server.sessions[0].channels["cp_enqueued"]("w|linux")
        assert received == ["w|linux"]

        server.refusals = 8
        server.sessions[0].lost.set()
        with anyio.fail_after(60):
            while len(server.sessions) < 2:
                await anyio.sleep(0.01)
        gaps = [round(b - a, 6) for a, b in zip(server.attempts, server.attempts[1:], strict=False)]
        assert gaps == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0, 2.0]
        assert server.sessions[0].closed and listener.reconnects == 1
        assert listener.connected and len(connects) == 2  # parked work re-checks

        lost_at = anyio.current_time()
        server.sessions[1].lost.set()
        with anyio.fail_after(60):
            while len(server.sessions) < 3:
                await anyio.sleep(0.01)
        assert round(server.attempts[-1] - lost_at, 6) == 0.05  # the success reset the backoff
        group.cancel_scope.cancel()


async def test_a_failing_handler_does_not_stop_the_others() -> None:
    server = FakeServer()
    cancels: list[str] = []

    def broken(_payload: str) -> None:
        raise ValueError("bad payload")

    listener = Listener(
        PoolSettings(url="postgresql://unused"),
        {"cp_enqueued": broken, "cp_cancel": cancels.append},
        lambda: None,
        connect=server.connect,
    )
    async with anyio.create_task_group() as group:
        await group.start(listener.run)
        session = server.sessions[0]
        session.channels["cp_enqueued"]("x")  # logged, not raised
        session.channels["cp_cancel"]("y")
        assert cancels == ["y"] and listener.connected
        group.cancel_scope.cancel()
