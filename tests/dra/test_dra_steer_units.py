"""DRA steering in the extender: the DRA nodes' state from slices, claims, nodes and pods, and /dra/filter."""

from __future__ import annotations

from typing import Any

import pytest

from sharegpu.k8s.cache.view import ClusterView
from sharegpu.k8s.extender.dra_steer import DraSteering, NotSteered, Steer, claim_names, claim_request
from sharegpu.k8s.extender.server import Extender
from sharegpu.kube.schema import ExtenderArgs, Node, Pod, ResourceClaim, ResourceSlice
from sharegpu.ledger import MPS_DAEMON_MEMORY_MIB, Ledger
from sharegpu.model.request import GpuRequest
from sharegpu.node.backends.base import DeviceInfo
from sharegpu.node.dra.slices import build_slices, resource_slice


def a100(node: str, i: int) -> DeviceInfo:
    return DeviceInfo(i, f"GPU-{node}-{i}", "NVIDIA A100-SXM4-80GB", "A100-80GB", 81920, 108, False)


def node_obj(name: str, dra: bool = True) -> dict[str, Any]:
    labels = {"sharegpu.io/device-path": "dra"} if dra else {}
    return {
        "metadata": {"name": name, "labels": labels},
        "status": {"allocatable": {"cpu": "64", "memory": "256Gi"}},
    }


def slices(name: str, gpus: int = 2) -> list[dict[str, Any]]:
    specs = build_slices(name, [a100(name, i) for i in range(gpus)])
    return [resource_slice(s, name, 1, len(specs), {"name": name, "uid": "u"}) for s in specs]


def claim(name: str, memory: str | None = "10Gi", compute: str | None = "25", cls: str = "gpu.sharegpu.io",
          allocated: tuple[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    asked = {k: v for k, v in (("memory", memory), ("compute", compute)) if v is not None}
    exact: dict[str, Any] = {"deviceClassName": cls}
    if asked:
        exact["capacity"] = {"requests": asked}
    obj: dict[str, Any] = {
        "metadata": {"namespace": "ml", "name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exact}]}},
    }
    if allocated is not None:
        result: dict[str, Any] = {"driver": "gpu.sharegpu.io", "pool": allocated[0], "device": allocated[1],
                                  "request": "gpu"}  # fmt: skip
        if asked:
            result["consumedCapacity"] = asked
        obj["status"] = {"allocation": {"devices": {"results": [result]}}}
    return obj


def pod(name: str, claim_name: str | None = None, uid: str = "") -> Pod:
    spec: dict[str, Any] = {
        "containers": [{"name": "m", "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}}],
    }
    if claim_name:
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim_name}]
    return Pod.model_validate({"metadata": {"namespace": "ml", "name": name, "uid": uid or name}, "spec": spec})


class Steering:
    """The cluster view with DRA steering on (one cache: its DRA ledger and assume cache) and the steering decision
    over it, fed the API objects as JSON, as the informer would."""

    def __init__(self) -> None:
        self.view = ClusterView(follow_dra=True)
        assert self.view.dra is not None
        self.dra = self.view.dra
        self.steering = DraSteering(self.dra)

    def apply(self, kind: str, event: str, obj: dict[str, Any]) -> None:
        if kind == "node":
            self.view.apply_node(event, Node.model_validate(obj))
        elif kind == "slice":
            self.view.apply_slice(event, ResourceSlice.model_validate(obj))
        elif kind == "claim":
            self.view.apply_claim(event, ResourceClaim.model_validate(obj))
        else:
            self.view.apply_pod(event, Pod.model_validate(obj))

    def steer(self, p: Pod, nodes: list[str]) -> Steer:
        return self.steering.steer(p, nodes, None, self.view.synced)

    def ledger(self) -> Ledger:
        return self.dra.ledger()

    @property
    def holds(self) -> set[str]:
        return {h.uid for h in self.dra.holds()}


def state(nodes: tuple[str, ...] = ("a", "b", "c"), claims: list[dict[str, Any]] = ()) -> Steering:  # type: ignore[assignment]
    s = Steering()
    s.view.relisted(
        [Node.model_validate(node_obj(n)) for n in nodes],
        [],
        [ResourceSlice.model_validate(x) for n in nodes for x in slices(n)],
        [ResourceClaim.model_validate(c) for c in claims],
    )
    s.view.synced = True
    return s


def typed(claims: list[dict[str, Any]]) -> list[ResourceClaim]:
    return [ResourceClaim.model_validate(c) for c in claims]


def test_claim_request_reads_capacity_requests() -> None:
    r = claim_request("ml/p", typed([claim("c", "10Gi", "30")]), 1000, 1024)
    assert (r.gpu_count, r.memory_mib, r.compute_milli, r.cpu_milli) == (1, 10240, 300, 1000)
    # compute left out is the whole compute (the driver's request policy default)
    assert claim_request("ml/p", typed([claim("c", "10Gi", None)]), 0, 0).compute_milli == 1000
    assert claim_request("ml/p", typed([claim("c", None, None)]), 0, 0) == GpuRequest("ml/p", 1)
    assert claim_request("ml/p", typed([claim("c", "10Gi", "30", cls="whole-gpu.sharegpu.io")]), 0, 0).is_whole


@pytest.mark.parametrize(
    ("claims", "why"),
    [
        ([claim("c", cls="other.example.com")], "is not one of"),
        ([claim("c", cls="mig.sharegpu.io")], "one CEL selector names its profile"),
        ([claim("c"), claim("d")], "several device requests"),
        ([{"spec": {"devices": {"requests": [{"name": "g", "firstAvailable": []}]}}}], "firstAvailable"),
        ([{"spec": {}}], "no device"),
    ],
)
def test_claims_steering_cannot_judge_are_named(claims: list[dict[str, Any]], why: str) -> None:
    with pytest.raises(NotSteered, match=why):
        claim_request("ml/p", typed(claims), 0, 0)


def test_claim_names_from_templates_come_from_the_pod_status() -> None:
    p: dict[str, Any] = {"spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "t"}]}}
    with pytest.raises(NotSteered, match="not made from its template yet"):
        claim_names(Pod.model_validate(p))
    p["status"] = {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "p-gpu-x1"}]}
    assert claim_names(Pod.model_validate(p)) == ["p-gpu-x1"]


def test_ledger_holds_the_dra_nodes_gpus_and_what_claims_consume() -> None:
    s = state(claims=[claim("x", "10Gi", "30", allocated=("b", "gpu-1")), claim("pending")])
    s.apply("node", "ADDED", node_obj("plugin", dra=False))
    s.apply("slice", "ADDED", slices("plugin")[0])
    led = s.ledger()
    assert [n.name for n in led.nodes] == ["a", "b", "c"]  # a node not on the DRA path is left out
    b = led.index["b"]
    assert led.free_milli[b].tolist()[:2] == [1000, 700]
    # The claim's share and the server of the MPS daemon that serves it (the ledger counts each daemon's).
    assert led.free_mem[b].tolist()[:2] == [81920, 81920 - 10240 - MPS_DAEMON_MEMORY_MIB]


def test_steer_packs_onto_the_used_gpu_and_holds_the_choice() -> None:
    s = state(claims=[claim("x", allocated=("b", "gpu-0")), claim("p1"), claim("p2")])
    got = s.steer(pod("p1", "p1"), ["a", "b", "c"])
    assert got.keep == ["b"] and got.assignment is not None and got.assignment.shares[0].gpu_index == 0
    # p1's claim is not allocated yet: its hold counts for p2, which still packs onto b's GPU 0
    assert s.ledger().free_milli[s.ledger().index["b"]][0] == 500
    assert s.steer(pod("p2", "p2"), ["a", "b", "c"]).keep == ["b"]
    # once p1's claim is seen allocated the hold goes (the allocation accounts it)
    s.apply("claim", "MODIFIED", claim("p1", allocated=("b", "gpu-0")))
    s.ledger()
    assert "p1" not in s.holds and "p2" in s.holds


def test_steer_keeps_only_candidates_the_scheduler_gave() -> None:
    s = state(claims=[claim("x", allocated=("b", "gpu-0")), claim("p1")])
    assert s.steer(pod("p1", "p1"), ["a", "c"]).keep in (["a"], ["c"])


def test_steer_passes_every_node_when_it_cannot_judge() -> None:
    s = state(claims=[claim("m", cls="mig.sharegpu.io")])
    nodes = ["a", "b", "c"]
    assert s.steer(pod("plain"), nodes).keep == nodes
    assert s.steer(pod("m", "m"), nodes).keep == nodes
    assert s.steer(pod("unseen", "unseen"), nodes).why.endswith("not seen yet")
    s.view.synced = False
    assert s.steer(pod("m", "m"), nodes).why == "DRA state not synced"
    # nothing fits in the model (e.g. every GPU used): the scheduler's own DRA filter decides
    full = state(("a",), [claim(f"w{i}", None, None, allocated=("a", f"gpu-{i}")) for i in range(2)] + [claim("p")])
    assert full.steer(pod("p", "p"), ["a"]).keep == ["a"]


def test_pods_bound_to_dra_nodes_count_their_cpu() -> None:
    s = state(("a",))
    bound = pod("r").model_dump(mode="json", by_alias=True)
    bound["spec"]["nodeName"] = "a"
    bound["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "10"
    s.apply("pod", "ADDED", bound)
    s.apply("pod", "ADDED", pod("unbound").model_dump(mode="json", by_alias=True))
    led = s.ledger()
    assert led.cpu_free[0] == 54_000


def test_extender_dra_filter_returns_the_pick_and_passes_others_over() -> None:
    s = state(claims=[claim("x", allocated=("b", "gpu-0")), claim("p1")])
    ext = Extender(s.view, None, policy="bestfit")
    args = ExtenderArgs.model_validate({"Pod": pod("p1", "p1").model_dump(mode="json", by_alias=True),
                                        "NodeNames": ["a", "b", "c"]})  # fmt: skip
    out = ext.dra_filter(args)
    assert out.NodeNames == ["b"]
    assert set(out.FailedNodes or {}) == {"a", "c"} and not out.FailedAndUnresolvableNodes
    # steering off: every node passes
    off = Extender(ClusterView(), None, policy="bestfit").dra_filter(args)
    assert off.NodeNames == ["a", "b", "c"]


def test_the_ledger_follows_events_incrementally_as_a_rebuild_would() -> None:
    s = state()
    led = s.ledger()
    s.apply("claim", "ADDED", claim("x", "10Gi", "30", allocated=("a", "gpu-0")))
    s.apply("claim", "ADDED", claim("y", "20Gi", "50", allocated=("a", "gpu-0")))
    s.apply("claim", "ADDED", claim("w", None, None, allocated=("c", "gpu-1")))
    s.apply("claim", "MODIFIED", claim("x", "10Gi", "30", allocated=("b", "gpu-1")))  # moved (re-allocated)
    s.apply("claim", "DELETED", claim("y"))
    bound = pod("r").model_dump(mode="json", by_alias=True)
    bound["spec"]["nodeName"] = "c"
    s.apply("pod", "ADDED", bound)
    assert s.ledger() is led  # no rebuild for claims and pods
    fresh = state(claims=[claim("x", "10Gi", "30", allocated=("b", "gpu-1")),
                          claim("w", None, None, allocated=("c", "gpu-1"))])  # fmt: skip
    fresh.apply("pod", "ADDED", bound)
    for field in ("free_milli", "free_mem", "cpu_free", "mem_free"):
        assert getattr(led, field).tolist() == getattr(fresh.ledger(), field).tolist(), field
    led.check_invariants()
    # a node leaving the DRA path rebuilds the ledger without it
    s.apply("node", "MODIFIED", node_obj("c", dra=False))
    assert [n.name for n in s.ledger().nodes] == ["a", "b"]
    s.apply("pod", "DELETED", bound)
    assert s.ledger().cpu_free.tolist() == [64_000, 64_000]


def test_an_expired_hold_stops_counting() -> None:
    s = state(claims=[claim("p1")])
    s.steering.hold_s = 0.0
    got = s.steer(pod("p1", "p1"), ["a", "b", "c"])
    assert got.assignment is not None
    led = s.ledger()  # the hold expired at once
    assert not s.holds and int(led.free_milli.sum()) == 6 * 1000


def mig_claim(name: str, profile: str, allocated: tuple[str, str] | None = None) -> dict[str, Any]:
    sel = f'device.attributes["gpu.sharegpu.io"].profile == "{profile}"'
    obj = claim(name, None, None, cls="mig.sharegpu.io", allocated=allocated)
    obj["spec"]["devices"]["requests"][0]["exactly"]["selectors"] = [{"cel": {"expression": sel}}]
    return obj


def test_mig_claims_are_read_and_their_partitions_accounted() -> None:
    r = claim_request("ml/p", typed([mig_claim("c", "3g.40gb")]), 0, 0)
    assert (r.mig_profile, r.gpu_count) == ("3g.40gb", 1)
    s = state(("a",), [mig_claim("m", "3g.40gb", allocated=("a", "gpu-0-mig-3g40gb-4"))])
    led = s.ledger()
    assert sorted(led.instances_on(0, 0)) == [4]  # the 3g instance at slot 4, as allocated
    assert led.instances_on(0, 0)[4].profile.name == "3g.40gb"
    led.check_invariants()


def test_a_mig_pod_is_steered_to_a_gpu_already_partitioned_not_a_shared_or_idle_one() -> None:
    # a: GPU 0 shared (no MIG possible), GPU 1 idle; b: GPU 0 has a 3g at slot 4, GPU 1 idle. First fit on a takes
    # its idle GPU 1 (opening a GPU); on b it takes the partitioned GPU 0: the steered pick is b.
    s = state(("a", "b"), [claim("x", allocated=("a", "gpu-0")),
                           mig_claim("m", "3g.40gb", allocated=("b", "gpu-0-mig-3g40gb-4")),
                           mig_claim("p", "3g.40gb")])  # fmt: skip
    got = s.steer(pod("p", "p"), ["a", "b"])
    assert got.keep == ["b"], got.why
    assert got.assignment is not None and got.assignment.shares[0].gpu_index == 0
    assert got.assignment.shares[0].mig is not None and got.assignment.shares[0].mig.start == 0


def test_a_held_choice_is_replaced_by_its_allocation_even_on_a_full_gpu() -> None:
    # Three quarters of b's GPU 0 allocated; the fourth pod is held there; when its claim is seen allocated the
    # hold must give way first, or the allocation would not fit beside it and the GPU would look a quarter free.
    s = state(("b",), [claim(f"x{i}", allocated=("b", "gpu-0")) for i in range(3)] + [claim("p4"), claim("p5")])
    assert s.steer(pod("p4", "p4"), ["b"]).assignment is not None
    s.apply("claim", "MODIFIED", claim("p4", allocated=("b", "gpu-0")))
    led = s.ledger()
    assert led.free_milli[0].tolist()[:2] == [0, 1000]
    got = s.steer(pod("p5", "p5"), ["b"])
    assert got.assignment is not None and got.assignment.shares[0].gpu_index == 1
