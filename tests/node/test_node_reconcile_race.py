"""A reconcile working from a pod list that predates a PreStartContainer must not undo what it made."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from node_fakes import (
    SIM_YAML,
    FakeKube,
    KubeletRecord,
    agent_config,
    assignment,
    cdi_spec,
    pod,
    record_for,
    share,
    start_container,
)

from sharegpu.model.assignment import Mechanism, MigSlot
from sharegpu.model.contract import cdi_allocation_name
from sharegpu.node.agent import NodeAgent
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


@asynccontextmanager
async def _agent(
    tmp_path: Path, sock_dir: Path, kube: FakeKube, grace_s: float = 120.0
) -> AsyncIterator[tuple[NodeAgent, SimBackend, KubeletRecord]]:
    sim = SimBackend(parse_sim_config(SIM_YAML), seed="node-a")
    config = agent_config(tmp_path, sock_dir, allocate_wait_s=2, grant_grace_s=grace_s)
    record = record_for(config)
    await record.start()
    try:
        yield NodeAgent(config, sim, kube, SimMpsDaemon()), sim, record
    finally:
        await record.stop()


def test_reconcile_with_a_stale_pod_list_keeps_what_prestart_just_made(tmp_path: Path, sock_dir: Path) -> None:
    async def main() -> None:
        kube = SlowKube(NodeInfo("node-a", {}, {}, 32000, 256 * 1024))
        async with _agent(tmp_path, sock_dir, kube) as (agent, sim, record):
            await agent.reconcile_once()
            g = [d.uuid for d in sim.devices()]
            kube.slow = True
            rec = asyncio.create_task(agent.reconcile_once())  # lists pods: none yet
            await asyncio.sleep(0.05)
            # The scheduler binds p (MPS inside a new 3g instance); the kubelet starts its container during the list.
            p = share(1, g[1], Mechanism.MIG, 500, 1024, MigSlot("3g.40gb", 0), Mechanism.MPS)
            pp = kube.add(pod("p", assignment("p", p)))
            grant = await start_container(agent, record, pp, "c0", ["tp"])
            unit = grant.envs["NVIDIA_VISIBLE_DEVICES"]
            await rec
            assert [i.uuid for i in sim.mig_instances(1)] == [unit]
            assert Path(grant.mounts[0].host_path).is_dir()
            assert await SimMpsDaemon().healthy(agent.mps.spec(unit, pp.tenant))
            assert agent.state.allocated_containers("uid-default-p") == {"c0"}
            assert cdi_spec(agent.config.cdi_dir, ["tp"])["env"]["NVIDIA_VISIBLE_DEVICES"] == unit
            # q arrives while p is still Pending: q's container gets q's share, and p's tie is untouched.
            q = kube.add(pod("q", assignment("q", share(0, g[0], Mechanism.TIME_SLICING, 100))))
            g2 = await start_container(agent, record, q, "c0", ["tq"])
            assert g2.pod == "default/q" and g2.envs["NVIDIA_VISIBLE_DEVICES"] == g[0]
            assert agent.state.device_share == {pp.uid: {"tp": 0}, q.uid: {"tq": 0}}

    asyncio.run(main())


def test_allocations_are_forgotten_only_after_two_lists_without_the_pod(tmp_path: Path, sock_dir: Path) -> None:
    async def main() -> None:
        kube = FakeKube(NodeInfo("node-a", {}, {}, 32000, 256 * 1024))
        async with _agent(tmp_path, sock_dir, kube, grace_s=0.0) as (agent, sim, record):
            g = sim.devices()[0].uuid
            a = kube.add(pod("a", assignment("a", share(0, g, Mechanism.TIME_SLICING, 100))))
            await start_container(agent, record, a, "c0", ["t0"])
            spec = agent.config.cdi_dir / f"sharegpu.io-dp_{cdi_allocation_name(['t0'])}.json"
            del kube.pods["uid-default-a"]
            await agent.reconcile_once()
            # One list without it: kept (ties, record and spec).
            assert agent.state.allocated_containers("uid-default-a") == {"c0"}
            assert agent.state.device_shares("uid-default-a") == {"t0": 0} and spec.exists()
            await agent.reconcile_once()
            assert agent.state.allocated_containers("uid-default-a") == frozenset()
            assert agent.state.device_shares("uid-default-a") == {} and not spec.exists()
            assert agent.state.known_pods() == set()

    asyncio.run(main())


def test_a_pod_gone_before_any_list_saw_it_frees_its_gpu_for_mig_at_the_next_reconcile(
    tmp_path: Path, sock_dir: Path
) -> None:
    """The MIG stall seen on the real node: a time-sliced pod granted, finished and deleted between two pod lists kept
    its GPU out of MIG mode for the whole grace period (2 min), so the MIG pods the scheduler then put there waited."""

    async def main() -> None:
        kube = FakeKube(NodeInfo("node-a", {}, {}, 32000, 256 * 1024))
        async with _agent(tmp_path, sock_dir, kube) as (agent, sim, record):
            await agent.reconcile_once()
            g = sim.devices()[1].uuid
            ts = kube.add(pod("ts", assignment("ts", share(1, g, Mechanism.TIME_SLICING, 100))))
            await start_container(agent, record, ts, "c0", ["t0"])
            del kube.pods[ts.uid]  # ran, finished and was deleted before the agent listed pods again
            m = share(1, g, Mechanism.MIG, 1000, 0, MigSlot("3g.40gb", 4), Mechanism.EXCLUSIVE)
            kube.add(pod("m", assignment("m", m)))
            result = await agent.reconcile_once()
            assert result.errors == ()
            assert [(i.profile, i.start) for i in sim.mig_instances(1)] == [("3g.40gb", 4)]

    asyncio.run(main())


def test_a_grant_newer_than_the_pod_list_is_kept_whatever_that_list_says(tmp_path: Path, sock_dir: Path) -> None:
    async def main() -> None:
        kube = SlowKube(NodeInfo("node-a", {}, {}, 32000, 256 * 1024))
        async with _agent(tmp_path, sock_dir, kube) as (agent, sim, record):
            await agent.reconcile_once()
            g = sim.devices()[1].uuid
            m = share(1, g, Mechanism.MIG, 1000, 0, MigSlot("3g.40gb", 4), Mechanism.EXCLUSIVE)
            kube.slow = True
            rec = asyncio.create_task(agent.reconcile_once())  # its list was served before m existed
            await asyncio.sleep(0.05)
            p = kube.add(pod("m", assignment("m", m)))
            await start_container(agent, record, p, "c0", ["t0"])
            await rec
            assert len(sim.mig_instances(1)) == 1 and agent.state.allocated_containers(p.uid) == {"c0"}
            assert agent.allocator.cdi.allocation_names() == {cdi_allocation_name(["t0"])}

    asyncio.run(main())
