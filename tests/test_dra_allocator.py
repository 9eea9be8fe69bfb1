"""The ``dra-default`` policy: the stock kube-scheduler's node scores and the DRA allocator's first-fit device."""

from __future__ import annotations

import numpy as np

from sharegpu.ledger import Ledger
from sharegpu.model.assignment import Assignment
from sharegpu.model.catalog import GIB
from sharegpu.model.inventory import NodeSpec, sim_gpus
from sharegpu.model.request import GpuRequest
from sharegpu.placement.dra_allocator import balanced_allocation, least_allocated
from sharegpu.placement.framework import CycleState, Decision, Scheduler
from sharegpu.placement.mechanism import make_share, usable_gpus
from sharegpu.placement.policies import PolicyContext, make_policy


def node(name: str, gpus: int = 4, cpu: int = 64_000, mem: int = 256 * GIB) -> NodeSpec:
    return NodeSpec(name, cpu, mem, sim_gpus(name, "A100-80GB", gpus))


def dra(nodes: list[NodeSpec], seed: int = 0) -> Scheduler:
    return Scheduler(Ledger(nodes), make_policy("dra-default", PolicyContext()), seed=seed)


def put(led: Ledger, n: int, gpus: list[int], req: GpuRequest) -> None:
    """Reserve ``req`` on exactly these GPUs of node ``n`` (bypassing any policy)."""
    shares = tuple(make_share(led, n, g, req) for g in gpus)
    led.place(Assignment(req.name, led.nodes[n].name, shares, req.cpu_milli, req.host_memory_mib))


def test_least_allocated_is_the_unused_share_rounded_down() -> None:
    got = least_allocated(np.array([3000, 333, 5000, 0, 10]), np.array([4000, 1000, 4000, 4000, 0]))
    # 25 exactly; 66.7 → 66; over the allocatable → 0; nothing requested → 100; no allocatable → 0
    assert got.tolist() == [25, 66, 0, 100, 0]


def test_balanced_allocation_is_one_minus_half_the_gap_truncated() -> None:
    got = balanced_allocation(np.array([[0.5, 0.25], [1.5, 0.5], [0.3, 0.3], [0.0, 0.99]]))
    # gap 0.25 → 87.5 → 87; cpu capped at 1 → gap 0.5 → 75; equal → 100; gap 0.99 → 50.5 → 50
    assert got.tolist() == [87, 75, 100, 50]


def test_node_score_is_least_allocated_mean_plus_balanced_and_blind_to_gpus() -> None:
    s = dra([node("a"), node("b")])
    led = s.ledger
    # node a: a CPU-heavy resident pod that also fills three of its four GPUs
    put(led, 0, [0, 1, 2], GpuRequest("resident", 3, cpu_milli=32_000, host_memory_mib=64 * GIB))
    req = GpuRequest("p", 1, compute_milli=300, cpu_milli=8_000, host_memory_mib=32 * GIB)
    _, usable = s.feasible(req)
    state = CycleState(req, usable, s.rng)
    scores = s.scores(state, np.array([0, 1], dtype=np.int64)).tolist()
    # a: cpu (64-40)/64 → 37, mem (256-96)/256 → 62, mean 49; fractions .625/.375 → 87; total 136
    # b: cpu 56/64 → 87, mem 224/256 → 87, mean 87; fractions .125/.125 → 100; total 187
    assert scores == [136, 187]
    # so the share goes to the empty node and opens an idle GPU there, although node a has a GPU with room
    d = s.decide(req)
    assert isinstance(d, Decision)
    assert d.assignment.node == "b" and d.assignment.shares[0].gpu_index == 0


def test_share_takes_the_first_gpu_by_index_with_room_not_the_tightest() -> None:
    s = dra([node("a")])
    led = s.ledger
    put(led, 0, [0], GpuRequest("x", 1, compute_milli=200, cpu_milli=1000))  # GPU 0: 800 free
    put(led, 0, [1], GpuRequest("y", 1, compute_milli=600, cpu_milli=1000))  # GPU 1: 400 free (tighter)
    d = s.place(GpuRequest("p", 1, compute_milli=300, cpu_milli=1000))
    assert d.assignment.shares[0].gpu_index == 0  # best fit would take GPU 1
    d = s.place(GpuRequest("q", 1, compute_milli=600, cpu_milli=1000))  # GPU 0 has 500 left, GPU 1 400
    assert d.assignment.shares[0].gpu_index == 2  # the first idle GPU, by index
    led.check_invariants()


def test_whole_gpus_are_the_first_idle_ones_by_index() -> None:
    s = dra([node("a", gpus=8)])
    put(s.ledger, 0, [1], GpuRequest("x", 1, compute_milli=100, cpu_milli=1000))
    put(s.ledger, 0, [3], GpuRequest("y", 1, cpu_milli=1000))
    d = s.place(GpuRequest("p", 3, cpu_milli=1000))
    assert [sh.gpu_index for sh in d.assignment.shares] == [0, 2, 4]
    state = CycleState(GpuRequest("q", 1, cpu_milli=1000), usable_gpus(s.ledger, GpuRequest("q", 1)), s.rng)
    assert make_policy("dra-default", PolicyContext()).selector.select(s.ledger, state, 0) == [5]


def test_ties_are_broken_at_random_but_reproducibly_per_seed() -> None:
    req = GpuRequest("p", 1, compute_milli=500, cpu_milli=1000)
    nodes = [node(f"n{i}") for i in range(4)]
    picks = {seed: dra(nodes, seed).decide(req) for seed in range(40)}
    chosen = {d.assignment.node for d in picks.values() if isinstance(d, Decision)}
    assert len(chosen) == 4  # not always the first node by name
    again = dra(nodes, 7).decide(req)
    assert isinstance(again, Decision) and isinstance(picks[7], Decision)
    assert again.assignment.node == picks[7].assignment.node
