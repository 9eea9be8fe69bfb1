"""A reconcile working from a pod list that predates an Allocate must not undo what that Allocate made."""

from __future__ import annotations

import asyncio
from pathlib import Path

from node_fakes import SIM_YAML, FakeKube, assignment, pod, share

from sharegpu.model.assignment import Mechanism, MigSlot
from sharegpu.node.agent import AgentConfig, NodeAgent
from sharegpu.node.backends.sim import SimBackend
from sharegpu.node.backends.sim_config import parse_sim_config
from sharegpu.node.kube import NodeInfo, PodInfo
from sharegpu.node.mps import SimMpsDaemon


class SlowKube(FakeKube):
    """An API server whose list answer reflects the moment it was served, then takes 200 ms to arrive."""

    slow = False

    async def pods_on_node(self, node: str) -> list[PodInfo]:
        snap = await super().pods_on_node(node)
        if self.slow:
            self.slow = False  # only the reconcile's list is slow
            await asyncio.sleep(0.2)
        return snap


def _agent(tmp_path: Path, kube: FakeKube, grace_s: float = 120.0) -> tuple[NodeAgent, SimBackend]:
    sim = SimBackend(parse_sim_config(SIM_YAML), seed="node-a")
    config = AgentConfig("node-a", tmp_path / "dp", tmp_path / "state", allocate_wait_s=2, grant_grace_s=grace_s)
    return NodeAgent(config, sim, kube, SimMpsDaemon()), sim


def test_reconcile_with_a_stale_pod_list_keeps_what_allocate_just_made(tmp_path: Path) -> None:
    async def main() -> None:
        kube = SlowKube(NodeInfo("node-a", {}, {}, 32000, 256 * 1024))
        agent, sim = _agent(tmp_path, kube)
        await agent.reconcile_once()
        g = [d.uuid for d in sim.devices()]
        kube.slow = True
        rec = asyncio.create_task(agent.reconcile_once())  # lists pods: none yet
        await asyncio.sleep(0.05)
        # The scheduler binds p (MPS inside a new 3g instance); the kubelet calls Allocate during the list.
        p = share(1, g[1], Mechanism.MIG, 500, 1024, MigSlot("3g.40gb", 0), Mechanism.MPS)
        kube.add(pod("p", assignment("p", p)))
        grant = await agent.allocator.allocate(1)
        unit = grant.envs["NVIDIA_VISIBLE_DEVICES"]
        await rec
        assert [i.uuid for i in sim.mig_instances(1)] == [unit]
        assert Path(grant.mounts[0].host_path).is_dir()
        assert await SimMpsDaemon().healthy(agent.mps.spec(unit))
        assert agent.state.allocated_containers("uid-default-p") == {"c0"}
        # q arrives while p is still Pending: q's Allocate must get q, not p's container a second time.
        kube.add(
            pod("q", assignment("q", share(0, g[0], Mechanism.TIME_SLICING, 100)), created="2024-05-01T10:00:05+00:00")
        )
        g2 = await agent.allocator.allocate(1)
        assert g2.pod == "default/q" and g2.envs == {"NVIDIA_VISIBLE_DEVICES": g[0]}

    asyncio.run(main())


def test_allocations_are_forgotten_only_after_two_lists_without_the_pod(tmp_path: Path) -> None:
    async def main() -> None:
        kube = FakeKube(NodeInfo("node-a", {}, {}, 32000, 256 * 1024))
        agent, sim = _agent(tmp_path, kube, grace_s=0.0)
        g = sim.devices()[0].uuid
        kube.add(pod("a", assignment("a", share(0, g, Mechanism.TIME_SLICING, 100))))
        await agent.allocator.allocate(1)
        del kube.pods["uid-default-a"]
        await agent.reconcile_once()
        assert agent.state.allocated_containers("uid-default-a") == {"c0"}  # one list without it: kept
        await agent.reconcile_once()
        assert agent.state.allocated_containers("uid-default-a") == frozenset()

    asyncio.run(main())


def test_a_recent_grant_outweighs_pod_lists_until_its_grace_period_ends(tmp_path: Path) -> None:
    async def main() -> None:
        kube = FakeKube(NodeInfo("node-a", {}, {}, 32000, 256 * 1024))
        agent, sim = _agent(tmp_path, kube)
        g = sim.devices()[1].uuid
        kube.add(
            pod("m", assignment("m", share(1, g, Mechanism.MIG, 1000, 0, MigSlot("3g.40gb", 4), Mechanism.EXCLUSIVE)))
        )
        await agent.allocator.allocate(1)
        hidden = kube.pods.pop("uid-default-m")  # a lagging list does not show it
        for _ in range(3):
            await agent.reconcile_once()
        assert len(sim.mig_instances(1)) == 1 and agent.state.allocated_containers(hidden.uid) == {"c0"}

    asyncio.run(main())
