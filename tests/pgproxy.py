"""A TCP proxy between a daemon and PostgreSQL, for tests.

It can stop forwarding and resume (`freeze`, `thaw`): while frozen, connections stay open and
nothing moves in either direction, new connections included, as with a hung server or a network
that drops every packet; bytes already sent wait and are delivered after `thaw`, in order. It
also counts the statements its clients run, by SQL text, from the protocol's Query and Bind
messages (a prepared statement counts once per execution), so a test can say how many times a
daemon ran a given statement. It answers an SSL request itself with "no", so the stream stays
readable.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import anyio
import anyio.abc

_SSL_REQUEST = 80877103
_GSSENC_REQUEST = 80877104
_CLOSED = (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)


class PgProxy:
    def __init__(self, upstream_url: str) -> None:
        parts = urlsplit(upstream_url)
        query = dict(parse_qsl(parts.query))
        self._socket_dir = query.pop("host", "") if not parts.hostname else ""
        self._host = parts.hostname or ""
        self._port = parts.port or int(query.pop("port", "5432"))
        self._parts = parts._replace(query=urlencode(query))
        self._flowing = anyio.Event()
        self._flowing.set()
        self.executed: Counter[str] = Counter()
        self.url = ""

    def freeze(self) -> None:
        if self._flowing.is_set():
            self._flowing = anyio.Event()

    def thaw(self) -> None:
        self._flowing.set()

    def count(self, *fragments: str) -> int:
        """Statements run so far whose text contains any of `fragments`."""
        return sum(n for text, n in self.executed.items() if any(f in text for f in fragments))

    def _listening_on(self, port: int) -> None:
        user, password = self._parts.username, self._parts.password
        credentials = f"{user}:{password}@" if password else f"{user}@" if user else ""
        self.url = urlunsplit(self._parts._replace(netloc=f"{credentials}127.0.0.1:{port}"))

    async def _gate(self) -> None:
        await self._flowing.wait()

    async def _connect_upstream(self) -> anyio.abc.ByteStream:
        if self._socket_dir:
            return await anyio.connect_unix(f"{self._socket_dir}/.s.PGSQL.{self._port}")
        return await anyio.connect_tcp(self._host, self._port)

    async def serve(self, client: anyio.abc.ByteStream) -> None:
        async with client:
            await self._gate()
            try:
                server = await self._connect_upstream()
            except OSError:
                return
            async with server, anyio.create_task_group() as group:

                async def upstream() -> None:
                    await self._client_to_server(client, server)
                    group.cancel_scope.cancel()

                async def downstream() -> None:
                    await self._server_to_client(server, client)
                    group.cancel_scope.cancel()

                group.start_soon(upstream)
                group.start_soon(downstream)

    async def _server_to_client(
        self, server: anyio.abc.ByteStream, client: anyio.abc.ByteStream
    ) -> None:
        try:
            while True:
                chunk = await server.receive()
                await self._gate()
                await client.send(chunk)
        except _CLOSED:
            pass
        await self._gate()  # a hung network delivers no close either

    async def _client_to_server(
        self, client: anyio.abc.ByteStream, server: anyio.abc.ByteStream
    ) -> None:
        buffer = bytearray()
        started = False
        statements: dict[bytes, str] = {}
        try:
            while True:
                chunk = await client.receive()
                await self._gate()
                buffer += chunk
                out = bytearray()
                while True:
                    if not started:  # untyped: length, then a request code
                        if len(buffer) < 8 or len(buffer) < int.from_bytes(buffer[:4], "big"):
                            break
                        length = int.from_bytes(buffer[:4], "big")
                        code = int.from_bytes(buffer[4:8], "big")
                        message = bytes(buffer[:length])
                        del buffer[:length]
                        if code in (_SSL_REQUEST, _GSSENC_REQUEST):
                            await client.send(b"N")
                        else:
                            started = True
                            out += message
                        continue
                    if len(buffer) < 5 or len(buffer) < 1 + int.from_bytes(buffer[1:5], "big"):
                        break
                    length = 1 + int.from_bytes(buffer[1:5], "big")
                    self._note(bytes(buffer[0:1]), bytes(buffer[5:length]), statements)
                    out += buffer[:length]
                    del buffer[:length]
                if out:
                    await server.send(bytes(out))
        except _CLOSED:
            pass
        await self._gate()

    def _note(self, kind: bytes, body: bytes, statements: dict[bytes, str]) -> None:
        if kind == b"Q":
            self.executed[body.split(b"\0", 1)[0].decode()] += 1
        elif kind == b"P":
            name, rest = body.split(b"\0", 1)
            statements[name] = rest.split(b"\0", 1)[0].decode()
        elif kind == b"B":
            _portal, rest = body.split(b"\0", 1)
            self.executed[statements.get(rest.split(b"\0", 1)[0], "?")] += 1


@asynccontextmanager
async def pg_proxy(database_url: str) -> AsyncIterator[PgProxy]:
    """A proxy to `database_url` on a free loopback port; `proxy.url` is the URL to give out."""
    proxy = PgProxy(database_url)
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    async with listener, anyio.create_task_group() as group:
        port = listener.extra(anyio.abc.SocketAttribute.local_port)  # noqa: S610 (not Django)
        proxy._listening_on(port)
        group.start_soon(listener.serve, proxy.serve)
        try:
            yield proxy
        finally:
            proxy.thaw()
            group.cancel_scope.cancel()
