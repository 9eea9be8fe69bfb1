from __future__ import annotations

import asyncio
from pathlib import Path

from node_fakes import SIM_YAML, FakeKube, assignment, pod, share

from sharegpu.model.assignment import Mechanism, MigSlot
from sharegpu.model.inventory import INVENTORY_ANNOTATION, NodeSpec
from sharegpu.node.agent import AgentConfig, NodeAgent
from sharegpu.node.backends.sim import SimBackend
from sharegpu.node.backends.sim_config import parse_sim_config
from sharegpu.node.kube import NodeInfo
from sharegpu.node.mps import SimMpsDaemon


def _agent(tmp: Path, sim: SimBackend, kube: FakeKube, daemon: SimMpsDaemon | None = None) -> NodeAgent:
    config = AgentConfig("node-a", tmp / "dp", tmp / "state", allocate_wait_s=0.2, tokens_per_gpu=2)
    return NodeAgent(config, sim, kube, daemon or SimMpsDaemon())


def _setup(tmp: Path) -> tuple[SimBackend, FakeKube]:
    sim = SimBackend(parse_sim_config(SIM_YAML), seed="node-a")
    kube = FakeKube(NodeInfo("node-a", {"kubernetes.io/hostname": "node-a"}, {}, 32000, 256 * 1024))
    return sim, kube


def test_inventory_and_labels_are_published_and_kept_current(tmp_path: Path) -> None:
    async def main() -> None:
        sim, kube = _setup(tmp_path)
        agent = _agent(tmp_path, sim, kube)
        assert (await agent.reconcile_once()).published
        node = kube.nodes["node-a"]
        spec = NodeSpec.from_json(node.annotations[INVENTORY_ANNOTATION])
        assert [(g.index, g.model, g.uuid) for g in spec.gpus] == [(d.index, d.model, d.uuid) for d in sim.devices()]
        assert (spec.cpu_milli, spec.memory_mib) == (32000, 256 * 1024)
        assert node.labels["sharegpu.io/gpu.count"] == "3" and node.labels["sharegpu.io/gpu.model"] == "mixed"
        assert (
            node.labels["sharegpu.io/gpu.count.H100-80GB"] == "2" and node.labels["kubernetes.io/hostname"] == "node-a"
        )
        assert not (await agent.reconcile_once()).published  # nothing changed: no write
        sim.set_health(1, False)
        assert (await agent.reconcile_once()).published
        assert not NodeSpec.from_json(kube.nodes["node-a"].annotations[INVENTORY_ANNOTATION]).gpus[1].healthy
        assert len(kube.patches) == 2

    asyncio.run(main())


def test_mig_and_mps_follow_the_pods_on_the_node(tmp_path: Path) -> None:
    async def main() -> None:
        sim, kube = _setup(tmp_path)
        daemon = SimMpsDaemon()
        agent = _agent(tmp_path, sim, kube, daemon)
        g = [d.uuid for d in sim.devices()]
        kube.add(pod("a", assignment("a", share(0, g[0], Mechanism.MPS, 300, 1024))))
        mig_mps = share(1, g[1], Mechanism.MIG, 500, 1024, MigSlot("3g.40gb", 0), Mechanism.MPS)
        kube.add(pod("b", assignment("b", mig_mps), phase="Running"))
        result = await agent.reconcile_once()
        assert result.errors == () and result.invalid == ()
        (inst,) = sim.mig_instances(1)
        assert (inst.profile, inst.start) == ("3g.40gb", 0)
        assert {s.unit_uuid for s in agent.mps.status() if s.up} == {g[0], inst.uuid}
        spec = NodeSpec.from_json(kube.nodes["node-a"].annotations[INVENTORY_ANNOTATION])
        assert spec.gpus[1].mig_enabled and [m.uuid for m in spec.gpus[1].mig_devices] == [inst.uuid]
        assert spec.gpus[1].mig_instances == ()  # sharegpu's own instance is not a static layout
        kube.set_phase("uid-default-b", "Succeeded")
        kube.pods.pop("uid-default-a")
        await agent.reconcile_once()
        assert sim.mig_instances(1) == ()
        assert [s.unit_uuid for s in agent.mps.status() if s.up] == []
        # MIG mode stays until a non-MIG share needs the GPU, then sharegpu (which turned it on) turns it off.
        assert sim.devices()[1].mig_enabled
        kube.add(pod("c", assignment("c", share(1, g[1], Mechanism.TIME_SLICING, 100))))
        await agent.reconcile_once()
        assert not sim.devices()[1].mig_enabled

    asyncio.run(main())


def test_a_restarted_agent_disturbs_no_running_pod(tmp_path: Path) -> None:
    async def main() -> None:
        sim, kube = _setup(tmp_path)
        g = [d.uuid for d in sim.devices()]
        first_daemon = SimMpsDaemon()
        first = _agent(tmp_path, sim, kube, first_daemon)
        s = share(0, g[0], Mechanism.MIG, 500, 1024, MigSlot("2g.20gb", 2), Mechanism.MPS)
        kube.add(pod("a", assignment("a", s)))
        await first.reconcile_once()
        grant = await first.allocator.allocate(1)
        (inst,) = sim.mig_instances(0)
        sim.add_process(500, inst.uuid, 900, pod_uid="uid-default-a")
        kube.set_phase("uid-default-a", "Running")

        # The agent process dies; the GPU, the MPS daemon (on disk) and the state directory survive.
        second_daemon = SimMpsDaemon()
        second = _agent(tmp_path, sim, kube, second_daemon)
        result = await second.reconcile_once()
        assert result.errors == ()
        assert sim.mig_instances(0) == (inst,)  # same instance, same UUID
        assert second_daemon.starts == 0  # the running daemon was adopted, not restarted
        assert second.state.allocations == {"uid-default-a": {"c0": grant.units}}
        assert second.mig.is_managed(inst.uuid)
        # The pod ends: now the instance and the daemon go.
        sim.remove_process(500)
        kube.set_phase("uid-default-a", "Succeeded")
        await second.reconcile_once()
        assert sim.mig_instances(0) == () and not any(s.up for s in second.mps.status())
        assert not (tmp_path / "state" / "mps" / inst.uuid).exists()

    asyncio.run(main())


def test_bad_and_foreign_assignments_are_reported_and_skipped(tmp_path: Path) -> None:
    async def main() -> None:
        sim, kube = _setup(tmp_path)
        kube.honour_field_selector = False
        agent = _agent(tmp_path, sim, kube)
        g = [d.uuid for d in sim.devices()]
        kube.add(pod("corrupt", "{nope"))
        kube.add(pod("elsewhere", assignment("elsewhere", share(0, g[0], Mechanism.MPS, 100)), node="node-b"))
        kube.add(pod("lacking", assignment("lacking", share(0, "GPU-missing", Mechanism.MPS, 100))))
        kube.add(pod("copied", assignment("someone", share(1, g[1], Mechanism.MPS, 100))))
        result = await agent.reconcile_once()
        assert len(result.invalid) == 3 and any("GPU-missing" in m for m in result.invalid)
        assert agent.mps.status() == ()  # nothing acted on: not even the other node's pod
        assert agent.snapshot.invalid_assignments == 3

    asyncio.run(main())
