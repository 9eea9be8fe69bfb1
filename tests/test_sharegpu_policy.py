"""The sharegpu policy: FGD's decision with its ties settled by exact fragmentation, stranded GPU and best fit."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sharegpu.ledger import Ledger
from sharegpu.model.assignment import Assignment
from sharegpu.model.catalog import GIB
from sharegpu.model.inventory import NodeSpec, sim_gpus
from sharegpu.model.request import GpuRequest
from sharegpu.placement.fragmentation import TaskShape, Workload
from sharegpu.placement.framework import CycleState, Decision, Scheduler
from sharegpu.placement.mechanism import make_share
from sharegpu.placement.policies import PolicyContext, make_policy
from sharegpu.placement.scorers import FgdScore, FragmentationModel, RefinedFgdScore


def node(name: str, model: str, gpus: int, cpu: int, mem: int = 256 * GIB) -> NodeSpec:
    return NodeSpec(name, cpu, mem, sim_gpus(name, model, gpus))


def share(name: str, milli: int, cpu: int = 4000) -> GpuRequest:
    return GpuRequest(name, 1, compute_milli=milli, cpu_milli=cpu)


def whole(name: str, gpus: int, cpu: int) -> GpuRequest:
    return GpuRequest(name, gpus, cpu_milli=cpu)


def test_rare_large_shapes_are_kept_beside_the_common_ones() -> None:
    """95 % of the tasks are small shares; the 8-GPU tasks are 2 % of the tasks but most of the GPU demand."""
    reqs = [share(f"s{i}", 300) for i in range(95)] + [whole(f"cpu{i}", 0, 2000) for i in range(3)]
    reqs += [whole(f"big{i}", 8, 120_000) for i in range(2)]
    wl = Workload.from_requests(reqs)
    assert [s.gpu_count for s in wl.shapes] == [1]  # FGD's typical shapes: 95 % of the tasks
    assert wl.extras == ((TaskShape(120_000, 1000, 8, frozenset()), 2),)
    ext = wl.extended()
    assert [s.gpu_count for s in ext.shapes] == [1, 8]
    np.testing.assert_allclose(ext.weights, [95 / 97, 2 / 97])
    # FGD's own view is unchanged by the extras.
    assert Workload.from_requests(reqs, demand_coverage=0.0).shapes == wl.shapes


def test_a_cpu_only_pod_goes_where_cpu_is_in_surplus_when_fgd_sees_a_tie() -> None:
    # An 8-GPU node with 12 cores per GPU and a 2-GPU node with 52: FGD rates both alike for a CPU-only pod
    # (no shape crosses a CPU threshold) and would take the first by name; on the 8-GPU node its 32 cores
    # would leave GPUs that the remaining CPU cannot feed.
    nodes = [node("a-gpu-rich", "V100-16GB", 8, cpu=96_000), node("b-cpu-rich", "T4", 2, cpu=104_000)]
    workload = Workload.from_requests([share(f"s{i}", 500, cpu=12_000) for i in range(20)])
    pod = whole("cpu-only", 0, 32_000)
    fgd = Scheduler(Ledger(nodes), make_policy("fgd", PolicyContext(workload)))
    ours = Scheduler(Ledger(nodes), make_policy("sharegpu", PolicyContext(workload)))
    d_fgd, d_ours = fgd.decide(pod), ours.decide(pod)
    assert isinstance(d_fgd, Decision) and isinstance(d_ours, Decision)
    assert d_fgd.assignment.node == "a-gpu-rich"  # a tie, to the first name
    assert d_ours.assignment.node == "b-cpu-rich"


def test_a_share_takes_the_tightest_gpu_when_fgd_rates_them_alike() -> None:
    # Only 100-milli shares are typical, so no GPU with room fragments anything: FGD takes the first GPU, sharegpu
    # the one with the least room left, keeping the emptier ones for larger shares.
    nodes = [node("a", "V100-16GB", 4, cpu=64_000)]
    workload = Workload.from_requests([share(f"s{i}", 100) for i in range(10)])
    ledger = Ledger(nodes)
    for pod, gpu, milli in (("x", 1, 300), ("y", 2, 500)):
        req = share(pod, milli)
        ledger.place(Assignment(pod, "a", (make_share(ledger, 0, gpu, req),), req.cpu_milli, 0))
    picks = {}
    for policy in ("fgd", "sharegpu"):
        d = Scheduler(ledger, make_policy(policy, PolicyContext(workload))).decide(share("p", 200))
        assert isinstance(d, Decision)
        picks[policy] = [sh.gpu_index for sh in d.assignment.shares]
    assert picks == {"fgd": [0], "sharegpu": [2]}


MODELS = ["V100-16GB", "T4", "G2", "P100"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1))
def test_sharegpu_only_chooses_among_the_placements_fgd_rates_best(seed: int) -> None:
    rnd = random.Random(seed)
    nodes = [
        node(f"n{i}", rnd.choice(MODELS), rnd.choice([1, 2, 4, 8]), cpu=rnd.choice([16_000, 64_000, 96_000]))
        for i in range(rnd.randint(2, 8))
    ]
    reqs = []
    for i in range(60):
        kind = rnd.random()
        if kind < 0.15:
            reqs.append(whole(f"c{i}", 0, rnd.choice([4000, 16_000])))
        elif kind < 0.6:
            reqs.append(share(f"s{i}", rnd.choice([100, 250, 500, 800]), cpu=rnd.choice([2000, 8000])))
        else:
            reqs.append(whole(f"w{i}", rnd.choice([1, 1, 2, 4, 8]), rnd.choice([4000, 12_000, 64_000])))
    workload = Workload.from_requests(reqs)
    sched = Scheduler(Ledger(nodes), make_policy("sharegpu", PolicyContext(workload)))
    fgd = FgdScore(FragmentationModel(workload))
    scorer = sched.policy.scorers[0][0]
    assert isinstance(scorer, RefinedFgdScore)
    for req in reqs:
        ok, usable = sched.feasible(req)
        d = sched.decide(req)
        if not isinstance(d, Decision):
            continue
        feasible = np.flatnonzero(ok).astype(np.int64)
        fgd_scores = fgd.score(sched.ledger, CycleState(req, usable, np.random.default_rng(0)), feasible)
        assert d.score // 10**15 == fgd_scores.max()  # FGD's best integer score, never overruled
        # The GPUs taken are the ones the node's score came from.
        keys = scorer.keys(sched.ledger, CycleState(req, usable, sched.rng), np.array([d.node_index]))
        if keys.ndim == 2:
            assert keys[0, d.assignment.shares[0].gpu_index] == d.score
        sched.ledger.place(d.assignment)
    sched.ledger.check_invariants()
