"""The work-conserving floor (sim/floor.py): the share-packing LP against hand-worked and brute-force values, and
the floor against every policy of the simulator on random clusters (no work-conserving policy may go below it)."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sharegpu.model.inventory import NodeSpec
from sharegpu.model.request import GpuRequest
from sharegpu.placement.fragmentation import Workload
from sharegpu.placement.policies import PolicyContext, make_policy
from sharegpu.sim.bound import BoundError, allocation_bound
from sharegpu.sim.engine import run_arrivals
from sharegpu.sim.floor import PatternPool, least_idle, work_conserving_floor
from test_bound import node, pod

POLICIES = ("random", "dotprod", "clustering", "packing", "bestfit", "fgd", "sharegpu")


# ----- the share-packing LP ----------------------------------------------------------------------------------------
def test_shares_that_cannot_pair_waste_what_they_leave() -> None:
    assert least_idle({810: 2}, {810: 2}, 0, 2000) == pytest.approx(380)
    # one 810 must be placed, a 190 may be: it fills the gap
    assert least_idle({810: 1}, {810: 1, 190: 1}, 0, 1000) == pytest.approx(0)
    # nothing has to be placed, a whole-GPU pod may take the GPU
    assert least_idle({}, {810: 1}, 1000, 1000) == 0


def test_shares_and_whole_gpus_compete_for_gpus() -> None:
    # two 600s on two GPUs, no whole pod: placing both leaves 800 idle
    assert least_idle({}, {600: 2}, 0, 2000) == pytest.approx(800)
    # with a whole pod of 1000 as well: one 600 and the whole pod leave 400 idle
    assert least_idle({}, {600: 2}, 1000, 2000) == pytest.approx(400)
    # but if both 600s must be placed, the whole pod finds no GPU
    assert least_idle({600: 2}, {600: 2}, 1000, 2000) == pytest.approx(800)
    # 500s pair without waste
    assert least_idle({500: 2}, {500: 2}, 1000, 2000) == pytest.approx(0)
    # shares that must be placed but cannot fit at all: the case cannot happen
    assert least_idle({700: 3}, {700: 3}, 0, 2000) == float("inf")


def test_bad_counts_are_refused_with_the_size() -> None:
    with pytest.raises(BoundError, match="3 shares of 500 milli must be placed but only 2 arrived"):
        least_idle({500: 3}, {500: 2}, 0, 4000)
    with pytest.raises(BoundError, match="1200 milli does not fit"):
        PatternPool([1200])


def _best_packing_waste(shares: list[int]) -> int:
    """The least idle milli of any packing of ``shares`` into GPUs of 1000 milli: every assignment tried."""
    best = 1000 * len(shares)
    for assign in itertools.product(range(len(shares)), repeat=len(shares)):
        loads = Counter[int]()
        for s, g in zip(shares, assign, strict=True):
            loads[g] += s
        if max(loads.values()) <= 1000:
            best = min(best, 1000 * len(loads) - sum(shares))
    return best


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([110, 160, 230, 320, 470, 500, 650, 810]), min_size=1, max_size=6))
def test_the_relaxation_never_exceeds_the_best_packing(shares: list[int]) -> None:
    counts = dict(Counter(shares))
    # on as many GPUs as shares and no whole pods, the idle is the packing's waste plus the GPUs left empty
    n = len(shares)
    empty = 1000 * n - sum(shares) - _best_packing_waste(shares)
    assert least_idle(counts, counts, 0, 1000 * n) <= _best_packing_waste(shares) + empty + 1e-6


# ----- the floor --------------------------------------------------------------------------------------------------
def test_a_hand_worked_floor_is_tight() -> None:
    # two 600s cannot share a GPU; a work-conserving policy places both, one per GPU, and the whole-GPU pod that
    # comes last finds no GPU: 800 milli idle, whatever the policy
    nodes = [node("n", 2, cpu=32_000)]
    pods = [pod("a", 1, 600, 1000), pod("b", 1, 600, 1000), pod("c", 1, 1000, 1000)]
    f = work_conserving_floor(nodes, pods)
    assert f.idle_milli == pytest.approx(800)
    assert f.first_failure is None and f.all_placed_milli == pytest.approx(800)
    for policy in POLICIES:
        r = run_arrivals(nodes, pods, make_policy(policy, PolicyContext(Workload.from_requests(pods))), seed=1)
        assert r.final_alloc_pct == pytest.approx(60)


def test_a_failing_share_takes_only_the_pods_that_need_as_much_with_it() -> None:
    # One GPU. The 500 is placed, the 700 fails (500 free), the 300 still fits beside the 500, the whole pod fails:
    # 200 idle. The 700's failure blocks the whole pod but not the smaller 300 after it, and the floor, which
    # counts the 300 as placeable, reaches exactly what every policy gets.
    nodes = [node("n", 1, cpu=32_000)]
    pods = [pod("a", 1, 500, 1000), pod("b", 1, 700, 1000), pod("c", 1, 300, 1000), pod("d", 1, 1000, 1000)]
    f = work_conserving_floor(nodes, pods)
    assert f.idle_milli == pytest.approx(200)
    assert f.first_failure == 1
    r = run_arrivals(nodes, pods, make_policy("bestfit", PolicyContext(Workload.from_requests(pods))), seed=1)
    assert r.final_alloc_pct == pytest.approx(80)


@st.composite
def clusters(draw: st.DrawFn) -> tuple[list[NodeSpec], list[GpuRequest]]:
    models = ("T4", "V100-16GB")
    n_nodes = draw(st.integers(1, 4))
    nodes = [
        node(
            f"n{i}",
            draw(st.sampled_from([1, 2, 4])),
            cpu=draw(st.sampled_from([4, 8, 16])) * 1000,
            mem=draw(st.sampled_from([8, 32])) * 1024,
            model=draw(st.sampled_from(models)),
        )
        for i in range(n_nodes)
    ]
    capacity = sum(len(n.gpus) for n in nodes) * 1000
    pods: list[GpuRequest] = []
    demand = 0
    i = 0
    while demand < 1.3 * capacity and i < 40:
        kind = draw(st.integers(0, 5))
        cpu = draw(st.integers(0, 6)) * 1000
        mem = draw(st.integers(0, 8)) * 1024
        allowed = frozenset({draw(st.sampled_from(models))}) if draw(st.integers(0, 4)) == 0 else frozenset()
        if kind <= 2:
            milli = draw(st.sampled_from([110, 190, 250, 300, 470, 500, 650, 810]))
            pods.append(pod(f"p{i:02d}", 1, milli, cpu, mem, allowed))
        elif kind == 3:
            pods.append(pod(f"p{i:02d}", 1, 1000, cpu, mem, allowed))
        elif kind == 4:
            pods.append(pod(f"p{i:02d}", draw(st.sampled_from([2, 4])), 1000, cpu, mem, allowed))
        else:
            pods.append(pod(f"p{i:02d}", 0, 0, cpu, mem))
        demand += pods[-1].total_milli
        i += 1
    return nodes, pods


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters(), st.integers(0, 3))
def test_no_work_conserving_policy_goes_below_the_floor(
    case: tuple[list[NodeSpec], list[GpuRequest]], seed: int
) -> None:
    nodes, pods = case
    f = work_conserving_floor(nodes, pods)
    assert 0 <= f.idle_milli <= f.capacity_milli + 1e-6
    ctx = PolicyContext(Workload.from_requests(pods))
    for policy in POLICIES:
        r = run_arrivals(nodes, pods, make_policy(policy, ctx), seed=seed)
        idle = f.capacity_milli * (1 - r.final_alloc_pct / 100)
        assert idle >= f.idle_milli - 1e-6, f"{policy} left {idle:.0f} milli idle, below the floor {f.idle_milli:.0f}"


def test_requests_beyond_the_model_are_refused() -> None:
    with pytest.raises(BoundError, match="GPU memory"):
        work_conserving_floor([node("n", 1, 4000)], [GpuRequest("m", 1, memory_mib=1024)])


def test_a_work_conserving_policy_cannot_trade_shares_for_whole_gpus() -> None:
    # 100 shares of 810 on 100 GPUs: each takes a GPU of its own (no two fit together), so the 19 whole-GPU pods
    # that come after find no GPU — 19,000 milli idle, whatever the policy. An offline placement may drop 19 shares
    # for the whole pods (81 × 810 + 19 × 1000 = 84,610 allocated): the offline bound is above the floor's cap.
    nodes = [node(f"n{i}", 4, cpu=64_000) for i in range(25)]
    pods = [pod(f"s{i:03d}", 1, 810, 1000) for i in range(100)] + [pod(f"w{i:02d}", 1, 1000, 1000) for i in range(19)]
    f = work_conserving_floor(nodes, pods)
    assert f.idle_milli == pytest.approx(19_000)
    assert np.isclose(f.alloc_pct, 81.0)
    assert allocation_bound(nodes, pods, gap_pct=0.0).bound_milli == pytest.approx(84_610, abs=1)
    r = run_arrivals(nodes, pods, make_policy("fgd", PolicyContext(Workload.from_requests(pods))), seed=1)
    assert r.final_alloc_pct == pytest.approx(81.0)
