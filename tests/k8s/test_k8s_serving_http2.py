"""Over real HTTP/2 with TLS (ALPN h2), as the kube-scheduler calls the extender: one connection carries any number of
requests. hypercorn's default ends a connection after 1,000 with the client's next requests in flight, which the
kube-scheduler saw as failed extender calls (GOAWAY PROTOCOL_ERROR) every 500 pods."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import httpx2 as httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from tls_helpers import make_pki_or_skip, wait_answering

from proc_helpers import free_port
from sharegpu.k8s.serving.server import Listener, ServerTls, Site, serve


async def _echo(request: Request) -> JSONResponse:
    # The client's port names its connection: a client that had to reconnect shows a second one.
    client = request.scope.get("client") or ("", 0)
    return JSONResponse({"n": int(request.path_params["n"]), "port": client[1]})


def test_one_http2_connection_carries_more_than_a_thousand_requests_with_some_in_flight(tmp_path: Path) -> None:
    pki = make_pki_or_skip(tmp_path)
    app = Starlette(routes=[Route("/echo/{n}", _echo)])
    port = free_port()
    site = Site(app, Listener("127.0.0.1", port, ServerTls(pki.server_crt, pki.server_key)), "test")

    async def main() -> tuple[list[int], set[str], set[int]]:
        stop = asyncio.Event()
        server = asyncio.ensure_future(serve([site], stop, signals=False))
        ctx = ssl.create_default_context(cafile=str(pki.ca))
        got: list[int] = []
        versions: set[str] = set()
        ports: set[int] = set()
        try:
            async with httpx.AsyncClient(http2=True, verify=ctx, timeout=10) as client:
                await wait_answering(client, f"https://127.0.0.1:{port}/echo/0")
                for start in range(0, 1500, 50):  # 50 at a time in flight on the one connection
                    answers = await asyncio.gather(
                        *(client.get(f"https://127.0.0.1:{port}/echo/{n}") for n in range(start, start + 50))
                    )
                    got += [r.json()["n"] for r in answers]
                    versions |= {r.http_version for r in answers}
                    ports |= {r.json()["port"] for r in answers}
        finally:
            stop.set()
            await server
        return got, versions, ports

    got, versions, ports = asyncio.run(main())
    assert versions == {"HTTP/2"}
    assert got == list(range(1500))
    assert len(ports) == 1, f"the server ended the connection: the client came back on {len(ports)} connections"
