"""Issue 28: ``sharegpu status`` counts a GPU as in use when a pod holds some of it, not by its mode: an idle GPU kept
in MIG mode (a static layout) was counted as in use."""

from __future__ import annotations

from k8s_helpers import node_obj, node_spec, nodes, pod_obj, pods, with_assignment

from sharegpu.k8s.cache.view import ClusterView
from sharegpu.k8s.status.report import status_report, summary_line
from sharegpu.model.assignment import Assignment, GpuShare, Mechanism, MigSlot
from sharegpu.model.inventory import GpuDevice, NodeSpec


def test_an_idle_gpu_in_mig_mode_is_not_in_use() -> None:
    static = (MigSlot("3g.40gb", 4),)
    mig = NodeSpec(
        "node-m", 64000, 262144, (GpuDevice(0, "GPU-m-0", "A100-80GB", mig_instances=static, mig_enabled=True),)
    )
    h100 = node_spec("node-h", gpus=2)
    a = Assignment("ml/a", "node-h", (GpuShare(0, "GPU-node-h-0", Mechanism.MPS, 300, 10240),))
    view = ClusterView()
    view.reset(
        nodes([node_obj(h100), node_obj(mig)]), pods([with_assignment(pod_obj("a", "ml"), a.to_json(), "node-h")])
    )
    report = status_report(view)
    (m,) = [n for n in report["nodes"] if n["name"] == "node-m"]
    assert m["gpus"][0]["mechanism"] == "mig" and m["gpus"][0]["pods"] == []  # the case: MIG mode, no pod
    assert report["summary"]["gpus_in_use"] == 1
    assert summary_line(report).startswith("1/3 GPUs in use on 2 node(s)")
