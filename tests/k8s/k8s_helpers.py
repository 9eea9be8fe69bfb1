"""Builders of pods and nodes in the API server's JSON shapes, and a loopback HTTP server in a thread."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any, TypeVar

from starlette.applications import Starlette

from sharegpu.k8s.serving.server import Listener, Site, serve_bound
from sharegpu.k8s.serving.tls import ServerTls
from sharegpu.kube.schema import Node, Pod
from sharegpu.model.contract import ASSIGNMENT_ANNOTATION, INVENTORY_ANNOTATION
from sharegpu.model.inventory import NodeSpec, sim_gpus

T = TypeVar("T")


def node_spec(
    name: str, model: str = "H100-80GB", gpus: int = 2, cpu_milli: int = 64000, memory_mib: int = 262144
) -> NodeSpec:
    return NodeSpec(name, cpu_milli, memory_mib, sim_gpus(name, model, gpus))


def node_obj(spec: NodeSpec | None, name: str | None = None, raw_inventory: str | None = None) -> dict[str, Any]:
    name = name or (spec.name if spec else "node")
    ann = {}
    if spec is not None:
        ann[INVENTORY_ANNOTATION] = spec.to_json()
    if raw_inventory is not None:
        ann[INVENTORY_ANNOTATION] = raw_inventory
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "uid": f"uid-{name}",
            "resourceVersion": "1",
            "annotations": ann,
            "labels": {"kubernetes.io/hostname": name},
        },
        "spec": {"podCIDR": "10.0.0.0/24"},
        "status": {
            "allocatable": {"cpu": "64", "memory": "256Gi", "sharegpu.io/gpu": "128"},
            "nodeInfo": {"kubeletVersion": "v1.31.0"},
        },
    }


def pod_obj(
    name: str,
    namespace: str = "default",
    gpu: int | None = 1,
    memory: str | None = None,
    compute: int | None = None,
    annotations: Mapping[str, str] | None = None,
    node_name: str = "",
    phase: str = "Pending",
    env: Mapping[str, str] | None = None,
    cpu: str | None = "1",
    scheduler_name: str | None = "sharegpu-scheduler",
    run_as_user: int | None = None,
) -> dict[str, Any]:
    """A pod as a user would write it: it runs as its image says (most pods declare no user), or as ``run_as_user``
    (the pod's securityContext). Each undeclared pod is an MPS tenant of its own, and shares MPS units with any
    other (sharegpu.model.tenant)."""
    limits: dict[str, str] = {}
    if gpu is not None:
        limits["sharegpu.io/gpu"] = str(gpu)
    if memory is not None:
        limits["sharegpu.io/gpu-memory"] = memory
    if compute is not None:
        limits["sharegpu.io/gpu-compute"] = str(compute)
    container: dict[str, Any] = {
        "name": "main",
        "image": "nvcr.io/nvidia/pytorch:24.01-py3",
        "resources": {"limits": limits},
    }
    if cpu is not None:
        container["resources"]["requests"] = {"cpu": cpu, "memory": "1Gi"}
    if env:
        container["env"] = [{"name": k, "value": v} for k, v in env.items()]
    spec: dict[str, Any] = {"containers": [container], "restartPolicy": "Never"}
    if run_as_user is not None:
        spec["securityContext"] = {"runAsUser": run_as_user}
    if scheduler_name is not None:
        spec["schedulerName"] = scheduler_name
    if node_name:
        spec["nodeName"] = node_name
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{namespace}-{name}",
            "resourceVersion": "1",
            "annotations": dict(annotations or {}),
        },
        "spec": spec,
        "status": {"phase": phase},
    }


def with_assignment(pod: dict[str, Any], assignment_json: str, node: str) -> dict[str, Any]:
    pod = json.loads(json.dumps(pod))
    pod["metadata"]["annotations"][ASSIGNMENT_ANNOTATION] = assignment_json
    pod["spec"]["nodeName"] = node
    pod["status"]["phase"] = "Running"
    return pod


def pods(objs: list[dict[str, Any]]) -> list[Pod]:
    return [Pod.model_validate(o) for o in objs]


def nodes(objs: list[dict[str, Any]]) -> list[Node]:
    return [Node.model_validate(o) for o in objs]


class LoopbackServer:
    """An ASGI app served as sharegpu serves its own (:mod:`sharegpu.k8s.serving.server`) on 127.0.0.1, in a thread with its
    own event loop.

    Everything that touches the app's state (the view, the in-memory API) runs on that loop through :meth:`call`
    or :meth:`run`, so tests never race the server.
    """

    def __init__(self, app: Starlette, tls: ServerTls | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.site = Site(app, Listener("127.0.0.1", 0, tls), "test server")
        self.sock = self.site.listener.bind()  # listening already: a connection made before serving waits
        self.port = self.sock.getsockname()[1]
        self.stop: asyncio.Event | None = None
        self.thread = threading.Thread(target=self._main, daemon=True)
        self._started = threading.Event()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def main() -> None:
            self.stop = asyncio.Event()
            self._started.set()
            await serve_bound([(self.site, self.sock)], self.stop, signals=False)

        self.loop.run_until_complete(main())

    def __enter__(self) -> LoopbackServer:
        self.thread.start()
        self._started.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        stop = self.stop
        if stop is not None:
            self.loop.call_soon_threadsafe(stop.set)
        self.thread.join(10)
        self.sock.close()

    def run(self, coro: Any, timeout: float = 10) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[[], T], timeout: float = 10) -> T:
        fut: Future[T] = Future()

        def go() -> None:
            try:
                fut.set_result(fn())
            except Exception as e:
                fut.set_exception(e)

        self.loop.call_soon_threadsafe(go)
        return fut.result(timeout)

    def post(self, path: str, body: Any, raw: bytes | None = None) -> tuple[int, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            data = raw if raw is not None else json.dumps(body).encode()
            conn.request("POST", path, data, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            text = resp.read()
            return resp.status, json.loads(text) if text else None
        finally:
            conn.close()

    def get(self, path: str) -> tuple[int, str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.read().decode()
        finally:
            conn.close()
