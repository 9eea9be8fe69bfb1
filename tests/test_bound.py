"""The offline allocation bound (sim/bound.py) against brute force on tiny instances, and against the simulator."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import pytest

from sharegpu.model.inventory import NodeSpec, sim_gpus
from sharegpu.model.request import GpuRequest
from sharegpu.placement.fragmentation import Workload
from sharegpu.placement.policies import PolicyContext, make_policy
from sharegpu.sim.bound import BoundError, allocation_bound, node_types, prefix_at, shapes
from sharegpu.sim.engine import run_arrivals

MODELS = ("T4", "V100-16GB")


def node(name: str, gpus: int, cpu: int, mem: int = 64_000, model: str = "T4") -> NodeSpec:
    return NodeSpec(name, cpu, mem, sim_gpus(name, model, gpus))


def pod(
    name: str, gpus: int, milli: int, cpu: int, mem: int = 1000, models: frozenset[str] = frozenset()
) -> GpuRequest:
    if gpus == 0:
        return GpuRequest(name, 0, cpu_milli=cpu, host_memory_mib=mem)
    return GpuRequest(name, gpus, compute_milli=milli, allowed_models=models, cpu_milli=cpu, host_memory_mib=mem)


def _gpus_fit(sharing: list[int], free_gpus: int) -> bool:
    """Whether shares (milli) can be laid on ``free_gpus`` GPUs of 1000 each: exhaustive, largest first."""
    loads = [0] * free_gpus

    def place(i: int) -> bool:
        if i == len(sharing):
            return True
        tried = set()
        for g in range(free_gpus):
            if loads[g] + sharing[i] <= 1000 and loads[g] not in tried:
                tried.add(loads[g])
                loads[g] += sharing[i]
                if place(i + 1):
                    return True
                loads[g] -= sharing[i]
        return False

    return place(0)


def fits(n: NodeSpec, pods: Sequence[GpuRequest]) -> bool:
    """The fit rules of DESIGN §5, written independently of the code under test."""
    model = n.gpus[0].model if n.gpus else ""
    if sum(p.cpu_milli for p in pods) > n.cpu_milli or sum(p.host_memory_mib for p in pods) > n.memory_mib:
        return False
    if any(p.allowed_models and model not in p.allowed_models for p in pods):
        return False
    whole = sum(p.gpu_count for p in pods if p.milli == 1000)
    if whole > len(n.gpus):
        return False
    return _gpus_fit(sorted((p.milli for p in pods if p.milli < 1000), reverse=True), len(n.gpus) - whole)


def brute_force(nodes: Sequence[NodeSpec], pods: Sequence[GpuRequest]) -> int:
    """The most GPU milli any placement of a subset of ``pods`` allocates: every assignment tried."""
    gpu_pods = [p for p in pods if p.gpu_count]
    best = 0
    for assign in itertools.product(range(len(nodes) + 1), repeat=len(gpu_pods)):
        groups: list[list[GpuRequest]] = [[] for _ in nodes]
        for p, a in zip(gpu_pods, assign, strict=True):
            if a < len(nodes):
                groups[a].append(p)
        if all(fits(n, g) for n, g in zip(nodes, groups, strict=True)):
            best = max(best, sum(p.total_milli for g in groups for p in g))
    return best


def bound_of(nodes: Sequence[NodeSpec], pods: Sequence[GpuRequest]) -> float:
    return allocation_bound(nodes, pods, gap_pct=0.0).bound_milli


# ----- hand-made cases where the trivial bound is wrong ----------------------------------------------------------
def test_shares_that_cannot_pair_on_a_gpu() -> None:
    nodes = [node("n", 2, cpu=64_000)]
    pods = [pod(f"p{i}", 1, 600, 1000) for i in range(3)]  # 1800 asked, 2000 capacity, but 600 + 600 > 1000
    assert brute_force(nodes, pods) == 1200
    assert bound_of(nodes, pods) == pytest.approx(1200, abs=1e-3)


def test_cpu_per_node_limits_whole_gpus() -> None:
    nodes = [node("a", 2, cpu=10_000), node("b", 2, cpu=10_000)]
    pods = [pod(f"p{i}", 1, 1000, 6000) for i in range(4)]  # one 6-core pod per 10-core node
    assert brute_force(nodes, pods) == 2000
    assert bound_of(nodes, pods) == pytest.approx(2000, abs=1e-3)  # an aggregate LP would say 3333


def test_model_constraints_and_multi_gpu() -> None:
    nodes = [node("t4", 2, 64_000, model="T4"), node("v100", 4, 64_000, model="V100-16GB")]
    pods = [
        pod("a", 4, 1000, 1000),
        pod("b", 2, 1000, 1000, models=frozenset({"V100-16GB"})),
        pod("c", 1, 1000, 1000, models=frozenset({"V100-16GB"})),
        pod("d", 1, 500, 1000),
    ]
    assert brute_force(nodes, pods) == 4500
    assert bound_of(nodes, pods) == pytest.approx(4500, abs=1e-3)


def test_cpu_only_pods_and_empty_inputs() -> None:
    nodes = [node("n", 1, 4000)]
    b = allocation_bound(nodes, [pod("c", 0, 0, 4000), pod("g", 1, 300, 1000)])
    assert b.bound_milli == pytest.approx(300) and b.demand_milli == 300 and b.capacity_milli == 1000
    assert allocation_bound(nodes, []).bound_milli == 0
    assert allocation_bound([node("cpu", 0, 4000)], [pod("g", 1, 300, 1000)]).bound_milli == 0


# ----- random tiny instances -------------------------------------------------------------------------------------
def random_instance(rng: np.random.Generator, n_nodes: int) -> tuple[list[NodeSpec], list[GpuRequest]]:
    nodes = [
        node(
            f"n{i}",
            int(rng.choice([1, 2, 4, 8])),
            cpu=int(rng.choice([4, 8, 16])) * 1000,
            mem=int(rng.choice([8, 32])) * 1024,
            model=str(rng.choice(MODELS)),
        )
        for i in range(n_nodes)
    ]
    pods = []
    for i in range(int(rng.integers(3, 7))):
        kind = rng.integers(4)
        cpu, mem = int(rng.integers(1, 9)) * 1000, int(rng.integers(1, 17)) * 1024
        models = frozenset({str(rng.choice(MODELS))}) if rng.random() < 0.2 else frozenset()
        if kind == 0:
            pods.append(pod(f"p{i}", 1, int(rng.choice([100, 250, 300, 450, 500, 600, 700])), cpu, mem, models))
        elif kind == 1:
            pods.append(pod(f"p{i}", 1, 1000, cpu, mem, models))
        elif kind == 2:
            pods.append(pod(f"p{i}", int(rng.choice([2, 4])), 1000, cpu, mem, models))
        else:
            pods.append(pod(f"p{i}", 0, 0, cpu, mem))
    return nodes, pods


@pytest.mark.parametrize("seed", range(12))
def test_one_node_bound_is_the_exact_optimum(seed: int) -> None:
    # With one node the configuration LP's optimum is its best configuration: the bound must equal brute force,
    # which checks the pricing MIP both ways (never below a feasible set, never above the best one).
    nodes, pods = random_instance(np.random.default_rng(seed), 1)
    assert bound_of(nodes, pods) == pytest.approx(brute_force(nodes, pods), abs=1e-3)


@pytest.mark.parametrize("seed", range(100, 112))
def test_bound_is_at_least_the_best_placement(seed: int) -> None:
    nodes, pods = random_instance(np.random.default_rng(seed), 2)
    best = brute_force(nodes, pods)
    b = allocation_bound(nodes, pods, gap_pct=0.0)
    assert b.bound_milli >= best - 1e-6
    assert b.bound_milli <= min(b.capacity_milli, b.demand_milli) + 1e-6
    assert b.master_milli <= b.bound_milli + 1e-6


@pytest.mark.parametrize("policy", ["bestfit", "fgd", "sharegpu", "random"])
def test_no_policy_beats_the_bound(policy: str) -> None:
    rng = np.random.default_rng(7)
    nodes = [
        node(f"n{i}", int(rng.choice([2, 4, 8])), int(rng.choice([16, 32, 64])) * 1000, 256 * 1024) for i in range(6)
    ]
    pods = [
        pod(f"p{i:03d}", 1, int(rng.choice([200, 300, 500, 700, 1000])), int(rng.integers(1, 12)) * 1000)
        for i in range(60)
    ]
    b = allocation_bound(nodes, pods, gap_pct=0.0)
    r = run_arrivals(nodes, pods, make_policy(policy, PolicyContext(Workload.from_requests(pods))), seed=1)
    allocated = r.final_alloc_pct / 100 * b.capacity_milli
    assert allocated <= b.bound_milli + 1e-6


# ----- inputs ---------------------------------------------------------------------------------------------------
def test_types_and_shapes_aggregate_identical_nodes_and_pods() -> None:
    nodes = [node("a", 2, 8000), node("b", 2, 8000), node("c", 4, 8000)]
    assert [(t.gpus, t.count) for t in node_types(nodes)] == [(2, 2), (4, 1)]
    pods = [pod("x", 1, 500, 1000), pod("y", 1, 500, 1000), pod("z", 0, 0, 1000)]
    assert [(s.milli, s.count) for s in shapes(pods)] == [(500, 2)]


def test_requests_beyond_the_model_are_refused() -> None:
    with pytest.raises(BoundError, match="GPU memory"):
        shapes([GpuRequest("m", 1, memory_mib=1024)])


def test_prefix_follows_the_curve_rounding() -> None:
    pods = [pod(f"p{i}", 1, 1000, 1) for i in range(10)]
    # capacity 4 GPUs: cumulative 25, 50, 75, 100, 125 %... level 100 keeps the first 4
    assert len(prefix_at(pods, 4000, 100)) == 4
    pods = [pod(f"p{i}", 1, 5, 1) for i in range(1000)]
    # capacity 1 GPU, 0.5 % per pod: 100.5 % rounds (half to even) to 100, 101.0 to 101
    assert len(prefix_at(pods, 1000, 100)) == 201
