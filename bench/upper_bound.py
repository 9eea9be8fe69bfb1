"""Offline upper bound on GPU allocation at an arrived level, per trace, and the share of the headroom above FGD
that each policy captures.

Usage:
    uv run python bench/upper_bound.py [--traces default,cpu050,...] [--seed 42] [--level 100]
        [--gpuspec-level 130] [--report R.json ...] [--json out.json]

For each trace: the FGD-protocol arrivals of the seed (shuffle, tune 1.3), their prefix up to the arrived level,
and sharegpu.sim.bound.allocation_bound over it (the configuration LP; the argument is in that module's doc). Prints
the bound, FGD's published 10-seed mean at that level, the headroom above it (bound − FGD, in pp and GPUs), and for
every policy found in the ``--report`` files (JSON reports of ``sharegpu sim``, matched to a trace by their
experiment name) its mean allocation at the level and the share of the headroom it captures:
(policy − FGD) / (bound − FGD).
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from pathlib import Path

from sharegpu.sim.bound import allocation_bound, prefix_at
from sharegpu.sim.openb import load_nodes, load_pods
from sharegpu.sim.protocol import fgd_arrivals

TRACES = ("default", "cpu050", "gpushare40", "gpuspec10", "multigpu20")
PUBLISHED_POLICY = "FGD"


def published(data: Path) -> dict[tuple[str, int], float]:
    out = {}
    with (data / "fgd_published_allocation.csv").open(newline="") as f:
        for row in csv.DictReader(f):
            if row["policy"] == PUBLISHED_POLICY:
                for level in (100, 130):
                    out[(row["trace"], level)] = float(row[f"gpu_alloc_pct_at_arrived_{level}"])
    return out


def policy_numbers(reports: list[Path]) -> dict[tuple[str, str, int], tuple[float, int]]:
    """(trace, policy, level) → (mean allocation %, seeds) from `sharegpu sim` JSON reports."""
    out = {}
    for path in reports:
        doc = json.loads(path.read_text(encoding="utf-8"))
        trace = str(doc.get("experiment", path.stem)).removeprefix("openb_pod_list_")
        for s in doc["summary"]:
            for level in ("100", "130"):
                mean = s["mean_alloc_pct_at_arrived"].get(level)
                reached = s.get("seeds_reaching_arrived", {}).get(level, s["seeds"])
                if mean is not None:
                    out[(trace, s["policy"], int(level))] = (float(mean), int(reached))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=Path("../shared/data/openb"))
    ap.add_argument("--traces", default=",".join(TRACES))
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--level", type=int, default=100, help="arrived level, %% of GPU capacity")
    ap.add_argument("--gpuspec-level", type=int, default=130, help="also bound gpuspec traces at this level (0: no)")
    ap.add_argument("--report", type=Path, action="append", default=[], help="`sharegpu sim` JSON report(s)")
    ap.add_argument("--json", type=Path, help="write the results here too")
    args = ap.parse_args()

    nodes = load_nodes(args.data / "openb_node_list_gpu_node.csv")
    capacity = sum(len(n.gpus) for n in nodes) * 1000
    fgd = published(args.data)
    policies = policy_numbers(args.report)
    names = sorted({p for _, p, _ in policies})
    rows = []
    print(
        f"seed {args.seed}; bound: configuration LP over node types × pod shapes (HiGHS); "
        f"FGD: published 10-seed mean; policies from {', '.join(map(str, args.report)) or 'no report'}",
        flush=True,
    )
    header = ["trace", "level", "pods", "bound %", "LP master %", "FGD pub %", "headroom pp", "headroom GPUs"]
    header += [f"{p} % (captured)" for p in names] + ["bound s"]
    print(" | ".join(header), flush=True)
    for trace in args.traces.split(","):
        tasks = load_pods(args.data / f"openb_pod_list_{trace}.csv")
        arrivals = fgd_arrivals(tasks, capacity, args.seed, 1.3)
        levels = [args.level] + ([args.gpuspec_level] if trace.startswith("gpuspec") and args.gpuspec_level else [])
        for level in levels:
            prefix = prefix_at(arrivals, capacity, level)
            started = time.perf_counter()
            b = allocation_bound(nodes, prefix)
            wall = time.perf_counter() - started
            ref = fgd.get((trace, level))
            headroom = None if ref is None else b.bound_pct - ref
            row: dict[str, object] = {
                "trace": trace,
                "level": level,
                "seed": args.seed,
                "pods": len(prefix),
                "bound_pct": round(b.bound_pct, 3),
                "lp_master_pct": round(b.master_pct, 3),
                "fgd_published_pct": ref,
                "headroom_pp": None if headroom is None else round(headroom, 3),
                "headroom_gpus": None if headroom is None else round(headroom * capacity / 100_000, 1),
                "rounds": b.rounds,
                "columns": b.columns,
                "bound_s": round(wall, 1),
                "policies": {},
            }
            cells = []
            for p in names:
                got = policies.get((trace, p, level))
                if got is None:
                    cells.append("—")
                    continue
                mean, seeds = got
                captured = None if not headroom or ref is None else (mean - ref) / headroom
                row["policies"][p] = {"alloc_pct": mean, "seeds": seeds, "captured": captured}  # type: ignore[index]
                share = "—" if captured is None else f"{100 * captured:.0f} %"
                cells.append(f"{mean:.2f} ({share}, {seeds} seeds)")
            rows.append(row)
            print(
                " | ".join(
                    [
                        trace,
                        str(level),
                        f"{len(prefix):,}",
                        f"{b.bound_pct:.2f}",
                        f"{b.master_pct:.2f}",
                        "—" if ref is None else f"{ref:.2f}",
                        "—" if headroom is None else f"{headroom:+.2f}",
                        "—" if headroom is None else f"{headroom * capacity / 100_000:.0f}",
                        *cells,
                        f"{wall:.0f}",
                    ]
                ),
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps({"seed": args.seed, "rows": rows}, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
