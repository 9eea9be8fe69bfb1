"""A GPU an administrator put in MIG mode takes only MIG shares: the ledger, placement, inventory and publisher."""

from __future__ import annotations

import dataclasses

import pytest

from sharegpu.ledger import GpuMode, Ledger, LedgerConflict
from sharegpu.model.assignment import Assignment, GpuShare, Mechanism, MigSlot
from sharegpu.model.catalog import GIB
from sharegpu.model.inventory import GpuDevice, InvalidInventory, NodeSpec
from sharegpu.model.request import GpuRequest, Isolation, Sharing
from sharegpu.placement.fragmentation import Workload
from sharegpu.placement.framework import NoFit, Scheduler
from sharegpu.placement.policies import PolicyContext, make_policy


def pinned_node(pinned: tuple[int, ...] = (0,)) -> NodeSpec:
    gpus = tuple(
        GpuDevice(i, f"GPU-a-{i}", "A100-80GB", mig_enabled=i in pinned, mig_pinned=i in pinned) for i in range(2)
    )
    return NodeSpec("a", 64_000, 256 * GIB, gpus)


def test_a_pinned_gpu_refuses_non_mig_shares_and_stays_in_mig_mode_when_empty() -> None:
    led = Ledger([pinned_node()])
    assert GpuMode(int(led.mode[0, 0])) is GpuMode.MIG and GpuMode(int(led.mode[0, 1])) is GpuMode.FREE
    led.check_invariants()
    for mech in (Mechanism.TIME_SLICING, Mechanism.MPS):
        share = GpuShare(0, "GPU-a-0", mech, 200, 4 * GIB)
        with pytest.raises(LedgerConflict, match="administrator"):
            led.place(Assignment("ns/p", "a", (share,)))
    mig = GpuShare(0, "GPU-a-0", Mechanism.MIG, 1000, 10 * GIB, MigSlot("1g.10gb", 0), Mechanism.EXCLUSIVE)
    led.place(Assignment("ns/m", "a", (mig,)))
    led.check_invariants()
    led.release("ns/m")
    assert GpuMode(int(led.mode[0, 0])) is GpuMode.MIG  # not FREE: the GPU is still in MIG mode
    led.check_invariants()


@pytest.mark.parametrize(
    "req",
    [
        GpuRequest("whole", 1),
        GpuRequest("ts", 1, compute_milli=300, memory_mib=8 * GIB, sharing=Sharing.TIME_SLICING),
    ],
)
def test_placement_puts_non_mig_shares_only_on_gpus_that_are_not_pinned(req: GpuRequest) -> None:
    wl = Workload.from_requests([req])
    s = Scheduler(Ledger([pinned_node()]), make_policy("bestfit", PolicyContext(wl)))
    for i in range(1 if req.name == "whole" else 3):
        d = s.place(dataclasses.replace(req, name=f"{req.name}-{i}"))
        assert {sh.gpu_index for sh in d.assignment.shares} == {1}
    s.ledger.check_invariants()
    if req.name == "whole":
        with pytest.raises(NoFit):
            s.place(dataclasses.replace(req, name="whole-2"))


def test_a_mig_request_still_goes_to_a_pinned_gpu() -> None:
    wl = Workload.from_requests([GpuRequest("m", 1, memory_mib=10 * GIB, isolation=Isolation.HARDWARE)])
    s = Scheduler(Ledger([pinned_node(pinned=(0, 1))]), make_policy("bestfit", PolicyContext(wl)))
    d = s.place(GpuRequest("m", 1, memory_mib=10 * GIB, isolation=Isolation.HARDWARE))
    assert d.assignment.shares[0].mechanism is Mechanism.MIG


def test_the_inventory_carries_the_pin_and_refuses_a_pin_without_mig_mode() -> None:
    spec = pinned_node()
    assert NodeSpec.from_json(spec.to_json()) == spec
    bad = spec.to_json().replace('"migEnabled":true', '"migEnabled":false', 1)
    with pytest.raises(InvalidInventory, match="migPinned needs migEnabled"):
        NodeSpec.from_json(bad)


def test_a_mig_request_prefers_the_pinned_gpu_so_free_gpus_stay_open_for_other_shares() -> None:
    """As on the rig: two free H100s and one an administrator put in MIG mode. The MIG pod goes to the pinned GPU, so
    an MPS share and a time-sliced share still find free GPUs afterwards."""
    gpus = tuple(GpuDevice(i, f"GPU-a-{i}", "H100-80GB", mig_enabled=i == 2, mig_pinned=i == 2) for i in range(3))
    reqs = [
        GpuRequest("mig", 1, memory_mib=10 * GIB, isolation=Isolation.HARDWARE),
        GpuRequest("ts", 1, compute_milli=100, memory_mib=4 * GIB, sharing=Sharing.TIME_SLICING),
        GpuRequest("mps", 1, compute_milli=300, memory_mib=10 * GIB, isolation=Isolation.MEMORY),
    ]
    for policy in ("bestfit", "fgd", "sharegpu"):
        s = Scheduler(
            Ledger([NodeSpec("a", 64_000, 256 * GIB, gpus)]),
            make_policy(policy, PolicyContext(Workload.from_requests(reqs))),
        )
        placed = {r.name: s.place(r).assignment.shares[0] for r in reqs}
        assert placed["mig"].gpu_index == 2, policy
        assert placed["ts"].gpu_index in (0, 1), policy
        # The memory-isolated share may also go into an instance of the pinned GPU, as MIG shared through MPS.
        mps = placed["mps"]
        assert mps.gpu_index in (0, 1) or (mps.mechanism, mps.inner) == (Mechanism.MIG, Mechanism.MPS), policy
        s.ledger.check_invariants()


def test_mps_shares_go_into_mig_instances_of_a_pinned_gpu_when_the_other_gpus_are_full() -> None:
    # issue 28: isolation memory is "MPS, or MIG shared through MPS"; a GPU an administrator keeps in MIG mode takes
    # only MIG shares, and an MPS share inside an instance is one. The online bench's small MPS shares stopped at the
    # room of the non-MIG GPUs before.
    req = GpuRequest("s", 1, compute_milli=50, memory_mib=2 * GIB, isolation=Isolation.MEMORY, tenant="ns/uid-0")
    wl = Workload.from_requests([req])
    s = Scheduler(Ledger([pinned_node()]), make_policy("sharegpu", PolicyContext(wl)))
    s.place(GpuRequest("whole", 1))  # GPU 1, the only one not in MIG mode
    shares = [s.place(dataclasses.replace(req, name=f"s{i}")).assignment.shares[0] for i in range(6)]
    assert {(sh.gpu_index, sh.mechanism, sh.inner) for sh in shares} == {(0, Mechanism.MIG, Mechanism.MPS)}
    assert len({sh.mig for sh in shares}) < len(shares)  # they share instances through MPS
    other = s.place(dataclasses.replace(req, name="other-user", tenant="ns/uid-1000")).assignment.shares[0]
    assert other.gpu_index == 0 and other.inner is Mechanism.MPS  # another tenant: still into the pinned GPU
    s.ledger.check_invariants()
    for sh_ in shares:
        assert sh_.mig is not None and sh_.memory_mib == 2 * GIB
