"""SLOW (~30 s): the real openb trace reproduces the FGD paper's published allocation for FGD and BestFit.

Needs ../shared/data/openb next to the repository (Alibaba cluster-trace-gpu-v2023; never copied into it) and
skips when it is absent. Three seeds (42-44) of the published ten, so the tolerance is 0.6 percentage points.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from sharegpu.sim.engine import RunResult
from sharegpu.sim.openb import load_nodes, load_pods
from sharegpu.sim.report import summarize
from sharegpu.sim.runner import Experiment, run_experiment

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "openb"
NODES = DATA / "openb_node_list_gpu_node.csv"
PODS = DATA / "openb_pod_list_default.csv"
PUBLISHED = DATA / "fgd_published_allocation.csv"
SEEDS = (42, 43, 44)
TOLERANCE_PP = 0.6
POLICY_NAMES = {"fgd": "FGD", "bestfit": "BestFit"}  # ours → the published table's

pytestmark = [
    pytest.mark.trace,
    pytest.mark.skipif(
        not all(p.is_file() for p in (NODES, PODS, PUBLISHED)),
        reason=f"the openb trace is not at {DATA} (needs {NODES.name}, {PODS.name} and {PUBLISHED.name})",
    ),
]


def published(trace: str, policy: str) -> tuple[float, float]:
    with PUBLISHED.open(newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            if row["trace"] == trace and row["policy"] == policy:
                return float(row["gpu_alloc_pct_at_arrived_100"]), float(row["gpu_alloc_pct_at_arrived_130"])
    raise AssertionError(f"{PUBLISHED} has no row for trace {trace!r}, policy {policy!r}")


@pytest.fixture(scope="module")
def runs() -> list[RunResult]:
    nodes = load_nodes(NODES)
    tasks = load_pods(PODS)
    exp = Experiment("default", tuple(nodes), tuple(tasks), tuple(POLICY_NAMES), SEEDS)
    return run_experiment(exp, jobs=1)


def test_the_trace_is_the_published_cluster(runs: list[RunResult]) -> None:
    assert [(r.policy, r.seed) for r in runs] == [(p, s) for p in POLICY_NAMES for s in SEEDS]
    for r in runs:
        assert r.total_gpus == 6212  # DESIGN §5: 1,213 nodes with 6,212 GPUs
        assert r.placed + r.failed == r.pods
        assert r.alloc_at(100) is not None and r.alloc_at(130) is not None


@pytest.mark.parametrize("policy", list(POLICY_NAMES))
def test_slow_mean_allocation_matches_the_published_mean(runs: list[RunResult], policy: str) -> None:
    (s,) = [s for s in summarize(runs) if s.policy == policy]
    assert s.seeds == len(SEEDS)
    want_100, want_130 = published("default", POLICY_NAMES[policy])
    assert s.alloc_100 is not None and s.alloc_130 is not None
    assert abs(s.alloc_100 - want_100) <= TOLERANCE_PP, f"{policy} @100: {s.alloc_100:.2f} vs published {want_100}"
    assert abs(s.alloc_130 - want_130) <= TOLERANCE_PP, f"{policy} @130: {s.alloc_130:.2f} vs published {want_130}"


def test_slow_fgd_beats_bestfit(runs: list[RunResult]) -> None:
    by = {s.policy: s for s in summarize(runs)}
    fgd, bestfit = by["fgd"], by["bestfit"]
    assert fgd.alloc_100 is not None and bestfit.alloc_100 is not None
    assert fgd.alloc_130 is not None and bestfit.alloc_130 is not None
    assert fgd.alloc_100 > bestfit.alloc_100
    assert fgd.alloc_130 > bestfit.alloc_130
    # Seed by seed as well: on the same arrivals FGD leaves fewer GPUs unallocated.
    for seed in SEEDS:
        f = next(r for r in runs if r.policy == "fgd" and r.seed == seed)
        b = next(r for r in runs if r.policy == "bestfit" and r.seed == seed)
        assert f.alloc_at(130) > b.alloc_at(130)  # type: ignore[operator]
