"""Priorities, preemption and consolidation in the simulator (issue 19): how long high-priority pods wait, and at what
cost, with and without each feature, against FGD and the `sharegpu` policy without them, side by side in one run.

Usage: uv run python bench/priority_replay.py [--trace default] [--seeds 42,43] [--arrivals 20000] [--load 2.0]
           [--high 0.2] [--max-moves 2] [--jobs 2] [--plot docs/priority.png]

Workload: the openb trace redrawn with its pods' lifetimes, arriving so that the GPU busy on average is --load × the
cluster (sharegpu.sim.replay.overloaded; the trace as recorded never fills its cluster), a seeded --high share of
pods marked high priority. Every variant of a seed replays the same pods with the same marking. In every variant the
pending queue retries higher priority first (the kube-scheduler's order, so "today" already favours them); the
features add preemption (victims chosen as the kube-scheduler chooses them) and consolidation (at most --max-moves
moves of low-priority pods per plan). "alloc %" is allocated GPU averaged over trace time up to the last arrival (the
loaded part); "alloc all %" the replay's mean over all events, most of which are the drain after the last arrival.
Prints one row per variant (medians over seeds) and the ratios to the
`sharegpu` baseline, and writes a plot: waiting times of high-priority pods, and allocation over time.
"""

from __future__ import annotations

import argparse
import statistics
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from sharegpu.placement.policies import PolicyContext, make_policy
from sharegpu.sim.engine import RunResult
from sharegpu.sim.openb import load_nodes, load_pods
from sharegpu.sim.replay import PriorityOptions, overloaded, replay_trace
from sharegpu.sim.runner import Experiment

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "openb"

VARIANTS: tuple[tuple[str, str, bool, bool], ...] = (
    # label, policy, preemption, consolidation
    ("fgd", "fgd", False, False),
    ("sharegpu", "sharegpu", False, False),
    ("sharegpu +preemption", "sharegpu", True, False),
    ("sharegpu +consolidation", "sharegpu", False, True),
    ("sharegpu +both", "sharegpu", True, True),
)


def one(args: tuple[str, str, int, int, float, float, int, str, bool, bool]) -> tuple[str, int, RunResult]:
    data, trace, seed, arrivals, load, high, max_moves, label_policy, pre, cons = args
    label, policy = label_policy.split("|")
    nodes = tuple(load_nodes(Path(data) / "openb_node_list_gpu_node.csv"))
    base = tuple(load_pods(Path(data) / f"openb_pod_list_{trace}.csv"))
    exp = Experiment(trace, nodes, base, (policy,), (seed,), replay=True)
    tasks = overloaded(base, exp.capacity_milli, arrivals, seed, load)
    pol = make_policy(policy, PolicyContext(exp.workload()))
    opts = PriorityOptions(high, pre, cons, max_moves)
    return label, seed, replay_trace(nodes, tasks, pol, opts, seed).run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--trace", default="default")
    ap.add_argument("--seeds", default="42,43")
    ap.add_argument("--arrivals", type=int, default=20_000)
    ap.add_argument("--load", type=float, default=2.0)
    ap.add_argument("--high", type=float, default=0.2)
    ap.add_argument("--max-moves", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--plot", type=Path, default=REPO / "docs" / "priority.png")
    a = ap.parse_args()
    if not (a.data / "openb_node_list_gpu_node.csv").exists():
        raise SystemExit(f"no openb trace under {a.data}; give --data")
    seeds = [int(s) for s in a.seeds.split(",")]
    jobs = [
        (str(a.data), a.trace, s, a.arrivals, a.load, a.high, a.max_moves, f"{label}|{policy}", pre, cons)
        for s in seeds
        for label, policy, pre, cons in VARIANTS
    ]
    with ProcessPoolExecutor(max_workers=a.jobs) as pool:
        results = list(pool.map(one, jobs))
    by_label: dict[str, list[RunResult]] = {}
    for label, _, r in results:
        by_label.setdefault(label, []).append(r)
    rows = {label: summary(rs) for label, rs in by_label.items()}
    print(
        f"trace {a.trace}, {a.arrivals:,} pods at load {a.load:g}, {a.high:.0%} high priority, seeds {a.seeds} "
        "(medians over seeds; waits in s of trace time)"
    )
    cols = (
        "hi mean",
        "hi p50",
        "hi p95",
        "hi p99",
        "hi never",
        "lo mean",
        "never",
        "evicted",
        "moves",
        "alloc %",
        "alloc all %",
        "wall s",
    )
    print(f"| variant | {' | '.join(cols)} |")
    print("|---|" + "---|" * len(cols))
    for label, row in rows.items():
        print(f"| {label} | " + " | ".join(fmt(row[c]) for c in cols) + " |")
    base = rows["sharegpu"]
    for label, row in rows.items():
        if label.startswith("sharegpu +"):
            print(
                f"{label} / sharegpu: high-priority mean wait {ratio(row['hi mean'], base['hi mean'])}, p95 "
                f"{ratio(row['hi p95'], base['hi p95'])}; allocation {row['alloc %'] - base['alloc %']:+.2f} pp; "
                f"low-priority mean wait {ratio(row['lo mean'], base['lo mean'])}"
            )
    plot(a.plot, by_label, rows, a)
    print(f"plot: {a.plot}")


def summary(rs: list[RunResult]) -> dict[str, float]:
    def med(key: str) -> float:
        return statistics.median(float((r.replay or {}).get(key, 0.0)) for r in rs)

    return {
        "hi mean": med("high_wait_mean_s"),
        "hi p50": med("high_wait_p50_s"),
        "hi p95": med("high_wait_p95_s"),
        "hi p99": med("high_wait_p99_s"),
        "hi never": med("high_never_placed"),
        "lo mean": med("low_wait_mean_s"),
        "never": med("never_placed"),
        "evicted": med("evictions"),
        "moves": med("moves"),
        "alloc %": med("arrival_alloc_pct"),
        "alloc all %": med("mean_alloc_pct"),
        "wall s": statistics.median(r.wall_s for r in rs),
    }


def fmt(v: float) -> str:
    return f"{v:,.2f}" if abs(v) < 100 and v != int(v) else f"{v:,.0f}"


def ratio(a: float, b: float) -> str:
    return "n/a (baseline 0)" if b == 0 else f"{a / b:.3f}×"


def plot(path: Path, by_label: dict[str, list[RunResult]], rows: dict[str, dict[str, float]], a: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8), dpi=120, width_ratios=(2, 3))
    labels = list(rows)
    x = np.arange(len(labels))
    for off, key in ((-0.2, "hi mean"), (0.2, "hi p95")):
        left.bar(x + off, [rows[lb][key] / 3600 for lb in labels], width=0.4, label=key.replace("hi", "high-priority"))
    left.set_xticks(x, [lb.replace(" +", "\n+") for lb in labels], fontsize=8)
    left.set_ylabel("wait, hours of trace time")
    left.set_title("high-priority pods' waiting time (median of seeds)")
    left.legend()
    left.grid(alpha=0.3, axis="y")
    for label, rs in by_label.items():
        r = rs[0]
        if r.timeline is None:
            continue
        hours = (np.asarray(r.timeline.time_s) - r.timeline.time_s[0]) / 3600
        right.step(hours, r.timeline.alloc_pct, where="post", label=label, linewidth=1.0)
    right.set_xlabel(f"trace time, hours (seed {by_label[labels[0]][0].seed})")
    right.set_ylabel("allocated GPU, % of cluster")
    right.set_title(f"allocation over time ({a.arrivals:,} pods, load {a.load:g}, {a.high:.0%} high)")
    right.grid(alpha=0.3)
    right.legend(fontsize=8, loc="lower right")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    main()
