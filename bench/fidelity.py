"""Fidelity of the reimplemented baselines against the FGD paper's published allocation (10-seed means).

Usage: uv run python bench/fidelity.py [--data ../shared/data/openb] [--traces default,cpu050,...]
       [--policies random,dotprod,clustering,packing,bestfit,fgd,sharegpu] [--seeds 42-51] [--jobs 0]
Prints a Markdown table (ours vs published at arrived 100 % and 130 %, the difference, and the verdict) and
writes the raw runs to bench/results/fidelity.json.

Verdict: a baseline is within when its mean is within 0.3 pp of the published mean at both levels. Clustering
and packing score most nodes alike, so their outcome rests on the order in which pods arrive, and our seeds
cannot replay the reference's shuffles: two 10-seed means then differ by sampling noise alone. For them the
rule is |Δ| ≤ 3 standard errors of the difference of the two means, SE = sqrt(s_ours² / n_ours + s_ref² / n_ref),
with the per-seed spreads s_ref from fgd_reference_allocation_curves.csv and s_ours from our runs.
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
TOLERANCE_PP = 0.3
ORDER_SENSITIVE = ("clustering", "packing")  # judged by standard errors (see the module's docstring)
SE_MULTIPLE = 3.0
LEVELS = (100, 130)

Stats = tuple[float, float, int]  # mean, per-seed standard deviation, seeds


def published(data: Path) -> dict[tuple[str, str], tuple[float, float]]:
    out = {}
    with (data / "fgd_published_allocation.csv").open() as f:
        for row in csv.DictReader(f):
            out[(row["trace"], row["policy"])] = (
                float(row["gpu_alloc_pct_at_arrived_100"]),
                float(row["gpu_alloc_pct_at_arrived_130"]),
            )
    return out


def reference_seeds(data: Path) -> dict[tuple[str, str], dict[int, list[float]]]:
    """Per-seed allocation % at arrived 100 and 130 of the reference simulator, per (trace, published policy)."""
    out: dict[tuple[str, str], dict[int, list[float]]] = {}
    with (data / "fgd_reference_allocation_curves.csv").open() as f:
        for row in csv.DictReader(f):
            per = out.setdefault((row["trace"], row["policy"]), {x: [] for x in LEVELS})
            for x in LEVELS:
                per[x].append(float(row[f"arrived_{x}"]))
    return out


def stats(values: list[float]) -> Stats:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0, len(values)


def verdict(policy: str, ours: dict[int, Stats], ref: dict[int, Stats] | None, pub: tuple[float, float]) -> str:
    """The fidelity verdict of one row (see the module's docstring for the rules)."""
    deltas = {x: ours[x][0] - p for x, p in zip(LEVELS, pub, strict=True)}
    if policy in ORDER_SENSITIVE and ref is not None:
        zs = []
        for x in LEVELS:
            (_, s1, n1), (_, s2, n2) = ours[x], ref[x]
            se = (s1**2 / n1 + s2**2 / n2) ** 0.5
            zs.append(abs(deltas[x]) / se if se > 0 else float("inf"))
        ok = all(z <= SE_MULTIPLE for z in zs)
        return f"{'yes' if ok else '**NO**'} ({max(zs):.1f} SE ≤ {SE_MULTIPLE:g})"
    ok = all(abs(d) <= TOLERANCE_PP for d in deltas.values())
    return f"{'yes' if ok else '**NO**'} (±{TOLERANCE_PP} pp)"


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
    ref_seeds = reference_seeds(args.data)
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
            ours = {x: stats([r.alloc_at(x) or 0.0 for r in rs]) for x in LEVELS}
            wall = statistics.median(r.wall_s for r in rs)
            name = PUBLISHED_NAMES.get(p, "")
            per_seed = ref_seeds.get((trace, name))
            ref = {x: stats(per_seed[x]) for x in LEVELS} if per_seed else None
            row = _row(trace, p, ours, ref, pub.get((trace, name)), wall)
            rows.append(row)
            raw.extend(r.to_dict() | {"trace": trace} for r in rs)
            print(row, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(raw, indent=1) + "\n")
    print()
    print(
        "| trace | policy | ours @100 | published @100 | Δ @100 | ours @130 | published @130 | Δ @130 "
        "| per-seed sd ours / ref @100 | within | median wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(row)


def _row(
    trace: str,
    p: str,
    ours: dict[int, Stats],
    ref: dict[int, Stats] | None,
    pub: tuple[float, float] | None,
    wall: float,
) -> str:
    a100, a130 = ours[100][0], ours[130][0]
    spread = f"{ours[100][1]:.2f} / {ref[100][1]:.2f}" if ref else f"{ours[100][1]:.2f} / —"
    if pub is None:
        return f"| {trace} | {p} | {a100:.2f} | — | — | {a130:.2f} | — | — | {spread} | — | {wall:.1f} |"
    d100, d130 = a100 - pub[0], a130 - pub[1]
    return (
        f"| {trace} | {p} | {a100:.2f} | {pub[0]:.2f} | {d100:+.2f} | {a130:.2f} | {pub[1]:.2f} | {d130:+.2f} "
        f"| {spread} | {verdict(p, ours, ref, pub)} | {wall:.1f} |"
    )


if __name__ == "__main__":
    main()
