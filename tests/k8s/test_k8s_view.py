"""The cluster view: watch → ledger, rebuild after restart, corrupt annotations, losing the API server, racing binds."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import pytest
from k8s_helpers import node_spec, pod_obj
from memory_api import MemoryClusterApi

from sharegpu.k8s.cache.view import ClusterView
from sharegpu.k8s.extender.server import Extender
from sharegpu.kube.schema import ExtenderBindingArgs
from sharegpu.model.assignment import Assignment, GpuShare, Mechanism, MigSlot
from sharegpu.model.contract import ASSIGNMENT_ANNOTATION
from sharegpu.model.inventory import GpuDevice, NodeSpec


async def until(cond: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


def run(body: Callable[[MemoryClusterApi, ClusterView, Extender], Awaitable[None]], latency_s: float = 0.0) -> None:
    async def main() -> None:
        api = MemoryClusterApi(latency_s=latency_s)
        view = ClusterView()
        stop = asyncio.Event()
        task = asyncio.ensure_future(view.follow(api, stop, max_backoff_s=0.05))
        try:
            await body(api, view, Extender(view, api, policy="bestfit"))
        finally:
            stop.set()
            await asyncio.wait_for(task, 5)

    asyncio.run(main())


async def bind(ext: Extender, api: MemoryClusterApi, key: str, node: str) -> str:
    ns, name = key.split("/")
    uid = api.pods[key]["metadata"]["uid"]
    return (await ext.bind(ExtenderBindingArgs(PodName=name, PodNamespace=ns, PodUID=uid, Node=node))).Error


MIG_NODE = NodeSpec(
    "node-mig",
    64000,
    262144,
    (
        GpuDevice(0, "GPU-mig-0", "A100-80GB", mig_enabled=True, mig_instances=(MigSlot("3g.40gb", 4),)),
        GpuDevice(1, "GPU-mig-1", "A100-80GB"),
    ),
)


def test_watch_keeps_the_ledger_current_and_releases_finished_and_deleted_pods() -> None:
    async def body(api: MemoryClusterApi, view: ClusterView, ext: Extender) -> None:
        api.put_node("node-a", node_spec("node-a", gpus=2))
        await until(lambda: view.synced and view.node_spec("node-a") is not None, "node-a")
        for i in range(3):
            api.put_pod(pod_obj(f"p{i}", memory="20Gi"))
        await until(lambda: view.pod("default/p2") is not None, "pods")
        for i in range(3):
            assert await bind(ext, api, f"default/p{i}", "node-a") == ""
        await until(
            lambda: view.pod("default/p2") is not None and view.pod("default/p2").spec.node_name == "node-a", "bound"
        )
        assert len(view.ledger) == 3
        api.set_phase("default/p0", "Succeeded")
        api.set_phase("default/p1", "Failed")
        api.delete_pod("default/p2")
        await until(lambda: len(view.ledger) == 0, "releases")
        view.ledger.check_invariants()
        # An inventory change (a GPU turned unhealthy) reshapes the ledger.
        spec = node_spec("node-a", gpus=2)
        sick = NodeSpec(
            spec.name,
            spec.cpu_milli,
            spec.memory_mib,
            (spec.gpus[0], GpuDevice(1, spec.gpus[1].uuid, "H100-80GB", healthy=False)),
        )
        api.put_node("node-a", sick)
        await until(lambda: not bool(view.ledger.healthy[0, 1]), "unhealthy GPU")

    run(body)


def test_rebuild_after_restart_equals_the_state_before() -> None:
    async def body(api: MemoryClusterApi, view: ClusterView, ext: Extender) -> None:
        api.put_node("node-a", node_spec("node-a", gpus=2))
        api.put_node("node-b", node_spec("node-b", "V100-16GB", 4))
        api.put_node(MIG_NODE.name, MIG_NODE)
        shapes = [
            dict(memory="10Gi", compute=20, annotations={"sharegpu.io/isolation": "memory"}),
            dict(memory="4Gi"),
            dict(gpu=2),
            dict(memory="10Gi", annotations={"sharegpu.io/isolation": "hardware"}),
            dict(memory="30Gi", annotations={"sharegpu.io/sharing": "mig"}),
            dict(compute=50, annotations={"sharegpu.io/sharing": "time-slicing"}),
        ]
        for i, kw in enumerate(shapes * 2):
            api.put_pod(pod_obj(f"p{i}", **kw))
        await until(lambda: view.pod("default/p11") is not None, "pods")
        bound = 0
        for i in range(len(shapes) * 2):
            for node in ("node-mig", "node-a", "node-b"):
                if await bind(ext, api, f"default/p{i}", node) == "":
                    bound += 1
                    break
        assert bound >= 8
        api.set_phase("default/p1", "Succeeded")
        api.delete_pod("default/p3")
        await until(lambda: "default/p1" not in view.ledger and view.pod("default/p3") is None, "releases")
        view.ledger.check_invariants()
        assert any(view.ledger.instances.values())  # MIG instances are part of what must be rebuilt
        before = view.ledger.state()

        restarted = ClusterView()
        nodes, _ = await api.list_nodes()
        pods, _ = await api.list_pods()
        restarted.reset(nodes, pods)
        assert restarted.ledger.state() == before
        restarted.ledger.check_invariants()

    run(body)


def test_corrupt_assignments_are_reported_and_excluded_never_fatal(caplog: pytest.LogCaptureFixture) -> None:
    async def body(api: MemoryClusterApi, view: ClusterView, ext: Extender) -> None:
        api.put_node("node-a", node_spec("node-a", gpus=1))
        api.put_node("node-x", "{broken json")
        good = Assignment("default/good", "node-a", (GpuShare(0, "GPU-node-a-0", Mechanism.MPS, 300, 8192),))
        bad_gpu = Assignment("default/wrong-gpu", "node-a", (GpuShare(0, "GPU-elsewhere", Mechanism.MPS, 100, 1024),))
        stolen = Assignment("default/good", "node-a", (GpuShare(0, "GPU-node-a-0", Mechanism.MPS, 100, 1024),))
        greedy = Assignment("default/greedy", "node-a", (GpuShare(0, "GPU-node-a-0", Mechanism.MPS, 900, 1024),))
        for name, text in (
            ("good", good.to_json()),
            ("garbage", "not json at all"),
            ("wrong-gpu", bad_gpu.to_json()),
            ("stolen", stolen.to_json()),
            ("greedy", greedy.to_json()),
        ):
            pod = pod_obj(
                name, memory="1Gi", annotations={ASSIGNMENT_ANNOTATION: text}, node_name="node-a", phase="Running"
            )
            api.put_pod(pod)
        await until(lambda: view.synced and view.pod("default/greedy") is not None, "pods")
        led = view.ledger
        assert set(led.assignments) == {"default/good"}  # greedy would over-commit the GPU: left out
        led.check_invariants()
        reasons = {p.name: p.reason for p in view.problems}
        assert "not valid JSON" in reasons["default/garbage"]
        assert "GPU-elsewhere" in reasons["default/wrong-gpu"]
        assert "belongs to pod default/good" in reasons["default/stolen"]
        assert "700 milli" in reasons["default/greedy"] or "free" in reasons["default/greedy"]
        assert "node-x" in reasons and "not valid JSON" in reasons["node-x"]
        assert any("not accounted for" in r.message for r in caplog.records)
        # The view keeps working: the corrupt pod is fixed by its owner and is then accounted.
        fixed = pod_obj("garbage", memory="1Gi", node_name="node-a", phase="Running")
        fixed["metadata"]["annotations"][ASSIGNMENT_ANNOTATION] = Assignment(
            "default/garbage", "node-a", (GpuShare(0, "GPU-node-a-0", Mechanism.MPS, 100, 1024),)
        ).to_json()
        api.put_pod(fixed)
        await until(lambda: "default/garbage" in view.ledger, "fixed pod")
        assert "default/garbage" not in {p.name for p in view.problems}

    with caplog.at_level(logging.WARNING):
        run(body)


def test_losing_the_api_server_stops_binds_and_recovers_by_itself() -> None:
    async def body(api: MemoryClusterApi, view: ClusterView, ext: Extender) -> None:
        api.put_node("node-a", node_spec("node-a", gpus=1))
        api.put_pod(pod_obj("p", memory="8Gi"))
        await until(lambda: view.synced and view.pod("default/p") is not None, "sync")
        api.down = True
        api.break_watches()
        await until(lambda: not view.synced, "lost sync")
        assert "reconnecting" in await bind(ext, api, "default/p", "node-a")
        # While it was away, a pod was bound by someone else: the relist must account for it.
        other = pod_obj("other", memory="76Gi", node_name="node-a", phase="Running")
        other["metadata"]["annotations"][ASSIGNMENT_ANNOTATION] = Assignment(
            "default/other", "node-a", (GpuShare(0, "GPU-node-a-0", Mechanism.MPS, 950, 77824),)
        ).to_json()
        api.pods["default/other"] = other
        api.down = False
        await until(lambda: view.synced, "resync")
        assert "default/other" in view.ledger
        # 4Gi left, less the 66 MiB that other's MPS daemon takes.
        assert "largest free share 3.9Gi < 8Gi asked" in await bind(ext, api, "default/p", "node-a")

    run(body)


def test_two_binds_racing_for_the_last_share_never_both_succeed() -> None:
    async def body(api: MemoryClusterApi, view: ClusterView, ext: Extender) -> None:
        api.put_node("node-a", node_spec("node-a", gpus=1))
        api.put_pod(pod_obj("first", memory="60Gi"))
        api.put_pod(pod_obj("x", memory="15Gi"))
        api.put_pod(pod_obj("y", memory="15Gi"))
        await until(lambda: view.synced and view.pod("default/y") is not None, "sync")
        assert await bind(ext, api, "default/first", "node-a") == ""
        # 20Gi left: room for one of x and y. The API answers slowly, so both binds are in flight together.
        errors = await asyncio.gather(bind(ext, api, "default/x", "node-a"), bind(ext, api, "default/y", "node-a"))
        assert sorted(e == "" for e in errors) == [False, True]
        loser = "default/x" if errors[0] else "default/y"
        # 5Gi left, less the 66 MiB each of first's and the winner's MPS daemons take (each pod declares no user: a
        # tenant of its own, a daemon each).
        assert "largest free share 4.9Gi < 15Gi asked" in (errors[0] or errors[1])
        assert not api.pods[loser]["spec"].get("nodeName")
        assert ASSIGNMENT_ANNOTATION not in api.pods[loser]["metadata"]["annotations"]
        await until(
            lambda: all(
                view.pod(k) is not None and view.pod(k).spec.node_name
                for k in ("default/first", "default/x" if loser == "default/y" else "default/y")
            ),
            "bound events",
        )
        view.ledger.check_invariants()
        assert len(view.ledger) == 2

    run(body, latency_s=0.02)


def test_the_same_pod_bound_twice_at_once_binds_once() -> None:
    async def body(api: MemoryClusterApi, view: ClusterView, ext: Extender) -> None:
        api.put_node("node-a", node_spec("node-a", gpus=1))
        api.put_node("node-b", node_spec("node-b", gpus=1))
        api.put_pod(pod_obj("p", memory="10Gi"))
        await until(lambda: view.synced and view.pod("default/p") is not None, "sync")
        errors = await asyncio.gather(bind(ext, api, "default/p", "node-a"), bind(ext, api, "default/p", "node-b"))
        assert sorted(e == "" for e in errors) == [False, True]
        node = api.pods["default/p"]["spec"]["nodeName"]
        a = Assignment.from_json(api.pods["default/p"]["metadata"]["annotations"][ASSIGNMENT_ANNOTATION])
        assert a.node == node
        await until(lambda: view.pod("default/p") is not None and view.pod("default/p").spec.node_name == node, "bound")
        assert set(view.ledger.assignments) == {"default/p"} and view.ledger.assignments["default/p"] == a

    run(body, latency_s=0.02)
