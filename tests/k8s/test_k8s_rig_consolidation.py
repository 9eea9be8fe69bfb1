"""Consolidation through the real kube-scheduler (issue 19 item 2), on the rig's control plane.

Two fake nodes of one H100 each hold a movable 39Gi share owned by a ReplicaSet (the rig runs the
kube-controller-manager, so an evicted share is recreated); a 70Gi pod of the same priority then waits: free room
is 41 + 41 GiB but no GPU has 70. (39Gi: each share's pod declares no user, a tenant of its own, and its MPS daemon
takes 66 MiB of the GPU too, so two shares of 40Gi no longer fit one GPU.) The extender's leader (``--consolidation``) moves one share; its replica lands on
the other node and the waiting pod binds. The Watchdog of test_k8s_rig_preemption.py plays the kubelet of the fake
nodes and audits every GPU from the API server's objects all the while.

Skipped unless SHAREGPU_TEST_KUBECONFIG names the rig's kubeconfig.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from rig import KUBECONFIG, SKIP_REASON, Rig, audit, wait_for
from test_k8s_rig_preemption import Watchdog, rig_pod

from sharegpu.model.contract import MOVABLE_ANNOTATION

pytestmark = pytest.mark.skipif(not KUBECONFIG, reason=SKIP_REASON)


def _replica_set(name: str, memory: str) -> dict[str, Any]:
    pod = rig_pod(name, memory=memory, cpu="100m")
    pod["spec"]["restartPolicy"] = "Always"  # the only policy a ReplicaSet's template may have
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "ReplicaSet",
        "metadata": {"name": name},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels, "annotations": {MOVABLE_ANNOTATION: "true"}},
                "spec": pod["spec"],
            },
        },
    }


def test_a_movable_share_moves_so_that_a_pod_waiting_for_fragmented_room_binds(rig: Rig) -> None:
    from lightkube.resources.apps_v1 import ReplicaSet
    from lightkube.resources.core_v1 import Pod

    for i in range(2):
        rig.add_node(f"c{i}", [{"model": "H100-80GB", "count": 1}])
    rig.wait_nodes_published()
    ext, url = rig.start_extender(0, "--preemption-interval", "0.5", "--consolidation")
    rig.start_scheduler(url)
    ns = rig.namespace()

    def on_node() -> dict[str, str]:
        return {p["metadata"]["name"]: p["spec"].get("nodeName") or "" for p in rig.pods(ns)}

    # Fragment the room: a bare filler takes half of one GPU, share a packs beside it, share b goes to the other
    # node; the filler leaves. Each node is then half full with one movable share.
    rig.create_pods(ns, [rig_pod("filler", memory="39Gi", cpu="100m")])
    wait_for(lambda: bool(on_node().get("filler")), "the filler bound", 60)
    rig.client.create(ReplicaSet.from_dict(_replica_set("a", "39Gi")), namespace=ns)
    wait_for(lambda: any(n.startswith("a-") and node for n, node in on_node().items()), "share a bound", 60)
    rig.client.create(ReplicaSet.from_dict(_replica_set("b", "39Gi")), namespace=ns)
    wait_for(lambda: any(n.startswith("b-") and node for n, node in on_node().items()), "share b bound", 60)
    rig.client.delete(Pod, "filler", namespace=ns, grace_period=0)
    wait_for(lambda: "filler" not in on_node(), "the filler gone", 60)
    before = on_node()
    assert len(set(before.values())) == 2, before  # one share per node

    with Watchdog(rig, ns) as dog:
        t0 = time.monotonic()
        rig.create_pods(ns, [rig_pod("big", memory="70Gi", cpu="100m")])
        try:
            wait_for(lambda: bool(on_node().get("big")), "the waiting pod bound", 60)
        except AssertionError:
            print(ext.text()[-6000:], rig.pods(ns))
            raise
        elapsed = time.monotonic() - t0

        def replicas_bound() -> bool:
            now = on_node()
            return all(any(n.startswith(f"{s}-") and node for n, node in now.items()) for s in ("a", "b"))

        wait_for(replicas_bound, "both shares bound again", 60)
        time.sleep(2)  # a few more audits after the last bind
    after = on_node()
    moved = sorted(set(before) - set(after))
    events = rig.events(ns)
    consolidated = [e for e in events if e.get("reason") == "Consolidated"]
    print(
        f"\nconsolidation: 2x1 H100 with a 39Gi movable share each, a 70Gi pod waiting: bound {elapsed:.1f}s after "
        f"creation, moved {moved}, {dog.audits} audits, findings {len(dog.findings)}, placement {after}"
    )
    assert dog.findings == [], dog.findings[:5]
    assert dog.audits >= 5
    assert len(moved) == 1, (before, after)
    assert after["big"] == before[moved[0]]  # the waiting pod took the room the moved share left
    final = audit([rig.node(n) for n in rig.nodes], rig.pods(ns))
    assert final.findings == []
    assert len(consolidated) == 1 and consolidated[0]["message"] == (
        f"moved off node {before[moved[0]]} so that {ns}/big fits"
    )
    assert sum(e.get("reason") == "Consolidating" for e in events) == 1
