"""Preemption planner: unit cases that pin the kube-scheduler's order of criteria, and properties over random small
clusters checked against a brute force written from the rules (fresh ledgers rebuilt by replay, the framework's
filter on each), not from the planner's own helpers. The pods of the random clusters belong to MPS tenants and the
units have a small daemon cap now and then (issue 32): room across tenants is the same brute force's."""

from __future__ import annotations

import math
from collections.abc import Mapping

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sharegpu.ledger import Ledger, MpsTenancy, replay
from sharegpu.model.assignment import Assignment, GpuShare, Mechanism, MigSlot
from sharegpu.model.inventory import GpuDevice, NodeSpec, sim_gpus
from sharegpu.model.request import GpuRequest, Isolation
from sharegpu.model.tenant import own_tenant
from sharegpu.placement.framework import Decision, Policy, Scheduler
from sharegpu.placement.policies import PolicyContext, make_policy
from sharegpu.placement.preemption import (
    NoCandidates,
    PodFacts,
    PreemptionNotAllowed,
    PreemptionPlan,
    PreemptionPolicy,
    Preemptor,
    copy_ledger,
    plan_preemption,
)

POLICY = make_policy("bestfit", PolicyContext())
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def node(name: str, model: str = "A100-40GB", gpus: int = 2, cpu: int = 64_000) -> NodeSpec:
    return NodeSpec(name, cpu, 262_144, sim_gpus(name, model, gpus))


def place(led: Ledger, req: GpuRequest, where: str, gpus: list[int] | None = None) -> None:
    """Place ``req`` on node ``where`` (the policy picks GPUs unless ``gpus`` pins them)."""
    sched = Scheduler(led, POLICY)
    d = sched.decide_on(req, led.node_of(where))
    assert isinstance(d, Decision), d
    a = d.assignment
    if gpus is not None:
        from dataclasses import replace

        from sharegpu.placement.mechanism import make_share

        n = led.node_of(where)
        a = replace(a, shares=tuple(make_share(led, n, g, req) for g in gpus))
    led.place(a)


def share(name: str, milli: int) -> GpuRequest:
    return GpuRequest(name, compute_milli=milli)


# ----- unit cases -------------------------------------------------------------------------------------------------
def test_never_policy_is_refused() -> None:
    led = Ledger([node("a", gpus=1)])
    place(led, share("low", 800), "a")
    with pytest.raises(PreemptionNotAllowed, match="Never"):
        plan_preemption(led, Preemptor(share("hp", 500), 10, PreemptionPolicy.NEVER), POLICY, PodFacts({"low": 0}))


def test_equal_priority_is_never_a_victim() -> None:
    led = Ledger([node("a", gpus=1)])
    place(led, share("same", 800), "a")
    with pytest.raises(NoCandidates, match="lower priority"):
        plan_preemption(led, Preemptor(share("hp", 500), 5), POLICY, PodFacts({"same": 5}))


def test_fewest_victims_on_the_gpu_that_needs_least() -> None:
    # GPU 0 holds two 400m shares, GPU 1 one 700m share: a 500m preemptor needs one victim on either GPU, and keeps
    # the other pod of GPU 0; the whole node is the only one, so it is about the victim set.
    led = Ledger([node("a", gpus=2)])
    place(led, share("p1", 400), "a", [0])
    place(led, share("p2", 400), "a", [0])
    place(led, share("p3", 700), "a", [1])
    plan = plan_preemption(led, Preemptor(share("hp", 500), 10), POLICY, PodFacts({"p1": 1, "p2": 2, "p3": 3}))
    # Reprieve goes most important first: p3 (3) is put back first and stays, then p2 (2) stays, p1 must go.
    assert plan.victim_pods == ("p1",)
    assert plan.assignment.shares[0].gpu_index == 0


def test_node_order_of_criteria() -> None:
    """Each criterion decides before the next: PDB, highest priority, sum, count, start time, name."""
    led = Ledger([node(n, gpus=1) for n in "abcdef"])
    for n, pods in {
        "a": [("a1", 900)],  # victim prio 1, violates PDB
        "b": [("b1", 900)],  # victim prio 4
        "c": [("c1", 450), ("c2", 450)],  # two victims prio 2 + 2 (sum larger than d's)
        "d": [("d1", 900)],  # one victim prio 2, started at 50
        "e": [("e1", 900)],  # one victim prio 2, started at 100: latest, wins over d
        "f": [("f1", 900)],  # one victim prio 2, started at 100: ties with e, loses on name
    }.items():
        for p, m in pods:
            place(led, share(p, m), n)
    prio = {"a1": 1, "b1": 4, "c1": 2, "c2": 2, "d1": 2, "e1": 2, "f1": 2}
    starts = {"d1": 50.0, "e1": 100.0, "f1": 100.0, "c1": 0.0, "c2": 0.0, "a1": 0.0, "b1": 0.0}
    facts = PodFacts(prio, starts, lambda p: p == "a1")
    hp = Preemptor(share("hp", 600), 10)
    assert plan_preemption(led, hp, POLICY, facts).node == "e"
    # Without e and f, d (one victim) beats c (two victims of the same highest priority, larger sum).
    assert plan_preemption(led, hp, POLICY, facts, nodes=[0, 1, 2, 3]).node == "d"
    # Between b (prio 4) and c (prio 2 + 2): the lower highest priority wins although c needs two victims.
    assert plan_preemption(led, hp, POLICY, facts, nodes=[1, 2]).node == "c"
    # a's victim has the lowest priority, but evicting it violates a PDB: b wins.
    assert plan_preemption(led, hp, POLICY, facts, nodes=[0, 1]).node == "b"
    # Alone, a is chosen and the violation is reported.
    only_a = plan_preemption(led, hp, POLICY, facts, nodes=[0])
    assert only_a.node == "a" and only_a.pdb_violations == 1


def test_a_node_with_room_wins_without_victims() -> None:
    led = Ledger([node("a", gpus=1), node("b", gpus=1)])
    place(led, share("low", 900), "a")
    plan = plan_preemption(led, Preemptor(share("hp", 500), 1), POLICY, PodFacts({"low": 0}))
    assert plan.node == "b" and plan.victims == ()


def test_whole_gpu_preemptor_evicts_every_share_of_one_gpu() -> None:
    led = Ledger([node("a", gpus=2)])
    place(led, share("x", 300), "a", [0])
    place(led, share("y", 300), "a", [0])
    place(led, share("z", 100), "a", [1])
    place(led, share("hp-peer", 100), "a", [1])
    plan = plan_preemption(
        led, Preemptor(GpuRequest("hp"), 5), POLICY, PodFacts({"x": 0, "y": 0, "z": 0, "hp-peer": 5})
    )
    # GPU 1 holds a pod of equal priority: only GPU 0 can be emptied.
    assert set(plan.victim_pods) == {"x", "y"}
    assert plan.assignment.shares[0].gpu_index == 0


def test_mig_slot_shortfall() -> None:
    """A 4g instance needs slots 0-3 free: the 1g instance at slot 0 must go, the one at slot 6 may stay."""
    led = Ledger([node("a", gpus=1)])
    for pod, start in (("m0", 0), ("m6", 6)):
        mig = GpuShare(0, "GPU-a-0", Mechanism.MIG, 1000, 5 * 1024, MigSlot("1g.5gb", start), Mechanism.EXCLUSIVE)
        led.place(Assignment(pod, "a", (mig,)))
    hp = Preemptor(GpuRequest("hp", isolation=Isolation.HARDWARE, mig_profile="4g.20gb"), 3)
    plan = plan_preemption(led, hp, POLICY, PodFacts({"m0": 0, "m6": 0}))
    assert plan.victim_pods == ("m0",)
    assert plan.assignment.shares[0].mig == MigSlot("4g.20gb", 0)
    after = copy_ledger(led)
    after.release("m0")
    after.place(plan.assignment)
    after.check_invariants()


def test_caller_ledger_is_unchanged() -> None:
    led = Ledger([node("a", gpus=1), node("b", gpus=1)])
    place(led, share("l1", 900), "a")
    place(led, share("l2", 900), "b")
    before = led.state()
    plan_preemption(led, Preemptor(share("hp", 500), 1), POLICY, PodFacts({}))
    assert led.state() == before
    led.check_invariants()


def test_copy_ledger_is_independent() -> None:
    led = Ledger([node("a", gpus=2)])
    hw = Isolation.HARDWARE
    place(led, GpuRequest("m", compute_milli=100, memory_mib=4096, isolation=hw, mig_profile="1g.5gb"), "a")
    place(led, share("s", 300), "a")
    c = copy_ledger(led)
    assert c.state() == led.state()
    c.release("m")
    c.release("s")
    c.check_invariants()
    led.check_invariants()
    assert len(led) == 2 and led.instances


# ----- properties against a brute force -------------------------------------------------------------------------
MODELS = ["A100-40GB", "T4", "H100-80GB"]
SHAPES: list[GpuRequest] = [
    GpuRequest("", compute_milli=250),
    GpuRequest("", compute_milli=500),
    GpuRequest("", compute_milli=700),
    GpuRequest("", memory_mib=8192),
    GpuRequest("", gpu_count=1),
    GpuRequest("", gpu_count=2),
    GpuRequest("", compute_milli=300, cpu_milli=6000),
    GpuRequest("", isolation=Isolation.HARDWARE, compute_milli=140, memory_mib=4096),
    GpuRequest("", isolation=Isolation.HARDWARE, mig_profile="3g.20gb"),
    GpuRequest("", isolation=Isolation.MEMORY, compute_milli=200, memory_mib=2048),
    GpuRequest("", compute_milli=400, allowed_models=frozenset({"T4"})),
]


# MPS tenants (issue 32): a few shared ones (pods of one namespace and user), pods of their own, and none (any).
TENANTS = st.sampled_from(["ns/uid-1000", "ns/uid-2000", "other/uid-1000", "own", None])


def tenant_of(drawn: str | None, pod: str) -> str | None:
    return own_tenant(pod) if drawn == "own" else drawn


@st.composite
def scenes(draw: st.DrawFn) -> tuple[Ledger, dict[str, int], dict[str, float], set[str], Preemptor]:
    specs = []
    for i in range(draw(st.integers(1, 3))):
        model = draw(st.sampled_from(MODELS))
        gpus = tuple(GpuDevice(g, f"GPU-n{i}-{g}", model) for g in range(draw(st.integers(1, 2))))
        specs.append(NodeSpec(f"n{i}", draw(st.sampled_from([16_000, 64_000])), 262_144, gpus))
    # A small daemon cap makes the MPS daemons, not memory or compute, what is short on some units.
    led = Ledger(specs, tenancy=MpsTenancy(daemons_per_unit=draw(st.sampled_from([1, 2, 3, 16]))))
    sched = Scheduler(led, POLICY)
    prio: dict[str, int] = {}
    start: dict[str, float] = {}
    pdb: set[str] = set()
    for k in range(draw(st.integers(2, 16))):
        shape = draw(st.sampled_from(SHAPES))
        req = GpuRequest(
            f"p{k}",
            shape.gpu_count,
            shape.compute_milli,
            shape.memory_mib,
            shape.isolation,
            shape.sharing,
            shape.allowed_models,
            shape.mig_profile,
            shape.cpu_milli,
            tenant=tenant_of(draw(TENANTS), f"p{k}"),
        )
        d = sched.decide(req)
        if isinstance(d, Decision):
            led.place(d.assignment)
            prio[req.name] = draw(st.integers(0, 3))
            if draw(st.booleans()):
                start[req.name] = float(draw(st.integers(0, 3)))
            if draw(st.integers(0, 4)) == 0:
                pdb.add(req.name)
    shape = draw(st.sampled_from(SHAPES))
    hp = GpuRequest("hp", shape.gpu_count, shape.compute_milli, shape.memory_mib, shape.isolation, shape.sharing,
                    shape.allowed_models, shape.mig_profile, shape.cpu_milli,
                    tenant=tenant_of(draw(TENANTS), "hp"))  # fmt: skip
    return led, prio, start, pdb, Preemptor(hp, draw(st.integers(0, 4)))


def _fits_without(led: Ledger, req: GpuRequest, node: int, gone: set[str]) -> bool:
    """The reference's fit: a fresh ledger rebuilt from the other assignments, the framework's filter on it."""
    fresh = replay(led.nodes, [a for p, a in led.assignments.items() if p not in gone], led.catalog, led.tenancy)
    return Scheduler(fresh, POLICY).fits(req, node)


def _reference_victims(
    led: Ledger, hp: Preemptor, node: int, prio: Mapping[str, int], start: Mapping[str, float], pdb: set[str]
) -> list[str] | None:
    """selectVictimsOnNode, written out: all lower-priority pods off; reprieve (PDB-violating first, each group most
    important first) every pod whose return leaves room."""
    lower = [p for p in led.node_pods[node] if prio.get(p, 0) < hp.priority]
    if not _fits_without(led, hp.request, node, set(lower)):
        return None

    def importance(p: str) -> tuple[float, float, str]:
        return (-prio.get(p, 0), start.get(p, math.inf), p)

    ordered = sorted((p for p in lower if p in pdb), key=importance) + sorted(
        (p for p in lower if p not in pdb), key=importance
    )
    gone = set(lower)
    for p in ordered:
        if _fits_without(led, hp.request, node, gone - {p}):
            gone.discard(p)
    return sorted(gone)


def _reference_pick(
    cands: dict[int, list[str]], prio: Mapping[str, int], start: Mapping[str, float], pdb: set[str]
) -> int:
    """pickOneNodeForPreemption as successive filters, each keeping the nodes that are best on one criterion."""
    nodes = sorted(cands)
    if any(not v for v in cands.values()):
        return min(n for n in nodes if not cands[n])

    def keep_min(f) -> None:  # type: ignore[no-untyped-def]
        nonlocal nodes
        best = min(f(n) for n in nodes)
        nodes = [n for n in nodes if f(n) == best]

    keep_min(lambda n: sum(p in pdb for p in cands[n]))
    keep_min(lambda n: max(prio.get(p, 0) for p in cands[n]))
    keep_min(lambda n: sum(prio.get(p, 0) + 2**31 for p in cands[n]))
    keep_min(lambda n: len(cands[n]))

    def earliest_of_top(n: int) -> float:
        top = max(prio.get(p, 0) for p in cands[n])
        return min(start.get(p, math.inf) for p in cands[n] if prio.get(p, 0) == top)

    keep_min(lambda n: -earliest_of_top(n))
    return nodes[0]


@SETTINGS
@given(scenes())
def test_plan_matches_brute_force_and_is_safe(scene: tuple[Ledger, dict[str, int], dict[str, float], set[str], Preemptor]) -> None:  # fmt: skip
    led, prio, start, pdb, hp = scene
    facts = PodFacts(prio, start, lambda p: p in pdb)
    before = led.state()
    cands = {n: v for n in range(len(led.nodes)) if (v := _reference_victims(led, hp, n, prio, start, pdb)) is not None}
    try:
        plan: PreemptionPlan | None = plan_preemption(led, hp, POLICY, facts)
    except NoCandidates:
        plan = None
    assert led.state() == before, "the caller's ledger changed"
    if plan is None:
        assert not cands
        return
    assert cands, "a plan where no node can make room"
    assert plan.node_index == _reference_pick(cands, prio, start, pdb)
    assert sorted(plan.victim_pods) == cands[plan.node_index]
    assert plan.candidates == len(cands)
    assert all(prio.get(p, 0) < hp.priority for p in plan.victim_pods)
    assert all(led.assignments[p].node == plan.node for p in plan.victim_pods)
    # The preemptor's assignment fits once the victims are gone: no over-allocation, no overlapping MIG instances.
    after = copy_ledger(led)
    for p in plan.victim_pods:
        after.release(p)
    after.place(plan.assignment)
    after.check_invariants()
    assert plan.assignment.pod == "hp" and plan.assignment.node == plan.node


@SETTINGS
@given(scenes())
def test_never_preempts_without_lower_priority(
    scene: tuple[Ledger, dict[str, int], dict[str, float], set[str], Preemptor],
) -> None:
    led, prio, _, _, hp = scene
    floor = Preemptor(hp.request, min(prio.values(), default=0))
    try:
        plan = plan_preemption(led, floor, POLICY, PodFacts(prio))
    except NoCandidates:
        return
    assert plan.victims == ()


def test_uses_the_policys_gpu_choice() -> None:
    # The plan's assignment is what the given policy picks on the chosen node once the victims are gone.
    led = Ledger([node("a", gpus=2)])
    place(led, share("v", 900), "a", [0])
    place(led, share("keep", 400), "a", [1])
    policy: Policy = make_policy("packing", PolicyContext())
    plan = plan_preemption(led, Preemptor(share("hp", 700), 1), policy, PodFacts({"v": 0, "keep": 1}))
    assert plan.victim_pods == ("v",)
    assert plan.assignment.shares[0].gpu_index == 0


# ----- MPS tenants (issue 32) -------------------------------------------------------------------------------------
def mps_share(name: str, gib: int, tenant: str | None) -> GpuRequest:
    return GpuRequest(name, memory_mib=gib * 1024, isolation=Isolation.MEMORY, tenant=tenant)


def test_a_preemptor_of_another_tenant_fits_where_a_victims_daemon_closes() -> None:
    """Cap 2: tenants t1 (two pods) and t2 (one, more important than t1's) run daemons on the only GPU; a third
    tenant's pod fits in memory and needs a slot. Evicting one pod of t1 frees memory and no slot: both go, and the
    more important pod of t2 stays."""
    led = Ledger([node("a", "A100-80GB", gpus=1)], tenancy=MpsTenancy(daemons_per_unit=2))
    place(led, mps_share("t1-a", 5, "ns/uid-1"), "a")
    place(led, mps_share("t1-b", 5, "ns/uid-1"), "a")
    place(led, mps_share("t2", 5, "ns/uid-2"), "a")
    hp = Preemptor(mps_share("hp", 5, "ns/uid-3"), 10)
    plan = plan_preemption(led, hp, POLICY, PodFacts({"t1-a": 0, "t1-b": 1, "t2": 5}))
    assert sorted(plan.victim_pods) == ["t1-a", "t1-b"]
    after = copy_ledger(led)
    for p in plan.victim_pods:
        after.release(p)
    after.place(plan.assignment)
    after.check_invariants()
    assert after.unit_tenants[(0, 0, None)] == {"ns/uid-2": 1, "ns/uid-3": 1}


def test_the_preemptors_own_daemon_memory_decides_who_is_reprieved() -> None:
    """t2 runs two 30Gi pods (one daemon), t1 one 19Gi pod; the preemptor, of a third tenant, asks 20,380 MiB. With
    t1 gone and both of t2's back, 20,414 MiB are free: enough for the share, not for the share and its own daemon's
    66 MiB. So t2's less important pod goes (its daemon stays), and t1, least important, is reprieved."""
    led = Ledger([node("a", "A100-80GB", gpus=1)])
    place(led, mps_share("t1", 19, "ns/uid-1"), "a")
    place(led, mps_share("t2-a", 30, "ns/uid-2"), "a")
    place(led, mps_share("t2-b", 30, "ns/uid-2"), "a")
    ask = GpuRequest("hp", memory_mib=20_380, isolation=Isolation.MEMORY, tenant="ns/uid-3")
    plan = plan_preemption(led, Preemptor(ask, 10), POLICY, PodFacts({"t1": 0, "t2-a": 1, "t2-b": 2}))
    assert plan.victim_pods == ("t2-a",)
    daemon = led.tenancy.daemon_memory_mib
    assert 80 * 1024 - 60 * 1024 - daemon == 20_414 < 20_380 + daemon  # t1 gone, t2's both back
