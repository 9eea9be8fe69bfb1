"""Regression tests of the cluster view's consistency: ordering of objects, binds in flight, leftover and observed
assignments, corrupt inventories, and the extender's /bind and /preempt guards."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import pytest
from k8s_helpers import node_spec, pod_obj
from memory_api import MemoryClusterApi
from starlette.testclient import TestClient

from sharegpu.k8s.cache.assume import Phase
from sharegpu.k8s.cache.view import ClusterView
from sharegpu.k8s.extender.server import Extender, make_app
from sharegpu.k8s.status.report import status_report
from sharegpu.kube.api import DELETED, MODIFIED
from sharegpu.kube.errors import Unavailable
from sharegpu.kube.schema import ExtenderArgs, ExtenderBindingArgs, Node, Pod
from sharegpu.model.contract import ASSIGNMENT_ANNOTATION, FENCE_ANNOTATION
from sharegpu.model.inventory import NodeSpec


def make(specs: list[NodeSpec]) -> tuple[MemoryClusterApi, ClusterView, Extender]:
    api = MemoryClusterApi()
    for s in specs:
        api.put_node(s.name, s)
    view = ClusterView()
    relist(api, view)
    view.synced = True
    return api, view, Extender(view, api, policy="bestfit")


def relist(api: MemoryClusterApi, view: ClusterView) -> None:
    view.reset([Node.model_validate(n) for n in api.nodes.values()], [Pod.model_validate(p) for p in api.pods.values()])


def passed(ext: Extender, pod: dict[str, Any], names: list[str]) -> list[str]:
    r = ext.filter(ExtenderArgs.model_validate({"Pod": pod, "NodeNames": names}))
    return list(r.NodeNames or [])


async def bind(ext: Extender, pod: dict[str, Any], node: str) -> str:
    m = pod["metadata"]
    args = ExtenderBindingArgs(PodName=m["name"], PodNamespace=m["namespace"], PodUID=m["uid"], Node=node)
    return (await ext.bind(args)).Error


def held(view: ClusterView) -> dict[str, list[str]]:
    return {k: [s.gpu_uuid for s in a.shares] for k, a in view.ledger.assignments.items()}


# ----- 3: never let an older object overwrite a newer one -----------------------------------------------------------
def test_a_late_watch_event_does_not_take_a_bound_pods_assignment_away() -> None:
    async def main() -> None:
        api, view, ext = make([node_spec("node-a", gpus=1)])
        first = api.put_pod(pod_obj("first", gpu=1))
        created = Pod.model_validate(first)  # what a lagging watch delivers after the bind
        assert await bind(ext, first, "node-a") == ""
        view.apply_pod("ADDED", created)
        assert held(view) == {"default/first": ["GPU-node-a-0"]}
        second = api.put_pod(pod_obj("second", gpu=1))
        assert passed(ext, second, ["node-a"]) == []
        assert "idle GPUs: 0 < 1 asked" in await bind(ext, second, "node-a")
        # The watch catches up: the annotated (unbound) version, then the bound one; the reservation holds throughout.
        for rv_event in api._events:
            if rv_event[1] == "pod" and rv_event[3]["metadata"]["name"] == "first":
                view.apply_pod(rv_event[2], Pod.model_validate(rv_event[3]))
                assert held(view) == {"default/first": ["GPU-node-a-0"]}
        assert not view.in_flight("default/first")  # seen bound at or after what the bind wrote
        assert view.problems == []

    asyncio.run(main())


def test_a_pod_deleted_while_its_binding_is_in_flight_does_not_come_back() -> None:
    async def main() -> None:
        api, view, ext = make([node_spec("node-a", gpus=1)])
        p = api.put_pod(pod_obj("short", gpu=1))
        view.apply_pod("ADDED", Pod.model_validate(p))
        real = api.bind_pod

        async def bind_then_delete(ns: str, name: str, uid: str, node: str, *args: Any) -> None:
            await real(ns, name, uid, node, *args)
            bound = Pod.model_validate(api.pods[f"{ns}/{name}"])
            api.delete_pod(f"{ns}/{name}")
            view.apply_pod(MODIFIED, bound)  # the watch delivers both events before the Binding's answer
            view.apply_pod(DELETED, Pod.model_validate(api._events[-1][3]))

        api.bind_pod = bind_then_delete  # type: ignore[method-assign]
        assert await bind(ext, p, "node-a") == ""
        assert view.pod("default/short") is None
        assert held(view) == {}
        nxt = api.put_pod(pod_obj("next", gpu=1))
        assert passed(ext, nxt, ["node-a"]) == ["node-a"]

    asyncio.run(main())


def test_deleted_before_the_bind_ends_the_reservation_is_dropped() -> None:
    async def main() -> None:
        api, view, ext = make([node_spec("node-a", gpus=1)])
        p = api.put_pod(pod_obj("gone", gpu=1))
        view.apply_pod("ADDED", Pod.model_validate(p))
        real = api.bind_pod

        async def deleted_first(ns: str, name: str, uid: str, node: str, *args: Any) -> None:
            api.delete_pod(f"{ns}/{name}")
            view.apply_pod(DELETED, Pod.model_validate(api._events[-1][3]))
            await real(ns, name, uid, node, *args)  # NotFound

        api.bind_pod = deleted_first  # type: ignore[method-assign]
        assert "not found" in await bind(ext, p, "node-a")
        assert held(view) == {} and not view.in_flight("default/gone")

    asyncio.run(main())


def test_a_resource_version_that_is_not_a_number_falls_back_to_last_writer_wins() -> None:
    _, view, _ = make([node_spec("node-a", gpus=1)])
    a = pod_obj("p", gpu=1)
    a["metadata"]["resourceVersion"] = "xyz-2"
    view.apply_pod("ADDED", Pod.model_validate(a))
    b = pod_obj("p", gpu=2)
    b["metadata"]["resourceVersion"] = "abc-1"
    view.apply_pod(MODIFIED, Pod.model_validate(b))
    pod = view.pod("default/p")
    assert pod is not None and pod.metadata.resource_version == "abc-1"
    c = pod_obj("p", gpu=1)
    c["metadata"]["resourceVersion"] = "7"
    view.apply_pod(MODIFIED, Pod.model_validate(c))
    d = pod_obj("p", gpu=2)
    d["metadata"]["resourceVersion"] = "5"
    view.apply_pod(MODIFIED, Pod.model_validate(d))  # older: ignored
    pod = view.pod("default/p")
    assert pod is not None and pod.metadata.resource_version == "7"


# ----- 7: a leftover assignment on an unbound pod holds nothing ----------------------------------------------------
def test_a_leftover_assignment_on_an_unbound_pod_holds_nothing_after_a_restart() -> None:
    """An assignment annotation on a pod that is not bound (written by an older extender that annotated before it
    bound) holds nothing, and the pod's next Binding replaces it."""

    async def main() -> None:
        api, _, _ = make([node_spec("node-a", gpus=1)])
        p = api.put_pod(pod_obj("train", gpu=1))
        other = json.dumps({"pod": "default/train", "node": "node-a"})
        stored = api.put_pod(p | {"metadata": p["metadata"] | {"annotations": {ASSIGNMENT_ANNOTATION: other}}})
        view2 = ClusterView()
        relist(api, view2)
        view2.synced = True
        ext2 = Extender(view2, api, policy="bestfit")
        assert held(view2) == {}
        assert passed(ext2, stored, ["node-a"]) == ["node-a"]
        assert await bind(ext2, api.pods["default/train"], "node-a") == ""
        assert api.pods["default/train"]["spec"]["nodeName"] == "node-a"
        assert held(view2) == {"default/train": ["GPU-node-a-0"]}

    asyncio.run(main())


# ----- issue 8: a bind whose outcome is unknown never releases what it reserved ----------------------------------
def test_a_binding_applied_whose_answer_was_lost_is_reported_bound() -> None:
    async def main() -> None:
        api, view, ext = make([node_spec("node-a", gpus=1)])
        p = api.put_pod(pod_obj("train", gpu=1))
        api.lose_bind_answers = 1  # the API server applies the Binding, the answer never arrives
        assert await bind(ext, p, "node-a") == ""
        assert api.pods["default/train"]["spec"]["nodeName"] == "node-a"
        assert held(view) == {"default/train": ["GPU-node-a-0"]}
        late = api.put_pod(pod_obj("late", gpu=1))
        assert passed(ext, late, ["node-a"]) == []
        assert "idle GPUs: 0 < 1 asked" in await bind(ext, late, "node-a")

    asyncio.run(main())


def test_a_bind_whose_pod_the_watch_showed_bound_before_its_answer_is_not_left_in_flight() -> None:
    """The watch may deliver the pod bound before the binder has handled the Binding's answer (the view leaves a bind
    in progress alone then). Once the answer is handled, nothing else would end the bind's entry on a node whose
    pods' status never changes again: the pod stayed "in flight" for good, and so was never a victim of preemption
    (the rig's preemption burst then waited for room that was never made)."""

    async def main() -> None:
        api, view, ext = make([node_spec("node-a", gpus=1)])
        p = api.put_pod(pod_obj("train", gpu=1))
        view.apply_pod("ADDED", Pod.model_validate(p))
        real_bind = api.bind_pod

        async def bind_then_watch(*args: Any, **kw: Any) -> None:
            await real_bind(*args, **kw)
            view.apply_pod(MODIFIED, Pod.model_validate(api.pods["default/train"]))  # before the answer is handled

        api.bind_pod = bind_then_watch  # type: ignore[method-assign]
        assert await bind(ext, p, "node-a") == ""
        assert not view.in_flight("default/train") and view.phase("default/train") is None
        assert held(view) == {"default/train": ["GPU-node-a-0"]}  # now held by its own assignment annotation

    asyncio.run(main())


def test_a_binding_lost_on_its_way_is_sent_again() -> None:
    async def main() -> None:
        api, view, ext = make([node_spec("node-a", gpus=1)])
        p = api.put_pod(pod_obj("train", gpu=1))
        api.drop_binds = 1  # lost before it reached the server
        assert await bind(ext, p, "node-a") == ""
        assert api.pods["default/train"]["spec"]["nodeName"] == "node-a"
        assert [c for c in api.calls if "train" in c].count("bind pod default/train") == 2
        assert held(view) == {"default/train": ["GPU-node-a-0"]}

    asyncio.run(main())


def test_an_unknown_outcome_keeps_the_reservation_until_the_pod_is_known_unbound() -> None:
    async def main() -> None:
        api, view, ext = make([node_spec("node-a", gpus=1)])
        p = api.put_pod(pod_obj("train", gpu=1))
        view.apply_pod("ADDED", Pod.model_validate(p))  # the watch delivered it: bind needs no read
        real_get = api.get_pod

        async def unreachable(*args: Any) -> Pod:
            raise Unavailable("cannot read pod: ConnectTimeout")

        rv0 = p["metadata"]["resourceVersion"]
        api.drop_binds = 10  # every Binding lost, and the pod cannot be read back either
        api.get_pod = unreachable  # type: ignore[method-assign]
        error = await bind(ext, p, "node-a")
        assert "stay reserved" in error
        assert view.phase("default/train") is Phase.UNKNOWN
        assert held(view) == {"default/train": ["GPU-node-a-0"]}  # not released: it may be bound
        other = api.put_pod(pod_obj("other", gpu=1))
        assert passed(ext, other, ["node-a"]) == []  # nobody else gets the GPU meanwhile

        # The API server is back: the pod is read back unbound at the lost Binding's version, and moved past it
        # (so that Binding can never apply); only then is the reservation released.
        api.get_pod = real_get  # type: ignore[method-assign]
        api.drop_binds = 0
        await ext.binder.settle_unknown("default/train")
        assert view.phase("default/train") is None
        assert api.pods["default/train"]["metadata"]["annotations"][FENCE_ANNOTATION] == rv0
        assert held(view) == {}
        assert await bind(ext, other, "node-a") == ""

    asyncio.run(main())


def test_an_unknown_outcome_is_settled_by_the_watch_showing_the_pod_bound() -> None:
    async def main() -> None:
        api, view, ext = make([node_spec("node-a", gpus=1)])
        p = api.put_pod(pod_obj("train", gpu=1))
        view.apply_pod("ADDED", Pod.model_validate(p))  # the watch delivered it: bind needs no read
        real_get = api.get_pod

        async def unreachable(*args: Any) -> Pod:
            raise Unavailable("cannot read pod: ConnectTimeout")

        api.lose_bind_answers = 1  # applied, answer lost, and no read-back possible
        api.get_pod = unreachable  # type: ignore[method-assign]
        assert "stay reserved" in await bind(ext, p, "node-a")
        assert view.phase("default/train") is Phase.UNKNOWN
        api.get_pod = real_get  # type: ignore[method-assign]
        view.apply_pod(MODIFIED, Pod.model_validate(api.pods["default/train"]))  # the watch: bound
        assert view.phase("default/train") is None
        assert held(view) == {"default/train": ["GPU-node-a-0"]}  # now held by the pod's own annotation
        # A retry of the same pod by the scheduler finds it bound and changes nothing.
        assert "already bound" in await bind(ext, p, "node-a")
        assert held(view) == {"default/train": ["GPU-node-a-0"]}

    asyncio.run(main())


def test_a_stale_cached_pod_is_bound_at_its_current_version() -> None:
    async def main() -> None:
        api, view, ext = make([node_spec("node-a", gpus=1)])
        p = api.put_pod(pod_obj("train", gpu=1))
        view.apply_pod("ADDED", Pod.model_validate(p))
        api.put_pod(api.pods["default/train"] | {"status": {"phase": "Pending"}})  # changed; the watch lags
        assert await bind(ext, p, "node-a") == ""
        assert api.pods["default/train"]["spec"]["nodeName"] == "node-a"

    asyncio.run(main())


# ----- 4: an unhealthy GPU does not drop an observed assignment -----------------------------------------------------
def test_one_unhealthy_gpu_keeps_the_whole_observed_assignment() -> None:
    async def main() -> None:
        spec = node_spec("node-a", gpus=2)
        api, view, ext = make([spec])
        big = api.put_pod(pod_obj("big", gpu=2))
        assert await bind(ext, big, "node-a") == ""
        view.apply_pod(MODIFIED, Pod.model_validate(api.pods["default/big"]))
        sick = dataclasses.replace(spec, gpus=(dataclasses.replace(spec.gpus[0], healthy=False), spec.gpus[1]))
        api.put_node("node-a", sick)
        view.apply_node(MODIFIED, Node.model_validate(api.nodes["node-a"]))
        assert held(view) == {"default/big": ["GPU-node-a-0", "GPU-node-a-1"]}
        assert view.problems == []
        new = api.put_pod(pod_obj("new", gpu=1))
        assert passed(ext, new, ["node-a"]) == []
        assert await bind(ext, new, "node-a") != ""
        # A restart sees the same.
        view2 = ClusterView()
        relist(api, view2)
        assert held(view2) == {"default/big": ["GPU-node-a-0", "GPU-node-a-1"]}
        # New placements still avoid the unhealthy GPU.
        api.delete_pod("default/big")
        view.apply_pod(DELETED, Pod.model_validate(api._events[-1][3]))
        assert await bind(ext, api.pods["default/new"], "node-a") == ""
        assert held(view)["default/new"] == ["GPU-node-a-1"]

    asyncio.run(main())


# ----- 8: one corrupt node inventory leaves only that node out --------------------------------------------------
def test_a_node_whose_inventory_cannot_be_accounted_is_left_out_and_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sharegpu.k8s.cache import ledger_view as view_module

    real = view_module.Ledger

    class PickyLedger(real):  # type: ignore[misc, valid-type]
        def __init__(self, nodes: Any, catalog: Any = None, tenancy: Any = None) -> None:
            nodes = list(nodes)
            if any(n.name == "node-bad" for n in nodes):
                raise ValueError("overlapping static MIG instances")
            super().__init__(nodes, catalog, tenancy)

    monkeypatch.setattr(view_module, "Ledger", PickyLedger)
    api = MemoryClusterApi()
    api.put_node("node-good", node_spec("node-good", gpus=1))
    api.put_node("node-bad", node_spec("node-bad", gpus=1))
    view = ClusterView()
    relist(api, view)
    assert [n.name for n in view.ledger.nodes] == ["node-good"]
    assert [(p.kind, p.name) for p in view.problems] == [("node", "node-bad")]
    assert "overlapping static MIG instances" in view.node_problem("node-bad")
    report = status_report(view)
    assert [n["name"] for n in report["nodes"]] == ["node-good"]
    assert report["problems"][0]["name"] == "node-bad"


def test_duplicate_static_mig_instances_are_an_invalid_inventory() -> None:
    d = node_spec("node-bad", "A100-80GB", 1).to_dict()
    d["gpus"][0]["migEnabled"] = True
    d["gpus"][0]["migStatic"] = [{"profile": "3g.40gb", "start": 0}, {"profile": "3g.40gb", "start": 0}]
    api = MemoryClusterApi()
    api.put_node("node-good", node_spec("node-good", gpus=1))
    api.put_node("node-bad", json.dumps(d))
    view = ClusterView()
    relist(api, view)
    assert [n.name for n in view.ledger.nodes] == ["node-good"]
    assert "node-bad" in view.problems[0].reason and "twice" in view.problems[0].reason
    assert status_report(view)["problems"]

    async def follow() -> None:
        stop = asyncio.Event()
        task = asyncio.ensure_future(view.follow(api, stop))
        for _ in range(200):
            if view.synced:
                break
            await asyncio.sleep(0.01)
        assert view.synced
        stop.set()
        await asyncio.wait_for(task, 5)

    asyncio.run(follow())


# ----- 5: /bind binds only the sharegpu scheduler's pods; /preempt restores exactly what it released --------------
def test_bind_refuses_pods_of_other_schedulers_and_pods_without_sharegpu_resources() -> None:
    api, _, ext = make([node_spec("node-a", gpus=1)])
    api.put_node("control-plane")
    api.put_pod(pod_obj("coredns", namespace="kube-system", gpu=None, scheduler_name="default-scheduler"))
    api.put_pod(pod_obj("plain", gpu=None))  # the sharegpu scheduler's, but asks for nothing of sharegpu's
    api.put_pod(pod_obj("other", gpu=1, scheduler_name="default-scheduler"))
    client = TestClient(make_app(ext))
    for ns, name in (("kube-system", "coredns"), ("default", "plain"), ("default", "other")):
        r = client.post("/bind", json={"PodName": name, "PodNamespace": ns, "PodUID": "", "Node": "control-plane"})
        assert r.status_code == 200 and r.json()["Error"], name
        assert not api.pods[f"{ns}/{name}"]["spec"].get("nodeName")
    assert (
        "schedulerName"
        in client.post(
            "/bind", json={"PodName": "coredns", "PodNamespace": "kube-system", "PodUID": "", "Node": "node-a"}
        ).json()["Error"]
    )


def test_preempt_with_a_victim_listed_twice_restores_the_ledger() -> None:
    async def setup() -> tuple[MemoryClusterApi, ClusterView, Extender]:
        api, view, ext = make([node_spec("node-a", gpus=1)])
        v = api.put_pod(pod_obj("victim", gpu=1))
        assert await bind(ext, v, "node-a") == ""
        view.apply_pod(MODIFIED, Pod.model_validate(api.pods["default/victim"]))
        return api, view, ext

    api, view, ext = asyncio.run(setup())
    before = held(view)
    uid = api.pods["default/victim"]["metadata"]["uid"]
    pre = api.put_pod(pod_obj("preemptor", gpu=1))
    body = {
        "Pod": pre,
        "NodeNameToMetaVictims": {
            "node-a": {"Pods": [{"UID": uid}, {"UID": uid}, {"UID": "not-a-pod"}], "NumPDBViolations": 0}
        },
    }
    r = TestClient(make_app(ext)).post("/preempt", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["NodeNameToMetaVictims"]["node-a"]["Pods"] == [{"UID": uid}, {"UID": "not-a-pod"}]
    assert held(view) == before
    view.ledger.check_invariants()
    assert passed(ext, pre, ["node-a"]) == []
