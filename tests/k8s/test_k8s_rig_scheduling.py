"""The whole extender path on a real control plane (../shared/k8s-rig): node agents publish inventories, the real
kube-scheduler runs the chart's profile and calls ``sharegpu scheduler-extender`` to filter, prioritize and bind.

Skipped unless SHAREGPU_TEST_KUBECONFIG names the rig's kubeconfig (.ci/run starts the rig and sets it).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from k8s_helpers import pod_obj
from rig import KUBECONFIG, SKIP_REASON, Rig, audit, status_json

pytestmark = pytest.mark.skipif(not KUBECONFIG, reason=SKIP_REASON)


@pytest.fixture
def rig() -> Iterator[Rig]:
    with Rig.open() as r:
        try:
            yield r
        finally:
            print(r.dump())


def rig_pod(name: str, **kw: Any) -> dict[str, Any]:
    obj = pod_obj(name, **kw)
    for k in ("uid", "resourceVersion", "namespace"):
        obj["metadata"].pop(k, None)
    obj.pop("status", None)
    return obj


def test_pods_are_bound_through_the_real_scheduler_with_their_assignments(rig: Rig) -> None:
    rig.add_node("h100", [{"model": "H100-80GB", "count": 2}, {"model": "H100-80GB", "count": 1, "mig": True}])
    rig.add_node("a30", [{"model": "A30-24GB", "count": 1}])
    rig.wait_nodes_published()
    _, url = rig.start_extender()
    rig.start_scheduler(url)
    ns = rig.namespace()
    pods = [
        rig_pod("mps", memory="10Gi", compute=30, annotations={"sharegpu.io/isolation": "memory"}),
        rig_pod("mig", memory="10Gi", annotations={"sharegpu.io/isolation": "hardware"}),
        rig_pod("whole", gpu=1),
        rig_pod("ts", memory="4Gi", annotations={"sharegpu.io/sharing": "time-slicing"}),
    ]
    rig.create_pods(ns, pods)
    settled = rig.wait_settled(ns)
    assert all(p["spec"].get("nodeName") for p in settled), [p["metadata"]["name"] for p in settled]
    result = audit([rig.node(n) for n in rig.nodes], settled)
    assert result.findings == [] and result.bound == 4
    # sharegpu status, from the API server, shows the same pods on the same GPUs.
    report = status_json(rig)
    shown = {pod for node in report["nodes"] if node["name"] in rig.nodes for g in node["gpus"] for pod in g["pods"]}
    assert shown == {f"{ns}/{p['metadata']['name']}" for p in pods}
    # No bind was reported failed.
    failed = [e["message"] for e in rig.events(ns) if e.get("reason") == "FailedScheduling"]
    assert failed == []
