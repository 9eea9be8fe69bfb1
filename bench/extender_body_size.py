"""The largest request bodies the kube-scheduler sends the extender, and the memory parsing them takes: the basis
of the extender's body cap (sharegpu.k8s.serving.body_limit.EXTENDER_MAX_BODY).

    uv run python bench/extender_body_size.py --nodes 10000

nodeCacheCapable: true (the chart's): filter/prioritize carry the Pod and every node's name; preempt carries the
Pod and, per candidate node (DefaultPreemption tries max(10 % of nodes, 100)), its victims' UIDs.
nodeCacheCapable: false: filter/prioritize carry whole Node objects (a kubelet's Node lists up to 50 images).
The Pod here is a small one; a real Pod may be up to 3 MiB (the API server's request limit), added on top.
"""

from __future__ import annotations

import argparse
import json
import sys
import tracemalloc
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "k8s"))

from k8s_helpers import node_obj, node_spec, pod_obj

from sharegpu.k8s.serving.body_limit import EXTENDER_MAX_BODY
from sharegpu.kube.quantity import MIB
from sharegpu.kube.schema import ExtenderArgs, ExtenderPreemptionArgs

MAX_NAME = 253  # a node name is a DNS subdomain
MAX_PODS = 250  # victims per node: the most pods a node runs (kubelet maxPods; 110 by default)


def kubelet_node(i: int) -> dict[str, Any]:
    """A Node as a kubelet reports it (conditions, 50 images) with an 8-GPU sharegpu inventory."""
    o = node_obj(node_spec(f"gpu-node-{i:05d}", "H100-80GB", 8))
    o["status"]["images"] = [
        {
            "names": [
                f"registry.example.com/team/image-{j}@sha256:" + "ab" * 32,
                f"registry.example.com/team/image-{j}:v1.2.{j}",
            ],
            "sizeBytes": 123456789,
        }
        for j in range(50)
    ]
    o["status"]["conditions"] = [
        {"type": t, "status": "False", "reason": f"KubeletHasSufficient{t}", "message": f"kubelet has sufficient {t}",
         "lastHeartbeatTime": "2025-01-01T00:00:00Z", "lastTransitionTime": "2025-01-01T00:00:00Z"}
        for t in ("MemoryPressure", "DiskPressure", "PIDPressure", "Ready")
    ]  # fmt: skip
    return o


def parsed_mib(model: Any, body: bytes) -> tuple[float, float]:
    tracemalloc.start()
    parsed = model.model_validate_json(body)
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del parsed
    return held / MIB, peak / MIB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=10_000)
    ap.add_argument("--skip-whole-nodes", action="store_true", help="skip the nodeCacheCapable: false body")
    n = ap.parse_args().nodes
    pod = pod_obj("p", memory="10Gi")
    candidates = min(n, max(n // 10, 100))
    names = [f"n{i:05d}-".ljust(MAX_NAME, "a") for i in range(n)]
    shapes: list[tuple[str, Any, bytes]] = [
        ("filter, node names (true)", ExtenderArgs, json.dumps({"Pod": pod, "NodeNames": names}).encode()),
        (
            f"preempt, {candidates} candidates x {MAX_PODS} victims (true)",
            ExtenderPreemptionArgs,
            json.dumps(
                {
                    "Pod": pod,
                    "NodeNameToMetaVictims": {
                        names[i]: {"Pods": [{"UID": str(uuid.uuid4())} for _ in range(MAX_PODS)], "NumPDBViolations": 0}
                        for i in range(candidates)
                    },
                }
            ).encode(),
        ),
    ]
    if not ap.parse_args().skip_whole_nodes:
        nodes = {"items": [kubelet_node(i) for i in range(n)]}
        shapes.append(("filter, whole Nodes (false)", ExtenderArgs, json.dumps({"Pod": pod, "Nodes": nodes}).encode()))
    print(f"{n} nodes; cap {EXTENDER_MAX_BODY / MIB:g} MiB (+ up to 3 MiB for a large Pod)")
    print(f"{'shape':<45} {'body MiB':>9} {'parsed MiB':>11} {'peak MiB':>9} {'parsed/body':>12}")
    for name, model, body in shapes:
        held, peak = parsed_mib(model, body)
        size = len(body) / MIB
        print(f"{name:<45} {size:>9.1f} {held:>11.1f} {peak:>9.1f} {held / size:>12.1f}")


if __name__ == "__main__":
    main()
