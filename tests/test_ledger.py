"""The ledger: place / release of every mechanism, atomic conflicts, MIG geometry, invariants and replay."""

from __future__ import annotations

import copy
import random
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from sharegpu.ledger import (
    MPS_DAEMON_MEMORY_MIB,
    MPS_MAX_CLIENTS,
    GpuMode,
    InvariantViolation,
    Ledger,
    LedgerConflict,
    MpsTenancy,
    UnknownNode,
    UnknownPod,
    replay,
)
from sharegpu.model.assignment import Assignment, GpuShare, Mechanism, MigSlot
from sharegpu.model.catalog import DEFAULT_CATALOG, GIB
from sharegpu.model.inventory import GpuDevice, NodeSpec

CPU = 64_000
MEM = 512 * GIB


def mk_node(
    name: str,
    *models: str,
    cpu: int = CPU,
    mem: int = MEM,
    unhealthy: tuple[int, ...] = (),
    mig: dict[int, list[tuple[str, int]]] | None = None,
) -> NodeSpec:
    mig = mig or {}
    return NodeSpec(
        name,
        cpu,
        mem,
        tuple(
            GpuDevice(i, f"GPU-{name}-{i}", m, i not in unhealthy, tuple(MigSlot(p, s) for p, s in mig.get(i, [])))
            for i, m in enumerate(models)
        ),
    )


def mem_of(model: str) -> int:
    return DEFAULT_CATALOG.get(model).memory_mib


def sh(node: str, i: int, mech: Mechanism, compute: int = 1000, memory: int = 0) -> GpuShare:
    return GpuShare(i, f"GPU-{node}-{i}", mech, compute, memory)


def excl(node: str, i: int, model: str) -> GpuShare:
    return GpuShare(i, f"GPU-{node}-{i}", Mechanism.EXCLUSIVE, 1000, mem_of(model))


def ts(node: str, i: int, compute: int, memory: int = 0) -> GpuShare:
    return sh(node, i, Mechanism.TIME_SLICING, compute, memory)


def mps(node: str, i: int, compute: int, memory: int = 0) -> GpuShare:
    return sh(node, i, Mechanism.MPS, compute, memory)


def mig(
    node: str,
    i: int,
    profile: str,
    start: int,
    inner: Mechanism = Mechanism.EXCLUSIVE,
    compute: int = 1000,
    memory: int | None = None,
    model: str = "H100-80GB",
) -> GpuShare:
    if memory is None:
        memory = DEFAULT_CATALOG.get(model).profile(profile).memory_mib if inner is Mechanism.EXCLUSIVE else 0
    return GpuShare(i, f"GPU-{node}-{i}", Mechanism.MIG, compute, memory, MigSlot(profile, start), inner)


def asg(pod: str, node: str, *shares: GpuShare, cpu: int = 0, mem: int = 0, tenant: str | None = None) -> Assignment:
    return Assignment(pod, node, tuple(shares), cpu, mem, tenant)


def snapshot(ledger: Ledger) -> dict[str, Any]:
    """Everything the ledger holds (every numpy array and container), for exact before/after comparison."""
    out: dict[str, Any] = {"state": ledger.state()}
    for k, v in vars(ledger).items():
        if k == "catalog":
            continue
        out[k] = (v.dtype.str, v.shape, v.tolist()) if isinstance(v, np.ndarray) else copy.deepcopy(v)
    return out


def ok(ledger: Ledger, a: Assignment) -> None:
    ledger.place(a)
    assert a.pod in ledger
    assert ledger.assignments[a.pod] == a
    ledger.check_invariants()


def conflict(ledger: Ledger, a: Assignment, match: str | None = None) -> str:
    """``a`` is rejected with LedgerConflict and the ledger is exactly as it was."""
    before = snapshot(ledger)
    with pytest.raises(LedgerConflict, match=match) as e:
        ledger.place(a)
    assert snapshot(ledger) == before
    assert a.pod not in ledger or ledger.assignments[a.pod] != a
    ledger.check_invariants()
    return str(e.value)


def release(ledger: Ledger, pod: str) -> Assignment:
    a = ledger.release(pod)
    assert pod not in ledger
    ledger.check_invariants()
    return a


@pytest.fixture
def h100() -> Ledger:
    return Ledger([mk_node("n", "H100-80GB", "H100-80GB")])


# ----- construction -------------------------------------------------------------------------------------------
def test_fresh_ledger() -> None:
    ledger = Ledger([mk_node("b", "T4", "T4", "T4"), mk_node("a", "H100-80GB"), mk_node("c")])
    ledger.check_invariants()
    assert [n.name for n in ledger.nodes] == ["a", "b", "c"]  # name order
    assert ledger.node_of("b") == 1
    assert len(ledger) == 0
    assert ledger.total_gpu_milli == 4000
    assert ledger.allocated_gpu_milli == 0
    # padded to the widest node; absent GPUs have nothing free
    assert ledger.free_milli.tolist() == [[1000, 0, 0], [1000, 1000, 1000], [0, 0, 0]]
    assert ledger.free_mem.tolist() == [[80 * GIB, 0, 0], [16 * GIB] * 3, [0, 0, 0]]
    assert ledger.cpu_free.tolist() == [CPU] * 3
    assert (ledger.mode == GpuMode.FREE).all()
    assert ledger.gpu_model(1, 2).name == "T4"
    assert ledger.instances == {}


def test_duplicate_node_names_are_refused() -> None:
    with pytest.raises(LedgerConflict, match="twice"):
        Ledger([mk_node("a", "T4"), mk_node("a", "T4")])


def test_empty_cluster() -> None:
    ledger = Ledger([])
    ledger.check_invariants()
    assert ledger.total_gpu_milli == 0
    with pytest.raises(UnknownNode):
        ledger.place(asg("p", "n"))


def test_aliases_and_generic_models() -> None:
    ledger = Ledger([mk_node("n", "V100M16", "G2")])
    assert ledger.gpu_model(0, 0).name == "V100-16GB"
    g2 = ledger.gpu_model(0, 1)
    assert g2.generic and g2.memory_mib == 0
    assert ledger.free_mem.tolist() == [[16 * GIB, 0]]
    # a generic GPU takes compute shares but no memory (its memory is unknown)
    conflict(ledger, asg("c", "n", mps("n", 1, 100)), "G2 does not support MPS")
    ok(ledger, asg("a", "n", ts("n", 1, 600)))
    conflict(ledger, asg("b", "n", ts("n", 1, 100, 1)))
    ok(ledger, asg("d", "n", ts("n", 1, 400)))
    assert ledger.free_milli[0, 1] == 0


# ----- exclusive ----------------------------------------------------------------------------------------------
def test_exclusive(h100: Ledger) -> None:
    fresh = h100.state()
    ok(h100, asg("p", "n", excl("n", 0, "H100-80GB"), cpu=1000, mem=GIB))
    assert h100.free_milli[0, 0] == 0 and h100.free_mem[0, 0] == 0
    assert h100.mode[0, 0] == GpuMode.EXCLUSIVE
    assert h100.cpu_free[0] == CPU - 1000 and h100.mem_free[0] == MEM - GIB
    assert h100.allocated_gpu_milli == 1000
    for mech in Mechanism:
        s = mig("n", 0, "1g.10gb", 0) if mech is Mechanism.MIG else sh("n", 0, mech, 1, 0)
        conflict(h100, asg("q", "n", s), "in use as exclusive")
    conflict(h100, asg("q", "n", excl("n", 0, "H100-80GB")))
    assert release(h100, "p").pod == "p"
    assert h100.state() == fresh


@pytest.mark.parametrize(("compute", "memory"), [(999, 80 * GIB), (1000, 80 * GIB - 1), (1000, 0), (500, 40 * GIB)])
def test_exclusive_must_take_the_whole_gpu(h100: Ledger, compute: int, memory: int) -> None:
    conflict(h100, asg("p", "n", sh("n", 0, Mechanism.EXCLUSIVE, compute, memory)), "whole GPU")


def test_exclusive_is_refused_on_a_shared_gpu(h100: Ledger) -> None:
    ok(h100, asg("a", "n", ts("n", 0, 1)))
    conflict(h100, asg("p", "n", excl("n", 0, "H100-80GB")), "time_slicing")


# ----- time-slicing and MPS -----------------------------------------------------------------------------------
def test_time_slicing_fills_to_exactly_one_gpu(h100: Ledger) -> None:
    for k, c in enumerate([300, 300, 399]):
        ok(h100, asg(f"p{k}", "n", ts("n", 0, c, 20 * GIB)))
    assert h100.free_milli[0, 0] == 1 and h100.free_mem[0, 0] == 20 * GIB
    assert h100.clients[0, 0] == 3
    assert h100.mode[0, 0] == GpuMode.TIME_SLICING
    conflict(h100, asg("x", "n", ts("n", 0, 2)), "1 milli")
    conflict(h100, asg("x", "n", ts("n", 0, 1, 20 * GIB + 1)))
    ok(h100, asg("last", "n", ts("n", 0, 1, 20 * GIB)))
    assert h100.free_milli[0, 0] == 0 and h100.free_mem[0, 0] == 0
    conflict(h100, asg("x", "n", ts("n", 0, 1)))
    # the other GPU is untouched
    assert h100.free_milli[0, 1] == 1000 and h100.mode[0, 1] == GpuMode.FREE


def test_mechanisms_never_mix_on_one_gpu(h100: Ledger) -> None:
    ok(h100, asg("t", "n", ts("n", 0, 100)))
    conflict(h100, asg("m", "n", mps("n", 0, 100)), "time_slicing")
    conflict(h100, asg("g", "n", mig("n", 0, "1g.10gb", 0)), "MIG needs it idle")
    ok(h100, asg("m", "n", mps("n", 1, 100)))
    conflict(h100, asg("t2", "n", ts("n", 1, 100)), "mps")
    release(h100, "t")
    ok(h100, asg("m2", "n", mps("n", 0, 100)))  # the GPU is free again once its last share leaves
    assert h100.mode[0, 0] == GpuMode.MPS


def test_mps_client_limit(h100: Ledger) -> None:
    assert MPS_MAX_CLIENTS == 48
    for k in range(48):
        ok(h100, asg(f"p{k}", "n", mps("n", 0, 20, GIB)))
    assert h100.clients[0, 0] == 48
    assert h100.free_milli[0, 0] == 1000 - 48 * 20
    msg = conflict(h100, asg("p48", "n", mps("n", 0, 1)))
    assert "48" in msg and "MPS" in msg
    release(h100, "p7")
    ok(h100, asg("p48", "n", mps("n", 0, 1)))


def test_time_slicing_has_no_client_limit(h100: Ledger) -> None:
    for k in range(60):
        h100.place(asg(f"p{k}", "n", ts("n", 0, 10)))
    h100.check_invariants()
    assert h100.clients[0, 0] == 60


def test_p100_refuses_mps_but_time_slices() -> None:
    ledger = Ledger([mk_node("n", "P100")])
    conflict(ledger, asg("m", "n", mps("n", 0, 100)), "P100 does not support MPS")
    ok(ledger, asg("t", "n", ts("n", 0, 100, GIB)))
    conflict(ledger, asg("g", "n", mig("n", 0, "1g.10gb", 0)))


def test_memory_is_never_over_allocated(h100: Ledger) -> None:
    ok(h100, asg("a", "n", mps("n", 0, 10, 60 * GIB)))
    free = 20 * GIB - MPS_DAEMON_MEMORY_MIB  # the daemon's server takes its part
    msg = conflict(h100, asg("b", "n", mps("n", 0, 10, free + 1)))
    assert f"{free}Mi free" in msg
    ok(h100, asg("b", "n", mps("n", 0, 10, free)))


# ----- CPU, host memory and bad references --------------------------------------------------------------------
def test_cpu_and_host_memory(h100: Ledger) -> None:
    ok(h100, asg("a", "n", cpu=CPU - 1, mem=MEM))  # a CPU-only pod
    assert h100.cpu_free[0] == 1 and h100.mem_free[0] == 0
    msg = conflict(h100, asg("b", "n", ts("n", 0, 10), cpu=2))
    assert "1m CPU" in msg
    conflict(h100, asg("b", "n", ts("n", 0, 10), mem=1))
    ok(h100, asg("b", "n", ts("n", 0, 10), cpu=1))
    assert h100.cpu_free[0] == 0
    release(h100, "a")
    assert h100.cpu_free[0] == CPU - 1 and h100.mem_free[0] == MEM


def test_bad_references(h100: Ledger) -> None:
    conflict(h100, asg("p", "n", ts("n", 2, 10)), "no GPU 2")
    conflict(h100, asg("p", "n", GpuShare(0, "GPU-other", Mechanism.TIME_SLICING, 10)), "not GPU-other")
    with pytest.raises(UnknownNode, match="'m'"):
        h100.place(asg("p", "m", ts("m", 0, 10)))
    ok(h100, asg("p", "n", ts("n", 0, 10)))
    msg = conflict(h100, asg("p", "n", ts("n", 1, 10)), "already placed")
    assert "p" in msg
    with pytest.raises(UnknownPod):
        h100.release("nobody")
    release(h100, "p")
    with pytest.raises(UnknownPod):
        h100.release("p")


def test_unhealthy_gpus_take_nothing() -> None:
    ledger = Ledger([mk_node("n", "T4", "T4", unhealthy=(1,))])
    conflict(ledger, asg("p", "n", ts("n", 1, 10)), "unhealthy")
    conflict(ledger, asg("p", "n", excl("n", 1, "T4")), "unhealthy")
    assert ledger.free_units(0).tolist() == [1000, 0]
    ok(ledger, asg("p", "n", ts("n", 0, 300)))
    assert ledger.free_units(0).tolist() == [700, 0]


# ----- atomicity ----------------------------------------------------------------------------------------------
def test_multi_gpu_assignment_where_a_later_share_fails_changes_nothing() -> None:
    ledger = Ledger([mk_node("n", "H100-80GB", "H100-80GB", "H100-80GB", "T4")])
    ok(ledger, asg("blocker", "n", excl("n", 2, "H100-80GB")))
    ok(ledger, asg("ts", "n", ts("n", 1, 900)))
    # GPU 0 exclusive, GPU 1 over-full, GPU 2 taken
    conflict(ledger, asg("p", "n", excl("n", 0, "H100-80GB"), ts("n", 1, 101)))
    conflict(ledger, asg("p", "n", excl("n", 0, "H100-80GB"), excl("n", 2, "H100-80GB")))
    # a MIG instance created for the first share is destroyed again
    conflict(ledger, asg("p", "n", mig("n", 0, "3g.40gb", 4), mig("n", 0, "1g.10gb", 6), ts("n", 2, 1)))
    assert ledger.instances == {}
    assert ledger.mode[0, 0] == GpuMode.FREE
    conflict(ledger, asg("p", "n", mps("n", 0, 500), mps("n", 3, 500), mps("n", 1, 500)))
    # CPU is checked too, and the shares before it are not applied
    conflict(ledger, asg("p", "n", ts("n", 0, 10), cpu=CPU + 1))
    ok(ledger, asg("p", "n", mig("n", 0, "3g.40gb", 4), mig("n", 0, "1g.10gb", 0), ts("n", 1, 100), mps("n", 3, 1)))
    assert ledger.version.tolist() == [3]


def test_failed_place_inside_existing_instance_keeps_it() -> None:
    ledger = Ledger([mk_node("n", "H100-80GB", "T4")])
    ok(ledger, asg("a", "n", mig("n", 0, "3g.40gb", 0, Mechanism.MPS, 500, 10 * GIB)))
    conflict(ledger, asg("b", "n", mig("n", 0, "3g.40gb", 0, Mechanism.MPS, 400, 10 * GIB), excl("n", 1, "H100-80GB")))
    assert ledger.instances_on(0, 0)[0].clients == 1


# ----- MIG ----------------------------------------------------------------------------------------------------
def test_mig_exclusive_instance_and_gpu_free(h100: Ledger) -> None:
    fresh = h100.state()
    ok(h100, asg("p", "n", mig("n", 0, "3g.40gb", 4)))
    assert h100.mode[0, 0] == GpuMode.MIG
    inst = h100.instances_on(0, 0)[4]
    assert inst.profile.name == "3g.40gb"
    assert inst.inner is Mechanism.EXCLUSIVE
    assert inst.clients == 1 and inst.free_milli == 0 and inst.free_mem == 0
    assert not inst.persistent
    # what no instance covers: 4 of 7 slices, 4 of 8 memory slots
    assert h100.free_milli[0, 0] == 4 * 1000 // 7
    assert h100.free_mem[0, 0] == 40 * GIB
    assert h100.allocated_gpu_milli == 3 * 1000 // 7
    conflict(h100, asg("q", "n", mig("n", 0, "3g.40gb", 4)), "used as exclusive")
    conflict(h100, asg("q", "n", mig("n", 0, "3g.40gb", 4, Mechanism.MPS, 10, 0)), "used as exclusive")
    conflict(h100, asg("q", "n", ts("n", 0, 1)), "in use as mig")
    release(h100, "p")
    assert h100.instances_on(0, 0) == {}
    assert h100.state() == fresh


@pytest.mark.parametrize(("compute", "memory"), [(999, 40 * GIB), (1000, 40 * GIB - 1), (1000, 0)])
def test_exclusive_mig_share_takes_its_whole_instance(h100: Ledger, compute: int, memory: int) -> None:
    conflict(h100, asg("p", "n", mig("n", 0, "3g.40gb", 0, Mechanism.EXCLUSIVE, compute, memory)), "whole instance")


def test_mps_inside_a_mig_instance(h100: Ledger) -> None:
    ok(h100, asg("a", "n", mig("n", 0, "3g.40gb", 0, Mechanism.MPS, 600, 30 * GIB)))
    ok(h100, asg("b", "n", mig("n", 0, "3g.40gb", 0, Mechanism.MPS, 400, 10 * GIB - MPS_DAEMON_MEMORY_MIB)))
    inst = h100.instances_on(0, 0)[0]
    assert (inst.clients, inst.free_milli, inst.free_mem, inst.inner) == (2, 0, 0, Mechanism.MPS)
    assert len(h100.instances_on(0, 0)) == 1  # one instance, two clients
    conflict(h100, asg("c", "n", mig("n", 0, "3g.40gb", 0, Mechanism.MPS, 1, 0)), "0 milli")
    conflict(h100, asg("c", "n", mig("n", 0, "3g.40gb", 0, Mechanism.TIME_SLICING, 1, 0)), "used as mps")
    release(h100, "a")
    conflict(h100, asg("c", "n", mig("n", 0, "3g.40gb", 0, Mechanism.MPS, 600, 30 * GIB + 1)))
    ok(h100, asg("c", "n", mig("n", 0, "3g.40gb", 0, Mechanism.MPS, 600, 30 * GIB)))
    release(h100, "b")
    release(h100, "c")
    assert h100.instances == {}


def test_mps_client_limit_inside_a_mig_instance(h100: Ledger) -> None:
    for k in range(48):
        ok(h100, asg(f"p{k}", "n", mig("n", 0, "7g.80gb", 0, Mechanism.MPS, 20, 0)))
    conflict(h100, asg("p48", "n", mig("n", 0, "7g.80gb", 0, Mechanism.MPS, 1, 0)), "48 MPS clients")


def test_time_slicing_inside_a_mig_instance_is_bounded_by_the_instance(h100: Ledger) -> None:
    ok(h100, asg("a", "n", mig("n", 1, "1g.10gb", 3, Mechanism.TIME_SLICING, 500, 10 * GIB)))
    conflict(h100, asg("b", "n", mig("n", 1, "1g.10gb", 3, Mechanism.TIME_SLICING, 500, 1)))
    ok(h100, asg("b", "n", mig("n", 1, "1g.10gb", 3, Mechanism.TIME_SLICING, 500, 0)))
    conflict(h100, asg("c", "n", mig("n", 1, "1g.10gb", 3, Mechanism.TIME_SLICING, 1, 0)))
    conflict(h100, asg("c", "n", mig("n", 1, "1g.20gb", 2, Mechanism.TIME_SLICING, 1, 0)), "overlaps")


@pytest.mark.parametrize(
    ("profile", "start"),
    [("3g.40gb", 2), ("3g.40gb", 1), ("2g.20gb", 6), ("1g.20gb", 1), ("4g.40gb", 4), ("7g.80gb", 1), ("1g.10gb", 7)],
)
def test_mig_instances_only_at_valid_starts(h100: Ledger, profile: str, start: int) -> None:
    msg = conflict(h100, asg("p", "n", mig("n", 0, profile, start)), "valid starts")
    assert f"slot {start}" in msg


def test_mig_profile_must_exist_on_the_model() -> None:
    ledger = Ledger([mk_node("n", "H100-80GB", "T4", "A100-40GB")])
    conflict(ledger, asg("p", "n", mig("n", 0, "1g.5gb", 0, model="A100-40GB")), "'1g.5gb' does not exist on H100")
    conflict(ledger, asg("p", "n", mig("n", 1, "1g.10gb", 0)), "T4")
    conflict(
        ledger, asg("p", "n", mig("n", 2, "1g.20gb", 0, Mechanism.MPS, 1, 0)), "'1g.20gb' does not exist on A100-40GB"
    )
    ok(ledger, asg("p", "n", mig("n", 2, "1g.5gb", 6, model="A100-40GB")))


def test_mig_instances_never_overlap(h100: Ledger) -> None:
    ok(h100, asg("a", "n", mig("n", 0, "3g.40gb", 0)))
    for profile, start in [
        ("1g.10gb", 0),
        ("1g.10gb", 3),
        ("1g.20gb", 2),
        ("2g.20gb", 2),
        ("4g.40gb", 0),
        ("7g.80gb", 0),
    ]:
        conflict(h100, asg("b", "n", mig("n", 0, profile, start)))
    conflict(h100, asg("b", "n", mig("n", 0, "1g.10gb", 0)), "is 3g.40gb")  # same start, other profile
    ok(h100, asg("b", "n", mig("n", 0, "2g.20gb", 4)))
    ok(h100, asg("c", "n", mig("n", 0, "1g.10gb", 6)))
    assert int(h100.mig_slots_used[0, 0]) == 0b0111_1111
    assert h100.free_milli[0, 0] == 1000 // 7
    assert h100.free_mem[0, 0] == 10 * GIB
    conflict(h100, asg("d", "n", mig("n", 0, "1g.20gb", 6)))


def test_a_full_gpu_of_seven_1g_instances(h100: Ledger) -> None:
    for s in range(7):
        ok(h100, asg(f"p{s}", "n", mig("n", 0, "1g.10gb", s)))
    assert int(h100.mig_slices_used[0, 0]) == 7
    assert h100.free_milli[0, 0] == 0
    assert h100.free_mem[0, 0] == 10 * GIB  # slot 7 is memory no 1g instance can start on
    assert h100.allocated_gpu_milli == 7 * (1000 // 7)
    for profile, start in [("1g.10gb", 6), ("1g.20gb", 6), ("7g.80gb", 0)]:
        conflict(h100, asg("x", "n", mig("n", 0, profile, start)))


@pytest.mark.parametrize(
    "layout",
    [
        [("4g.40gb", 0), ("3g.40gb", 4)],
        [("2g.20gb", 0), ("2g.20gb", 2), ("3g.40gb", 4)],
        [("3g.40gb", 0), ("2g.20gb", 4), ("1g.10gb", 6)],
        [("1g.20gb", 0), ("1g.20gb", 2), ("1g.20gb", 4), ("1g.20gb", 6)],
        [("7g.80gb", 0)],
    ],
)
def test_valid_full_layouts_take_at_most_seven_slices(h100: Ledger, layout: list[tuple[str, int]]) -> None:
    for k, (p, s) in enumerate(layout):
        ok(h100, asg(f"p{k}", "n", mig("n", 0, p, s)))
    slices = sum(DEFAULT_CATALOG.get("H100-80GB").profile(p).compute_slices for p, _ in layout)
    assert slices <= 7
    assert int(h100.mig_slices_used[0, 0]) == slices
    assert h100.free_milli[0, 0] == (7 - slices) * 1000 // 7
    # nothing more fits anywhere on the GPU
    for p in DEFAULT_CATALOG.get("H100-80GB").mig_profiles:
        for s in p.starts:
            if s not in dict((b, a) for a, b in layout):
                conflict(h100, asg("x", "n", mig("n", 0, p.name, s)))


def test_design_insufficient_resources_example(h100: Ledger) -> None:
    """DESIGN §4: 1g and 2g instances placed first at the driver's choice can leave no aligned room for a 3g."""
    ok(h100, asg("small", "n", mig("n", 0, "1g.10gb", 5)))
    ok(h100, asg("medium", "n", mig("n", 0, "2g.20gb", 2)))
    # 5 of 8 memory slots and 4 of 7 compute slices are free, yet neither 3g start is
    assert (8 - int(h100.mig_slots_used[0, 0]).bit_count(), 7 - int(h100.mig_slices_used[0, 0])) == (5, 4)
    conflict(h100, asg("big", "n", mig("n", 0, "3g.40gb", 0)), "overlaps")
    conflict(h100, asg("big", "n", mig("n", 0, "3g.40gb", 4)), "overlaps")
    for s in (1, 3):
        conflict(h100, asg("big", "n", mig("n", 0, "3g.40gb", s)), "valid starts")
    # at explicit placements the same three instances fit together
    ok(h100, asg("small2", "n", mig("n", 1, "1g.10gb", 6)))
    ok(h100, asg("medium2", "n", mig("n", 1, "2g.20gb", 4)))
    ok(h100, asg("big2", "n", mig("n", 1, "3g.40gb", 0)))
    assert int(h100.mig_slices_used[0, 1]) == 6


def test_a30_geometry() -> None:
    ledger = Ledger([mk_node("n", "A30-24GB", "A30-24GB")])
    for s in range(4):
        ok(ledger, asg(f"p{s}", "n", mig("n", 0, "1g.6gb", s, model="A30-24GB")))
    assert ledger.free_milli[0, 0] == 0 and ledger.free_mem[0, 0] == 0
    conflict(ledger, asg("x", "n", mig("n", 1, "2g.12gb", 1, model="A30-24GB")), "valid starts")
    conflict(ledger, asg("x", "n", mig("n", 1, "1g.6gb", 4, model="A30-24GB")), "valid starts")
    ok(ledger, asg("a", "n", mig("n", 1, "2g.12gb", 2, model="A30-24GB")))
    assert ledger.free_milli[0, 1] == 500 and ledger.free_mem[0, 1] == 12 * GIB
    conflict(ledger, asg("x", "n", mig("n", 1, "4g.24gb", 0, model="A30-24GB")), "overlaps")
    ok(ledger, asg("b", "n", mig("n", 1, "1g.6gb", 1, model="A30-24GB")))
    ok(ledger, asg("c", "n", mig("n", 1, "1g.6gb", 0, model="A30-24GB")))


# ----- persistent (static) MIG instances -------------------------------------------------------------------------
def test_persistent_instances_survive_release() -> None:
    spec = mk_node("n", "H100-80GB", "H100-80GB", mig={0: [("3g.40gb", 0), ("3g.40gb", 4)]})
    ledger = Ledger([spec])
    ledger.check_invariants()
    fresh = ledger.state()
    insts = ledger.instances_on(0, 0)
    assert sorted(insts) == [0, 4]
    assert all(i.persistent and i.clients == 0 and i.inner is None for i in insts.values())
    assert ledger.mode[0, 0] == GpuMode.MIG
    assert ledger.free_milli[0, 0] == 1000 // 7 and ledger.free_mem[0, 0] == 0
    # a non-MIG share or another layout does not fit on the GPU, even while it is empty
    conflict(ledger, asg("x", "n", ts("n", 0, 1)), "in use as mig")
    conflict(ledger, asg("x", "n", mig("n", 0, "7g.80gb", 0)))
    conflict(ledger, asg("x", "n", mig("n", 0, "1g.10gb", 0)), "is 3g.40gb")
    ok(ledger, asg("a", "n", mig("n", 0, "3g.40gb", 4, Mechanism.MPS, 500, GIB)))
    ok(ledger, asg("b", "n", mig("n", 0, "3g.40gb", 0)))
    release(ledger, "a")
    release(ledger, "b")
    assert sorted(ledger.instances_on(0, 0)) == [0, 4]
    assert ledger.state() == fresh
    # inner mechanism is free to change once the instance is empty again
    ok(ledger, asg("c", "n", mig("n", 0, "3g.40gb", 4, Mechanism.TIME_SLICING, 500, GIB)))


def test_invalid_persistent_layouts_are_refused() -> None:
    with pytest.raises(LedgerConflict, match="overlaps"):
        Ledger([mk_node("n", "H100-80GB", mig={0: [("3g.40gb", 0), ("1g.10gb", 2)]})])
    with pytest.raises(LedgerConflict, match="valid starts"):
        Ledger([mk_node("n", "H100-80GB", mig={0: [("3g.40gb", 2)]})])
    with pytest.raises(LedgerConflict):
        Ledger([mk_node("n", "T4", mig={0: [("1g.10gb", 0)]})])


# ----- invariants, reads and replay ---------------------------------------------------------------------------
def _busy_ledger() -> tuple[list[NodeSpec], Ledger]:
    nodes = [
        mk_node("a", "H100-80GB", "H100-80GB", mig={1: [("4g.40gb", 0)]}),
        mk_node("b", "T4", "T4", "P100"),
        mk_node("c", "A30-24GB", "G2"),
    ]
    ledger = Ledger(nodes)
    for a in [
        asg("p1", "a", excl("a", 0, "H100-80GB"), cpu=1000),
        asg("p2", "a", mig("a", 1, "4g.40gb", 0, Mechanism.MPS, 300, GIB), mig("a", 1, "2g.20gb", 4), mem=GIB),
        asg("p3", "a", mig("a", 1, "4g.40gb", 0, Mechanism.MPS, 300, GIB)),
        asg("p4", "b", mps("b", 0, 250, 4 * GIB), ts("b", 2, 500, GIB)),
        asg("p5", "b", mps("b", 0, 250, 4 * GIB), mps("b", 1, 1000, 16 * GIB - MPS_DAEMON_MEMORY_MIB)),
        asg("p6", "c", mig("c", 0, "2g.12gb", 2, model="A30-24GB"), ts("c", 1, 999)),
        asg("p7", "c", cpu=5),
    ]:
        ok(ledger, a)
    return nodes, ledger


def test_replay_gives_an_equal_state_in_any_order() -> None:
    nodes, ledger = _busy_ledger()
    assert replay(nodes, ledger.assignments.values()).state() == ledger.state()
    assigned = list(ledger.assignments.values())
    rng = random.Random(7)
    for _ in range(5):
        rng.shuffle(assigned)
        again = replay(list(reversed(nodes)), assigned)
        again.check_invariants()
        assert again.state() == ledger.state()
    # from the annotations' JSON alone
    texts = [a.to_json() for a in ledger.assignments.values()]
    assert replay(nodes, [Assignment.from_json(t) for t in texts]).state() == ledger.state()


def test_release_everything_gives_the_fresh_state() -> None:
    nodes, ledger = _busy_ledger()
    assert ledger.state() != Ledger(nodes).state()
    for pod in sorted(ledger.assignments, reverse=True):
        release(ledger, pod)
    assert ledger.state() == Ledger(nodes).state()
    assert len(ledger) == 0


def test_reads() -> None:
    _, ledger = _busy_ledger()
    assert len(ledger) == 7
    assert "p1" in ledger and "nobody" not in ledger
    assert sorted(a.pod for a in ledger.pods_on("b")) == ["p4", "p5"]
    assert sorted(a.pod for a in ledger.pods_on("c")) == ["p6", "p7"]
    # 1000 + MPS 300+300 in 4g (4/7 each) + exclusive 2g (2/7) + 250+250 + 1000 + 500 + 2g of A30 (2/4) + 999
    expected = 1000 + 2 * (300 * 4 // 7) + 2000 // 7 + 250 + 250 + 1000 + 500 + 500 + 999
    assert ledger.allocated_gpu_milli == expected
    assert ledger.total_gpu_milli == 7000
    assert ledger.version.tolist() == [3, 2, 2]
    release(ledger, "p7")
    assert ledger.version.tolist() == [3, 2, 3]


@pytest.mark.parametrize(
    "tamper",
    [
        lambda lg: lg.free_milli.__setitem__((1, 0), lg.free_milli[1, 0] - 1),
        lambda lg: lg.free_mem.__setitem__((1, 2), 0),
        lambda lg: lg.cpu_free.__setitem__(0, lg.cpu_free[0] + 1),
        lambda lg: lg.mem_free.__setitem__(2, 0),
        lambda lg: lg.mig_slots_used.__setitem__((0, 1), 0),
        lambda lg: lg.mig_slices_used.__setitem__((0, 1), 7),
        lambda lg: setattr(lg.instances_on(0, 1)[0], "free_milli", 1000),
        lambda lg: setattr(lg.instances_on(0, 1)[0], "clients", 1),
        lambda lg: lg.assignments.__setitem__("ghost", asg("ghost", "b", ts("b", 2, 600))),
        lambda lg: lg.assignments.__setitem__("ghost", asg("ghost", "b", mps("b", 2, 1))),
        lambda lg: lg.assignments.pop("p3"),
        # The daemons of an MPS unit are its clients' tenants: another count, tenant or index is corruption.
        lambda lg: lg.daemons.__setitem__((1, 0), 2),
        lambda lg: lg.unit_tenants.__setitem__((1, 0), {"ns/uid-7": 1}),
        lambda lg: lg.tenant_units.__setitem__("ns/uid-7", {(1, 0, None)}),
        lambda lg: lg.full_units.add((1, 0, None)),
        lambda lg: lg.assignments.__setitem__("p3", replace(lg.assignments["p3"], tenant="ns/uid-1000")),
    ],
)
def test_check_invariants_notices_a_corrupt_state(tamper: Any) -> None:
    _, ledger = _busy_ledger()
    tamper(ledger)
    with pytest.raises(InvariantViolation):
        ledger.check_invariants()


def test_existing_assignment_on_a_gpu_that_turned_unhealthy_is_still_accounted() -> None:
    """A running pod keeps all its GPUs in the books when one turns unhealthy; new shares still avoid it."""
    from sharegpu.ledger import replay
    from sharegpu.model.inventory import GpuDevice

    gpus = (GpuDevice(0, "GPU-a-0", "T4", healthy=False), GpuDevice(1, "GPU-a-1", "T4"))
    nodes = [NodeSpec("a", 8000, 8192, gpus)]
    t4 = DEFAULT_CATALOG.get("T4").memory_mib
    running = Assignment(
        "ns/big",
        "a",
        (
            GpuShare(0, "GPU-a-0", Mechanism.EXCLUSIVE, 1000, t4),
            GpuShare(1, "GPU-a-1", Mechanism.EXCLUSIVE, 1000, t4),
        ),
    )
    ledger = replay(nodes, [running])
    assert "ns/big" in ledger and int(ledger.free_milli[0, 1]) == 0
    ledger.check_invariants()
    with pytest.raises(LedgerConflict, match="unhealthy"):
        Ledger(nodes).place(running)


# ----- MPS daemons per tenant ------------------------------------------------------------------------------------
A, B, C = "ns/uid-1000", "ns/uid-0", "pod/anon"


def test_an_mps_gpu_takes_shares_of_any_tenant_a_daemon_each_with_its_server_memory() -> None:
    ledger = Ledger([mk_node("n", "H100-80GB")])
    total = mem_of("H100-80GB")
    ok(ledger, asg("a", "n", mps("n", 0, 300, 10 * GIB), tenant=A))
    ok(ledger, asg("b", "n", mps("n", 0, 300, 10 * GIB), tenant=A))  # joins A's daemon: no second server
    assert int(ledger.daemons[0, 0]) == 1 and int(ledger.free_mem[0, 0]) == total - 20 * GIB - MPS_DAEMON_MEMORY_MIB
    ok(ledger, asg("root", "n", mps("n", 0, 100, GIB), tenant=B))
    ok(ledger, asg("anon", "n", mps("n", 0, 100, GIB), tenant=C))
    assert int(ledger.daemons[0, 0]) == 3
    assert int(ledger.free_mem[0, 0]) == total - 22 * GIB - 3 * MPS_DAEMON_MEMORY_MIB
    assert ledger.unit_tenants[(0, 0, None)] == {A: 2, B: 1, C: 1}
    for pod in ("a", "root", "anon"):
        ledger.release(pod)
        ledger.check_invariants()
    assert int(ledger.daemons[0, 0]) == 1 and ledger.units_of(A) == {(0, 0, None)} and not ledger.units_of(C)
    ledger.release("b")
    assert int(ledger.free_mem[0, 0]) == total and not ledger.unit_tenants and not ledger.tenant_units


def test_the_daemon_cap_closes_a_unit_to_new_tenants_only() -> None:
    ledger = Ledger([mk_node("n", "H100-80GB")], tenancy=MpsTenancy(daemons_per_unit=2))
    ok(ledger, asg("a", "n", mps("n", 0, 100, GIB), tenant=A))
    ok(ledger, asg("b", "n", mps("n", 0, 100, GIB), tenant=B))
    assert ledger.full_units == {(0, 0, None)}
    conflict(ledger, asg("c", "n", mps("n", 0, 100, GIB), tenant=C), "already runs 2 MPS daemons")
    ok(ledger, asg("a2", "n", mps("n", 0, 100, GIB), tenant=A))  # its tenant's daemon is there
    ledger.release("b")
    assert not ledger.full_units
    ok(ledger, asg("c", "n", mps("n", 0, 100, GIB), tenant=C))


def test_a_daemon_takes_its_server_memory_so_a_share_that_fills_the_gpu_fits_its_tenant_only() -> None:
    ledger = Ledger([mk_node("n", "H100-80GB")])
    total = mem_of("H100-80GB")
    ok(ledger, asg("a", "n", mps("n", 0, 100, GIB), tenant=A))
    rest = total - GIB - MPS_DAEMON_MEMORY_MIB
    conflict(ledger, asg("b", "n", mps("n", 0, 100, rest), tenant=B), "for its MPS daemon")
    ok(ledger, asg("a2", "n", mps("n", 0, 100, rest), tenant=A))


def test_an_mps_mig_instance_runs_a_daemon_per_tenant_under_the_cap() -> None:
    ledger = Ledger([mk_node("n", "H100-80GB")], tenancy=MpsTenancy(daemons_per_unit=2))
    ok(ledger, asg("a", "n", mig("n", 0, "3g.40gb", 0, Mechanism.MPS, 300, GIB), tenant=A))
    ok(ledger, asg("b", "n", mig("n", 0, "3g.40gb", 0, Mechanism.MPS, 300, GIB), tenant=B))
    conflict(ledger, asg("c", "n", mig("n", 0, "3g.40gb", 0, Mechanism.MPS, 300, GIB), tenant=C), "2 MPS daemons")
    inst = ledger.instances_on(0, 0)[0]
    assert inst.free_mem == inst.profile.memory_mib - 2 * GIB - 2 * MPS_DAEMON_MEMORY_MIB
    ok(ledger, asg("c", "n", mig("n", 0, "3g.40gb", 4, Mechanism.MPS, 300, GIB), tenant=C))  # its own instance
    for pod in ("a", "b", "c"):
        ledger.release(pod)
        ledger.check_invariants()
    assert not ledger.instances and not ledger.unit_tenants


def test_time_slicing_runs_no_daemon() -> None:
    ledger = Ledger([mk_node("n", "H100-80GB")], tenancy=MpsTenancy(daemons_per_unit=1))
    ok(ledger, asg("a", "n", ts("n", 0, 300, GIB), tenant=A))
    ok(ledger, asg("b", "n", ts("n", 0, 300, GIB), tenant=C))
    assert int(ledger.daemons[0, 0]) == 0 and not ledger.unit_tenants


def test_a_multi_user_node_runs_one_daemon_per_unit_for_every_tenant() -> None:
    node = replace(mk_node("n", "H100-80GB"), mps_multi_user=True)
    ledger = Ledger([node], tenancy=MpsTenancy(daemons_per_unit=1))
    ok(ledger, asg("a", "n", mps("n", 0, 100, GIB), tenant=A))
    ok(ledger, asg("b", "n", mps("n", 0, 100, GIB), tenant=B))
    ok(ledger, asg("c", "n", mps("n", 0, 100, GIB), tenant=C))
    assert int(ledger.daemons[0, 0]) == 1
    assert int(ledger.free_mem[0, 0]) == mem_of("H100-80GB") - 3 * GIB - MPS_DAEMON_MEMORY_MIB


@pytest.mark.parametrize("in_mig", [False, True], ids=["gpu", "mig-instance"])
def test_running_clients_above_the_cap_are_recorded_and_the_unit_open_to_their_tenants_only(in_mig: bool) -> None:
    # Placed under a larger cap (an extender restarted with a smaller one): they exist, so they are accounted for,
    # on a whole GPU as in a MIG instance (issue 33: a mixed record kept only its first tenant there, unseen).
    def share(compute: int, memory: int) -> GpuShare:
        return mig("n", 0, "7g.80gb", 0, Mechanism.MPS, compute, memory) if in_mig else mps("n", 0, compute, memory)

    ledger = Ledger([mk_node("n", "H100-80GB")], tenancy=MpsTenancy(daemons_per_unit=1))
    ledger.place(asg("old-a", "n", share(300, 10 * GIB), tenant=A), check_health=False)
    ledger.place(asg("old-b", "n", share(200, 20 * GIB), tenant=B), check_health=False)
    ledger.check_invariants()
    unit = (0, 0, 0 if in_mig else None)
    assert ledger.unit_tenants[unit] == {A: 1, B: 1} and unit in ledger.full_units
    conflict(ledger, asg("new", "n", share(100, GIB), tenant=C), "already runs 1 MPS daemons")
    ok(ledger, asg("new", "n", share(100, GIB), tenant=B))
    ledger.release("old-a")
    ledger.release("old-b")
    ledger.release("new")
    ledger.check_invariants()
    ok(ledger, asg("new", "n", share(100, GIB), tenant=C))


def test_an_assignment_from_before_tenants_is_read_as_its_pods_tenant() -> None:
    a = asg("ns/p", "n", mps("n", 0, 100, GIB))
    raw = a.to_dict()
    assert raw.pop("tenant") == ""  # any tenant, said
    assert Assignment.from_dict(raw | {"tenant": ""}).tenant is None
    assert Assignment.from_dict(raw | {"user": 1000}).tenant == "ns/uid-1000"
    assert Assignment.from_dict(raw).tenant == "pod/ns/p"  # it declared no user: its pod alone
    whole = asg("ns/w", "n", excl("n", 0, "H100-80GB"))
    assert Assignment.from_dict(whole.to_dict() | {"user": 5}).tenant is None
    assert Assignment.from_dict(asg("ns/p", "n", mps("n", 0, 100, GIB), tenant=A).to_dict()).tenant == A
