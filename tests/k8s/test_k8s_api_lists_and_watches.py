"""Lists and watches of :class:`LightkubeClusterApi` read as plain JSON: pages joined, a watch the server ends resumed
from the last version seen, an ERROR event (a version too old) raised as an :class:`KubeError`.

Against a scripted API server over real HTTP (what each request asked, what it answered), and against a real API
server (SHAREGPU_TEST_KUBECONFIG) for the objects themselves, compared with what lightkube's typed client reads."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from k8s_helpers import LoopbackServer, pod_obj
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from sharegpu.kube import client as client_module
from sharegpu.kube.api import ADDED, DELETED, MODIFIED, LightkubeClusterApi
from sharegpu.kube.errors import KubeError
from sharegpu.kube.schema import Pod

KUBECONFIG = os.environ.get("SHAREGPU_TEST_KUBECONFIG")


def _pod(name: str, rv: int) -> dict[str, Any]:
    obj = pod_obj(name, memory="1Gi")
    obj["metadata"]["resourceVersion"] = str(rv)
    return obj


class ScriptedApiServer:
    """Pods in pages of ``limit``; each watch request gets the next script entry: events then the stream's end."""

    def __init__(self, pods: list[dict[str, Any]], watches: list[list[dict[str, Any]]]) -> None:
        self.pods, self.watches = pods, watches
        self.requests: list[dict[str, str]] = []

        async def pods_route(request: Request) -> Response:
            q = dict(request.query_params)
            self.requests.append(q)
            if q.get("watch") == "true":
                events = self.watches.pop(0) if self.watches else []

                async def lines() -> AsyncIterator[bytes]:
                    for e in events:
                        yield json.dumps(e).encode() + b"\n"

                return StreamingResponse(lines(), media_type="application/json")
            start = int(q.get("continue") or 0)
            limit = int(q["limit"])
            page = self.pods[start : start + limit]
            more = start + limit < len(self.pods)
            meta = {"resourceVersion": "100", **({"continue": str(start + limit)} if more else {})}
            return JSONResponse({"kind": "PodList", "apiVersion": "v1", "metadata": meta, "items": page})

        self.app = Starlette(routes=[Route("/api/v1/pods", pods_route)])

    def kubeconfig(self, tmp_path: Path, port: int) -> Path:
        path = tmp_path / "kubeconfig"
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
                    "users": [{"name": "u", "user": {}}],
                    "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                    "current-context": "x",
                }
            )
        )
        return path


def test_a_list_is_read_page_by_page_and_a_watch_resumes_from_the_last_version_seen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client_module, "LIST_CHUNK", 2)
    server = ScriptedApiServer(
        [_pod(f"p{i}", 10 + i) for i in range(5)],
        [
            [{"type": ADDED, "object": _pod("a", 101)}, {"type": MODIFIED, "object": _pod("a", 102)}],
            [],  # a watch the server ends at once (its timeout): resumed again from 102
            [{"type": DELETED, "object": _pod("a", 103)}],
            [{"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old resource version"}}],
        ],
    )
    with LoopbackServer(server.app) as srv:
        api = LightkubeClusterApi(server.kubeconfig(tmp_path, srv.port))

        async def main() -> tuple[list[Pod], str, list[tuple[str, str, str]], str]:
            pods, version = await api.list_pods("sharegpu-scheduler")
            seen: list[tuple[str, str, str]] = []
            with pytest.raises(KubeError) as broke:
                async for kind, pod in api.watch_pods(version, timeout_s=7, scheduler_name="sharegpu-scheduler"):
                    seen.append((kind, pod.metadata.name, pod.metadata.resource_version))
            await api.close()
            return pods, version, seen, str(broke.value)

        pods, version, seen, error = asyncio.run(asyncio.wait_for(main(), 30))
    assert [p.metadata.name for p in pods] == [f"p{i}" for i in range(5)] and version == "100"
    assert pods[0] == Pod.model_validate(server.pods[0])
    lists, watches = server.requests[:3], server.requests[3:]
    assert [q.get("continue") for q in lists] == [None, "2", "4"]
    assert all(q["limit"] == "2" and q["fieldSelector"] == "spec.schedulerName=sharegpu-scheduler" for q in lists)
    assert seen == [(ADDED, "a", "101"), (MODIFIED, "a", "102"), (DELETED, "a", "103")]
    # Each watch request resumes from the last version the previous one delivered.
    assert [q["resourceVersion"] for q in watches] == ["100", "102", "102", "103"]
    assert all(q["timeoutSeconds"] == "7" and q["watch"] == "true" for q in watches)
    assert "410" in error and "too old resource version" in error


@pytest.mark.skipif(
    not KUBECONFIG, reason="no API server: set SHAREGPU_TEST_KUBECONFIG to a kubeconfig to run the integration suite"
)
def test_against_a_real_api_server_lists_and_watches_read_what_lightkube_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightkube import AsyncClient, KubeConfig
    from lightkube.models.meta_v1 import ObjectMeta
    from lightkube.resources.core_v1 import Namespace
    from lightkube.resources.core_v1 import Pod as KPod

    assert KUBECONFIG is not None
    monkeypatch.setattr(client_module, "LIST_CHUNK", 2)  # five pods: three pages
    ns = f"sharegpu-lw-{uuid.uuid4().hex[:6]}"
    scheduler = f"sched-{ns}"  # a field selector that only this test's pods match

    async def create(client: AsyncClient, name: str) -> None:
        obj = pod_obj(name, ns, memory="1Gi")
        for server_set in ("uid", "resourceVersion"):
            del obj["metadata"][server_set]
        obj["spec"]["schedulerName"] = scheduler
        await client.create(KPod.from_dict(obj | {"status": {}}), namespace=ns)

    async def main() -> None:
        client = AsyncClient(config=KubeConfig.from_file(KUBECONFIG))
        api = LightkubeClusterApi(Path(KUBECONFIG))
        try:
            await client.create(Namespace(metadata=ObjectMeta(name=ns)))
            for i in range(5):
                await create(client, f"p{i}")
            pods, version = await api.list_pods(scheduler)
            assert sorted(p.metadata.name for p in pods) == [f"p{i}" for i in range(5)]
            assert int(version) > 0
            typed = {p.metadata.name: p async for p in client.list(KPod, namespace=ns)}
            for p in pods:  # the same object lightkube's typed client reads, in the fields sharegpu uses
                want = Pod.model_validate(typed[p.metadata.name].to_dict())
                assert (p.metadata, p.spec.containers, p.spec.scheduler_name) == (
                    want.metadata,
                    want.spec.containers,
                    want.spec.scheduler_name,
                )

            # The server ends the watch after 1 s; events after that still arrive (resumed from the last version).
            seen: list[tuple[str, str]] = []

            async def watch() -> None:
                async for kind, pod in api.watch_pods(version, timeout_s=1, scheduler_name=scheduler):
                    seen.append((kind, pod.metadata.name))
                    if kind == DELETED:
                        return

            task = asyncio.ensure_future(watch())
            await create(client, "early")
            await asyncio.sleep(2.5)  # past two server-side timeouts
            await create(client, "late")
            await client.delete(KPod, "late", namespace=ns, grace_period=0)
            await asyncio.wait_for(task, 20)
            assert (ADDED, "early") in seen and (ADDED, "late") in seen and seen[-1] == (DELETED, "late")
            assert all(name in ("early", "late") for _, name in seen)  # nothing before the version watched from
        finally:
            with contextlib.suppress(Exception):
                await client.delete(Namespace, ns)
            await api.close()
            await client.close()

    asyncio.run(asyncio.wait_for(main(), 90))
