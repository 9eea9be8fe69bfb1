"""The listening sockets sharegpu serves on: accepted connections must get TCP_NODELAY (asyncio sets it only on
sockets made with proto IPPROTO_TCP), or every response waits 40 ms for the client's delayed ACK."""

from __future__ import annotations

import asyncio
import socket

from proc_helpers import free_port
from sharegpu.k8s.serving.server import Listener


def test_accepted_connections_have_tcp_nodelay() -> None:
    async def main() -> bool:
        sock = Listener("127.0.0.1", free_port()).bind()
        flags: list[int] = []

        async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            conn = writer.get_extra_info("socket")
            flags.append(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(accepted, sock=sock)
        port = sock.getsockname()[1]
        _, w = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(100):
            if flags:
                break
            await asyncio.sleep(0.01)
        w.close()
        server.close()
        return bool(flags and flags[0])

    assert asyncio.run(main())
