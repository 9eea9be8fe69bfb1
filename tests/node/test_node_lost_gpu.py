"""A GPU that falls off the bus fails every NVML query: it turns unhealthy, the node's other GPUs keep working."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from node_fakes import FakeKube, agent_config, assignment, pod, record_for, share, start_container
from test_node_nvml_backend import FakeGpu, FakeNvml

from sharegpu.model.assignment import Mechanism
from sharegpu.node.agent import NodeAgent
from sharegpu.node.allocation import AllocationError
from sharegpu.node.backends.base import BackendError
from sharegpu.node.backends.nvml import NvmlBackend
from sharegpu.node.backends.nvml_api import NvmlCallError
from sharegpu.node.kube import NodeInfo
from sharegpu.node.mps import SimMpsDaemon


class LostNvml(FakeNvml):
    """``broken`` GPUs fail every query, the UUID too (NVML_ERROR_GPU_IS_LOST)."""

    uuid_lost = True

    def _check(self, h: FakeGpu, what: str) -> None:
        if h.broken:
            raise NvmlCallError("gpu_lost", f"{what}: GPU is lost")

    def memory(self, h: FakeGpu) -> tuple[int, int]:
        self._check(h, "nvmlDeviceGetMemoryInfo")
        return super().memory(h)

    def name(self, h: FakeGpu) -> str:
        self._check(h, "nvmlDeviceGetName")
        return super().name(h)

    def uuid(self, h: Any) -> str:
        if self.uuid_lost:
            self._check(h, "nvmlDeviceGetUUID")
        return super().uuid(h)

    def mig_mode(self, h: FakeGpu) -> tuple[bool, bool]:
        self._check(h, "nvmlDeviceGetMigMode")
        return super().mig_mode(h)


def test_a_lost_gpu_is_reported_unhealthy_under_its_last_uuid(tmp_path: Path, sock_dir: Path) -> None:
    async def main() -> None:
        api = LostNvml(FakeGpu("NVIDIA H100 80GB HBM3"), FakeGpu("NVIDIA H100 PCIe"))
        kube = FakeKube(NodeInfo("node-a", {}, {}, 32000, 256 * 1024))
        config = agent_config(tmp_path, sock_dir, allocate_wait_s=0.2, tokens_per_gpu=1)
        agent = NodeAgent(config, NvmlBackend(api), kube, SimMpsDaemon())
        record = record_for(config)
        await record.start()
        try:
            await agent.reconcile_once()
            api.gpus[1].broken = True
            await agent.reconcile_once()  # no exception: the node keeps being served
            assert [(t.id, t.healthy) for t in agent.plugin._tokens] == [("GPU-0::0", True), ("GPU-1::0", False)]
            a = kube.add(pod("a", assignment("a", share(0, "GPU-0", Mechanism.TIME_SLICING, 100))))
            grant = await start_container(agent, record, a, "c0", ["GPU-0::0"])
            assert grant.units == ("GPU-0",) and grant.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-0"
            b = kube.add(pod("b", assignment("b", share(1, "GPU-1", Mechanism.TIME_SLICING, 100))))
            with pytest.raises(AllocationError, match="unhealthy"):
                await start_container(agent, record, b, "c0", ["GPU-1::0"])
            api.gpus[1].broken = False
            assert [d.healthy for d in agent.backend.devices()] == [True, True]
        finally:
            await record.stop()

    asyncio.run(main())


def test_a_gpu_lost_before_it_was_ever_read() -> None:
    api = LostNvml(FakeGpu("NVIDIA H100 80GB HBM3"), FakeGpu("NVIDIA H100 PCIe", broken=True))
    devs = NvmlBackend(api).devices()
    assert [(d.uuid, d.healthy) for d in devs] == [("GPU-0", True)]  # no identity to report it under
    api.uuid_lost = False
    devs = NvmlBackend(api).devices()
    assert [(d.uuid, d.healthy) for d in devs] == [("GPU-0", True), ("GPU-1", False)]


def test_device_count_failing_reports_the_known_gpus_unhealthy() -> None:
    api = LostNvml(FakeGpu("NVIDIA H100 80GB HBM3"))
    backend = NvmlBackend(api)
    backend.devices()

    def fail() -> int:
        raise NvmlCallError("other", "driver gone")

    api.device_count = fail  # type: ignore[method-assign]
    assert [(d.uuid, d.healthy) for d in backend.devices()] == [("GPU-0", False)]
    with pytest.raises(BackendError, match="listing GPUs"):
        NvmlBackend(api).devices()
