"""Extender requests a new user's run found answered wrongly (issue 21), over real loopback HTTP in the exact
kube-scheduler JSON shapes: a filter with no node list, a nameless pod, another scheduler's pod, and nodes that are not
in the ledger for different reasons (no such node, a DRA node, a node without the agent)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from k8s_helpers import LoopbackServer, node_spec, nodes, pod_obj
from memory_api import MemoryClusterApi

from sharegpu.k8s.cache.view import ClusterView
from sharegpu.k8s.extender.server import Extender, make_app
from sharegpu.model.contract import DEVICE_PATH_DRA, DEVICE_PATH_LABEL

FIELDS = {"Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}


class Cluster:
    def __init__(self, srv: LoopbackServer, api: MemoryClusterApi, view: ClusterView) -> None:
        self.srv, self.api, self.view = srv, api, view


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    api = MemoryClusterApi()
    api.put_node("node-a", node_spec("node-a", gpus=1))
    api.put_node("dra-node", labels={DEVICE_PATH_LABEL: DEVICE_PATH_DRA})
    api.put_node("cpu-only")
    view = ClusterView()
    view.reset(nodes(list(api.nodes.values())), [])
    view.synced = True
    with LoopbackServer(make_app(Extender(view, api, policy="bestfit"))) as srv:
        yield Cluster(srv, api, view)


def test_a_filter_without_nodes_is_answered_with_an_error(cluster: Cluster) -> None:
    for body in ({"Pod": pod_obj("p", memory="10Gi")}, {"Pod": pod_obj("p", memory="10Gi"), "NodeNames": None}):
        status, answer = cluster.srv.post("/filter", body)
        assert status == 200 and set(answer) == FIELDS
        assert "names no nodes: it has neither NodeNames" in answer["Error"]
        assert answer["NodeNames"] is None and answer["Nodes"] is None
    assert cluster.view.held("default/p") is None


@pytest.mark.parametrize("mode", ["NodeNames", "Nodes"])
def test_a_pod_without_a_name_gets_an_error_and_nothing_is_held(cluster: Cluster, mode: str) -> None:
    pod = pod_obj("", memory="10Gi")
    body = {"Pod": pod, "NodeNames": ["node-a"]} if mode == "NodeNames" else {"Pod": pod, "Nodes": {"items": []}}
    status, answer = cluster.srv.post("/filter", body)
    assert status == 200 and set(answer) == FIELDS
    assert answer["Error"] == (
        "sharegpu cannot place a pod without a name: the Pod in the request has no metadata.name or metadata.namespace"
    )
    assert cluster.view.held("default/") is None and len(cluster.view.ledger) == 0
    status, prio = cluster.srv.post("/prioritize", {"Pod": pod, "NodeNames": ["node-a"]})
    assert status == 200 and prio == [{"Host": "node-a", "Score": 0}] and len(cluster.view.ledger) == 0


def test_another_schedulers_pod_is_not_placed(cluster: Cluster) -> None:
    pod = pod_obj("other", memory="10Gi", scheduler_name="default-scheduler")
    status, answer = cluster.srv.post("/filter", {"Pod": pod, "NodeNames": ["node-a"]})
    assert status == 200
    assert answer["NodeNames"] is None and answer["FailedNodes"] == {}
    assert "its schedulerName is default-scheduler, not sharegpu-scheduler" in answer["Error"]
    assert "is --scheduler-name the scheduler profile's name?" in answer["Error"]
    assert cluster.view.held("default/other") is None and len(cluster.view.ledger) == 0
    status, prio = cluster.srv.post("/prioritize", {"Pod": pod, "NodeNames": ["node-a"]})
    assert prio == [{"Host": "node-a", "Score": 0}] and len(cluster.view.ledger) == 0
    # A pod that asks for nothing of sharegpu's passes whatever its scheduler: the extender must not stand in the way
    # of another profile's pods when it is not configured with managedResources.
    plain = pod_obj("plain", gpu=None, scheduler_name="default-scheduler")
    _, answer = cluster.srv.post("/filter", {"Pod": plain, "NodeNames": ["node-a", "cpu-only"]})
    assert answer["NodeNames"] == ["node-a", "cpu-only"] and answer["Error"] == ""


WHY = {
    "gone": "node gone does not exist (the API server lists no node of that name)",
    "dra-node": "node dra-node is on the DRA path (sharegpu.io/device-path=dra): its GPUs are handed out through "
    "ResourceClaims of the gpu.sharegpu.io driver, never as sharegpu.io/gpu",
    "cpu-only": "node cpu-only has no sharegpu.io/inventory annotation (is the sharegpu node agent running there?)",
}


@pytest.mark.parametrize("mode", ["NodeNames", "Nodes"])
def test_nodes_outside_the_ledger_are_told_apart_by_filter(cluster: Cluster, mode: str) -> None:
    names = ["node-a", *WHY]
    pod = cluster.api.put_pod(pod_obj("big", memory="90Gi"))  # fits nowhere: every node gets its reason
    if mode == "NodeNames":
        body = {"Pod": pod, "NodeNames": names}
    else:
        body = {"Pod": pod, "Nodes": {"items": [{"metadata": {"name": n}} for n in names]}}
    status, answer = cluster.srv.post("/filter", body)
    assert status == 200 and answer["Error"] == ""
    for name, why in WHY.items():
        assert answer["FailedAndUnresolvableNodes"][name] == why


@pytest.mark.parametrize("node", list(WHY))
def test_nodes_outside_the_ledger_are_told_apart_by_bind(cluster: Cluster, node: str) -> None:
    pod = cluster.srv.call(lambda: cluster.api.put_pod(pod_obj("p", memory="10Gi")))
    meta = pod["metadata"]
    body = {"PodName": "p", "PodNamespace": "default", "PodUID": meta["uid"], "Node": node}
    status, answer = cluster.srv.post("/bind", body)
    assert status == 200 and answer == {"Error": f"cannot bind default/p: {WHY[node]}"}


def test_a_node_deleted_or_relabelled_changes_its_reason(cluster: Cluster) -> None:
    from sharegpu.kube.api import DELETED, MODIFIED
    from sharegpu.kube.schema import Node

    view = cluster.view
    view.apply_node(DELETED, Node.model_validate(cluster.api.nodes["cpu-only"]))
    assert view.node_problem("cpu-only") == "node cpu-only does not exist (the API server lists no node of that name)"
    dra = dict(cluster.api.nodes["dra-node"])
    dra["metadata"] = {**dra["metadata"], "labels": {}}
    view.apply_node(MODIFIED, Node.model_validate(dra))
    assert "has no sharegpu.io/inventory annotation" in view.node_problem("dra-node")
