"""lightkube's requests over aiohttp (:mod:`sharegpu.kube.transport`), against servers over real sockets: mutual TLS
with the kubeconfig's certificates and token, a Binding's body as sent, gzip answers, watch streams read as they come
and cut in the middle, timeouts and refused connections raised as the httpx errors callers handle."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
from pathlib import Path
from typing import Any

import httpx2
import pytest
from k8s_helpers import LoopbackServer, pod_obj
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from tls_helpers import Pki, make_pki_or_skip

from sharegpu.k8s.serving.tls import ServerTls
from sharegpu.kube.api import ADDED, LightkubeClusterApi
from sharegpu.kube.errors import KubeError, Unavailable
from sharegpu.kube.transport import AiohttpTransport


def _kubeconfig(path: Path, server: str, user: dict[str, Any], cluster: dict[str, Any] | None = None) -> Path:
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": server, **(cluster or {})}}],
                "users": [{"name": "u", "user": user}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    return path


class RecordingApiServer:
    """A pod to read (gzip-encoded when asked) and its binding subresource; every request's headers and body kept."""

    def __init__(self, gzip_answers: bool = False) -> None:
        self.seen: list[dict[str, Any]] = []

        async def record(request: Request) -> None:
            self.seen.append({"method": request.method, "path": request.url.path, "headers": dict(request.headers),
                              "query": dict(request.query_params), "body": await request.body()})  # fmt: skip

        async def pod(request: Request) -> Response:
            await record(request)
            body = json.dumps(pod_obj("p", "ns", memory="1Gi")).encode()
            if gzip_answers:
                return Response(
                    gzip.compress(body), media_type="application/json", headers={"content-encoding": "gzip"}
                )
            return Response(body, media_type="application/json")

        async def binding(request: Request) -> Response:
            await record(request)
            return JSONResponse({"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 201}, 201)

        self.app = Starlette(
            routes=[
                Route("/api/v1/namespaces/ns/pods/p", pod),
                Route("/api/v1/namespaces/ns/pods/p/binding", binding, methods=["POST"]),
            ]
        )


def _tls_user(pki: Pki, rogue: bool = False) -> dict[str, Any]:
    crt, key = (pki.rogue_crt, pki.rogue_key) if rogue else (pki.client_crt, pki.client_key)
    return {"client-certificate": str(crt), "client-key": str(key), "token": "t0k3n"}


def test_over_mutual_tls_a_read_and_a_binding_carry_the_kubeconfigs_certificate_token_and_body(tmp_path: Path) -> None:
    pki = make_pki_or_skip(tmp_path / "pki")
    server = RecordingApiServer()
    with LoopbackServer(server.app, ServerTls(pki.server_crt, pki.server_key, pki.ca)) as srv:
        url = f"https://127.0.0.1:{srv.port}"
        kc = _kubeconfig(tmp_path / "kc", url, _tls_user(pki), {"certificate-authority": str(pki.ca)})
        api = LightkubeClusterApi(kc)

        async def main() -> str:
            pod = await api.get_pod("ns", "p")
            await api.bind_pod("ns", "p", "uid-1", "node-a", {"sharegpu.io/assignment": '{"gpus": [0]}'}, "42")
            await api.close()
            return pod.metadata.name

        assert asyncio.run(asyncio.wait_for(main(), 30)) == "p"
    get, post = server.seen
    assert get["method"] == "GET" and post["method"] == "POST"
    for r in (get, post):
        assert r["headers"]["authorization"] == "Bearer t0k3n"
        assert r["headers"]["host"] == f"127.0.0.1:{srv.port}"
    assert post["headers"]["content-type"] == "application/json"
    assert int(post["headers"]["content-length"]) == len(post["body"])
    body = json.loads(post["body"])
    assert body["target"] == {"apiVersion": "v1", "kind": "Node", "name": "node-a"}
    assert body["metadata"]["annotations"] == {"sharegpu.io/assignment": '{"gpus": [0]}'}
    assert (body["metadata"]["uid"], body["metadata"]["resourceVersion"]) == ("uid-1", "42")
    # The body is encoded by hand (issue 34): exactly what lightkube's Binding model encoded, at the same path and
    # with the same field manager.
    from lightkube.models.core_v1 import ObjectReference
    from lightkube.models.meta_v1 import ObjectMeta
    from lightkube.resources.core_v1 import Pod as KPod

    assert body == KPod.Binding(
        metadata=ObjectMeta(name="p", namespace="ns", uid="uid-1", resourceVersion="42",
                            annotations={"sharegpu.io/assignment": '{"gpus": [0]}'}),
        target=ObjectReference(apiVersion="v1", kind="Node", name="node-a"),
    ).to_dict()  # fmt: skip
    assert post["path"] == "/api/v1/namespaces/ns/pods/p/binding"
    assert post["query"] == {"fieldManager": "sharegpu-scheduler-extender"}


def test_a_client_certificate_the_server_does_not_trust_is_an_unknown_outcome_naming_the_server(tmp_path: Path) -> None:
    pki = make_pki_or_skip(tmp_path / "pki")
    server = RecordingApiServer()
    with LoopbackServer(server.app, ServerTls(pki.server_crt, pki.server_key, pki.ca)) as srv:
        url = f"https://127.0.0.1:{srv.port}"
        kc = _kubeconfig(tmp_path / "kc", url, _tls_user(pki, rogue=True), {"certificate-authority": str(pki.ca)})
        api = LightkubeClusterApi(kc)

        async def main() -> None:
            try:
                await api.bind_pod("ns", "p", "uid-1", "node-a")
            finally:
                await api.close()

        with pytest.raises(Unavailable) as refused:
            asyncio.run(asyncio.wait_for(main(), 30))
    assert f"the API server at {url} did not answer" in str(refused.value)
    assert server.seen == []


def test_a_gzip_encoded_answer_is_decoded_once(tmp_path: Path) -> None:
    server = RecordingApiServer(gzip_answers=True)
    with LoopbackServer(server.app) as srv:
        api = LightkubeClusterApi(_kubeconfig(tmp_path / "kc", f"http://127.0.0.1:{srv.port}", {}))

        async def main() -> str:
            pod = await api.get_pod("ns", "p")
            await api.close()
            return pod.metadata.name

        assert asyncio.run(asyncio.wait_for(main(), 30)) == "p"
    assert "gzip" in server.seen[0]["headers"]["accept-encoding"]


async def _raw_server(handler: Any) -> tuple[asyncio.Server, int]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def _event(name: str, rv: int) -> bytes:
    obj = pod_obj(name, "ns", memory="1Gi")
    obj["metadata"]["resourceVersion"] = str(rv)
    return json.dumps({"type": ADDED, "object": obj}).encode() + b"\n"


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def test_watch_events_are_read_as_they_come_and_a_stream_cut_mid_event_is_an_api_error(tmp_path: Path) -> None:
    """The second event is sent only once the first one reached the caller: a transport that waited for the
    whole body would hang here. Then the connection closes in the middle of a chunk."""

    async def main() -> tuple[list[str], str]:
        first_read = asyncio.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
            writer.write(_chunk(_event("a", 5)))
            await writer.drain()
            await first_read.wait()
            writer.write(_chunk(_event("b", 6)))
            writer.write(b"400\r\n" + b'{"type": "ADD')  # a chunk of 1,024 bytes cut after 13
            await writer.drain()
            writer.close()

        server, port = await _raw_server(handle)
        api = LightkubeClusterApi(_kubeconfig(tmp_path / "kc", f"http://127.0.0.1:{port}", {}))
        names: list[str] = []
        try:
            async for _, pod in api.watch_pods("1"):
                names.append(pod.metadata.name)
                first_read.set()
        except KubeError as e:
            return names, str(e)
        finally:
            await api.close()
            server.close()
        return names, ""

    names, error = asyncio.run(asyncio.wait_for(main(), 30))
    assert names == ["a", "b"]
    assert "cannot watch pods" in error and "the API server at http://127.0.0.1:" in error


def test_a_server_that_never_answers_times_out_and_a_closed_port_is_a_connect_error() -> None:
    async def main() -> tuple[BaseException, BaseException, int]:
        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await asyncio.sleep(30)

        server, port = await _raw_server(silent)
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            closed = s.getsockname()[1]
        client = httpx2.AsyncClient(transport=AiohttpTransport(None), timeout=httpx2.Timeout(0.3))
        try:
            with pytest.raises(httpx2.ReadTimeout) as timed_out:
                await client.get(f"http://127.0.0.1:{port}/api")
            with pytest.raises(httpx2.ConnectError) as refused:
                await client.get(f"http://127.0.0.1:{closed}/api")
        finally:
            await client.aclose()
            server.close()
        return timed_out.value, refused.value, closed

    timed_out, refused, closed = asyncio.run(asyncio.wait_for(main(), 30))
    # The request travels with the error: callers name the server from it.
    assert isinstance(timed_out, httpx2.ReadTimeout) and timed_out.request.url.path == "/api"
    assert isinstance(refused, httpx2.ConnectError) and refused.request.url.port == closed
