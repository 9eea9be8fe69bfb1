from __future__ import annotations

import asyncio
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
from sharegpu.model.contract import INVENTORY_ANNOTATION, cdi_allocation_name
from sharegpu.model.inventory import NodeSpec
from sharegpu.node.agent import NodeAgent
from sharegpu.node.backends.sim import SimBackend
from sharegpu.node.backends.sim_config import parse_sim_config
from sharegpu.node.kube import NodeInfo
from sharegpu.node.mps import SimMpsDaemon


def _agent(
    tmp: Path,
    sim: SimBackend,
    kube: FakeKube,
    daemon: SimMpsDaemon | None = None,
    sock_dir: Path | None = None,
    grant_grace_s: float = 120.0,
) -> NodeAgent:
    config = agent_config(tmp, sock_dir or tmp, allocate_wait_s=0.2, tokens_per_gpu=2, grant_grace_s=grant_grace_s)
    return NodeAgent(config, sim, kube, daemon or SimMpsDaemon())


async def _record(agent: NodeAgent) -> KubeletRecord:
    record = record_for(agent.config)
    await record.start()
    return record


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


def test_a_restarted_agent_disturbs_no_running_pod(tmp_path: Path, sock_dir: Path) -> None:
    async def main() -> None:
        sim, kube = _setup(tmp_path)
        g = [d.uuid for d in sim.devices()]
        first_daemon = SimMpsDaemon()
        first = _agent(tmp_path, sim, kube, first_daemon, sock_dir)
        record = await _record(first)
        try:
            s = share(0, g[0], Mechanism.MIG, 500, 1024, MigSlot("2g.20gb", 2), Mechanism.MPS)
            a = kube.add(pod("a", assignment("a", s)))
            await first.reconcile_once()
            grant = await start_container(first, record, a, "c0", ["t0"])
            spec = cdi_spec(first.config.cdi_dir, ["t0"])
            (inst,) = sim.mig_instances(0)
            sim.add_process(500, inst.uuid, 900, pod_uid="uid-default-a")
            kube.set_phase("uid-default-a", "Running")

            # The agent process dies; the GPU, the MPS daemon (on disk), the state directory and the CDI specs survive.
            second_daemon = SimMpsDaemon()
            second = _agent(tmp_path, sim, kube, second_daemon, sock_dir, grant_grace_s=0.0)
            result = await second.reconcile_once()
            assert result.errors == ()
            assert sim.mig_instances(0) == (inst,)  # same instance, same UUID
            assert second_daemon.starts == 0  # the running daemon was adopted, not restarted
            assert second.state.allocations == {"uid-default-a": {"c0": grant.units}}
            assert second.mig.is_managed(inst.uuid)
            assert cdi_spec(second.config.cdi_dir, ["t0"]) == spec  # a known pod's spec is kept
            # The container restarts under the new agent: the very same unit, spec and daemon.
            assert (await second.allocator.prestart(["t0"])).units == grant.units
            assert cdi_spec(second.config.cdi_dir, ["t0"]) == spec and second_daemon.starts == 0
            # The pod ends: now the instance and the daemon go.
            sim.remove_process(500)
            kube.set_phase("uid-default-a", "Succeeded")
            await second.reconcile_once()
            assert sim.mig_instances(0) == () and not any(s.up for s in second.mps.status())
            assert not (tmp_path / "state" / "mps" / inst.uuid).exists()
        finally:
            await record.stop()

    asyncio.run(main())


def test_device_id_ties_outlive_an_agent_restart(tmp_path: Path, sock_dir: Path) -> None:
    async def main() -> None:
        sim, kube = _setup(tmp_path)
        g = [d.uuid for d in sim.devices()]
        first = _agent(tmp_path, sim, kube, sock_dir=sock_dir)
        record = await _record(first)
        try:
            a = assignment("p", *(share(i, g[i], Mechanism.TIME_SLICING, 100) for i in range(3)))
            p = kube.add(pod("p", a, gpus=(1, 1, 1)))
            c2 = await start_container(first, record, p, "c2", ["t2"])  # takes share 0
            assert c2.units == (g[0],)
            second = _agent(tmp_path, sim, kube, sock_dir=sock_dir)
            await second.reconcile_once()
            # The new agent knows that t2 holds share 0: c0 gets share 1, not share 0 a second time.
            c0 = await start_container(second, record, p, "c0", ["t0"])
            assert c0.units == (g[1],)
            assert (await second.allocator.prestart(["t2"])).units == (g[0],)  # c2 restarted
            assert (await start_container(second, record, p, "c1", ["t1"])).units == (g[2],)
            assert second.state.device_shares(p.uid) == {"t2": 0, "t0": 1, "t1": 2}
        finally:
            await record.stop()

    asyncio.run(main())


def test_cdi_specs_go_with_their_pod_and_orphans_at_start(tmp_path: Path, sock_dir: Path) -> None:
    async def main() -> None:
        sim, kube = _setup(tmp_path)
        g = [d.uuid for d in sim.devices()]
        agent = _agent(tmp_path, sim, kube, sock_dir=sock_dir, grant_grace_s=0.0)  # only the pod lists count
        await agent.reconcile_once()
        record = await _record(agent)
        cdi = agent.config.cdi_dir
        try:
            a = kube.add(
                pod("a", assignment("a", *(share(i, g[i], Mechanism.TIME_SLICING, 100) for i in (0, 1))), gpus=(1, 1))
            )
            b = kube.add(pod("b", assignment("b", share(2, g[2], Mechanism.TIME_SLICING, 100))))
            await start_container(agent, record, a, "c0", ["a0"])
            await start_container(agent, record, a, "c1", ["a1"])
            await start_container(agent, record, b, "c0", ["b0"])
            names = {n: cdi_allocation_name([n]) for n in ("a0", "a1", "b0")}
            assert cdi.is_dir() and agent.allocator.cdi.allocation_names() == set(names.values())
            del kube.pods[a.uid]
            record.release(a.uid)
            await agent.reconcile_once()
            assert agent.allocator.cdi.allocation_names() == set(names.values())  # one list without it: kept
            await agent.reconcile_once()
            assert agent.allocator.cdi.allocation_names() == {names["b0"]}
            assert agent.state.cdi_specs == {b.uid: {names["b0"]}} and a.uid not in agent.state.device_share
            # Specs the state does not know (written by an agent whose state was lost, or left by a pod that went
            # while no agent ran) go when an agent starts; the known pod's spec and DRA claim specs stay.
            orphan = cdi / f"sharegpu.io-dp_{cdi_allocation_name(['gone'])}.json"
            orphan.write_text((cdi / f"sharegpu.io-dp_{names['b0']}.json").read_text())
            claim = cdi / "sharegpu.io-gpu_0b4cb1c1-0000-4000-8000-000000000001.json"
            claim.write_text("{}")
            restarted = _agent(tmp_path, sim, kube, sock_dir=sock_dir)
            await restarted.reconcile_once()
            assert not orphan.exists() and claim.exists()
            assert restarted.allocator.cdi.allocation_names() == {names["b0"]}
        finally:
            await record.stop()

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
