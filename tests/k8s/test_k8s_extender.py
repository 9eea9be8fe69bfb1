"""The extender over real loopback HTTP, in the exact kube-scheduler JSON shapes, both node-cache modes."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from k8s_helpers import LoopbackServer, node_obj, node_spec, nodes, pod_obj
from memory_api import MemoryClusterApi

from sharegpu.k8s.cache.view import ClusterView
from sharegpu.k8s.extender.server import Extender, make_app
from sharegpu.k8s.pod_request import pod_request
from sharegpu.kube.schema import Pod
from sharegpu.model.assignment import Assignment, Mechanism
from sharegpu.placement.framework import Decision


class Cluster:
    def __init__(self, srv: LoopbackServer, api: MemoryClusterApi, view: ClusterView, ext: Extender) -> None:
        self.srv, self.api, self.view, self.ext = srv, api, view, ext

    def add_pod(self, obj: dict) -> dict:
        return self.srv.call(lambda: self.api.put_pod(obj))

    def schedule(self, obj: dict, names: list[str]) -> tuple[dict, list[dict], dict]:
        """One cycle as the kube-scheduler runs it: filter, prioritize, then bind on the best host."""
        stored = self.add_pod(obj)
        status, f = self.srv.post("/filter", {"Pod": stored, "Nodes": None, "NodeNames": names})
        assert status == 200
        status, prio = self.srv.post("/prioritize", {"Pod": stored, "Nodes": None, "NodeNames": f["NodeNames"]})
        assert status == 200
        bind: dict = {}
        if prio:
            host = max(prio, key=lambda h: h["Score"])["Host"]
            meta = stored["metadata"]
            _, bind = self.srv.post(
                "/bind",
                {"PodName": meta["name"], "PodNamespace": meta["namespace"], "PodUID": meta["uid"], "Node": host},
            )
        return f, prio, bind


NODE_SPECS = [node_spec("node-a", gpus=1), node_spec("node-b", gpus=2), node_spec("node-v", "V100-16GB", 1)]
NAMES = [s.name for s in NODE_SPECS] + ["cpu-only"]


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    api = MemoryClusterApi()
    for s in NODE_SPECS:
        api.put_node(s.name, s)
    api.put_node("cpu-only")
    view = ClusterView()
    view.reset(nodes(list(api.nodes.values())), [])
    view.synced = True
    ext = Extender(view, api, policy="bestfit")
    with LoopbackServer(make_app(ext)) as srv:
        yield Cluster(srv, api, view, ext)


def test_filter_node_names_mode_explains_each_rejected_node(cluster: Cluster) -> None:
    # Fill node-a's only GPU to 68Gi, node-b's two to 70Gi: 12Gi and 10Gi left, less the 66 MiB that the MPS daemon
    # of each pod there takes (each declares no user: a tenant of its own, a daemon each).
    for name, node in (("big-a", "node-a"), ("big-b0", "node-b"), ("big-b1", "node-b")):
        memory = "68Gi" if node == "node-a" else "70Gi"
        f, _, bind = cluster.schedule(pod_obj(name, memory=memory), [node])
        assert f["NodeNames"] == [node] and bind == {"Error": ""}
    pod = cluster.add_pod(pod_obj("needs-20", memory="20Gi", annotations={"sharegpu.io/gpu-model": "H100-80GB"}))
    status, body = cluster.srv.post("/filter", {"Pod": pod, "Nodes": None, "NodeNames": NAMES})
    assert status == 200
    assert set(body) == {"Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}
    assert body["NodeNames"] == [] and body["Nodes"] is None and body["Error"] == ""
    assert body["FailedNodes"] == {
        "node-a": "largest free share 11.9Gi < 20Gi asked",
        "node-b": "largest free share 9.9Gi < 20Gi asked",
    }
    assert body["FailedAndUnresolvableNodes"]["node-v"] == "no GPU of an allowed model (H100-80GB)"
    assert "no sharegpu.io/inventory annotation" in body["FailedAndUnresolvableNodes"]["cpu-only"]


def test_filter_without_node_cache_returns_the_node_objects_unchanged(cluster: Cluster) -> None:
    pod = cluster.add_pod(pod_obj("small", memory="4Gi", compute=10))
    items = [node_obj(s) for s in NODE_SPECS]
    status, body = cluster.srv.post("/filter", {"Pod": pod, "Nodes": {"items": items}, "NodeNames": None})
    assert status == 200
    assert body["NodeNames"] is None
    # Only the policy's pick is left, every field kept (unknown ones: spec.podCIDR, nodeInfo).
    [picked] = body["Nodes"]["items"]
    assert picked in items
    status, prio = cluster.srv.post("/prioritize", {"Pod": pod, "Nodes": {"items": items}, "NodeNames": None})
    assert status == 200
    assert [h["Host"] for h in prio] == [s.name for s in NODE_SPECS]
    assert all(set(h) == {"Host", "Score"} and 0 <= h["Score"] <= 10 for h in prio)


def test_prioritize_gives_10_to_exactly_the_policy_choice(cluster: Cluster) -> None:
    pod = cluster.add_pod(pod_obj("share", memory="10Gi"))
    names = [s.name for s in NODE_SPECS]
    _, prio = cluster.srv.post("/prioritize", {"Pod": pod, "NodeNames": names})
    req = pod_request(Pod.model_validate(pod))
    assert req is not None
    expected = cluster.srv.call(lambda: cluster.ext.decisions.schedulers.placement().decide(req))
    assert isinstance(expected, Decision)
    tens = [h["Host"] for h in prio if h["Score"] == 10]
    assert tens == [expected.assignment.node]
    assert all(h["Score"] <= 9 for h in prio if h["Host"] != expected.assignment.node)


def test_bind_writes_the_assignment_with_the_binding(cluster: Cluster) -> None:
    _, _, bind = cluster.schedule(
        pod_obj("mps", memory="10Gi", compute=25, annotations={"sharegpu.io/isolation": "memory"}), NAMES
    )
    assert bind == {"Error": ""}
    stored = cluster.api.pods["default/mps"]
    a = Assignment.from_json(stored["metadata"]["annotations"]["sharegpu.io/assignment"])
    assert stored["spec"]["nodeName"] == a.node
    assert (
        a.shares[0].mechanism is Mechanism.MPS and a.shares[0].memory_mib == 10240 and a.shares[0].compute_milli == 250
    )
    assert cluster.srv.call(lambda: cluster.view.ledger.assignments["default/mps"]) == a
    calls = [c for c in cluster.api.calls if "default/mps" in c]
    # One write: the Binding carries the assignment annotation (no separate annotate call to leave behind), and no
    # read: the view has not seen the pod (it does not follow this API here), but prioritize was sent it.
    assert calls == ["bind pod default/mps"]


def test_bind_reads_the_pod_when_neither_the_watch_nor_prioritize_gave_it(cluster: Cluster) -> None:
    stored = cluster.add_pod(pod_obj("unseen", memory="10Gi", compute=25))
    meta = stored["metadata"]
    status, bind = cluster.srv.post(
        "/bind", {"PodName": "unseen", "PodNamespace": "default", "PodUID": meta["uid"], "Node": "node-b"}
    )
    assert status == 200 and bind == {"Error": ""}
    assert [c for c in cluster.api.calls if "default/unseen" in c] == [
        "get pod default/unseen",
        "bind pod default/unseen",
    ]


def test_bind_of_a_replaced_pod_reads_it_and_refuses(cluster: Cluster) -> None:
    """Prioritize saw one incarnation; the bind names another UID: the copy prioritize saw is not used."""
    stored = cluster.add_pod(pod_obj("again", memory="10Gi", compute=25))
    status, _ = cluster.srv.post("/prioritize", {"Pod": stored, "Nodes": None, "NodeNames": ["node-b"]})
    assert status == 200
    status, bind = cluster.srv.post(
        "/bind", {"PodName": "again", "PodNamespace": "default", "PodUID": "another-uid", "Node": "node-b"}
    )
    assert status == 200 and "replaced" in bind["Error"]
    assert "get pod default/again" in cluster.api.calls and "bind pod default/again" not in cluster.api.calls


def test_invalid_pod_is_unresolvable_everywhere_with_the_core_message(cluster: Cluster) -> None:
    pod = pod_obj("bad", compute=150)
    status, body = cluster.srv.post("/filter", {"Pod": pod, "NodeNames": NAMES})
    assert status == 200 and body["NodeNames"] == []
    assert set(body["FailedAndUnresolvableNodes"]) == set(NAMES)
    # Readable through the kube-scheduler, which formats reasons as a Go format string: no bare %.
    assert "GPU compute 150 percent is outside 1–100 percent" in body["FailedAndUnresolvableNodes"]["node-a"]


def test_pod_without_sharegpu_resources_passes_every_node(cluster: Cluster) -> None:
    pod = pod_obj("web", gpu=None)
    _, body = cluster.srv.post("/filter", {"Pod": pod, "NodeNames": NAMES})
    assert body["NodeNames"] == NAMES and body["FailedNodes"] == {}


@pytest.mark.parametrize(
    ("path", "raw", "fragment"),
    [
        ("/filter", b"{not json", "malformed filter request"),
        ("/filter", b'{"NodeNames": ["a"]}', "Pod"),
        ("/prioritize", b"[]", "malformed prioritize request"),
        ("/bind", b'{"PodName": "x"}', "PodNamespace"),
        ("/preempt", b'{"Pod": 3}', "malformed preempt request"),
    ],
)
def test_malformed_bodies_get_400_and_the_extender_keeps_serving(
    cluster: Cluster, path: str, raw: bytes, fragment: str
) -> None:
    status, body = cluster.srv.post(path, None, raw=raw)
    assert status == 400 and fragment in body["error"]
    status, body = cluster.srv.post("/filter", {"Pod": pod_obj("ok", memory="1Gi"), "NodeNames": ["node-a"]})
    assert status == 200 and body["NodeNames"] == ["node-a"]


def test_not_in_sync_means_no_new_binds(cluster: Cluster) -> None:
    cluster.srv.call(lambda: setattr(cluster.view, "synced", False))
    pod = cluster.add_pod(pod_obj("wait", memory="1Gi"))
    _, body = cluster.srv.post("/filter", {"Pod": pod, "NodeNames": ["node-a"]})
    assert "reconnecting" in body["FailedNodes"]["node-a"]
    _, res = cluster.srv.post("/bind", {"PodName": "wait", "PodNamespace": "default", "PodUID": "", "Node": "node-a"})
    assert "reconnecting" in res["Error"]
    assert cluster.srv.get("/readyz")[0] == 503
    assert "spec" in cluster.api.pods["default/wait"] and "nodeName" not in cluster.api.pods["default/wait"]["spec"]


def test_bind_refuses_a_node_without_room_and_leaves_nothing_behind(cluster: Cluster) -> None:
    cluster.schedule(pod_obj("whole", gpu=None, memory=None) | {}, ["node-v"])  # no sharegpu resources: bound as is
    pod = cluster.add_pod(pod_obj("huge", memory="70Gi"))
    _, res = cluster.srv.post(
        "/bind", {"PodName": "huge", "PodNamespace": "default", "PodUID": pod["metadata"]["uid"], "Node": "node-v"}
    )
    assert "cannot bind default/huge" in res["Error"]
    assert "sharegpu.io/assignment" not in cluster.api.pods["default/huge"]["metadata"]["annotations"]
    assert cluster.srv.call(lambda: "default/huge" not in cluster.view.ledger.assignments)


def test_preempt_keeps_only_nodes_where_the_victims_free_enough(cluster: Cluster) -> None:
    for name in ("v1", "v2"):  # two MPS daemons (each pod a tenant of its own) take 132 MiB of the 80Gi beside them
        _, _, bind = cluster.schedule(pod_obj(name, memory="39Gi"), ["node-a"])
        assert bind == {"Error": ""}
    _, _, bind = cluster.schedule(pod_obj("v3", memory="79Gi"), ["node-b"])
    assert bind == {"Error": ""}
    pod = cluster.add_pod(pod_obj("urgent", memory="40Gi"))
    args = {
        "Pod": pod,
        "NodeNameToVictims": None,
        "NodeNameToMetaVictims": {
            "node-a": {"Pods": [{"UID": "uid-default-v1"}], "NumPDBViolations": 0},
            "node-v": {"Pods": [], "NumPDBViolations": 0},
            # urgent fits on node-b's free GPU as it is: no victim, so no candidate (the kube-scheduler logs a node
            # without victims as an error).
            "node-b": {"Pods": [], "NumPDBViolations": 0},
        },
    }
    before = cluster.srv.call(lambda: cluster.view.ledger.state())
    status, body = cluster.srv.post("/preempt", args)
    assert status == 200
    assert body == {"NodeNameToMetaVictims": {"node-a": {"Pods": [{"UID": "uid-default-v1"}], "NumPDBViolations": 0}}}
    assert cluster.srv.call(lambda: cluster.view.ledger.state()) == before  # the what-if was undone


def test_responses_are_exactly_the_go_shapes(cluster: Cluster) -> None:
    pod = cluster.add_pod(pod_obj("shape", memory="1Gi"))
    _, prio = cluster.srv.post("/prioritize", {"Pod": pod, "NodeNames": ["node-a", "nope"]})
    assert prio == [{"Host": "node-a", "Score": 10}, {"Host": "nope", "Score": 0}]
    status, res = cluster.srv.post(
        "/bind", {"PodName": "shape", "PodNamespace": "default", "PodUID": "uid-default-shape", "Node": "node-a"}
    )
    assert status == 200 and json.dumps(res) == '{"Error": ""}'
