from __future__ import annotations

import socket

from controlplane.web import server


def test_listening_socket_is_tcp_so_connections_get_nodelay() -> None:
    """asyncio sets TCP_NODELAY on accepted connections only when the listening socket's proto
    is IPPROTO_TCP; without it every long-poll answer waited out a 40 ms delayed ACK."""
    sock = server.bind("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
        assert not sock.getblocking()
    finally:
        sock.close()
