"""HTTP/2 answers written at once (sharegpu.k8s.serving.h2_direct), over real TLS with ALPN h2 and an HTTP/2 client:
small answers never reach hypercorn's send task; a body beyond the flow-control window, a streamed answer and an
empty one still arrive whole and in order."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest
from hypercorn.protocol.h2 import H2Protocol
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from tls_helpers import make_pki_or_skip, wait_answering

from proc_helpers import free_port
from sharegpu.k8s.serving.server import Listener, ServerTls, Site, serve

BIG = 300_000  # beyond HTTP/2's initial 65,535-byte stream window: the client's WINDOW_UPDATEs must let it through


async def _small(request: Request) -> JSONResponse:
    return JSONResponse({"n": int(request.path_params["n"])})


async def _big(request: Request) -> Response:
    return Response(bytes(i % 251 for i in range(BIG)), media_type="application/octet-stream")


async def _empty(request: Request) -> Response:
    return Response(status_code=204)


async def _streamed(request: Request) -> StreamingResponse:
    async def parts() -> AsyncIterator[bytes]:
        for i in range(3):
            yield f"part{i};".encode()
            await asyncio.sleep(0.05)

    return StreamingResponse(parts(), media_type="text/plain")


def _run(tmp_path: Path, calls: Any) -> Any:
    pki = make_pki_or_skip(tmp_path)
    app = Starlette(
        routes=[
            Route("/small/{n}", _small),
            Route("/big", _big),
            Route("/empty", _empty),
            Route("/streamed", _streamed),
        ]
    )
    port = free_port()
    site = Site(app, Listener("127.0.0.1", port, ServerTls(pki.server_crt, pki.server_key)), "test")

    async def main() -> Any:
        stop = asyncio.Event()
        server = asyncio.ensure_future(serve([site], stop, signals=False))
        ctx = ssl.create_default_context(cafile=str(pki.ca))
        try:
            async with httpx.AsyncClient(http2=True, verify=ctx, timeout=10) as client:
                await wait_answering(client, f"https://127.0.0.1:{port}/small/0")
                return await calls(client, f"https://127.0.0.1:{port}")
        finally:
            stop.set()
            await server

    return asyncio.run(main())


@pytest.fixture
def send_task_streams(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The streams hypercorn's send task wrote DATA for."""
    served: list[int] = []
    original = H2Protocol._send_data

    async def spy(self: H2Protocol, stream_id: int) -> None:
        served.append(stream_id)
        await original(self, stream_id)

    monkeypatch.setattr(H2Protocol, "_send_data", spy)
    return served


def test_small_answers_are_written_without_the_send_task(tmp_path: Path, send_task_streams: list[int]) -> None:
    async def calls(client: httpx.AsyncClient, url: str) -> list[tuple[str, int]]:
        answers = await asyncio.gather(*(client.get(f"{url}/small/{n}") for n in range(200)))
        return [(r.http_version, r.json()["n"]) for r in answers]

    assert _run(tmp_path, calls) == [("HTTP/2", n) for n in range(200)]
    assert send_task_streams == []


def test_a_body_beyond_the_window_a_streamed_and_an_empty_answer_arrive_whole(
    tmp_path: Path, send_task_streams: list[int]
) -> None:
    async def calls(client: httpx.AsyncClient, url: str) -> tuple[Any, ...]:
        big, streamed, empty, small = await asyncio.gather(
            client.get(f"{url}/big"), client.get(f"{url}/streamed"), client.get(f"{url}/empty"),
            client.get(f"{url}/small/7"),
        )  # fmt: skip
        return big.content, streamed.text, (empty.status_code, empty.content), small.json(), big.http_version

    big, streamed, empty, small, version = _run(tmp_path, calls)
    assert version == "HTTP/2"
    assert big == bytes(i % 251 for i in range(BIG))
    assert streamed == "part0;part1;part2;"
    assert empty == (204, b"")
    assert small == {"n": 7}
    assert send_task_streams  # the big body went through hypercorn's own path
