"""The effective GPU request of a pod with init containers, quantities with an upper-case exponent, and the message
for non-positive memory."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from k8s_helpers import node_spec, pod_obj
from memory_api import MemoryClusterApi

from sharegpu.k8s.cache.view import ClusterView
from sharegpu.k8s.extender.server import Extender
from sharegpu.k8s.pod_request import pod_request
from sharegpu.kube.schema import ExtenderArgs, Node, Pod
from sharegpu.model.inventory import NodeSpec
from sharegpu.model.request import InvalidRequest


def with_init(pod: dict[str, Any], *gpus: int) -> dict[str, Any]:
    pod["spec"]["initContainers"] = [
        {
            "name": f"init-{i}",
            "image": "x",
            "resources": {"limits": {"sharegpu.io/gpu": str(g), "sharegpu.io/gpu-memory": "10Gi"}},
        }
        for i, g in enumerate(gpus)
    ]
    return pod


@pytest.mark.parametrize(
    ("app", "init", "effective"),
    [(1, (1,), 1), (1, (2,), 2), (2, (1,), 2), (1, (3, 1), 3), (2, (), 2)],
)
def test_init_containers_count_as_the_kube_scheduler_counts_them(
    app: int, init: tuple[int, ...], effective: int
) -> None:
    pod = with_init(pod_obj("p", gpu=app, memory="10Gi"), *init)
    req = pod_request(Pod.model_validate(pod))
    assert req is not None and req.gpu_count == effective


def test_a_pod_with_a_gpu_init_container_fits_a_one_gpu_node() -> None:
    api = MemoryClusterApi()
    api.put_node("node-a", node_spec("node-a", gpus=1))
    view = ClusterView()
    view.reset([Node.model_validate(n) for n in api.nodes.values()], [])
    view.synced = True
    pod = with_init(pod_obj("p", gpu=1, memory="10Gi"), 1)
    r = Extender(view, api, policy="bestfit").filter(ExtenderArgs.model_validate({"Pod": pod, "NodeNames": ["node-a"]}))
    assert r.NodeNames == ["node-a"]


def test_fewer_healthy_gpus_than_asked_is_unresolvable() -> None:
    spec = node_spec("node-a", gpus=2)
    sick = dataclasses.replace(spec, gpus=(dataclasses.replace(spec.gpus[0], healthy=False), spec.gpus[1]))
    small = node_spec("node-b", gpus=2)
    view = ClusterView()
    nodes: list[NodeSpec] = [sick, small]
    api = MemoryClusterApi()
    for n in nodes:
        api.put_node(n.name, n)
    view.reset([Node.model_validate(n) for n in api.nodes.values()], [])
    view.synced = True
    pod = pod_obj("p", gpu=2)
    ext = Extender(view, api, policy="bestfit")
    assert ext.filter(ExtenderArgs.model_validate({"Pod": pod, "NodeNames": ["node-a", "node-b"]})).NodeNames == [
        "node-b"
    ]
    # Reasons are given when no node fits (a narrowed answer names only the pick).
    r = ext.filter(ExtenderArgs.model_validate({"Pod": pod, "NodeNames": ["node-a"]}))
    assert r.NodeNames == []
    assert "healthy GPUs of an allowed model: 1 < 2 asked" in r.FailedAndUnresolvableNodes["node-a"]
    assert "node-a" not in r.FailedNodes


@pytest.mark.parametrize(
    ("text", "mib"), [("1E9", 954), ("2E9", 1908), ("1.5E10", 14306), ("1e9", 954), ("10Gi", 10240)]
)
def test_upper_case_exponents_are_quantities(text: str, mib: int) -> None:
    req = pod_request(Pod.model_validate(pod_obj("p", memory=text)))
    assert req is not None and req.memory_mib == mib
    # 1E3 is read as 1000 bytes too, and refused as below the floor (a forgotten unit) in those words
    with pytest.raises(InvalidRequest, match=r"sharegpu.io/gpu-memory '1E3' is 1Mi, less than the 256Mi"):
        pod_request(Pod.model_validate(pod_obj("p", memory="1E3")))


def test_upper_case_exponent_of_compute() -> None:
    req = pod_request(Pod.model_validate(pod_obj("p", compute="3E1")))  # type: ignore[arg-type]
    assert req is not None and req.compute_milli == 300


@pytest.mark.parametrize(("text", "shown"), [("-1Gi", "-1024Mi"), ("0", "0Mi"), ("-512Mi", "-512Mi")])
def test_non_positive_memory_is_reported_in_mib(text: str, shown: str) -> None:
    with pytest.raises(InvalidRequest, match="must be positive") as e:
        pod_request(Pod.model_validate(pod_obj("p", memory=text)))
    assert shown in str(e.value)


def test_a_native_sidecar_counts_beside_the_app_containers() -> None:
    """An init container with restartPolicy: Always runs for the pod's whole life: its GPU is not handed on."""
    pod = with_init(pod_obj("p", gpu=1, memory="10Gi"), 1)
    pod["spec"]["initContainers"][0]["restartPolicy"] = "Always"
    request = pod_request(Pod.model_validate(pod))
    assert request is not None and request.gpu_count == 2
    # An ordinary init container after the sidecar runs beside it too.
    pod["spec"]["initContainers"].append(
        {
            "name": "late",
            "image": "x",
            "resources": {"limits": {"sharegpu.io/gpu": "2", "sharegpu.io/gpu-memory": "10Gi"}},
        }
    )
    request = pod_request(Pod.model_validate(pod))
    assert request is not None and request.gpu_count == 3
