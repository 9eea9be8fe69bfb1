"""The extender's cluster metrics: gauges computed from its ledger at scrape time, and the counters and histograms
its HTTP layer records, read back over real HTTP in the Prometheus text format."""

from __future__ import annotations

import asyncio
import http.client
import socket
from collections.abc import Iterator

import pytest
from k8s_helpers import LoopbackServer, node_obj, node_spec, nodes, pod_obj, pods, with_assignment
from memory_api import MemoryClusterApi
from prometheus_client.parser import text_string_to_metric_families

from sharegpu.k8s.cache.view import ClusterView
from sharegpu.k8s.extender.metrics import BindOutcome, ClusterMetrics
from sharegpu.k8s.extender.server import Extender, make_app
from sharegpu.k8s.pending import REASON_CLASSES
from sharegpu.k8s.status.report import fragmentation_milli, status_report
from sharegpu.model.assignment import Assignment, GpuShare, Mechanism, MigSlot
from sharegpu.model.inventory import GpuDevice, NodeSpec

GIB = 1024**3


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(data: dict, name: str, **labels: str) -> float:
    return data[(name, tuple(sorted(labels.items())))]


def cluster_view() -> ClusterView:
    """node-h: 2 H100 (one MPS-shared by two pods), node-m: an A100 with a 3g MIG instance, node-t: 2 T4; and three
    pending pods: one that fits, one asking for a model no node has, one too big for any free GPU now."""
    mig = NodeSpec("node-m", 64000, 262144, (GpuDevice(0, "GPU-m-0", "A100-80GB", mig_enabled=True),))
    a1 = Assignment("ml/infer-a", "node-h", (GpuShare(0, "GPU-node-h-0", Mechanism.MPS, 300, 10240),))
    a2 = Assignment("ml/infer-b", "node-h", (GpuShare(0, "GPU-node-h-0", Mechanism.MPS, 200, 20480),))
    a3 = Assignment(
        "ml/iso",
        "node-m",
        (GpuShare(0, "GPU-m-0", Mechanism.MIG, 1000, 40960, MigSlot("3g.40gb", 4), Mechanism.EXCLUSIVE),),
    )
    a4 = Assignment("ml/train", "node-t", (GpuShare(0, "GPU-node-t-0", Mechanism.EXCLUSIVE, 1000, 16384),))
    pod_list = [
        with_assignment(pod_obj("infer-a", "ml", memory="10Gi"), a1.to_json(), "node-h"),
        with_assignment(pod_obj("infer-b", "ml", memory="20Gi"), a2.to_json(), "node-h"),
        with_assignment(pod_obj("iso", "ml", memory="40Gi"), a3.to_json(), "node-m"),
        with_assignment(pod_obj("train", "ml", gpu=1), a4.to_json(), "node-t"),
        pod_obj("fits", "ml", memory="5Gi"),
        pod_obj("wants-l4", "ml", memory="5Gi", annotations={"sharegpu.io/gpu-model": "L4"}),
        pod_obj("too-big", "ml", gpu=4),
        pod_obj("plain", "ml", gpu=None),  # asks for no sharegpu resource: never pending here
    ]
    view = ClusterView()
    view.reset(
        nodes([node_obj(node_spec("node-h", gpus=2)), node_obj(mig), node_obj(node_spec("node-t", "T4", 2))]),
        pods(pod_list),
    )
    view.synced = True
    return view


def test_cluster_gauges_match_the_ledger_and_the_status_report() -> None:
    view = cluster_view()
    data = samples(ClusterMetrics(view).render().decode())
    assert value(data, "sharegpu_cluster_nodes") == 3
    assert value(data, "sharegpu_cluster_gpus", model="H100-80GB", mechanism="mps") == 1
    assert value(data, "sharegpu_cluster_gpus", model="H100-80GB", mechanism="free") == 1
    assert value(data, "sharegpu_cluster_gpus", model="A100-80GB", mechanism="mig") == 1
    assert value(data, "sharegpu_cluster_gpus", model="T4", mechanism="exclusive") == 1
    assert value(data, "sharegpu_cluster_gpus", model="T4", mechanism="free") == 1
    assert value(data, "sharegpu_cluster_gpu_memory_bytes", model="H100-80GB") == 160 * GIB
    assert value(data, "sharegpu_cluster_gpu_memory_promised_bytes", model="H100-80GB", mechanism="mps") == 30 * GIB
    assert value(data, "sharegpu_cluster_gpu_memory_promised_bytes", model="A100-80GB", mechanism="mig") == 40 * GIB
    assert value(data, "sharegpu_cluster_gpu_compute_promised_gpus", model="H100-80GB", mechanism="mps") == 0.5
    # A 3g instance of an A100 is 3 of its 7 compute slices.
    assert value(data, "sharegpu_cluster_gpu_compute_promised_gpus", model="A100-80GB", mechanism="mig") == 0.428
    # (300 + 200 + 428 + 1000) milli of 5 GPUs.
    assert value(data, "sharegpu_cluster_allocation_ratio") == pytest.approx(1928 / 5000, abs=1e-4)
    frag = fragmentation_milli(view.ledger, view.workload())
    assert frag is not None and frag > 0
    assert value(data, "sharegpu_cluster_fragmentation_ratio") == pytest.approx(frag / 5000, abs=1e-4)
    assert value(data, "sharegpu_cluster_pods_placed") == 4
    pending = {r: value(data, "sharegpu_cluster_pending_pods", reason=r) for r in REASON_CLASSES}
    assert pending == {r: 0 for r in REASON_CLASSES} | {"fits": 1, "no-allowed-model": 1, "gpu-busy": 1}
    assert value(data, "sharegpu_cluster_view_synced") == 1
    assert value(data, "sharegpu_cluster_view_problems", kind="pod") == 0
    assert value(data, "sharegpu_extender_leader") == 1
    # The same numbers as `sharegpu status`.
    s = status_report(view)["summary"]
    assert s["allocation_pct"] == pytest.approx(100 * 1928 / 5000, abs=0.01)
    assert s["gpus_in_use"] == 3 and s["gpus_total"] == 5 and s["pending"] == 3


def test_pending_reasons_name_the_nearest_miss() -> None:
    report = status_report(cluster_view())
    by_pod = {p["pod"]: p for p in report["pending"]}
    assert set(by_pod) == {"ml/fits", "ml/wants-l4", "ml/too-big"}
    assert by_pod["ml/fits"]["reason"] == "fits"
    assert by_pod["ml/wants-l4"]["reason"] == "no-allowed-model"
    assert "no GPU of an allowed model" in by_pod["ml/wants-l4"]["detail"]
    assert by_pod["ml/too-big"]["reason"] == "gpu-busy"


def test_fragmentation_is_absent_until_a_pod_is_seen() -> None:
    view = ClusterView()
    view.reset(nodes([node_obj(node_spec("node-h", gpus=2))]), [])
    data = samples(ClusterMetrics(view).render().decode())
    assert ("sharegpu_cluster_fragmentation_ratio", ()) not in data
    assert value(data, "sharegpu_cluster_allocation_ratio") == 0
    assert value(data, "sharegpu_cluster_view_synced") == 0


NODE_SPECS = [node_spec("node-a", gpus=1), node_spec("node-v", "V100-16GB", 1)]


@pytest.fixture
def served() -> Iterator[tuple[LoopbackServer, MemoryClusterApi, ClusterView, ClusterMetrics]]:
    api = MemoryClusterApi()
    for s in NODE_SPECS:
        api.put_node(s.name, s)
    api.put_node("cpu-only")
    view = ClusterView()
    view.reset(nodes(list(api.nodes.values())), [])
    view.synced = True
    metrics = ClusterMetrics(view)
    with LoopbackServer(make_app(Extender(view, api, metrics=metrics, policy="bestfit"))) as srv:
        yield srv, api, view, metrics


def test_every_bind_path_of_the_extender_lands_in_its_outcome(
    served: tuple[LoopbackServer, MemoryClusterApi, ClusterView, ClusterMetrics],
) -> None:
    srv, api, view, metrics = served

    def bind(obj: dict, node: str, uid: str | None = None, put: bool = True) -> str:
        stored = srv.call(lambda: api.put_pod(obj)) if put else obj
        meta = stored["metadata"]
        _, res = srv.post(
            "/bind",
            {"PodName": meta["name"], "PodNamespace": meta["namespace"], "PodUID": uid or meta["uid"], "Node": node},
        )
        return str(res["Error"])

    cases: list[tuple[BindOutcome, str]] = []
    cases.append((BindOutcome.BOUND, bind(pod_obj("ok", memory="1Gi"), "node-a")))
    cases.append((BindOutcome.CONFLICT, bind(api.pods["default/ok"], "node-a", put=False)))  # already bound
    cases.append((BindOutcome.CONFLICT, bind(pod_obj("swap", memory="1Gi"), "node-a", uid="another-uid")))
    cases.append((BindOutcome.UNSCHEDULABLE, bind(pod_obj("huge", memory="70Gi"), "node-v")))
    cases.append((BindOutcome.UNSCHEDULABLE, bind(pod_obj("nowhere", memory="1Gi"), "cpu-only")))
    cases.append(
        (BindOutcome.REFUSED, bind(pod_obj("other", memory="1Gi", scheduler_name="default-scheduler"), "node-a"))
    )
    cases.append((BindOutcome.REFUSED, bind(pod_obj("plain", gpu=None), "node-a")))
    cases.append((BindOutcome.REFUSED, bind(pod_obj("invalid", compute=150), "node-a")))
    cases.append(
        (BindOutcome.REFUSED, bind(pod_obj("nomodel", annotations={"sharegpu.io/gpu-model": "Nope"}), "node-a"))
    )
    srv.call(lambda: api.put_pod(pod_obj("gone", memory="1Gi")))
    srv.call(lambda: setattr(api, "down", True))
    cases.append((BindOutcome.FAILURE, bind(api.pods["default/gone"], "node-a", put=False)))
    srv.call(lambda: setattr(api, "down", False))
    srv.call(lambda: setattr(view, "synced", False))
    cases.append((BindOutcome.REFUSED, bind(pod_obj("later", memory="1Gi"), "node-a")))
    srv.call(lambda: setattr(view, "synced", True))

    from sharegpu.k8s.extender.metrics import bind_outcome
    from sharegpu.kube.schema import ExtenderBindingResult

    for want, error in cases:
        assert bind_outcome(ExtenderBindingResult(Error=error)) == want, error
    data = samples(srv.call(metrics.render).decode())
    counts = {o: value(data, "sharegpu_extender_binds_total", outcome=o.value) for o in BindOutcome}
    expected = {o: sum(1 for w, _ in cases if w == o) for o in BindOutcome}
    assert counts == expected
    assert value(data, "sharegpu_extender_request_duration_seconds_count", verb="bind") == len(cases)
    metrics.bind(BindOutcome.UNKNOWN)  # what the extender reports once a Binding's result is unknown (issue 8)
    assert value(samples(metrics.render().decode()), "sharegpu_extender_binds_total", outcome="unknown") == 1


def test_filter_and_preempt_decisions_latency_and_errors_are_counted(
    served: tuple[LoopbackServer, MemoryClusterApi, ClusterView, ClusterMetrics],
) -> None:
    srv, api, view, metrics = served
    for obj in (
        pod_obj("small", memory="1Gi"),
        pod_obj("big", memory="70Gi", annotations={"sharegpu.io/gpu-model": "V100-16GB"}),
        pod_obj("plain", gpu=None),
    ):
        pod = srv.call(lambda obj=obj: api.put_pod(obj))
        assert srv.post("/filter", {"Pod": pod, "NodeNames": ["node-a", "node-v"]})[0] == 200
        assert srv.post("/prioritize", {"Pod": pod, "NodeNames": ["node-a", "node-v"]})[0] == 200
    srv.call(lambda: setattr(view, "synced", False))
    srv.post("/filter", {"Pod": api.pods["default/small"], "NodeNames": ["node-a"]})
    srv.call(lambda: setattr(view, "synced", True))
    srv.post("/preempt", {"Pod": api.pods["default/small"], "NodeNameToMetaVictims": {"node-a": {"Pods": []}}})
    assert srv.post("/filter", None, raw=b"{not json")[0] == 400
    data = samples(srv.call(metrics.render).decode())
    outcomes = {
        o: value(data, "sharegpu_extender_decisions_total", verb="filter", outcome=o)
        for o in ("feasible", "unschedulable", "not_synced", "ignored")
    }
    assert outcomes == {"feasible": 1, "unschedulable": 1, "not_synced": 1, "ignored": 1}
    # A candidate without victims is no candidate (the kube-scheduler takes one for an error): counted as none.
    assert value(data, "sharegpu_extender_decisions_total", verb="preempt", outcome="none") == 1
    assert value(data, "sharegpu_extender_decisions_total", verb="preempt", outcome="victims") == 0
    assert value(data, "sharegpu_extender_request_duration_seconds_count", verb="filter") == 4
    assert value(data, "sharegpu_extender_request_duration_seconds_count", verb="prioritize") == 3
    assert value(data, "sharegpu_extender_request_errors_total", verb="filter", code="400") == 1
    metrics.set_leader(False)
    assert value(samples(metrics.render().decode()), "sharegpu_extender_leader") == 0


def test_run_extender_serves_metrics_on_its_own_port_and_counts_relists() -> None:
    from sharegpu.k8s.extender.server import run_extender

    api = MemoryClusterApi()
    api.put_node("node-a", node_spec("node-a", gpus=1))
    view = ClusterView()

    async def main() -> str:
        stop = asyncio.Event()
        api_port, metrics_port = _free_port(), _free_port()
        task = asyncio.ensure_future(
            run_extender(
                view, api, "127.0.0.1", api_port, stop, metrics_listen=("127.0.0.1", metrics_port), policy="bestfit"
            )
        )
        for _ in range(200):
            if view.synced:
                break
            await asyncio.sleep(0.02)
        loop = asyncio.get_running_loop()
        text = await loop.run_in_executor(None, _get, metrics_port, "/metrics")
        stop.set()
        await task
        return text

    text = asyncio.run(main())
    data = samples(text)
    assert value(data, "sharegpu_cluster_view_synced") == 1
    assert value(data, "sharegpu_cluster_view_relists_total") == 1
    assert value(data, "sharegpu_cluster_nodes") == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(port: int, path: str) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        assert resp.status == 200
        return resp.read().decode()
    finally:
        conn.close()
