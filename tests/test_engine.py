"""The simulation engine (sim/engine.py): the FGD arrival protocol and the timed replay, on tiny hand-made clusters."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from sharegpu.ledger import Ledger, replay
from sharegpu.model.catalog import GIB
from sharegpu.model.inventory import NodeSpec, sim_gpus
from sharegpu.model.request import GpuRequest
from sharegpu.placement.fragmentation import Workload
from sharegpu.placement.framework import Policy
from sharegpu.placement.policies import POLICIES, PolicyContext, make_policy
from sharegpu.placement.reasons import ReasonKind
from sharegpu.sim.engine import RunResult, run_arrivals
from sharegpu.sim.openb import TraceTask
from sharegpu.sim.replay import replay_trace


def node(name: str, gpus: int, model: str = "V100-16GB", cpu: int = 8000, mem: int = 16 * GIB) -> NodeSpec:
    return NodeSpec(name, cpu, mem, sim_gpus(name, model, gpus))


def req(
    name: str,
    gpus: int = 1,
    milli: int = 1000,
    cpu: int = 1000,
    mem: int = 1024,
    models: frozenset[str] = frozenset(),
) -> GpuRequest:
    if gpus == 0:
        return GpuRequest(name, 0, cpu_milli=cpu, host_memory_mib=mem)
    return GpuRequest(name, gpus, compute_milli=milli, allowed_models=models, cpu_milli=cpu, host_memory_mib=mem)


def policy(name: str, requests: Sequence[GpuRequest]) -> Policy:
    return make_policy(name, PolicyContext(Workload.from_requests(requests)))


class Capture:
    """A ``frag`` callback that keeps the engine's final ledger, to check it from the outside."""

    def __init__(self) -> None:
        self.ledger: Ledger | None = None

    def __call__(self, ledger: Ledger) -> float:
        self.ledger = ledger
        return 0.0


def run(
    nodes: Sequence[NodeSpec], arrivals: Sequence[GpuRequest], name: str = "bestfit", **kw: object
) -> tuple[RunResult, Ledger]:
    cap = Capture()
    r = run_arrivals(nodes, arrivals, policy(name, arrivals), seed=0, frag=cap, **kw)  # type: ignore[arg-type]
    assert cap.ledger is not None
    return r, cap.ledger


def check_ledger(nodes: Sequence[NodeSpec], ledger: Ledger, arrivals: Sequence[GpuRequest], r: RunResult) -> None:
    ledger.check_invariants()
    rebuilt = replay(nodes, ledger.assignments.values())
    rebuilt.check_invariants()
    assert rebuilt.state() == ledger.state()
    placed = [a for a in arrivals if a.name in ledger]
    assert len(placed) == r.placed == len(ledger)
    assert ledger.allocated_gpu_milli == sum(a.total_milli for a in placed)
    assert r.final_alloc_pct == pytest.approx(100 * ledger.allocated_gpu_milli / ledger.total_gpu_milli)
    for a in ledger.assignments.values():
        request = next(x for x in arrivals if x.name == a.pod)
        assert len(a.shares) == request.gpu_count
        assert len({s.gpu_index for s in a.shares}) == request.gpu_count  # a multi-GPU pod uses distinct GPUs


# ----- run_arrivals --------------------------------------------------------------------------------------------
TINY = [node("a", 2, "V100-16GB", cpu=8000, mem=16 * GIB), node("b", 1, "T4", cpu=4000, mem=8 * GIB)]


def test_failures_are_recorded_by_reason() -> None:
    arrivals = [
        req("fits-0", 1, 1000, cpu=2000),
        req("too-much-cpu", 1, 500, cpu=100_000),
        req("four-gpus", 4),
        req("wrong-model", 1, 500, models=frozenset({"A100-40GB"})),
        req("too-much-memory", 1, 500, mem=100 * GIB),
        req("fits-1", 1, 500),
        req("fits-2", 0, cpu=1000),
    ]
    r, ledger = run(TINY, arrivals)
    assert r.pods == 7
    assert r.placed == 3
    assert r.failed == 4
    assert r.placed + r.failed == r.pods
    assert r.failures == {
        ReasonKind.CPU: 1,
        ReasonKind.GPU_ROOM: 1,
        ReasonKind.NO_ALLOWED_MODEL: 1,
        ReasonKind.HOST_MEMORY: 1,
    }
    assert r.to_dict()["failures_by_reason"] == {"cpu": 1, "gpu-busy": 1, "no-allowed-model": 1, "host-memory": 1}
    assert set(ledger.assignments) == {"fits-0", "fits-1", "fits-2"}
    assert r.total_gpus == 3
    assert r.final_alloc_pct == pytest.approx(100 * 1500 / 3000)
    check_ledger(TINY, ledger, arrivals, r)


def test_a_pod_that_fits_nowhere_is_skipped_for_good_and_later_pods_still_place() -> None:
    arrivals = [req("big", 2), req("huge", 3), req("small", 1, 300)]
    r, ledger = run([node("a", 2)], arrivals)
    assert set(ledger.assignments) == {"big"}  # small cannot fit: both GPUs are taken whole
    assert r.failures == {ReasonKind.GPU_ROOM: 2}  # one kind, whatever the GPU count asked
    r, ledger = run([node("a", 3)], arrivals)
    assert set(ledger.assignments) == {"big", "small"}  # huge was skipped and never retried
    assert r.failed == 1


def test_allocation_reaches_100_and_never_exceeds_it() -> None:
    # 2 GPUs, four half-GPU shares fill them exactly at arrived 100 %; one more arrives and fails.
    arrivals = [req(f"half-{i}", 1, 500, cpu=100, mem=64) for i in range(5)]
    r, ledger = run([node("a", 2)], arrivals)
    assert r.placed == 4 and r.failed == 1
    assert r.alloc_at(50) == 50.0
    assert r.alloc_at(100) == 100.0
    assert r.alloc_at(125) == 100.0
    assert r.alloc_at(130) is None  # arrivals stop at 125 %
    assert r.final_alloc_pct == 100.0
    assert max(v for v in r.curve if v is not None) <= 100.0
    check_ledger([node("a", 2)], ledger, arrivals, r)


def random_arrivals(seed: int, n: int) -> list[GpuRequest]:
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        gpus = rnd.choice([0, 1, 1, 1, 1, 2, 4, 8])
        milli = rnd.choice([100, 250, 300, 500, 700, 1000]) if gpus == 1 else 1000
        models = rnd.choice([frozenset(), frozenset(), frozenset(), frozenset({"T4"}), frozenset({"V100-16GB"})])
        out.append(
            req(
                f"p{i:04d}",
                gpus,
                milli,
                cpu=rnd.choice([0, 1000, 2000, 4000, 8000]),
                mem=rnd.choice([0, 1024, 4096, 16384]),
                models=models if gpus else frozenset(),
            )
        )
    return out


CLUSTER = [
    node("v0", 8, "V100-16GB", cpu=64_000, mem=256 * GIB),
    node("v1", 4, "V100-16GB", cpu=32_000, mem=128 * GIB),
    node("t0", 2, "T4", cpu=16_000, mem=64 * GIB),
    node("t1", 1, "T4", cpu=8_000, mem=32 * GIB),
    node("p0", 4, "P100", cpu=32_000, mem=128 * GIB),
    node("cpu", 0, cpu=32_000, mem=128 * GIB),
]


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("seed", [1, 2])
def test_every_policy_keeps_the_ledger_consistent(name: str, seed: int) -> None:
    arrivals = random_arrivals(seed, 120)
    r, ledger = run(CLUSTER, arrivals, name)
    assert r.policy == name
    assert r.pods == len(arrivals) == r.placed + r.failed
    assert sum(r.failures.values()) == r.failed
    assert r.failed > 0  # 120 pods on 19 GPUs: some must fail
    check_ledger(CLUSTER, ledger, arrivals, r)
    values = [v for v in r.curve if v is not None]
    assert values and max(values) <= 100.0
    assert all(v >= 0.0 for v in values)
    # No pod ever leaves, so allocation never falls as more arrives; nor can it run ahead of what arrived.
    assert values == sorted(values)
    for x, v in enumerate(r.curve):
        if v is not None:
            assert v <= x + 2
    assert 0 <= r.latency_p50_ms <= r.latency_p99_ms
    assert r.wall_s > 0


def test_arrivals_are_deterministic_for_a_seed() -> None:
    arrivals = random_arrivals(3, 80)
    r1, l1 = run(CLUSTER, arrivals, "random")
    r2, l2 = run(CLUSTER, arrivals, "random")
    assert l1.state() == l2.state()
    assert r1.curve == r2.curve


def test_rank_is_the_tie_break_order() -> None:
    nodes = [node("n0", 1), node("n1", 1), node("n2", 1)]
    arrivals = [req("p", 1, 500)]
    _, ledger = run(nodes, arrivals)
    assert ledger.assignments["p"].node == "n0"  # default: name order
    _, ledger = run(nodes, arrivals, rank=[2, 0, 1])
    assert ledger.assignments["p"].node == "n1"  # rank 0 goes first
    _, ledger = run(nodes, arrivals, rank=[1, 2, 0])
    assert ledger.assignments["p"].node == "n2"


def test_fragmentation_and_progress_callbacks() -> None:
    arrivals = [req(f"p{i}", 1, 100, cpu=0, mem=0) for i in range(300)]
    seen: list[int] = []
    r = run_arrivals(
        [node("a", 8, cpu=1_000_000)],
        arrivals,
        policy("bestfit", arrivals),
        0,
        frag=lambda _: 2000.0,
        progress=seen.append,
    )
    assert seen == [0, 256]
    assert r.fragmentation_pct == pytest.approx(100 * 2000 / 8000)
    assert r.to_dict()["fragmentation_pct"] == 25.0
    r = run_arrivals([node("a", 8)], arrivals[:3], policy("bestfit", arrivals), 0)
    assert r.fragmentation_pct is None


# ----- replay (plain) -------------------------------------------------------------------------------------------
def whole(name: str, created: int | None, deleted: int | None, gpus: int = 1) -> TraceTask:
    return TraceTask(req(name, gpus, 1000, cpu=100, mem=64), created, deleted)


def share(name: str, milli: int, created: int | None, deleted: int | None) -> TraceTask:
    return TraceTask(req(name, 1, milli, cpu=100, mem=64), created, deleted)


def replay_policy(tasks: Sequence[TraceTask], name: str = "bestfit") -> Policy:
    return policy(name, [t.request for t in tasks])


def test_replay_pending_pods_are_placed_when_a_deletion_frees_room() -> None:
    nodes = [node("a", 1)]
    tasks = [
        whole("p1", 0, 10),  # holds the only GPU until 10
        whole("p2", 5, 20),  # waits; placed at 10 when p1 leaves (first in the queue)
        whole("p3", 6, None),  # waits; placed at 20 when p2 leaves; never leaves
        share("p4", 500, 30, None),  # waits for good: p3 holds the GPU whole and never leaves
    ]
    res = replay_trace(nodes, tasks, replay_policy(tasks))
    assert res.run.pods == 4
    assert res.run.placed == 3
    assert res.waited == 3
    assert res.never_placed == 1
    assert res.peak_pending == 2
    assert res.run.failed == 1
    assert res.run.failures == {ReasonKind.STILL_PENDING: 1}
    assert res.run.final_alloc_pct == 100.0  # p3 is still there at the end
    assert res.run.replay is not None
    assert {k: res.run.replay[k] for k in ("waited", "never_placed", "peak_pending")} == {
        "waited": 3,
        "never_placed": 1,
        "peak_pending": 2,
    }
    assert res.run.to_dict()["replay"] == res.run.replay
    assert 0 < res.run.replay["mean_alloc_pct"] <= 100


def test_replay_pods_without_deletion_never_leave() -> None:
    nodes = [node("a", 2)]
    tasks = [whole("stay", 0, None), whole("go", 0, 5), whole("late", 10, None), whole("later", 20, None)]
    res = replay_trace(nodes, tasks, replay_policy(tasks))
    # "stay" never leaves, so after "go" leaves there is room for exactly one more pod.
    assert res.run.placed == 3
    assert res.never_placed == 1
    assert res.run.final_alloc_pct == 100.0


def test_replay_everything_leaves() -> None:
    nodes = [node("a", 1)]
    tasks = [whole("p1", 0, 10), whole("p2", 1, 11), whole("p3", 2, 12)]
    res = replay_trace(nodes, tasks, replay_policy(tasks))
    assert res.run.placed == 3
    assert res.never_placed == 0 and res.run.failed == 0
    assert res.waited == 2
    assert res.run.final_alloc_pct == 0.0  # the last one left at 12+


def test_replay_deletion_goes_before_a_creation_at_the_same_time() -> None:
    nodes = [node("a", 1)]
    tasks = [whole("p1", 0, 10), whole("p2", 10, None)]
    res = replay_trace(nodes, tasks, replay_policy(tasks))
    assert res.waited == 0  # p1's deletion at 10 is handled before p2's creation at 10
    assert res.run.placed == 2 and res.peak_pending == 0


def test_replay_without_times_arrive_at_zero_in_name_order() -> None:
    nodes = [node("a", 1)]
    tasks = [whole("b", None, None), whole("a", None, None)]
    res = replay_trace(nodes, tasks, replay_policy(tasks))
    assert res.run.placed == 1
    assert res.waited == 1 and res.never_placed == 1


def test_replay_pending_queue_is_fifo_but_not_blocked_by_its_head() -> None:
    # A 2-GPU pod waits first, then a 1-GPU pod; when one GPU frees, the 1-GPU pod behind the head is placed.
    nodes = [node("a", 2)]
    tasks = [whole("hold-a", 0, 10), whole("hold-b", 0, None), whole("two", 1, None, gpus=2), whole("one", 2, 30)]
    res = replay_trace(nodes, tasks, replay_policy(tasks))
    assert res.waited == 2
    assert res.run.placed == 3  # hold-a, hold-b, then "one" at 10; "two" never fits next to hold-b
    assert res.never_placed == 1
    assert res.run.failures == {ReasonKind.STILL_PENDING: 1}


def test_replay_full_pending_queue_drops_pods() -> None:
    nodes = [node("a", 1)]
    tasks = [whole("p0", 0, None), whole("p1", 1, None), whole("p2", 2, None), whole("p3", 3, None)]
    res = replay_trace(nodes, tasks, replay_policy(tasks), max_pending=1)
    assert res.run.placed == 1
    assert res.run.failures == {ReasonKind.QUEUE_FULL: 2, ReasonKind.STILL_PENDING: 1}
    assert res.run.failed == 3
    assert res.peak_pending == 1


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_replay_random_trace_accounts_for_every_pod(name: str) -> None:
    rnd = random.Random(7)
    arrivals = random_arrivals(5, 150)
    tasks = []
    for r in arrivals:
        created = rnd.randrange(0, 1000)
        deleted = rnd.choice([None, created + rnd.randrange(0, 300)])
        tasks.append(TraceTask(r, created, deleted))
    res = replay_trace(CLUSTER, tasks, replay_policy(tasks, name))
    assert res.run.pods == 150
    # Every pod is placed once, or is left pending, or was dropped.
    assert res.run.placed + res.run.failed == 150
    assert res.never_placed == res.run.failures.get(ReasonKind.STILL_PENDING, 0)
    assert res.waited >= res.never_placed
    values = [v for v in res.run.curve if v is not None]
    assert values and max(values) <= 100.0
    assert 0.0 <= res.run.final_alloc_pct <= 100.0
