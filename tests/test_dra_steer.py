"""The ``dra-steered`` policy: sharegpu's node choice for the device the DRA allocator's first fit takes there."""

from __future__ import annotations

import numpy as np

from sharegpu.ledger import Ledger
from sharegpu.model.assignment import Assignment
from sharegpu.model.catalog import GIB
from sharegpu.model.inventory import NodeSpec, sim_gpus
from sharegpu.model.request import GpuRequest
from sharegpu.placement.dra_steer import FirstFitSharegpuScore, first_fit_gpu
from sharegpu.placement.fragmentation import Workload
from sharegpu.placement.framework import CycleState, Decision, Scheduler
from sharegpu.placement.mechanism import make_share
from sharegpu.placement.plugins.refined import RefinedFgdScore
from sharegpu.placement.policies import PolicyContext, make_policy

WORKLOAD = Workload.from_requests(
    [GpuRequest(f"s{i}", 1, compute_milli=250, cpu_milli=2000) for i in range(6)]
    + [GpuRequest(f"w{i}", 1, cpu_milli=8000) for i in range(3)]
)


def node(name: str, gpus: int = 2) -> NodeSpec:
    return NodeSpec(name, 64_000, 256 * GIB, sim_gpus(name, "A100-80GB", gpus))


def put(led: Ledger, n: int, g: int, milli: int, name: str) -> None:
    req = GpuRequest(name, 1, compute_milli=milli, cpu_milli=1000)
    led.place(Assignment(name, led.nodes[n].name, (make_share(led, n, g, req),), 1000, 0))


def steered(nodes: list[NodeSpec]) -> Scheduler:
    return Scheduler(Ledger(nodes), make_policy("dra-steered", PolicyContext(WORKLOAD)))


def test_first_fit_gpu_is_the_first_usable_per_row() -> None:
    usable = np.array([[False, True, True], [True, False, False], [False, False, True]])
    assert first_fit_gpu(usable).tolist() == [1, 0, 2]


def test_a_node_is_scored_by_the_gpu_first_fit_takes_not_the_best() -> None:
    s = steered([node("a"), node("b")])
    led = s.ledger
    put(led, 1, 1, 750, "x")  # b: GPU 0 idle, GPU 1 has exactly a quarter left (sharegpu's best GPU of all)
    req = GpuRequest("p", 1, compute_milli=250, cpu_milli=1000)
    _, usable = s.feasible(req)
    state = CycleState(req, usable, s.rng)
    nodes = np.array([0, 1], dtype=np.int64)
    inner = RefinedFgdScore.of(WORKLOAD)
    keys = inner.keys(led, state, nodes)
    got = FirstFitSharegpuScore(inner).score(led, state, nodes)
    assert got.tolist() == [keys[0, 0], keys[1, 0]]  # GPU 0 on both nodes: first fit's, whatever is best
    assert keys[1, 1] > keys[1, 0]  # sharegpu itself would take b's GPU 1


def test_steered_policy_picks_the_node_where_first_fit_packs() -> None:
    # a: GPU 0 half used; b: GPU 0 idle, GPU 1 three quarters used. sharegpu alone takes b's GPU 1 (an exact fit);
    # the allocator on b would take the idle GPU 0 instead, so the steered policy goes to a, where first fit packs.
    s = steered([node("a"), node("b")])
    put(s.ledger, 0, 0, 500, "x")
    put(s.ledger, 1, 1, 750, "y")
    req = GpuRequest("p", 1, compute_milli=250, cpu_milli=1000)
    d = s.decide(req)
    assert isinstance(d, Decision)
    assert (d.assignment.node, d.assignment.shares[0].gpu_index) == ("a", 0)
    sharegpu = Scheduler(s.ledger, make_policy("sharegpu", PolicyContext(WORKLOAD))).decide(req)
    assert isinstance(sharegpu, Decision)
    assert (sharegpu.assignment.node, sharegpu.assignment.shares[0].gpu_index) == ("b", 1)


def test_steered_policy_packs_quarter_shares_onto_one_node() -> None:
    s = steered([node("a"), node("b"), node("c")])
    got = [s.place(GpuRequest(f"p{i}", 1, compute_milli=250, cpu_milli=1000)).assignment for i in range(6)]
    assert {a.node for a in got} == {got[0].node}
    assert [a.shares[0].gpu_index for a in got] == [0, 0, 0, 0, 1, 1]
    s.ledger.check_invariants()


def test_whole_gpu_requests_take_the_first_idle_gpus() -> None:
    s = steered([node("a", 4)])
    put(s.ledger, 0, 1, 250, "x")
    d = s.place(GpuRequest("w", 2, cpu_milli=1000))
    assert [sh.gpu_index for sh in d.assignment.shares] == [0, 2]
