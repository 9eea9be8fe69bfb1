"""Property tests of the ledger: random clusters, random place/release sequences, an independent reference model.

The reference (:func:`audit`) is written from DESIGN §3–4 without looking at the ledger's bookkeeping: a set of
assignments is valid when no node, GPU or MIG instance is over-allocated, mechanisms never mix on a unit, MIG
instances sit on valid, non-overlapping placements within the compute slices, MPS has at most 48 clients and
only on MPS-capable models, and an MPS unit runs a daemon per tenant of its clients, at most the cap, each taking its
server's memory. A place must succeed exactly when the assignments plus the new one are valid.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sharegpu.ledger import MPS_DAEMON_MEMORY_MIB, GpuMode, Ledger, LedgerConflict, MpsTenancy, replay
from sharegpu.model.assignment import Assignment, GpuShare, InvalidAssignment, Mechanism, MigSlot
from sharegpu.model.catalog import DEFAULT_CATALOG, GpuModel, MigProfile
from sharegpu.model.inventory import GpuDevice, NodeSpec

CAT = DEFAULT_CATALOG
MODELS = ["H100-80GB", "A100-40GB", "A30-24GB", "T4", "P100", "G2"]
STATIC_LAYOUTS: dict[str, list[tuple[tuple[str, int], ...]]] = {
    "H100-80GB": [(("3g.40gb", 0),), (("1g.10gb", 0), ("2g.20gb", 4)), (("7g.80gb", 0),)],
    "A100-40GB": [(("4g.20gb", 0),), (("1g.5gb", 6),)],
    "A30-24GB": [(("2g.12gb", 2),)],
}
ALL_PROFILES = sorted({p.name for m in CAT for p in m.mig_profiles})
INNER = [Mechanism.MPS, Mechanism.EXCLUSIVE, Mechanism.TIME_SLICING]
MECHANISMS = [Mechanism.MPS, Mechanism.TIME_SLICING, Mechanism.EXCLUSIVE, Mechanism.MIG]
MIG_GPU_MECHANISMS = [Mechanism.MIG, Mechanism.MIG, *MECHANISMS]
MPS_LIMIT = 48
TENANCY = MpsTenancy(daemons_per_unit=2)  # small, so that random operations reach the cap
DAEMON_MIB = MPS_DAEMON_MEMORY_MIB

SETTINGS = settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# ----- strategies ---------------------------------------------------------------------------------------------
@st.composite
def clusters(draw: st.DrawFn) -> list[NodeSpec]:
    nodes = []
    for i in range(draw(st.integers(1, 3))):
        name = f"node-{i}"
        devs = []
        node_model = draw(st.sampled_from(MODELS))
        for g in range(draw(st.integers(1, 4))):
            model = draw(st.sampled_from([node_model] * 3 + MODELS))  # mostly one model per node, some mixed
            layout: tuple[tuple[str, int], ...] = ()
            if model in STATIC_LAYOUTS and draw(st.sampled_from([False] * 4 + [True])):
                layout = draw(st.sampled_from(STATIC_LAYOUTS[model]))
            healthy = draw(st.sampled_from([True] * 19 + [False]))
            devs.append(GpuDevice(g, f"GPU-{name}-{g}", model, healthy, tuple(MigSlot(p, s) for p, s in layout)))
        cpu = draw(st.sampled_from([4_000, 16_000, 64_000, 3_999]))
        mem = draw(st.sampled_from([8_192, 65_536, 4_095]))
        nodes.append(NodeSpec(name, cpu, mem, tuple(devs)))
    return draw(st.permutations(nodes))


def computes() -> st.SearchStrategy[int]:
    return st.sampled_from([500, 1000, 250, 333, 750, 100, 1]) | st.integers(1, 1000)


def memories(total: int) -> st.SearchStrategy[int]:
    return st.sampled_from([total // 2, 0, 1024, total // 4, total, 0]) | st.integers(0, total + 1)


@st.composite
def shares(draw: st.DrawFn, node: NodeSpec, index: int) -> GpuShare:
    dev = node.gpus[index] if index < len(node.gpus) else None
    model = CAT.get(dev.model) if dev else CAT.get("T4")
    uuid = dev.uuid if dev is not None and draw(st.sampled_from([True] * 29 + [False])) else f"GPU-bogus-{index}"
    mech = draw(st.sampled_from(MIG_GPU_MECHANISMS if model.mig_capable else MECHANISMS))
    if mech is Mechanism.MIG:
        profiles = model.mig_profiles or CAT.get("H100-80GB").mig_profiles
        profile = draw(st.sampled_from(profiles))
        name = profile.name if draw(st.sampled_from([True] * 9 + [False])) else draw(st.sampled_from(ALL_PROFILES))
        start = draw(
            st.sampled_from(profile.starts) if draw(st.sampled_from([True] * 7 + [False])) else st.integers(0, 8)
        )
        inner = draw(st.sampled_from(INNER))
        if inner is Mechanism.EXCLUSIVE and draw(st.sampled_from([True] * 5 + [False])):
            compute, memory = 1000, profile.memory_mib
        else:
            compute, memory = draw(computes()), draw(memories(profile.memory_mib))
        return GpuShare(index, uuid, mech, compute, memory, MigSlot(name, start), inner)
    if mech is Mechanism.EXCLUSIVE and draw(st.sampled_from([True] * 5 + [False])):
        return GpuShare(index, uuid, mech, 1000, model.memory_mib)
    return GpuShare(index, uuid, mech, draw(computes()), draw(memories(model.memory_mib)))


@st.composite
def assignments(draw: st.DrawFn, nodes: list[NodeSpec], step: int, placed: list[str]) -> Assignment | None:
    node = draw(st.sampled_from(nodes))
    k = draw(st.sampled_from([1, 1, 1, 1, 1, 1, 1, 0, 2, 2, 3]))
    indices = [
        draw(st.integers(0, len(node.gpus) - 1))
        if draw(st.sampled_from([True] * 15 + [False]))
        else len(node.gpus)  # a GPU the node does not have
        for _ in range(k)
    ]
    pod = f"pod-{step}"
    if placed and draw(st.sampled_from([False] * 19 + [True])):
        pod = draw(st.sampled_from(placed))  # a pod that is already placed
    try:
        return Assignment(
            pod,
            node.name,
            tuple(draw(shares(node, i)) for i in indices),
            draw(st.sampled_from([0, 0, 0, 100, 500, 1_000, 4_000])),
            draw(st.sampled_from([0, 0, 0, 512, 4_096])),
            # Mostly one tenant, so MPS units fill; sometimes others, so that units reach the daemon cap (2 here).
            draw(st.sampled_from([None, None, None, "ns/uid-0", "ns/uid-1000", "pod/a", "pod/b"])),
        )
    except InvalidAssignment:  # the same GPU or MIG instance twice: not a ledger matter
        return None


# ----- the independent reference ------------------------------------------------------------------------------
def mask(start: int, size: int) -> int:
    return ((1 << size) - 1) << start


def find_profile(model: GpuModel, name: str) -> MigProfile | None:
    return next((p for p in model.mig_profiles if p.name == name), None)


@dataclass
class GpuView:
    mode: str = "free"  # free | exclusive | time-slicing | mps | mig
    used_milli: int = 0
    used_mem: int = 0
    clients: int = 0
    # start -> [profile, used milli, used mem, inner (None when empty), clients, persistent]
    instances: dict[int, list[Any]] = field(default_factory=dict)


def audit(nodes: list[NodeSpec], assigned: list[Assignment]) -> tuple[list[str], dict[tuple[str, int], GpuView]]:
    """Every rule a set of assignments breaks, and what each GPU should look like."""
    problems: list[str] = []
    by_name = {n.name: n for n in nodes}
    cpu: dict[str, int] = defaultdict(int)
    mem: dict[str, int] = defaultdict(int)
    on_gpu: dict[tuple[str, int], list[GpuShare]] = defaultdict(list)
    user_of: dict[int, str | None] = {}  # id(share) -> the MPS tenant of its pod
    pods = [a.pod for a in assigned]
    if len(pods) != len(set(pods)):
        problems.append("a pod is placed twice")
    for a in assigned:
        node = by_name.get(a.node)
        if node is None:
            problems.append(f"unknown node {a.node}")
            continue
        cpu[a.node] += a.cpu_milli
        mem[a.node] += a.host_memory_mib
        for s in a.shares:
            if s.gpu_index >= len(node.gpus):
                problems.append("no such GPU")
                continue
            dev = node.gpus[s.gpu_index]
            if dev.uuid != s.gpu_uuid:
                problems.append("wrong UUID")
            if not dev.healthy:
                problems.append("unhealthy GPU")
            on_gpu[(a.node, s.gpu_index)].append(s)
            user_of[id(s)] = a.tenant
    views: dict[tuple[str, int], GpuView] = {}
    for node in nodes:
        if cpu[node.name] > node.cpu_milli or mem[node.name] > node.memory_mib:
            problems.append(f"{node.name}: CPU or memory over-allocated")
        for dev in node.gpus:
            model = CAT.get(dev.model)
            view = views[(node.name, dev.index)] = GpuView()
            shares_here = on_gpu[(node.name, dev.index)]
            plain = [s for s in shares_here if s.mig is None]
            migs = [s for s in shares_here if s.mig is not None]
            static = {slot.start: slot.profile for slot in dev.mig_instances}
            if plain and (migs or static):
                problems.append("MIG and non-MIG use on one GPU")
            if plain:
                mechs = {s.mechanism for s in plain}
                if len(mechs) > 1:
                    problems.append("mechanisms mix on a GPU")
                mech = plain[0].mechanism
                view.mode = mech.value
                view.clients = len(plain)
                view.used_milli = sum(s.compute_milli for s in plain)
                view.used_mem = sum(s.memory_mib for s in plain)
                if mech is Mechanism.MPS:
                    tenants = {user_of[id(s)] for s in plain}
                    view.used_mem += len(tenants) * DAEMON_MIB  # each tenant's daemon runs its own server
                    if len(tenants) > TENANCY.daemons_per_unit:
                        problems.append("an MPS GPU runs more daemons than the cap")
                if mech is Mechanism.EXCLUSIVE and (
                    len(plain) > 1 or plain[0].compute_milli != 1000 or plain[0].memory_mib != model.memory_mib
                ):
                    problems.append("exclusive share is not alone and whole")
                if mech is Mechanism.MPS and (not model.mps_capable or len(plain) > MPS_LIMIT):
                    problems.append("MPS where it cannot run, or too many clients")
                if view.used_milli > 1000 or view.used_mem > model.memory_mib:
                    problems.append("GPU over-allocated")
            by_start: dict[int, list[GpuShare]] = defaultdict(list)
            for s in migs:
                assert s.mig is not None
                by_start[s.mig.start].append(s)
            names = {start: {profile} for start, profile in static.items()}
            for start, ss in by_start.items():
                names.setdefault(start, set()).update(s.mig.profile for s in ss if s.mig)
            covered = slices = 0
            for start, profile_names in names.items():
                if len(profile_names) != 1:
                    problems.append("two profiles at one start")
                    continue
                profile = find_profile(model, next(iter(profile_names)))
                if profile is None:
                    problems.append("profile does not exist on the model")
                    continue
                if start not in profile.starts or start + profile.memory_slots > model.memory_slots:
                    problems.append("instance at an invalid start")
                m = mask(start, profile.memory_slots)
                if covered & m:
                    problems.append("instances overlap")
                covered |= m
                slices += profile.compute_slices
                ss = by_start.get(start, [])
                inners = {s.inner for s in ss}
                if len(inners) > 1:
                    problems.append("mechanisms mix in an instance")
                used_milli = sum(s.compute_milli for s in ss)
                used_mem = sum(s.memory_mib for s in ss)
                if Mechanism.EXCLUSIVE in inners and (
                    len(ss) > 1 or ss[0].compute_milli != 1000 or ss[0].memory_mib != profile.memory_mib
                ):
                    problems.append("exclusive MIG share is not alone and whole")
                if Mechanism.MPS in inners and len(ss) > MPS_LIMIT:
                    problems.append("too many MPS clients in an instance")
                if Mechanism.MPS in inners:
                    tenants = {user_of[id(s)] for s in ss}
                    used_mem += len(tenants) * DAEMON_MIB
                    if len(tenants) > TENANCY.daemons_per_unit:
                        problems.append("an MPS instance runs more daemons than the cap")
                if used_milli > 1000 or used_mem > profile.memory_mib:
                    problems.append("instance over-allocated")
                inner = ss[0].inner if ss else None
                view.instances[start] = [profile.name, used_milli, used_mem, inner, len(ss), start in static]
            if slices > model.compute_slices:
                problems.append("more compute slices than the GPU has")
            if view.instances:
                view.mode = "mig"
    return problems, views


def check_against_reference(ledger: Ledger, nodes: list[NodeSpec]) -> None:
    """The ledger's numbers, recomputed from its assignments and the inventories alone."""
    problems, views = audit(nodes, list(ledger.assignments.values()))
    assert problems == []
    for node in nodes:
        n = ledger.node_of(node.name)
        used_cpu = sum(a.cpu_milli for a in ledger.assignments.values() if a.node == node.name)
        used_mem = sum(a.host_memory_mib for a in ledger.assignments.values() if a.node == node.name)
        assert ledger.cpu_free[n] == node.cpu_milli - used_cpu
        assert ledger.mem_free[n] == node.memory_mib - used_mem
        for dev in node.gpus:
            g = dev.index
            model = CAT.get(dev.model)
            view = views[(node.name, g)]
            insts = ledger.instances_on(n, g)
            got = {
                start: [
                    i.profile.name,
                    1000 - i.free_milli,
                    i.profile.memory_mib - i.free_mem,
                    i.inner,
                    i.clients,
                    i.persistent,
                ]
                for start, i in insts.items()
            }
            assert got == view.instances
            if view.mode == "mig":
                assert ledger.mode[n, g] == GpuMode.MIG
                taken_slices = sum(find_profile(model, p[0]).compute_slices for p in view.instances.values())  # type: ignore[union-attr]
                taken_slots = sum(find_profile(model, p[0]).memory_slots for p in view.instances.values())  # type: ignore[union-attr]
                # what no instance covers
                assert ledger.free_milli[n, g] == (model.compute_slices - taken_slices) * 1000 // model.compute_slices
                assert (
                    ledger.free_mem[n, g] == (model.memory_slots - taken_slots) * model.memory_mib // model.memory_slots
                )
            else:
                modes = {
                    "free": GpuMode.FREE,
                    "exclusive": GpuMode.EXCLUSIVE,
                    "time-slicing": GpuMode.TIME_SLICING,
                    "mps": GpuMode.MPS,
                }
                assert ledger.mode[n, g] == modes[view.mode]
                assert ledger.clients[n, g] == view.clients
                assert ledger.free_milli[n, g] == 1000 - view.used_milli
                assert ledger.free_mem[n, g] == model.memory_mib - view.used_mem


def snapshot(ledger: Ledger) -> dict[str, Any]:
    out: dict[str, Any] = {"state": ledger.state()}
    for k, v in vars(ledger).items():
        if k == "catalog":
            continue
        out[k] = (v.dtype.str, v.shape, v.tolist()) if isinstance(v, np.ndarray) else copy.deepcopy(v)
    return out


# ----- the driver ---------------------------------------------------------------------------------------------
@dataclass
class Counts:
    placed: int = 0
    rejected: int = 0
    released: int = 0


def run(ledger: Ledger, nodes: list[NodeSpec], data: st.DataObject, *, oracle: bool, after: Any) -> Counts:
    counts = Counts()
    for step in range(data.draw(st.integers(5, 50), label="steps")):
        placed = sorted(ledger.assignments)
        if placed and data.draw(st.integers(0, 3)) == 0:
            pod = data.draw(st.sampled_from(placed))
            a = ledger.release(pod)
            assert a.pod == pod and pod not in ledger
            counts.released += 1
        else:
            a = data.draw(assignments(nodes, step, placed))
            if a is None:
                continue
            expected_ok = oracle and a.pod not in ledger and audit(nodes, [*ledger.assignments.values(), a])[0] == []
            before = snapshot(ledger)
            try:
                ledger.place(a)
            except LedgerConflict as e:
                counts.rejected += 1
                assert str(e)
                if oracle:
                    assert not expected_ok, f"refused a valid assignment: {e}"
                assert snapshot(ledger) == before  # atomic: nothing changed
            else:
                counts.placed += 1
                assert ledger.assignments[a.pod] is a
                if oracle:
                    assert expected_ok, (
                        f"accepted an invalid assignment: {audit(nodes, list(ledger.assignments.values()))[0]}"
                    )
        ledger.check_invariants()
        after(ledger)
    return counts


# ----- properties ---------------------------------------------------------------------------------------------
@SETTINGS
@given(nodes=clusters(), data=st.data())
def test_random_operations_match_the_reference(nodes: list[NodeSpec], data: st.DataObject) -> None:
    ledger = Ledger(nodes, tenancy=TENANCY)
    ledger.check_invariants()
    fresh = ledger.state()
    assert fresh == Ledger(list(reversed(nodes)), tenancy=TENANCY).state()
    run(ledger, nodes, data, oracle=True, after=lambda lg: check_against_reference(lg, nodes))
    # a restart rebuilds the same state from the assignments, in any order
    order = data.draw(st.permutations(list(ledger.assignments.values())))
    assert replay(nodes, order, tenancy=TENANCY).state() == ledger.state()
    assert replay(nodes, [Assignment.from_json(a.to_json()) for a in order], tenancy=TENANCY).state() == ledger.state()
    # releasing everything gives exactly a fresh ledger
    for pod in data.draw(st.permutations(sorted(ledger.assignments))):
        ledger.release(pod)
        ledger.check_invariants()
    assert len(ledger) == 0
    assert ledger.state() == fresh
    assert ledger.state() == Ledger(nodes, tenancy=TENANCY).state()


def _gpu_totals(ledger: Ledger) -> None:
    """Compute per GPU never above one GPU, and MIG slot masks never overlap, from ledger.assignments alone."""
    plain_milli: dict[tuple[str, int], int] = defaultdict(int)
    plain_mem: dict[tuple[str, int], int] = defaultdict(int)
    inst: dict[tuple[str, int, int], list[GpuShare]] = defaultdict(list)
    for a in ledger.assignments.values():
        for s in a.shares:
            if s.mig is None:
                plain_milli[(a.node, s.gpu_index)] += s.compute_milli
                plain_mem[(a.node, s.gpu_index)] += s.memory_mib
            else:
                inst[(a.node, s.gpu_index, s.mig.start)].append(s)
    for node in ledger.nodes:
        for dev in node.gpus:
            key = (node.name, dev.index)
            model = CAT.get(dev.model)
            assert plain_milli[key] <= 1000
            assert plain_mem[key] <= model.memory_mib
            layout = {slot.start: slot.profile for slot in dev.mig_instances}
            for (nn, g, start), ss in inst.items():
                if (nn, g) == key:
                    assert len({s.mig.profile for s in ss if s.mig}) == 1
                    assert layout.setdefault(start, ss[0].mig.profile) == ss[0].mig.profile  # type: ignore[union-attr]
                    assert sum(s.compute_milli for s in ss) <= 1000
            if layout:
                assert plain_milli[key] == 0  # MIG and non-MIG never share a GPU
            covered = 0
            gpu_milli = Fraction(0)
            slots = 0
            for start, name in layout.items():
                profile = find_profile(model, name)
                assert profile is not None
                assert start in profile.starts
                m = mask(start, profile.memory_slots)
                assert covered & m == 0, f"MIG instances overlap on {key}"
                covered |= m
                slots += profile.memory_slots
                used = sum(s.compute_milli for s in inst.get((node.name, dev.index, start), []))
                gpu_milli += Fraction(used * profile.compute_slices, model.compute_slices)
                assert sum(s.memory_mib for s in inst.get((node.name, dev.index, start), [])) <= profile.memory_mib
            assert covered < (1 << max(model.memory_slots, 0)) or not layout
            assert slots <= model.memory_slots
            assert sum(find_profile(model, p).compute_slices for p in layout.values()) <= max(model.compute_slices, 0)  # type: ignore[union-attr]
            assert gpu_milli <= 1000
    assert ledger.allocated_gpu_milli <= ledger.total_gpu_milli


@SETTINGS
@given(nodes=clusters(), data=st.data())
def test_gpu_compute_and_mig_masks_never_over_allocated(nodes: list[NodeSpec], data: st.DataObject) -> None:
    ledger = Ledger(nodes, tenancy=TENANCY)
    run(ledger, nodes, data, oracle=False, after=_gpu_totals)


def test_the_generators_exercise_both_outcomes() -> None:
    """Guard against a vacuous property: random operations are both placed and rejected, often."""
    totals = Counts()

    @settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(nodes=clusters(), data=st.data())
    def go(nodes: list[NodeSpec], data: st.DataObject) -> None:
        c = run(Ledger(nodes, tenancy=TENANCY), nodes, data, oracle=False, after=lambda lg: None)
        totals.placed += c.placed
        totals.rejected += c.rejected
        totals.released += c.released

    go()
    assert totals.placed >= 40
    assert totals.rejected >= 40
    assert totals.released >= 10
