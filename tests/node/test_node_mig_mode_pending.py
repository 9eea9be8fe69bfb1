"""A MIG-mode change that NVML stores but cannot activate: typed error, the pending request withdrawn or recorded;
and no whole-GPU grant on a GPU in MIG mode."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from node_fakes import FakeKube, KubeletRecord, assignment, pod, share, start_container
from test_node_nvml_backend import FakeGpu, FakeNvml

from sharegpu.model.assignment import Mechanism, MigSlot
from sharegpu.node.allocation import AllocationError, Allocator
from sharegpu.node.backends.base import InstanceInUse, MigModeInUse, MigModePending, ResetRequired
from sharegpu.node.backends.nvml import NvmlBackend
from sharegpu.node.backends.nvml_api import NvmlCallError
from sharegpu.node.backends.sim import SimBackend
from sharegpu.node.backends.sim_config import parse_sim_config
from sharegpu.node.cdi import CdiWriter
from sharegpu.node.mig import MigError, MigManager
from sharegpu.node.mps import MpsManager, SimMpsDaemon
from sharegpu.node.state import AgentState


class PendingNvml(FakeNvml):
    """NVML stores the request, activation fails; ``sticky`` plays a request that cannot be withdrawn."""

    def __init__(self, *gpus: FakeGpu, error: str | None = None, sticky: bool = False) -> None:
        super().__init__(*gpus)
        self.error, self.sticky = error, sticky
        self.pending: dict[int, bool] = {}

    def set_mig_mode(self, h: FakeGpu, enabled: bool) -> bool:
        i = self.gpus.index(h)
        if self.sticky and i in self.pending:
            raise NvmlCallError("other", "Unknown Error")
        self.pending[i] = enabled
        if self.error:
            raise NvmlCallError(self.error, "activation failed")
        return enabled == h.mig

    def mig_mode(self, h: FakeGpu) -> tuple[bool, bool]:
        return h.mig, self.pending.get(self.gpus.index(h), h.mig)


def test_reset_required_is_typed_and_the_pending_enable_is_withdrawn() -> None:
    api = PendingNvml(FakeGpu("NVIDIA H100 80GB HBM3"))
    with pytest.raises(ResetRequired, match="withdrawn") as e:
        NvmlBackend(api).set_mig_mode(0, True)
    assert not e.value.still_pending
    assert api.mig_mode(api.gpus[0]) == (False, False)


def test_in_use_is_typed_as_in_use() -> None:
    api = PendingNvml(FakeGpu("NVIDIA H100 80GB HBM3"), error="in_use")
    with pytest.raises(MigModeInUse) as e:
        NvmlBackend(api).set_mig_mode(0, True)
    assert isinstance(e.value, InstanceInUse) and isinstance(e.value, MigModePending)
    assert api.mig_mode(api.gpus[0]) == (False, False)


def test_a_pending_enable_that_cannot_be_withdrawn_is_recorded_as_sharegpus() -> None:
    api = PendingNvml(FakeGpu("NVIDIA H100 80GB HBM3"), sticky=True)
    state = AgentState()
    with pytest.raises(MigError, match="still pending"):
        MigManager(NvmlBackend(api), state).ensure(0, "GPU-0", MigSlot("3g.40gb", 0))
    assert api.mig_mode(api.gpus[0]) == (False, True)
    assert state.mig_mode_set == {"GPU-0"}  # after the reset, sharegpu may turn it off again for whole-GPU shares


def _run(
    tmp_path: Path,
    sock_dir: Path,
    yaml: str,
    body: Callable[[Allocator, SimBackend, FakeKube, AgentState, KubeletRecord], Awaitable[None]],
) -> None:
    async def main() -> None:
        sim = SimBackend(parse_sim_config(yaml), seed="node-a")
        kube, state = FakeKube(), AgentState()
        record = KubeletRecord(sock_dir / "pr" / "kubelet.sock", tmp_path / "dp")
        await record.start()
        alloc = Allocator(
            "node-a",
            sim,
            kube,
            MigManager(sim, state),
            MpsManager(tmp_path / "mps", SimMpsDaemon()),
            state,
            record.attributor(),
            CdiWriter(tmp_path / "cdi"),
            wait_s=0.2,
            poll_s=0.05,
        )
        try:
            await body(alloc, sim, kube, state, record)
        finally:
            await record.stop()

    asyncio.run(main())


def test_no_whole_gpu_grant_on_a_gpu_an_administrator_put_in_mig_mode(tmp_path: Path, sock_dir: Path) -> None:
    async def body(alloc: Allocator, sim: SimBackend, kube: FakeKube, _: AgentState, record: KubeletRecord) -> None:
        g = sim.devices()[0].uuid
        a = kube.add(pod("a", assignment("a", share(0, g, Mechanism.TIME_SLICING, 100))))
        with pytest.raises(AllocationError, match="is in MIG mode"):
            await start_container(alloc, record, a, "c0", ["t0"])
        assert sim.devices()[0].mig_enabled
        assert not alloc.cdi.allocation_names()  # no spec that would hand out every MIG instance

    _run(tmp_path, sock_dir, "gpus: [{model: A30-24GB, mig: true}]\n", body)


def test_a_gpu_sharegpu_put_in_mig_mode_is_taken_out_for_a_whole_gpu_grant(tmp_path: Path, sock_dir: Path) -> None:
    async def body(alloc: Allocator, sim: SimBackend, kube: FakeKube, state: AgentState, record: KubeletRecord) -> None:
        g = sim.devices()[0].uuid
        sim.set_mig_mode(0, True)
        state.set_mig_mode_by_us(g, True)
        a = kube.add(pod("a", assignment("a", share(0, g, Mechanism.EXCLUSIVE, 1000))))
        assert (await start_container(alloc, record, a, "c0", ["t0"])).units == (g,)
        assert not sim.devices()[0].mig_enabled and state.mig_mode_set == set()

    _run(tmp_path, sock_dir, "gpus: [{model: A30-24GB}]\n", body)
