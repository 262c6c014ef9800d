"""A lean HTTP/1.1 client for the throughput runners: one keep-alive connection per runner.

Why not httpx: on a two-core machine the benchmark's own client shares the CPU with PostgreSQL
and the replicas, and httpx spends several times more CPU per request than the server's route
does. Real runners run on their own machines, so the client's cost is not the control plane's;
this client keeps it small: it writes the request bytes by hand and reads a response by its
Content-Length. It is still real HTTP over a real TCP connection, parsed by the server's real
stack. It speaks only what the runner routes answer (no chunked bodies) and reconnects when the
server has closed an idle connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any
from urllib.parse import urlsplit


class Closed(Exception):
    """The server closed the connection before a complete response."""


class Connection:
    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._reader is None or self._writer is None or self._writer.is_closing():
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        return self._reader, self._writer

    async def post(
        self, path: str, token: str, body: dict[str, Any] | None = None
    ) -> tuple[int, Any]:
        """POST `body` as JSON with a bearer token; the status and the decoded JSON (or None)."""
        payload = b"" if body is None else json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nhost: {self.host}\r\nauthorization: Bearer {token}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n"
        ).encode()
        for attempt in (1, 2):
            reader, writer = await self._open()
            try:
                writer.write(head + payload)
                return await _read_response(reader)
            except (Closed, ConnectionError):
                await self.aclose()
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        writer, self._reader, self._writer = self._writer, None, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, Any]:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as error:
        raise Closed() from error
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.lower() == "content-length":
            length = int(value)
    body = await reader.readexactly(length) if length else b""
    return status, (json.loads(body) if body else None)
