"""Wall time of one FGD-protocol run of an openb trace (target: fgd on `default`, one seed, <= 20 s).

Usage: uv run python bench/sim_speed.py [--trace default] [--policies fgd,sharegpu] [--seed 42] [--repeat 3]
Runs each policy --repeat times in this one process, alternating policies so that they share the machine's
state, and prints the median and each run's wall time, pods and decision latency.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from sharegpu.sim.openb import load_nodes, load_pods
from sharegpu.sim.runner import Experiment, run_one


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, default=Path("../shared/data/openb"))
    ap.add_argument("--trace", default="default")
    ap.add_argument("--policies", default="fgd,sharegpu")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    nodes = tuple(load_nodes(args.data / "openb_node_list_gpu_node.csv"))
    tasks = tuple(load_pods(args.data / f"openb_pod_list_{args.trace}.csv"))
    policies = tuple(args.policies.split(","))
    exp = Experiment(args.trace, nodes, tasks, policies, (args.seed,))
    workload = exp.workload()
    walls: dict[str, list[float]] = {p: [] for p in policies}
    for i in range(args.repeat):
        for p in policies:
            r = run_one(exp, workload, p, args.seed)
            walls[p].append(r.wall_s)
            print(
                f"run {i + 1} {p}: wall {r.wall_s:.2f}s, {r.pods} pods on {len(nodes)} nodes, "
                f"decision p50 {r.latency_p50_ms:.2f} ms p99 {r.latency_p99_ms:.2f} ms, alloc@100 {r.alloc_at(100)}",
                flush=True,
            )
    for p in policies:
        print(f"{p}: median wall {statistics.median(walls[p]):.2f}s over {args.repeat} runs")


if __name__ == "__main__":
    main()
