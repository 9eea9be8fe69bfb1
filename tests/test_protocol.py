"""The FGD arrival protocol (sim/protocol.py): seed lists, and shuffle + tune of a trace to a load ratio."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sharegpu.model.request import GpuRequest
from sharegpu.sim.openb import TraceTask
from sharegpu.sim.protocol import fgd_arrivals, parse_seeds, with_users


# ----- parse_seeds --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "seeds"),
    [
        ("42-51", list(range(42, 52))),
        ("42,45", [42, 45]),
        ("7", [7]),
        ("0", [0]),
        ("3-3", [3]),
        (" 1 , 3-4 ", [1, 3, 4]),
        ("42-44,50", [42, 43, 44, 50]),
    ],
)
def test_parse_seeds(text: str, seeds: list[int]) -> None:
    assert parse_seeds(text) == seeds


@pytest.mark.parametrize(
    ("text", "part"),
    [
        ("abc", "'abc'"),
        ("51-42", "'51-42'"),
        ("-1", "'-1'"),
        ("1-2-3", "'1-2-3'"),
        ("42,x", "'x'"),
        ("4.5", "'4.5'"),
    ],
)
def test_parse_seeds_rejects_bad_parts(text: str, part: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_seeds(text)
    msg = str(e.value)
    assert repr(text) in msg
    assert part in msg
    assert "42-51" in msg  # says what a good value looks like


@pytest.mark.parametrize("text", ["", " ", ",", " , ,"])
def test_parse_seeds_needs_a_seed(text: str) -> None:
    with pytest.raises(ValueError, match="no seed given"):
        parse_seeds(text)


# ----- fgd_arrivals -------------------------------------------------------------------------------------------
def task(name: str, gpus: int, milli: int = 1000, cpu: int = 1000) -> TraceTask:
    if gpus == 0:
        return TraceTask(GpuRequest(name, 0, cpu_milli=cpu, host_memory_mib=1024))
    return TraceTask(GpuRequest(name, gpus, compute_milli=milli, cpu_milli=cpu, host_memory_mib=1024))


# Names deliberately not in name order, to check the protocol sorts them before it shuffles.
TRACE = [
    task("pod-c", 1, 500),
    task("pod-a", 2),
    task("pod-e", 0),
    task("pod-b", 1, 250),
    task("pod-d", 1, 1000),
    task("pod-f", 4),
    task("pod-g", 1, 100),
    task("pod-h", 8),
]
TRACE_MILLI = sum(t.request.total_milli for t in TRACE)  # 500+2000+0+250+1000+4000+100+8000 = 15850
CAPACITY = 16 * 1000  # a 16-GPU cluster


def names(reqs: list[GpuRequest]) -> list[str]:
    return [r.name for r in reqs]


def original_of(name: str) -> str:
    return name.split("-tuned-")[0]


def test_trace_total_is_what_the_tests_assume() -> None:
    assert TRACE_MILLI == 15850


def test_deterministic_for_a_seed() -> None:
    a = fgd_arrivals(TRACE, CAPACITY, seed=42, tune=1.3)
    b = fgd_arrivals(TRACE, CAPACITY, seed=42, tune=1.3)
    assert names(a) == names(b)
    assert a == b


def test_independent_of_input_order() -> None:
    # Pods are ordered by name before the shuffle, so the file's order does not matter.
    a = fgd_arrivals(TRACE, CAPACITY, seed=7, tune=1.3)
    b = fgd_arrivals(list(reversed(TRACE)), CAPACITY, seed=7, tune=1.3)
    assert names(a) == names(b)


def test_most_seeds_grow_the_trace() -> None:
    # 15.85 GPUs of a 20.8-GPU target: only a first draw of the 8-GPU pod (1 in 8) stops growth at once.
    grown = [len(fgd_arrivals(TRACE, CAPACITY, seed=s, tune=1.3)) > len(TRACE) for s in range(42, 52)]
    assert sum(grown) >= 5


def test_different_for_another_seed() -> None:
    orders = {tuple(names(fgd_arrivals(TRACE, CAPACITY, seed=s, tune=1.3))) for s in range(42, 52)}
    assert len(orders) > 5


@pytest.mark.parametrize("seed", range(42, 52))
def test_every_original_once_then_tuned_clones(seed: int) -> None:
    out = fgd_arrivals(TRACE, CAPACITY, seed=seed, tune=1.3)
    n = len(TRACE)
    originals = {t.name for t in TRACE}
    # The originals come first, each exactly once, shuffled.
    assert sorted(names(out[:n])) == sorted(originals)
    clones = out[n:]
    counts = Counter(names(out))
    assert all(c == 1 for c in counts.values())
    for i, c in enumerate(clones):
        assert c.name.endswith(f"-tuned-{i}")
        base = original_of(c.name)
        assert base in originals
        src = next(t.request for t in TRACE if t.name == base)
        assert dataclasses.replace(c, name=base) == src  # a clone is the original in all but name


@pytest.mark.parametrize("seed", range(42, 52))
@pytest.mark.parametrize("tune", [1.0, 1.3, 2.0, 3.7])
def test_tuned_total_stays_within_target_and_next_draw_exceeds(seed: int, tune: float) -> None:
    out = fgd_arrivals(TRACE, CAPACITY, seed=seed, tune=tune)
    target = tune * CAPACITY
    total = sum(r.total_milli for r in out)
    assert total <= target
    # The definition: after the shuffle, draws are uniform with replacement from the trace ordered by name, and
    # the first draw that would push the total past the target ends the growth (and is not added).
    rng = np.random.default_rng(seed)
    base = sorted((t.request for t in TRACE), key=lambda r: r.name)
    perm = rng.permutation(len(base))
    assert names(out[: len(base)]) == [base[i].name for i in perm]
    for c in out[len(base) :]:
        assert base[int(rng.integers(len(base)))].name == original_of(c.name)
    nxt = base[int(rng.integers(len(base)))]
    assert total + nxt.total_milli > target


def test_growth_stops_at_the_first_draw_that_overshoots_even_when_smaller_pods_would_fit() -> None:
    # One huge and one tiny pod: growth ends as soon as the huge one is drawn and would overshoot, although the tiny
    # one would still fit. Some seed must show it: the result stays below target by more than a tiny pod.
    trace = [task("big", 8), task("tiny", 1, 10)]
    target = 1.3 * CAPACITY
    gaps = []
    for seed in range(20):
        out = fgd_arrivals(trace, CAPACITY, seed=seed, tune=1.3)
        total = sum(r.total_milli for r in out)
        assert total <= target
        gaps.append(target - total)
    assert max(gaps) > 10


def test_tune_below_the_trace_total_removes_pods() -> None:
    tune = 0.5  # target 8000 of a 15850 trace
    target = tune * CAPACITY
    for seed in range(42, 52):
        out = fgd_arrivals(TRACE, CAPACITY, seed=seed, tune=tune)
        kept = names(out)
        assert not any("-tuned-" in n for n in kept)
        assert len(set(kept)) == len(kept)
        removed = [t.request for t in TRACE if t.name not in kept]
        assert removed
        total = sum(r.total_milli for r in out)
        assert total <= target
        # Removal stops as soon as the total is within the target: putting back the last one removed (at most
        # the largest removed) would exceed it again.
        assert total + max(r.total_milli for r in removed) > target
        # The kept pods keep the seed's shuffled order.
        full = names(fgd_arrivals(TRACE, CAPACITY, seed=seed, tune=10.0))[: len(TRACE)]
        assert kept == [n for n in full if n in kept]


def test_tune_exactly_at_the_trace_total_removes_nothing() -> None:
    out = fgd_arrivals(TRACE, TRACE_MILLI, seed=1, tune=1.0)
    assert sorted(names(out)[: len(TRACE)]) == sorted(t.name for t in TRACE)
    assert sum(r.total_milli for r in out) <= TRACE_MILLI
    # Only zero-milli clones (the CPU-only pod) could still be added at exactly the target.
    assert all(r.total_milli == 0 for r in out[len(TRACE) :])


def test_tune_zero_keeps_only_pods_that_ask_no_gpu() -> None:
    out = fgd_arrivals(TRACE, CAPACITY, seed=3, tune=0.0)
    assert all(r.total_milli == 0 for r in out)


def test_empty_trace_gives_no_arrivals() -> None:
    assert fgd_arrivals([], CAPACITY, seed=42, tune=1.3) == []


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(
    shapes=st.lists(
        st.tuples(st.sampled_from([1, 2, 4, 8]), st.integers(1, 1000)).map(
            lambda t: (t[0], 1000 if t[0] > 1 else t[1])
        ),
        min_size=1,
        max_size=12,
    ),
    gpus=st.integers(1, 64),
    tune=st.floats(0.1, 3.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_total_and_membership(shapes: list[tuple[int, int]], gpus: int, tune: float, seed: int) -> None:
    trace = [task(f"p{i:03d}", n, m) for i, (n, m) in enumerate(shapes)]
    capacity = gpus * 1000
    out = fgd_arrivals(trace, capacity, seed=seed, tune=tune)
    total = sum(r.total_milli for r in out)
    trace_total = sum(t.request.total_milli for t in trace)
    assert total <= tune * capacity
    counts = Counter(names(out))
    assert all(c == 1 for c in counts.values())
    originals = {t.name for t in trace}
    kept = [n for n in names(out) if n in originals]
    if trace_total <= tune * capacity:
        assert set(kept) == originals
        # The growth stops only on a draw that overshoots, so the gap is below the largest pod.
        assert tune * capacity - total < max(t.request.total_milli for t in trace)
    else:
        assert len(kept) == len(out) < len(trace)


HANG_SCRIPT = """
from sharegpu.model.request import GpuRequest
from sharegpu.sim.openb import TraceTask
from sharegpu.sim.protocol import fgd_arrivals
out = fgd_arrivals([TraceTask(GpuRequest("cpu-only", 0, cpu_milli=1000))], 16000, 42, 1.3)
print(len(out))
"""


def test_trace_without_gpu_demand_terminates() -> None:
    try:
        r = subprocess.run([sys.executable, "-c", HANG_SCRIPT], capture_output=True, text=True, timeout=5)
    except subprocess.TimeoutExpired:
        pytest.fail("fgd_arrivals did not return within 5 s for a CPU-only trace")
    assert r.returncode == 0, r.stderr


def test_users_are_drawn_per_pod_with_the_seed() -> None:
    reqs = [GpuRequest(f"p{i}", 1, compute_milli=100) for i in range(300)]
    assert {r.tenant for r in with_users(reqs, 1, 42)} == {None}  # one user: as if no rule existed
    three = with_users(reqs, 3, 42)
    assert [r.tenant for r in three] == [r.tenant for r in with_users(reqs, 3, 42)]
    assert [r.tenant for r in three] != [r.tenant for r in with_users(reqs, 3, 43)]
    counts = Counter(r.tenant for r in three)
    assert set(counts) == {"sim/uid-1000", "sim/uid-1001", "sim/uid-1002"} and min(counts.values()) > 60
    assert [r.name for r in three] == [r.name for r in reqs]
    with pytest.raises(ValueError, match="users 0"):
        with_users(reqs, 0, 42)


def test_a_daemon_per_tenant_places_every_users_shares_together_and_one_user_per_unit_does_not() -> None:
    from sharegpu.ledger import Ledger, MpsTenancy
    from sharegpu.model.inventory import GpuDevice, NodeSpec
    from sharegpu.placement.fragmentation import Workload
    from sharegpu.placement.framework import Scheduler, Unschedulable
    from sharegpu.placement.policies import PolicyContext, make_policy

    node = NodeSpec("n", 64_000, 262_144, tuple(GpuDevice(i, f"GPU-{i}", "V100-16GB") for i in range(4)))
    reqs = [GpuRequest(f"p{i}", 1, compute_milli=250) for i in range(16)]  # 16 quarter-GPU shares: 4 GPUs' worth

    def placed(users: int, daemons: int) -> int:
        arrivals = with_users(reqs, users, 7)
        ledger = Ledger([node], tenancy=MpsTenancy(daemons_per_unit=daemons))
        sched = Scheduler(ledger, make_policy("bestfit", PolicyContext(Workload.from_requests(arrivals))))
        return sum(not isinstance(sched.decide(r), Unschedulable) and bool(sched.place(r)) for r in arrivals)

    assert placed(1, 1) == 16
    assert placed(10, 16) == 16  # a daemon per tenant: four users' shares on one GPU
    assert placed(10, 1) < 16  # one daemon per unit (the rule before): a GPU opened by one user takes no other's
