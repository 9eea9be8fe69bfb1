"""Fidelity of the reimplemented baselines against the FGD paper's published allocation (10-seed means).

Usage: uv run python bench/fidelity.py [--data ../shared/data/openb] [--traces default,cpu050,...]
       [--policies random,dotprod,clustering,packing,bestfit,fgd,sharegpu] [--seeds 42-51] [--jobs 0]
Prints a Markdown table (ours vs published at arrived 100 % and 130 %, and the difference) and writes the
raw runs to bench/results/fidelity.json.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import time
from pathlib import Path

from sharegpu.sim.openb import load_nodes, load_pods
from sharegpu.sim.protocol import parse_seeds
from sharegpu.sim.runner import Experiment, run_experiment

PUBLISHED_NAMES = {
    "random": "Random",
    "dotprod": "DotProd",
    "clustering": "GpuClustering",
    "packing": "GpuPacking",
    "bestfit": "BestFit",
    "fgd": "FGD",
}
TOLERANCE = {"random": 1.0}
DEFAULT_TOLERANCE = 0.3


def published(data: Path) -> dict[tuple[str, str], tuple[float, float]]:
    out = {}
    with (data / "fgd_published_allocation.csv").open() as f:
        for row in csv.DictReader(f):
            out[(row["trace"], row["policy"])] = (
                float(row["gpu_alloc_pct_at_arrived_100"]),
                float(row["gpu_alloc_pct_at_arrived_130"]),
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, default=Path("../shared/data/openb"))
    ap.add_argument("--traces", default="default,cpu050,gpushare40,gpuspec10,multigpu20")
    ap.add_argument("--policies", default="random,dotprod,clustering,packing,bestfit,fgd,sharegpu")
    ap.add_argument("--seeds", default="42-51")
    ap.add_argument("--jobs", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench/results/fidelity.json"))
    args = ap.parse_args()
    pub = published(args.data)
    nodes = tuple(load_nodes(args.data / "openb_node_list_gpu_node.csv"))
    rows = []
    raw = []
    for trace in args.traces.split(","):
        tasks = tuple(load_pods(args.data / f"openb_pod_list_{trace}.csv"))
        exp = Experiment(trace, nodes, tasks, tuple(args.policies.split(",")), tuple(parse_seeds(args.seeds)))
        t0 = time.perf_counter()
        runs = run_experiment(exp, args.jobs)
        print(f"# {trace}: {len(runs)} runs in {time.perf_counter() - t0:.0f}s", flush=True)
        for p in exp.policies:
            rs = [r for r in runs if r.policy == p]
            a100 = statistics.fmean(r.alloc_at(100) or 0.0 for r in rs)
            a130 = statistics.fmean(r.alloc_at(130) or 0.0 for r in rs)
            wall = statistics.median(r.wall_s for r in rs)
            ref = pub.get((trace, PUBLISHED_NAMES.get(p, "")))
            rows.append((trace, p, a100, a130, ref, wall))
            raw.extend(r.to_dict() | {"trace": trace} for r in rs)
            print(_row(trace, p, a100, a130, ref, wall), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(raw, indent=1) + "\n")
    print()
    print(
        "| trace | policy | ours @100 | published @100 | Δ @100 | ours @130 | published @130 | Δ @130 | within | median wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(_row(*r))


def _row(trace: str, p: str, a100: float, a130: float, ref: tuple[float, float] | None, wall: float) -> str:
    if ref is None:
        return f"| {trace} | {p} | {a100:.2f} | — | — | {a130:.2f} | — | — | — | {wall:.1f} |"
    d100, d130 = a100 - ref[0], a130 - ref[1]
    tol = TOLERANCE.get(p, DEFAULT_TOLERANCE)
    ok = "yes" if abs(d100) <= tol and abs(d130) <= tol else f"**NO** (±{tol})"
    return (
        f"| {trace} | {p} | {a100:.2f} | {ref[0]:.2f} | {d100:+.2f} | {a130:.2f} | {ref[1]:.2f} | {d130:+.2f} "
        f"| {ok} | {wall:.1f} |"
    )


if __name__ == "__main__":
    main()
