"""Cost of a /metrics scrape and of a status report on the openb cluster (1,213 nodes, 6,212 GPUs).

The cluster is filled with trace pods to ``--fill`` of its GPU capacity (as bound pods with assignments, the way a
running cluster holds them, through the extender's pod and node JSON of bench/extender_bench.py), plus
``--pending`` trace pods that are not placed. Then it times, on the extender's view: the cluster metrics'
``render()`` (what a Prometheus scrape costs the extender's event loop) and ``status_report()`` (what
``sharegpu status``, ``--watch`` and the live page compute per refresh).

    uv run python bench/metrics_bench.py                 # defaults: fill 0.6, 500 pending, 20 repeats
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from extender_bench import DATA, node_json, placed_pod_json, pod_json
from sharegpu.k8s.cache.view import ClusterView
from sharegpu.k8s.extender.metrics import ClusterMetrics
from sharegpu.k8s.status.report import status_report
from sharegpu.kube.schema import Node, Pod
from sharegpu.ledger import Ledger
from sharegpu.placement.fragmentation import Workload
from sharegpu.placement.framework import Decision, Scheduler
from sharegpu.placement.policies import PolicyContext, make_policy
from sharegpu.sim.openb import load_nodes, load_pods


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=Path, default=DATA / "openb_node_list_gpu_node.csv")
    ap.add_argument("--pods", type=Path, default=DATA / "openb_pod_list_default.csv")
    ap.add_argument("--fill", type=float, default=0.6)
    ap.add_argument("--pending", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()
    if not args.nodes.is_file() or not args.pods.is_file():
        print(f"openb trace not found at {args.nodes} / {args.pods}; pass --nodes and --pods", file=sys.stderr)
        return 2
    specs = load_nodes(args.nodes)
    tasks = [t.request for t in load_pods(args.pods)]
    random.Random(args.seed).shuffle(tasks)
    workload = Workload.from_requests(tasks)
    sched = Scheduler(Ledger(specs), make_policy("sharegpu", PolicyContext(workload)), args.seed)
    capacity = sched.ledger.total_gpu_milli
    objs: list[dict[str, Any]] = []
    rest = []
    for req in tasks:
        if sched.ledger.allocated_gpu_milli >= args.fill * capacity:
            rest.append(req)
            continue
        d = sched.decide(req)
        if isinstance(d, Decision):
            sched.ledger.place(d.assignment)
            objs.append(placed_pod_json(req, d.assignment, f"uid-placed-{len(objs)}"))
    placed = len(objs)
    objs += [pod_json(r, f"uid-pending-{i}") for i, r in enumerate(rest[: args.pending])]
    view = ClusterView()
    view.reset([Node.model_validate(node_json(s)) for s in specs], [Pod.model_validate(p) for p in objs])
    view.synced = True
    metrics = ClusterMetrics(view)

    def timed(fn: Any) -> list[float]:
        fn()  # warm
        out = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
        return out

    scrape = timed(metrics.render)
    report = timed(lambda: status_report(view))
    summary = status_report(view)["summary"]
    gpus = summary["gpus_total"]
    print(
        f"openb: {len(specs)} nodes, {gpus} GPUs, {placed} pods placed, {summary['pending']} pending, "
        f"allocation {summary['allocation_pct']}%, fragmentation {summary['fragmentation_pct']}%"
    )
    for name, xs in (("metrics render (scrape)", scrape), ("status_report", report)):
        print(f"{name:26s} median {statistics.median(xs) * 1000:7.1f} ms  max {max(xs) * 1000:7.1f} ms")
    print(f"scrape size {len(metrics.render()) / 1024:.1f} KiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
