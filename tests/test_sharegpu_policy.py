"""The sharegpu policy: FGD's decision less the model pressure cost, with its ties settled by exact fragmentation,
stranded GPU and best fit."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sharegpu.ledger import Ledger
from sharegpu.model.assignment import Assignment
from sharegpu.model.catalog import GIB
from sharegpu.model.inventory import NodeSpec, sim_gpus
from sharegpu.model.request import GpuRequest
from sharegpu.placement.fragmentation import FragmentationModel, TaskShape, Workload, fgd_score, model_pressure
from sharegpu.placement.framework import CycleState, Decision, Scheduler
from sharegpu.placement.mechanism import make_share
from sharegpu.placement.plugins.fgd import FgdScore
from sharegpu.placement.plugins.refined import RefinedFgdScore
from sharegpu.placement.policies import PolicyContext, make_policy


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


def test_model_pressure_is_the_confined_demand_over_the_capacity_it_may_use() -> None:
    # GPU demand: 10 × 0.5 unconstrained, 10 × 2 confined to V100, 5 × 1 confined to V100 or T4 (30 GPUs in all).
    reqs = [share(f"s{i}", 500) for i in range(10)]
    reqs += [dataclasses.replace(whole(f"v{i}", 2, 8000), allowed_models=frozenset({"V100-16GB"})) for i in range(10)]
    reqs += [
        dataclasses.replace(whole(f"t{i}", 1, 8000), allowed_models=frozenset({"V100-16GB", "T4"})) for i in range(5)
    ]
    wl = Workload.from_requests(reqs, coverage=1.0)
    names = ["V100-16GB", "T4", "P100"]
    capacity = np.array([4.0, 4.0, 8.0])  # GPUs of each model: V100 a quarter, V100 + T4 half the cluster
    v100_only, either = 20 / 30, 5 / 30
    np.testing.assert_allclose(
        model_pressure(wl, names, capacity), [v100_only / 0.25 + either / 0.5, either / 0.5, 0.0]
    )
    # Without confined shapes no model is under pressure, so sharegpu decides as it did before the term existed.
    free = Workload.from_requests([share(f"s{i}", 500) for i in range(10)] + [whole("w", 2, 8000)])
    assert not model_pressure(free, names, capacity).any()


def test_an_unconstrained_share_leaves_the_scarce_model_to_the_pods_confined_to_it() -> None:
    # Two one-GPU nodes alike but for the model. The typical 2-GPU tasks confined to V100 fit neither node, so FGD
    # and the fragmentation terms rate both nodes alike; most of the GPU demand may only run on V100, so the share
    # that may run anywhere goes to the T4.
    nodes = [node("a-v100", "V100-16GB", 1, cpu=64_000), node("b-t4", "T4", 1, cpu=64_000)]
    reqs = [share(f"s{i}", 500) for i in range(10)]
    reqs += [dataclasses.replace(whole(f"v{i}", 2, 8000), allowed_models=frozenset({"V100-16GB"})) for i in range(10)]
    workload = Workload.from_requests(reqs)
    picks = {}
    for policy in ("fgd", "sharegpu"):
        d = Scheduler(Ledger(nodes), make_policy(policy, PolicyContext(workload))).decide(share("p", 500))
        assert isinstance(d, Decision)
        picks[policy] = d.assignment.node
    assert picks == {"fgd": "a-v100", "sharegpu": "b-t4"}  # FGD: a tie, to the first name


def test_an_unconstrained_share_leaves_the_scarce_model_even_where_fgd_prefers_it() -> None:
    # The share fills the V100's half-used GPU, which FGD rates clearly better (it closes a 500-milli gap that the
    # typical 800-milli shares cannot use) than opening the idle T4. But most of the GPU demand is confined to V100
    # and the V100 left is a third of the free GPU: its pressure (2.1) costs the share 26 of FGD's score points,
    # more than FGD's gain (5), so sharegpu opens the T4. Before the pressure moved into the primary key it only
    # settled FGD's ties, and this share went to the V100.
    nodes = [node("a-v100", "V100-16GB", 1, cpu=64_000), node("b-t4", "T4", 1, cpu=64_000)]
    reqs = [share(f"s{i}", 500) for i in range(10)] + [share(f"l{i}", 800) for i in range(5)]
    reqs += [dataclasses.replace(whole(f"v{i}", 2, 8000), allowed_models=frozenset({"V100-16GB"})) for i in range(10)]
    workload = Workload.from_requests(reqs)
    picks = {}
    for policy in ("fgd", "sharegpu"):
        ledger = Ledger(nodes)
        first = share("x", 500)
        ledger.place(Assignment("x", "a-v100", (make_share(ledger, 0, 0, first),), first.cpu_milli, 0))
        sched = Scheduler(ledger, make_policy(policy, PolicyContext(workload)))
        d = sched.decide(share("p", 500))
        assert isinstance(d, Decision)
        picks[policy] = d.assignment.node
        if policy == "fgd":
            _, usable = sched.feasible(share("p", 500))
            fgd_scores = fgd_reference(FragmentationModel(workload), ledger, share("p", 500), usable, np.arange(2))
            assert fgd_scores[0] > fgd_scores[1]  # FGD's own preference, not a tie
    assert picks == {"fgd": "a-v100", "sharegpu": "b-t4"}


def test_the_model_pressure_follows_the_free_capacity() -> None:
    # Half the GPU demand is confined to V100, which is half the cluster: pressure 1 on an empty cluster. Once the
    # V100 GPUs are half taken, what is left of them is a third of the free GPU and the pressure rises to 1.5.
    nodes = [node("a-v100", "V100-16GB", 2, cpu=64_000), node("b-t4", "T4", 2, cpu=64_000)]
    reqs = [share(f"s{i}", 500) for i in range(10)]
    reqs += [dataclasses.replace(share(f"v{i}", 500), allowed_models=frozenset({"V100-16GB"})) for i in range(10)]
    scorer = RefinedFgdScore.of(Workload.from_requests(reqs, coverage=1.0))
    ledger = Ledger(nodes)
    v100 = ledger.model_names.index("V100-16GB")
    assert scorer.pressures(ledger)[v100] == 1.0
    req = whole("w", 1, 4000)
    ledger.place(Assignment("w", "a-v100", (make_share(ledger, 0, 0, req),), req.cpu_milli, 0))
    assert scorer.pressures(ledger)[v100] == 1.5
    assert scorer.pressures(ledger)[ledger.model_names.index("T4")] == 0.0


MODELS = ["V100-16GB", "T4", "G2", "P100"]


def fgd_reference(
    model: FragmentationModel, ledger: Ledger, req: GpuRequest, usable: np.ndarray, nodes: np.ndarray
) -> np.ndarray:
    """FGD's integer score of each node, with its ΔF rounded to 10⁻⁶ milli-GPU first: FgdScore subtracts two
    separately summed dot products, so a ΔF that is exactly 0 can come out a rounding error below (score 49
    instead of 50) when the workload's shapes make the sums inexact."""
    if req.gpu_count == 1 and req.milli < 1000:
        per_gpu = fgd_score(np.zeros(1), model.share_delta(ledger, req, nodes).round(6))
        return np.where(usable[nodes], per_gpu, -1).max(axis=1)
    return fgd_score(np.zeros(1), (model.whole_after(ledger, req, nodes) - model.before(ledger, nodes)).round(6))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1), st.booleans())
def test_sharegpu_only_chooses_among_the_placements_fgd_rates_best(seed: int, confine: bool) -> None:
    """Without confined shapes FGD's best integer score is never overruled; with them (the model pressure at work)
    the decisions stay consistent: the GPUs taken are those the node's key came from, and the ledger stays valid."""
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
        if confine and kind >= 0.15 and rnd.random() < 0.3:  # confined to one or two models
            reqs[-1] = dataclasses.replace(reqs[-1], allowed_models=frozenset(rnd.sample(MODELS, rnd.choice([1, 2]))))
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
        if not confine:
            assert not scorer.pressures(sched.ledger).any()
            feasible = np.flatnonzero(ok).astype(np.int64)
            fgd_scores = fgd_reference(fgd.model, sched.ledger, req, usable, feasible)
            assert d.score // 10**15 == fgd_scores.max()  # FGD's best integer score, never overruled
        # The GPUs taken are the ones the node's score came from.
        keys = scorer.keys(sched.ledger, CycleState(req, usable, sched.rng), np.array([d.node_index]))
        if keys.ndim == 2:
            assert keys[0, d.assignment.shares[0].gpu_index] == d.score
        sched.ledger.place(d.assignment)
    sched.ledger.check_invariants()
