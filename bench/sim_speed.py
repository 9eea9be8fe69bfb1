"""Simulator speed: one FGD-protocol run of an openb trace, this code against a baseline commit, side by side;
and a timed replay of an overloaded trace (pods leave, a pending queue waits for room).

Usage: uv run python bench/sim_speed.py [--trace default] [--policies fgd,sharegpu] [--seed 42] [--repeat 3]
           [--baseline a518376] [--replay-pods 100000] [--replay-naive-pods 0]

FGD protocol: each run is a fresh process (the same small driver for both codes; the baseline's source comes
from `git archive BASELINE src` and is put first on PYTHONPATH), runs alternate between the two codes and the
policies so that both see the same machine, and the wall time is the engine's own (ledger built, every pod
decided; the trace is read before the clock starts). Prints every run and the medians with their ratio.

Replay: --replay-pods pods drawn with replacement from the trace (seeded), each keeping its row's shape and
lifetime (deletion − creation, clipped at its 90th percentile and rescaled), arriving as a Poisson process whose offered GPU load is 1.5 × the
cluster, so that demand exceeds capacity and the pending queue fills (10,000 pods at most wait; more are dropped).
--replay-naive-pods N also replays the first N of those pods with the whole queue retried on every deletion
(the plain reference), to show what the indexed queue saves.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

from sharegpu.placement.policies import PolicyContext, make_policy
from sharegpu.placement.reasons import ReasonKind
from sharegpu.sim.openb import TraceTask, load_nodes, load_pods
from sharegpu.sim.replay import overloaded, replay_trace
from sharegpu.sim.runner import Experiment

REPO = Path(__file__).resolve().parents[1]

DRIVER = """
import json, sys
from pathlib import Path
from sharegpu.sim.openb import load_nodes, load_pods
from sharegpu.sim.runner import Experiment, run_one
data, trace, policy, seed = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
nodes = tuple(load_nodes(data / "openb_node_list_gpu_node.csv"))
tasks = tuple(load_pods(data / f"openb_pod_list_{trace}.csv"))
exp = Experiment(trace, nodes, tasks, (policy,), (seed,))
r = run_one(exp, exp.workload(), policy, seed)
print(json.dumps({"wall_s": r.wall_s, "pods": r.pods, "p50": r.latency_p50_ms, "p99": r.latency_p99_ms,
                  "alloc100": r.alloc_at(100), "alloc130": r.alloc_at(130), "placed": r.placed}))
"""


def baseline_src(ref: str) -> Path:
    """The baseline commit's src/ tree, extracted once into a temporary folder (git archive: no checkout)."""
    sha = subprocess.run(["git", "rev-parse", ref], cwd=REPO, capture_output=True, text=True, check=True).stdout
    dest = Path(tempfile.gettempdir()) / f"sharegpu-bench-{sha.strip()[:12]}"
    if not (dest / "src" / "sharegpu").is_dir():
        blob = subprocess.run(["git", "archive", ref, "src"], cwd=REPO, capture_output=True, check=True).stdout
        with tarfile.open(fileobj=BytesIO(blob)) as tar:
            tar.extractall(dest, filter="data")
    return dest / "src"


def fgd_run(src: Path, data: Path, trace: str, policy: str, seed: int) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(src))
    out = subprocess.run(
        [sys.executable, "-c", DRIVER, str(data), trace, policy, str(seed)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    result: dict[str, float] = json.loads(out.strip().splitlines()[-1])
    return result


def overloaded_tasks(data: Path, trace: str, pods: int, seed: int, load: float = 1.5) -> tuple[TraceTask, ...]:
    """The trace's pods redrawn to overload its cluster (:func:`sharegpu.sim.replay.overloaded`, as `sharegpu sim
    --replay --load` does)."""
    base = load_pods(data / f"openb_pod_list_{trace}.csv")
    capacity_milli = 1000 * sum(len(n.gpus) for n in load_nodes(data / "openb_node_list_gpu_node.csv"))
    return overloaded(base, capacity_milli, pods, seed, load)


def replay_bench(data: Path, trace: str, policy: str, pods: int, retry_all: bool) -> None:
    nodes = tuple(load_nodes(data / "openb_node_list_gpu_node.csv"))
    tasks = overloaded_tasks(data, trace, pods, seed=42)
    exp = Experiment(trace, nodes, tasks, (policy,), (0,), replay=True)
    pol = make_policy(policy, PolicyContext(exp.workload()))
    t0 = time.perf_counter()
    res = replay_trace(nodes, tasks, pol, retry_all=retry_all)
    wall = time.perf_counter() - t0
    how = "whole queue retried" if retry_all else "indexed queue"
    print(
        f"replay {policy} ({how}): {len(tasks):,} pods in {wall:.1f}s wall; placed {res.run.placed:,}, "
        f"waited {res.waited:,}, never placed {res.never_placed:,}, peak pending {res.peak_pending:,}, "
        f"dropped {res.run.failures.get(ReasonKind.QUEUE_FULL, 0):,}, mean allocation "
        f"{res.run.replay['mean_alloc_pct'] if res.run.replay else 0}%",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data" / "openb")
    ap.add_argument("--trace", default="default")
    ap.add_argument("--policies", default="fgd,sharegpu")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--baseline", default="a518376", help="git ref to compare with ('' for none)")
    ap.add_argument("--replay-pods", type=int, default=100_000, help="0 to skip the replay")
    ap.add_argument("--replay-policy", default="sharegpu")
    ap.add_argument("--replay-naive-pods", type=int, default=0)
    args = ap.parse_args()
    data = args.data.resolve()
    codes = {"this": REPO / "src"}
    if args.baseline:
        codes[args.baseline] = baseline_src(args.baseline)
    policies = args.policies.split(",")
    runs: dict[tuple[str, str], list[dict[str, float]]] = {(c, p): [] for c in codes for p in policies}
    for i in range(args.repeat):
        order = list(codes) if i % 2 == 0 else list(reversed(codes))
        for p in policies:
            for c in order:
                r = fgd_run(codes[c], data, args.trace, p, args.seed)
                runs[(c, p)].append(r)
                print(
                    f"run {i + 1} {c:>8} {p}: wall {r['wall_s']:.2f}s, {r['pods']} pods, decision p50 "
                    f"{r['p50']:.2f} ms p99 {r['p99']:.2f} ms, alloc@100 {r['alloc100']}",
                    flush=True,
                )
    print()
    print("| code | policy | runs | median wall s (min–max) | pods | decision p50 | decision p99 | alloc @100 |")
    print("|---|---|---|---|---|---|---|---|")
    for c in codes:
        for p in policies:
            rs = runs[(c, p)]
            walls = [r["wall_s"] for r in rs]
            print(
                f"| {c} | {p} | {len(rs)} | {statistics.median(walls):.2f} ({min(walls):.2f}–{max(walls):.2f}) | "
                f"{int(rs[0]['pods']):,} | {statistics.median(r['p50'] for r in rs):.2f} ms | "
                f"{statistics.median(r['p99'] for r in rs):.2f} ms | {rs[0]['alloc100']} |"
            )
    med = {k: statistics.median(r["wall_s"] for r in v) for k, v in runs.items()}
    for p in policies:
        if args.baseline:
            print(f"{p}: {args.baseline} / this = {med[(args.baseline, p)] / med[('this', p)]:.2f}x")
        print(f"{p} / {policies[0]} (this code) = {med[('this', p)] / med[('this', policies[0])]:.2f}x")
    if args.replay_pods:
        replay_bench(data, args.trace, args.replay_policy, args.replay_pods, retry_all=False)
    if args.replay_naive_pods:
        replay_bench(data, args.trace, args.replay_policy, args.replay_naive_pods, retry_all=True)
        replay_bench(data, args.trace, args.replay_policy, args.replay_naive_pods, retry_all=False)


if __name__ == "__main__":
    main()
