"""A pod that Allocate refused, or that the kubelet rejected, must not take the next pod's Allocate."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest
from node_fakes import SIM_YAML, FakeKube, assignment, pod, share

from sharegpu.model.assignment import Mechanism
from sharegpu.node import allocation
from sharegpu.node.agent import AgentConfig, NodeAgent
from sharegpu.node.allocation import AllocationError
from sharegpu.node.backends.sim import SimBackend
from sharegpu.node.backends.sim_config import parse_sim_config
from sharegpu.node.kube import NodeInfo, pod_info_from_dict
from sharegpu.node.mps import SimMpsDaemon


def _agent(tmp_path: Path) -> tuple[NodeAgent, FakeKube, list[str]]:
    sim = SimBackend(parse_sim_config(SIM_YAML), seed="node-a")
    kube = FakeKube(NodeInfo("node-a", {}, {}, 32000, 256 * 1024))
    agent = NodeAgent(
        AgentConfig("node-a", tmp_path / "dp", tmp_path / "state", allocate_wait_s=0.2), sim, kube, SimMpsDaemon()
    )
    return agent, kube, [d.uuid for d in sim.devices()]


def test_a_refused_pod_does_not_poison_the_next_allocate(tmp_path: Path) -> None:
    async def main() -> None:
        agent, kube, g = _agent(tmp_path)
        # a: older, names a GPU this node lacks; b: younger, valid. a's Failed status has not reached the API.
        bad = share(0, "GPU-not-here", Mechanism.TIME_SLICING, 100)
        kube.add(pod("a", assignment("a", bad), created="2024-05-01T10:00:00+00:00"))
        kube.add(
            pod("b", assignment("b", share(0, g[0], Mechanism.TIME_SLICING, 100)), created="2024-05-01T10:00:01+00:00")
        )
        with pytest.raises(AllocationError, match="default/a"):
            await agent.allocator.allocate(1)
        grant = await agent.allocator.allocate(1)
        assert grant.pod == "default/b" and grant.envs == {"NVIDIA_VISIBLE_DEVICES": g[0]}

    asyncio.run(main())


def test_pods_the_kubelet_rejected_are_skipped(tmp_path: Path) -> None:
    async def main() -> None:
        agent, kube, g = _agent(tmp_path)
        a = kube.add(pod("a", assignment("a", share(0, g[0], Mechanism.TIME_SLICING, 100))))
        kube.pods[a.uid] = replace(a, reason="UnexpectedAdmissionError")
        kube.add(
            pod("b", assignment("b", share(1, g[1], Mechanism.TIME_SLICING, 100)), created="2024-05-01T10:00:01+00:00")
        )
        assert (await agent.allocator.allocate(1)).pod == "default/b"

    asyncio.run(main())


def test_status_reason_is_read_from_the_api() -> None:
    p = pod_info_from_dict({"metadata": {"name": "x"}, "status": {"phase": "Pending", "reason": "OutOfcpu"}})
    assert p.reason == "OutOfcpu"
    assert pod_info_from_dict({"metadata": {"name": "x"}, "status": {"phase": "Pending"}}).reason == ""


def test_refused_pods_are_remembered_bounded_and_for_a_while(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    agent, _, _ = _agent(tmp_path)
    alloc = agent.allocator
    monkeypatch.setattr(allocation, "REFUSED_MAX", 3)
    for i in range(5):
        alloc._refuse(f"uid-{i}")
    assert [alloc.refused(f"uid-{i}") for i in range(5)] == [False, False, True, True, True]
    monkeypatch.setattr(allocation, "REFUSED_TTL_S", -1.0)
    alloc._refuse("uid-old")
    assert not alloc.refused("uid-old")


def test_init_container_reuses_the_first_shares_and_app_containers_follow(tmp_path: Path) -> None:
    """As the kubelet does: an init container's devices go on to the app containers, so a pod with a 1-GPU init
    container and app containers of 1 and 1 GPUs holds 2 shares (not 3), and the init container gets share 0."""
    from sharegpu.node.kube import ContainerInfo

    async def main() -> None:
        agent, kube, g = _agent(tmp_path)
        a = assignment("p", share(0, g[0], Mechanism.TIME_SLICING, 100), share(1, g[1], Mechanism.TIME_SLICING, 100))
        p = replace(pod("p", a, gpus=(1, 1)), init_containers=(ContainerInfo("init", 1),))
        assert p.gpu_demand == 2
        kube.add(p)
        init = await agent.allocator.allocate(1)
        app0 = await agent.allocator.allocate(1)
        app1 = await agent.allocator.allocate(1)
        assert [x.container for x in (init, app0, app1)] == ["init", "c0", "c1"]
        assert init.envs["NVIDIA_VISIBLE_DEVICES"] == g[0]
        assert app0.envs["NVIDIA_VISIBLE_DEVICES"] == g[0]
        assert app1.envs["NVIDIA_VISIBLE_DEVICES"] == g[1]

    asyncio.run(main())
