"""Consolidation planner: a plan is complete (the waiting pod fits and every moved pod has a new place, with no
over-allocation when all of it is applied) or there is none; unit cases for each refusal. The random clusters' pods
belong to MPS tenants, under a daemon cap per unit now and then (issue 32): a plan never takes a unit past it."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sharegpu.ledger import Ledger, MpsTenancy
from sharegpu.model.inventory import GpuDevice, NodeSpec, sim_gpus
from sharegpu.model.request import GpuRequest, Isolation
from sharegpu.model.tenant import own_tenant
from sharegpu.placement.consolidation import (
    AlreadyFits,
    ConsolidationPlan,
    NoPlan,
    NotEnoughRoom,
    plan_consolidation,
)
from sharegpu.placement.framework import Decision, Scheduler
from sharegpu.placement.mechanism import make_share
from sharegpu.placement.policies import PolicyContext, make_policy
from sharegpu.placement.preemption import copy_ledger

POLICY = make_policy("bestfit", PolicyContext())
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def pinned(led: Ledger, req: GpuRequest, node: str, gpu: int) -> None:
    from sharegpu.model.assignment import Assignment

    n = led.node_of(node)
    share = make_share(led, n, gpu, req)
    led.place(Assignment(req.name, node, (share,), req.cpu_milli, req.host_memory_mib, tenant=req.tenant))


def fragmented() -> tuple[Ledger, dict[str, GpuRequest]]:
    """Two nodes of two GPUs, each GPU 60 % or 30 % used: 2.2 GPUs free in all, no GPU with 80 % free."""
    led = Ledger([NodeSpec(n, 64_000, 262_144, sim_gpus(n, "A100-40GB", 2)) for n in ("a", "b")])
    reqs = {}
    for node, gpu, name, milli in (("a", 0, "a0", 600), ("a", 1, "a1", 300), ("b", 0, "b0", 600), ("b", 1, "b1", 300)):
        reqs[name] = GpuRequest(name, compute_milli=milli)
        pinned(led, reqs[name], node, gpu)
    return led, reqs


def apply(led: Ledger, plan: ConsolidationPlan) -> Ledger:
    out = copy_ledger(led)
    for m in plan.moves:
        out.release(m.pod)
    out.place(plan.assignment)
    for m in plan.moves:
        out.place(m.assignment)
    out.check_invariants()
    return out


def test_one_move_repairs_fragmentation() -> None:
    led, reqs = fragmented()
    before = led.state()
    plan = plan_consolidation(led, GpuRequest("w", compute_milli=800), POLICY, reqs)
    assert led.state() == before
    assert len(plan.moves) == 1
    (move,) = plan.moves
    # The 30 % pod moves next to the other 30 % pod, freeing a whole GPU for the 80 % one.
    assert move.pod in ("a1", "b1") and move.assignment.node != move.source
    after = apply(led, plan)
    assert set(after.assignments) == {*reqs, "w"}
    assert plan == plan_consolidation(led, GpuRequest("w", compute_milli=800), POLICY, reqs)  # deterministic


def test_only_movable_pods_move() -> None:
    led, reqs = fragmented()
    w = GpuRequest("w", compute_milli=800)
    with pytest.raises(NoPlan):
        plan_consolidation(led, w, POLICY, {})
    # With only the 60 % pods movable, one of them moves beside a 30 % pod instead.
    plan = plan_consolidation(led, w, POLICY, {"a0": reqs["a0"], "b0": reqs["b0"]})
    assert [m.pod for m in plan.moves] in (["a0"], ["b0"])
    apply(led, plan)


def test_refuses_when_it_fits_or_room_is_short() -> None:
    led, reqs = fragmented()
    with pytest.raises(AlreadyFits):
        plan_consolidation(led, GpuRequest("w", compute_milli=300), POLICY, reqs)
    with pytest.raises(NotEnoughRoom, match=r"only 2\.2 GPU is free"):
        plan_consolidation(led, GpuRequest("w", gpu_count=3), POLICY, reqs)


def test_moves_are_bounded() -> None:
    # Each GPU of one node holds two 30 % pods and nothing else has room for both: a whole GPU needs two moves.
    led = Ledger([NodeSpec(n, 64_000, 262_144, sim_gpus(n, "A100-40GB", 1)) for n in ("a", "b", "c")])
    reqs = {}
    for name, node in (("x", "a"), ("y", "a"), ("p", "b"), ("q", "c")):
        reqs[name] = GpuRequest(name, compute_milli=300 if node == "a" else 600)
        pinned(led, reqs[name], node, 0)
    w = GpuRequest("w", gpu_count=1)
    with pytest.raises(NoPlan, match="at most 1"):
        plan_consolidation(led, w, POLICY, reqs, max_moves=1)
    plan = plan_consolidation(led, w, POLICY, reqs, max_moves=2)
    assert plan.node == "a" and sorted(m.pod for m in plan.moves) == ["x", "y"]
    apply(led, plan)


def test_every_moved_pod_needs_a_place() -> None:
    # Moving the 30 % pod off GPU 1 of a would free a whole GPU, but nowhere else can take a 30 % share.
    led = Ledger([NodeSpec("a", 64_000, 262_144, sim_gpus("a", "A100-40GB", 2))])
    reqs = {"a0": GpuRequest("a0", compute_milli=800), "a1": GpuRequest("a1", compute_milli=300)}
    pinned(led, reqs["a0"], "a", 0)
    pinned(led, reqs["a1"], "a", 1)
    with pytest.raises(NoPlan):
        plan_consolidation(led, GpuRequest("w", compute_milli=900), POLICY, reqs)


def test_a_moved_pod_goes_only_where_its_tenant_may_run_a_daemon() -> None:
    """Issue 32. Two A100s at a cap of one MPS daemon each: a runs tenant t1's 30 % share, b tenant t2's; a pod asking
    80 % waits. Moving t1's share beside t2's would open a second daemon there: no plan. Where both shares are one
    tenant's, the move joins the daemon that runs there."""

    def scene(tenant_b: str) -> tuple[Ledger, dict[str, GpuRequest]]:
        led = Ledger([NodeSpec(n, 64_000, 262_144, sim_gpus(n, "A100-40GB", 1)) for n in ("a", "b")],
                     tenancy=MpsTenancy(daemons_per_unit=1))  # fmt: skip
        reqs = {}
        for name, node, tenant in (("on-a", "a", "ns/uid-1"), ("on-b", "b", tenant_b)):
            reqs[name] = GpuRequest(name, compute_milli=300, memory_mib=4096, isolation=Isolation.MEMORY, tenant=tenant)
            pinned(led, reqs[name], node, 0)
        return led, reqs

    w = GpuRequest("w", compute_milli=800, memory_mib=4096, isolation=Isolation.MEMORY, tenant="other/uid-1")
    led, reqs = scene("ns/uid-2")
    with pytest.raises(NoPlan):
        plan_consolidation(led, w, POLICY, reqs)
    led, reqs = scene("ns/uid-1")
    plan = plan_consolidation(led, w, POLICY, reqs)
    (move,) = plan.moves
    after = apply(led, plan)
    moved_to = after.index[move.assignment.node]
    assert after.unit_tenants[(moved_to, 0, None)] == {"ns/uid-1": 2}


def test_bad_bounds() -> None:
    led, reqs = fragmented()
    with pytest.raises(ValueError, match="at least 1"):
        plan_consolidation(led, GpuRequest("w", compute_milli=800), POLICY, reqs, max_moves=0)


SHAPES = [
    GpuRequest("", compute_milli=250),
    GpuRequest("", compute_milli=450),
    GpuRequest("", compute_milli=700),
    GpuRequest("", memory_mib=12_288),
    GpuRequest("", gpu_count=1),
    GpuRequest("", isolation=Isolation.HARDWARE, compute_milli=140, memory_mib=4096),
    GpuRequest("", isolation=Isolation.MEMORY, compute_milli=300, memory_mib=4096),
]


def named(shape: GpuRequest, name: str, tenant: str | None = None) -> GpuRequest:
    return GpuRequest(
        name, shape.gpu_count, shape.compute_milli, shape.memory_mib, shape.isolation, shape.sharing, tenant=tenant
    )


# MPS tenants (issue 32): shared ones, pods of their own, and none (any).
TENANTS = st.sampled_from(["ns/uid-1000", "ns/uid-2000", "own", None])


@st.composite
def scenes(draw: st.DrawFn) -> tuple[Ledger, dict[str, GpuRequest], GpuRequest, int]:
    specs = []
    for i in range(draw(st.integers(2, 3))):
        model = draw(st.sampled_from(["A100-40GB", "T4"]))
        specs.append(
            NodeSpec(
                f"n{i}",
                64_000,
                262_144,
                tuple(GpuDevice(g, f"GPU-n{i}-{g}", model) for g in range(draw(st.integers(1, 2)))),
            )
        )
    led = Ledger(specs, tenancy=MpsTenancy(daemons_per_unit=draw(st.sampled_from([1, 2, 16]))))
    sched = Scheduler(led, make_policy("random", PolicyContext()), seed=draw(st.integers(0, 99)))
    reqs: dict[str, GpuRequest] = {}
    for k in range(draw(st.integers(4, 16))):
        drawn = draw(TENANTS)
        req = named(draw(st.sampled_from(SHAPES)), f"p{k}", own_tenant(f"p{k}") if drawn == "own" else drawn)
        d = sched.decide(req)
        if isinstance(d, Decision):
            led.place(d.assignment)
            if draw(st.integers(0, 3)):  # most pods may move, some may not
                reqs[req.name] = req
    drawn = draw(TENANTS)
    waiting = named(draw(st.sampled_from(SHAPES[1:5] + SHAPES[6:])), "w", own_tenant("w") if drawn == "own" else drawn)
    return led, reqs, waiting, draw(st.integers(1, 3))


@SETTINGS
@given(scenes())
def test_a_plan_ends_with_everything_placed(scene: tuple[Ledger, dict[str, GpuRequest], GpuRequest, int]) -> None:
    led, movable, w, max_moves = scene
    before = led.state()
    try:
        plan = plan_consolidation(led, w, POLICY, movable, max_moves=max_moves)
    except AlreadyFits:
        assert Scheduler(led, POLICY).feasible(w)[0].any()
        return
    except (NotEnoughRoom, NoPlan):
        assert led.state() == before
        return
    assert led.state() == before
    assert 1 <= len(plan.moves) <= max_moves
    assert all(m.pod in movable and m.source == led.assignments[m.pod].node != m.assignment.node for m in plan.moves)
    after = apply(led, plan)  # places everything; check_invariants: no over-allocation, no MIG overlap
    assert set(after.assignments) == {*led.assignments, "w"}
    assert plan == plan_consolidation(led, w, POLICY, movable, max_moves=max_moves)
