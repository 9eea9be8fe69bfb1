"""Correctness under load on the real control plane (issue 8, item 2), as a bench: mixed pods created at once on a
saturated five-node cluster with node agents running, audited from the API server's objects alone.

Needs a running ../shared/k8s-rig and SHAREGPU_TEST_KUBECONFIG set to its kubeconfig.

    uv run python bench/k8s_load.py                       # 300 pods, one extender
    uv run python bench/k8s_load.py --kill                # the extender SIGKILLed mid-load and restarted
    uv run python bench/k8s_load.py --replicas            # two replicas, the leader SIGKILLed mid-load
    uv run python bench/k8s_load.py --cluster roomy --pods 150   # eleven nodes of 16 GPUs that hold all 150 pods

Prints one JSON line per run: pods bound and pending, over-allocations found (must be 0), bound pods whose bind no
extender reported as a success, whether `sharegpu status` agrees, the time to settle and (with --replicas) the
takeover time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "k8s"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from rig import (
    KUBECONFIG,
    LOAD_NODES,
    ROOMY_NODES,
    ReadyProxy,
    Rig,
    audit,
    mixed_pods,
    status_agrees,
    status_json,
    unreported_binds,
    wait_for,
)

# load: five nodes that saturate well under 300 mixed pods; roomy: room for all of mixed_pods(150) (issue 32).
CLUSTERS = {"load": LOAD_NODES, "roomy": ROOMY_NODES}


def bound(rig: Rig, ns: str) -> int:
    return sum(bool(p["spec"].get("nodeName")) for p in rig.pods(ns))


def run(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    from lightkube.resources.coordination_v1 import Lease

    with Rig.open() as rig:
        for suffix, gpus in CLUSTERS[args.cluster].items():
            rig.add_node(suffix, gpus)
        rig.wait_nodes_published(120)
        figures: dict[str, Any] = {"cluster": args.cluster, "pods": args.pods, "seed": seed, "mode": "single"}
        proxy = None
        if args.replicas:
            lease_ns = rig.namespace()
            flags = ("--leader-elect", "--lease-namespace", lease_ns, "--lease-name", "sharegpu-extender")
            a, url_a = rig.start_extender(0, *flags, "--identity", "a", name="extender-a", ready=False)
            b, url_b = rig.start_extender(0, *flags, "--identity", "b", name="extender-b", ready=False)
            proxy = ReadyProxy([(a.health, url_a), (b.health, url_b)]).__enter__()
            wait_for(lambda: proxy is not None and proxy.ready is not None, "a leader", 60)
            url = proxy.url
            figures["mode"] = "two replicas, leader killed"
        else:
            ext, url = rig.start_extender()
        rig.start_scheduler(url)
        ns = rig.namespace()
        started = time.perf_counter()
        rig.create_pods(ns, mixed_pods(args.pods, seed))
        if args.kill or args.replicas:
            wait_for(lambda: bound(rig, ns) >= 5, "the first binds", 120)
            if args.replicas:
                holder = rig.client.get(Lease, "sharegpu-extender", namespace=lease_ns).spec.holderIdentity
                leader, other = (a, url_b) if holder == "a" else (b, url_a)
                leader.kill()
                killed = time.perf_counter()
                assert proxy is not None
                wait_for(lambda: proxy is not None and proxy.ready == other, "the takeover", 60)
                figures["takeover_s"] = round(time.perf_counter() - killed, 1)
            else:
                figures["mode"] = "extender killed and restarted"
                figures["bound_at_kill"] = bound(rig, ns)
                ext.kill()
                time.sleep(1.0)
                rig.start_extender(int(url.rsplit(":", 1)[1]), name="extender-restarted")
        pods = rig.wait_settled(ns, quiet_s=args.quiet_s, timeout=900)
        figures["settled_s"] = round(time.perf_counter() - started, 1)
        result = audit([rig.node(n) for n in rig.nodes], pods)
        figures |= {
            "bound": result.bound,
            "pending": result.pending,
            "over_allocations_and_bad_assignments": len(result.findings),
            "bound_not_reported_bound": len(unreported_binds(rig, pods)),
            "status_disagreements": len(status_agrees(status_json(rig), result, rig.nodes)),
        }
        if proxy is not None:
            proxy.__exit__(None, None, None)
        return figures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pods", type=int, default=300)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--cluster", choices=sorted(CLUSTERS), default="load", help="the nodes (see CLUSTERS)")
    ap.add_argument(
        "--quiet-s", type=float, default=6.0, help="settled once no pod was bound for this long (or all are bound)"
    )
    ap.add_argument("--kill", action="store_true", help="SIGKILL the extender mid-load and restart it")
    ap.add_argument("--replicas", action="store_true", help="two replicas; SIGKILL the leader mid-load")
    args = ap.parse_args()
    if not KUBECONFIG:
        print("set SHAREGPU_TEST_KUBECONFIG to a running k8s-rig's kubeconfig (see ../shared/k8s-rig/README.md)")
        return 2
    for i in range(args.runs):
        print(json.dumps(run(args, seed=i)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
