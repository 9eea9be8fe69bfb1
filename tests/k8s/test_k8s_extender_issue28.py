"""The extender's bind and the client layer refuse what can never be right (issue 28): names that are no Kubernetes
names never reach a URL, and a pod that asks for no GPU is not bound."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from k8s_helpers import LoopbackServer, node_spec, nodes, pod_obj
from memory_api import MemoryClusterApi
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from proc_helpers import kubeconfig
from sharegpu.k8s.cache.view import ClusterView
from sharegpu.k8s.extender.server import Extender, make_app
from sharegpu.kube.api import LightkubeClusterApi
from sharegpu.kube.names import InvalidName, check_name, name_problem

NODE = "node-a"


@pytest.fixture
def srv() -> Iterator[tuple[LoopbackServer, MemoryClusterApi]]:
    api = MemoryClusterApi()
    api.put_node(NODE, node_spec(NODE, gpus=2))
    view = ClusterView()
    view.reset(nodes(list(api.nodes.values())), [])
    view.synced = True
    with LoopbackServer(make_app(Extender(view, api, policy="bestfit"))) as s:
        yield s, api


def _bind(s: LoopbackServer, name: str, namespace: str = "default", node: str = NODE, uid: str = "") -> str:
    status, body = s.post("/bind", {"PodName": name, "PodNamespace": namespace, "PodUID": uid, "Node": node})
    assert status == 200
    return str(body["Error"])


@pytest.mark.parametrize(
    ("name", "namespace", "node", "says"),
    [
        ("../../../nodes/x", "default", NODE, "pod name '../../../nodes/x' is not a DNS-1123 subdomain"),
        ("p", "../kube-system", NODE, "namespace name '../kube-system' is not a DNS-1123 label"),
        ("p", "default", "../nodes/n1", "node name '../nodes/n1' is not a DNS-1123 subdomain"),
        ("p", "a.b", NODE, "namespace name 'a.b' is not a DNS-1123 label"),
        ("P", "default", NODE, "pod name 'P' is not a DNS-1123 subdomain"),
        ("p", "default", "n" * 254, "is 254 characters long"),
    ],
)
def test_bind_refuses_names_that_are_no_kubernetes_names_before_any_request(
    srv: tuple[LoopbackServer, MemoryClusterApi], name: str, namespace: str, node: str, says: str
) -> None:
    s, api = srv
    api.put_pod(pod_obj("p", memory="10Gi"))
    before = list(api.calls)
    error = _bind(s, name, namespace, node)
    assert error.startswith("cannot bind: ") and says in error, error
    assert api.calls == before  # nothing was asked of the API server
    assert "nodeName" not in api.pods["default/p"]["spec"]


def test_bind_refuses_a_pod_that_asks_for_zero_gpus(srv: tuple[LoopbackServer, MemoryClusterApi]) -> None:
    s, api = srv
    stored = api.put_pod(pod_obj("zero", gpu=0))
    error = _bind(s, "zero", uid=stored["metadata"]["uid"])
    assert "it asks for sharegpu.io/gpu: 0 (no GPU)" in error and "sharegpu.io/gpu: 1 or more" in error
    assert "nodeName" not in api.pods["default/zero"]["spec"]
    assert not any(c.startswith("bind pod") for c in api.calls)
    plain = api.put_pod(pod_obj("web", gpu=None))
    assert "it asks for no sharegpu.io resource" in _bind(s, "web", uid=plain["metadata"]["uid"])
    # A pod that asks for a GPU is still bound.
    one = api.put_pod(pod_obj("one", gpu=1))
    assert _bind(s, "one", uid=one["metadata"]["uid"]) == ""


@pytest.mark.parametrize(
    ("kind", "name", "ok"),
    [
        ("pod", "train-0", True),
        ("pod", "a.b.c", True),
        ("pod", "a" * 253, True),
        ("pod", "a" * 254, False),
        ("pod", "-a", False),
        ("pod", "a-", False),
        ("pod", "a..b", False),
        ("pod", "", False),
        ("namespace", "kube-system", True),
        ("namespace", "a" * 63, True),
        ("namespace", "a" * 64, False),
        ("namespace", "a.b", False),
        ("node", "ip-10-0-0-1.ec2.internal", True),
        ("node", "Node1", False),
        ("node", "n1/../x", False),
    ],
)
def test_names_are_checked_as_kubernetes_defines_them(kind: Any, name: str, ok: bool) -> None:
    assert (name_problem(kind, name) == "") is ok
    if not ok:
        with pytest.raises(InvalidName):
            check_name(kind, name)


class _Recorder:
    """An API server stand-in that records every request's path and answers each with an empty object."""

    def __init__(self) -> None:
        self.paths: list[str] = []

        async def any_path(request: Request) -> JSONResponse:
            self.paths.append(request.url.path)
            return JSONResponse({"kind": "Pod", "apiVersion": "v1", "metadata": {"name": "p", "namespace": "default"}})

        self.app = Starlette(routes=[Route("/{path:path}", any_path, methods=["GET", "POST", "PATCH"])])


def test_the_client_layer_checks_every_name_before_any_request(tmp_path: Path) -> None:
    rec = _Recorder()
    with LoopbackServer(rec.app) as s:
        api = LightkubeClusterApi(kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{s.port}"))

        async def calls() -> list[str]:
            refused = []
            for call in (
                lambda: api.get_pod("default", "../../../nodes/x"),
                lambda: api.get_pod("../kube-system", "p"),
                lambda: api.bind_pod("default", "p", "", "../nodes/x"),
                lambda: api.bind_pod("default", "../../nodes/x", "", "n1"),
                lambda: api.evict_pod("default", "../../nodes/x"),
                lambda: api.patch_pod_annotations("default", "p/../../x", {"a": "b"}, None),
                lambda: api.set_nominated_node("x/..", "p", "n1"),
                lambda: api.get_lease("default", "../x"),
            ):
                try:
                    await call()
                except InvalidName as e:
                    refused.append(str(e))
            await api.get_pod("default", "p")  # a valid name reaches the server
            await api.close()
            return refused

        refused = asyncio.run(calls())
    assert len(refused) == 8, refused
    assert refused[0] == (
        "cannot read pod default/../../../nodes/x: name '../../../nodes/x' is not a DNS-1123 subdomain: a name is a "
        "DNS-1123 subdomain of at most 253 characters (lower-case letters, digits, '-' and '.', starting and ending "
        "with a letter or digit, e.g. train-0)"
    )
    assert "namespace name '../kube-system' is not a DNS-1123 label" in refused[1]
    assert "node name '../nodes/x' is not a DNS-1123 subdomain" in refused[2]
    assert rec.paths == ["/api/v1/namespaces/default/pods/p"]
