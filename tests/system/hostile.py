"""A hostile client, run as its own process so that a test's probe measures the replica and not
the attacker's CPU: `python -m tests.system.hostile headers HOST PORT CONNECTIONS BYTES`.

`headers`: opens CONNECTIONS connections and says `ready`; on a line on its stdin, each sends a
request head whose one header value is BYTES long and never ends, until it has sent them all or
the server has closed the connection. All stay open until the last is done; then it prints how
many bytes each one got out, as a JSON list, and exits.
"""

from __future__ import annotations

import json
import sys

import anyio
import anyio.abc

_GONE = (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)


async def unfinished_headers(host: str, port: int, connections: int, size: int) -> list[int]:
    chunk = b"a" * (64 * 1024)
    sent: list[int] = []
    all_sent = anyio.Event()

    async def flood(stream: anyio.abc.SocketStream) -> None:
        total = 0
        try:
            await stream.send(b"GET /healthz HTTP/1.1\r\nhost: t\r\nx-big: ")
            while total < size:
                await stream.send(chunk)
                total += len(chunk)
        except _GONE:
            pass
        sent.append(total)
        if len(sent) == connections:
            all_sent.set()
        await all_sent.wait()  # every connection is held open until all have sent
        await stream.aclose()

    # Connected before the signal, so that the measured phase is the flood of header bytes.
    streams = [await anyio.connect_tcp(host, port) for _ in range(connections)]
    print("ready", flush=True)
    await anyio.to_thread.run_sync(sys.stdin.readline)
    async with anyio.create_task_group() as group:
        for stream in streams:
            group.start_soon(flood, stream)
    return sent


def main(argv: list[str]) -> int:
    attack, host, port, connections, size = argv
    if attack != "headers":
        sys.stderr.write(f"unknown attack {attack}\n")
        return 2
    sent = anyio.run(unfinished_headers, host, int(port), int(connections), int(size))
    print(json.dumps(sent), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
