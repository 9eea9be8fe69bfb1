"""The work-conserving floor per trace: how few GPUs any policy that places every pod that fits can leave idle, next
to FGD and the policies of `sharegpu sim` reports.

Usage:
    uv run python bench/online_floor.py [--traces default,cpu050,... | PATH.csv,...] [--seeds 42-51] [--level 100]
        [--report R.json ...] [--json out.json]

For each trace and seed: the FGD-protocol arrivals (shuffle, tune 1.3), their prefix up to the arrived level, and
sharegpu.sim.floor.work_conserving_floor over it (the argument is in that module's doc). Prints the mean over the
seeds of the floor (idle GPUs, and the allocation % it caps), FGD's idle GPUs — its published 10-seed mean for the
visible traces, else the `fgd` runs of a report — the floor as a share of FGD's idle GPUs (no work-conserving
policy gets below it; the aim of issue 11 is 0.80), and for each policy of the reports its idle GPUs and ratio.
A trace is a visible trace's name (openb_pod_list_NAME.csv in --data) or a path to a pod list.

--report reads a `sharegpu sim` JSON report (FGD is published for the visible traces only: a variant's FGD comes
from a report of it, matched by the pod list's name); --json writes this script's results. For a variant:
    uv run sharegpu sim --nodes ../shared/data/openb/openb_node_list_gpu_node.csv --pods multigpu40.csv \
        --policy fgd,sharegpu --seeds 42-44 --json multigpu40.json
    uv run python bench/online_floor.py --traces multigpu40.csv --seeds 42-44 --report multigpu40.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import NoReturn

from sharegpu.sim.bound import prefix_at
from sharegpu.sim.floor import work_conserving_floor
from sharegpu.sim.openb import load_nodes, load_pods
from sharegpu.sim.protocol import fgd_arrivals, parse_seeds
from upper_bound import policy_numbers, published

TRACES = ("default", "cpu050", "gpushare40", "gpuspec10", "multigpu20")
AIM = 0.80


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=Path("../shared/data/openb"))
    ap.add_argument("--traces", default=",".join(TRACES))
    ap.add_argument("--seeds", default="42-51")
    ap.add_argument("--level", type=int, default=100, help="arrived level, %% of GPU capacity")
    ap.add_argument(
        "--report",
        type=Path,
        action="append",
        default=[],
        help="read: a `sharegpu sim` JSON report (sharegpu sim ... --json R.json), FGD and the policies from it",
    )
    ap.add_argument("--json", type=Path, help="write the results here too")
    args = ap.parse_args()

    # Every input is checked before the minutes of work: a bad path is a message, not a traceback at the end.
    policies = _reports(ap, args.report)
    traces = [
        (t, Path(t) if t.endswith(".csv") else args.data / f"openb_pod_list_{t}.csv") for t in args.traces.split(",")
    ]
    node_list = args.data / "openb_node_list_gpu_node.csv"
    published_csv = args.data / "fgd_published_allocation.csv"
    for path in (node_list, published_csv):
        if not path.is_file():
            _fail(ap, f"--data {args.data}: {path.name} is not there; give the folder of the openb files")
    for _, path in traces:
        if not path.is_file():
            _fail(
                ap, f"--traces: {path} does not exist (a trace is a visible trace's name, or a path to a .csv pod list)"
            )
    if args.json is not None and not args.json.parent.is_dir():
        _fail(ap, f"--json {args.json}: its directory {args.json.parent} does not exist")
    try:
        seeds = parse_seeds(args.seeds)
    except ValueError as e:
        _fail(ap, str(e))

    nodes = load_nodes(node_list)
    capacity = sum(len(n.gpus) for n in nodes) * 1000
    gpus = capacity / 1000
    fgd_published = published(args.data)
    names = sorted({p for _, p, _ in policies if p != "fgd"})
    print(
        f"seeds {args.seeds}, arrived {args.level} %; floor: work-conserving policies (sim/floor.py); FGD: "
        f"published 10-seed mean where the trace is visible, else `fgd` from the reports",
        flush=True,
    )
    header = ["trace", "floor idle GPUs (min–max)", "floor alloc %", "FGD idle GPUs", "floor / FGD", "aim: FGD × 0.8"]
    header += [f"{p} idle GPUs (/ FGD)" for p in names] + ["s per seed"]
    print(" | ".join(header), flush=True)
    rows = []
    for trace, path in traces:
        name = path.stem.removeprefix("openb_pod_list_")
        tasks = load_pods(path)
        floors = []
        started = time.perf_counter()
        for seed in seeds:
            prefix = prefix_at(fgd_arrivals(tasks, capacity, seed, 1.3), capacity, args.level)
            floors.append(work_conserving_floor(nodes, prefix))
        per_seed = (time.perf_counter() - started) / len(seeds)
        idle = [f.idle_gpus for f in floors]
        mean_idle = sum(idle) / len(idle)
        ref_pct = fgd_published.get((name, args.level)) if not trace.endswith(".csv") else None
        source = "published"
        if ref_pct is None and (name, "fgd", args.level) in policies:
            ref_pct, source = policies[(name, "fgd", args.level)][0], "report"
        fgd_idle = None if ref_pct is None else (100 - ref_pct) * gpus / 100
        row: dict[str, object] = {
            "trace": name,
            "level": args.level,
            "seeds": seeds,
            "floor_idle_gpus": [round(x, 2) for x in idle],
            "floor_idle_gpus_mean": round(mean_idle, 2),
            "floor_alloc_pct_mean": round(sum(f.alloc_pct for f in floors) / len(floors), 3),
            "all_placed_idle_gpus_mean": _mean_or_none([f.all_placed_milli / 1000 for f in floors]),
            "first_failure": [f.first_failure for f in floors],
            "fgd_idle_gpus": None if fgd_idle is None else round(fgd_idle, 1),
            "fgd_source": source if fgd_idle is not None else None,
            "floor_over_fgd": None if not fgd_idle else round(mean_idle / fgd_idle, 3),
            "s_per_seed": round(per_seed, 2),
            "policies": {},
        }
        cells = []
        for p in names:
            got = policies.get((name, p, args.level))
            if got is None:
                cells.append("—")
                continue
            p_idle = (100 - got[0]) * gpus / 100
            ratio = None if not fgd_idle else p_idle / fgd_idle
            row["policies"][p] = {"idle_gpus": round(p_idle, 1), "over_fgd": ratio, "seeds": got[1]}  # type: ignore[index]
            cells.append(f"{p_idle:.0f} ({'—' if ratio is None else f'{ratio:.2f}'})")
        rows.append(row)
        print(
            " | ".join(
                [
                    name,
                    f"{mean_idle:.1f} ({min(idle):.1f}–{max(idle):.1f})",
                    f"{row['floor_alloc_pct_mean']:.2f}",
                    "—" if fgd_idle is None else f"{fgd_idle:.1f} ({source})",
                    "—" if not fgd_idle else f"{mean_idle / fgd_idle:.2f}",
                    "—" if fgd_idle is None else f"{AIM * fgd_idle:.1f}",
                    *cells,
                    f"{per_seed:.1f}",
                ]
            ),
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps({"seeds": args.seeds, "rows": rows}, indent=2) + "\n", encoding="utf-8")


def _fail(ap: argparse.ArgumentParser, message: str) -> NoReturn:
    ap.error(message)  # the usage and the message on stderr, exit 2


def _reports(ap: argparse.ArgumentParser, paths: list[Path]) -> dict[tuple[str, str, int], tuple[float, int]]:
    """The numbers of every --report, or exit 2 saying which one cannot be read and what it should be."""
    out = {}
    for path in paths:
        if not path.is_file():
            _fail(
                ap,
                f"--report {path}: no such file. --report reads a `sharegpu sim` JSON report (make one with "
                f"`sharegpu sim --pods TRACE.csv --policy fgd --json {path}`); --json writes this script's results",
            )
        try:
            out.update(policy_numbers([path]))
        except (OSError, ValueError) as e:  # unreadable, or not JSON (JSONDecodeError and UnicodeDecodeError)
            _fail(ap, f"--report {path}: cannot read it as JSON ({e})")
        except (KeyError, TypeError, AttributeError) as e:
            _fail(ap, f"--report {path}: not a `sharegpu sim` JSON report ({type(e).__name__}: {e})")
    return out


def _mean_or_none(values: list[float]) -> float | None:
    """The mean, or None where some seed's shares cannot all be placed (an infinite floor for that case)."""
    return None if any(math.isinf(v) for v in values) else round(sum(values) / len(values), 2)


if __name__ == "__main__":
    main()
