"""Upgrading a node from one MPS daemon per unit (issue 32): the daemon an agent before tenants left running.

Before the daemon per (unit, tenant), the agent (and the DRA driver) ran one daemon per GPU or MIG instance for every
pod, at ``<state dir>/mps/<unit>/pipe`` and ``.../log`` (``git show 5c4dca3:src/sharegpu/node/mps.py``), and the
containers it started mount ``<unit>/pipe``. :func:`_old_layout` writes exactly what that code wrote (the simulated
daemon's marker with its unit and limits, the log directory) and plays its daemon still running on the simulated node,
with the clients of the pods started before the upgrade connected to it. The agent of today adopts it as the unit's
legacy daemon, keeps it while a pod it served is still assigned there, then stops it and removes its directory.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest
from node_fakes import FakeKube, agent_config, assignment, cdi_spec, pod, record_for, share
from node_fakes import start_container as start

from sharegpu.kube.schema import Pod, ResourceClaim
from sharegpu.model.assignment import Mechanism
from sharegpu.model.tenant import tenant_dir
from sharegpu.node.agent import NodeAgent
from sharegpu.node.audit import FindingKind
from sharegpu.node.backends.sim import SimBackend
from sharegpu.node.backends.sim_config import SimConfig, SimGpuGroup, parse_sim_config
from sharegpu.node.cdi import CdiWriter
from sharegpu.node.dra.checkpoint import Checkpoint
from sharegpu.node.dra.driver import ClaimRef, DraDriver, SimTimeSlicer
from sharegpu.node.kube import NodeInfo, PodInfo
from sharegpu.node.mig import MigManager
from sharegpu.node.mps import LEGACY_HOLDERS_FILE, LEGACY_TENANT, DaemonKey, MpsError, MpsManager, SimMpsDaemon
from sharegpu.node.state import AgentState

GIB = 1024
STOPPED = "stopped the MPS daemon of the layout before tenants for"


def _old_layout(sim: SimBackend, state_dir: Path, unit: str, *, running: bool = True) -> Path:
    """The unit's daemon as the agent before tenants left it (its directory ``<state>/mps/<unit>``): the pipe
    directory with the simulated daemon's marker as 5c4dca3's SimMpsDaemon wrote it (unit, then the limits it was
    told), the log directory; ``running``: the daemon still runs on the node (its clients can connect)."""
    base = state_dir / "mps" / unit
    (base / "pipe").mkdir(parents=True)
    (base / "log").mkdir()
    if running:
        marker = {"unit": unit, "threadPercentage": 15, "pinnedMemMiB": 10 * GIB}
        (base / "pipe" / SimMpsDaemon.MARKER).write_text(json.dumps(marker))
        sim.start_mps_daemon(unit, base / "pipe", log_dir=base / "log")
    return base


def _node(tmp: Path, sock: Path) -> tuple[SimBackend, FakeKube, NodeAgent]:
    sim = SimBackend(parse_sim_config("gpus: [{model: H100-80GB, count: 1}]\n"), seed="node-a")
    kube = FakeKube(NodeInfo("node-a", {}, {}, 32000, 256 * 1024))
    return sim, kube, _agent(tmp, sock, sim, kube)


def _agent(tmp: Path, sock: Path, sim: SimBackend, kube: FakeKube) -> NodeAgent:
    return NodeAgent(agent_config(tmp, sock, tokens_per_gpu=8), sim, kube, SimMpsDaemon(sim))


def _mps_pod(kube: FakeKube, name: str, unit: str, user: int, namespace: str = "default") -> PodInfo:
    a = assignment(name, share(0, unit, Mechanism.MPS, 150, 10 * GIB), namespace=namespace)
    return kube.add(pod(name, a, user=user, namespace=namespace, phase="Running"))


def _stopped_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(STOPPED)]


def test_the_old_daemon_is_adopted_its_clients_are_its_own_and_new_pods_get_their_tenants_daemon(
    tmp_path: Path, sock_dir: Path
) -> None:
    """Two pods of two tenants (uid 1000 in two namespaces) started before the upgrade, both clients of the unit's one
    old daemon: the agent adopts it, the audit finds nothing, a pod that comes later gets its tenant's daemon and a
    client of that later pod on the old daemon is another tenant's client."""

    async def main() -> None:
        sim, kube, agent = _node(tmp_path, sock_dir)
        g = sim.devices()[0].uuid
        base = _old_layout(sim, agent.config.state_dir, g)
        old_a = _mps_pod(kube, "old-a", g, 1000)
        old_b = _mps_pod(kube, "old-b", g, 1000, namespace="team-b")
        assert old_a.tenant != old_b.tenant
        assert sim.add_process(100, g, 1000, old_a.uid, mps=True, daemon=base / "pipe", user=1000)
        assert sim.add_process(101, g, 1000, old_b.uid, mps=True, daemon=base / "pipe", user=1000)
        await agent.reconcile_once()
        legacy = DaemonKey(g, LEGACY_TENANT)
        assert legacy in agent.mps.running()
        assert agent.mps.legacy() == {legacy: frozenset({old_a.uid, old_b.uid})}
        assert json.loads((base / LEGACY_HOLDERS_FILE).read_text()) == sorted([old_a.uid, old_b.uid])
        assert agent.mps.daemon_of_pipe(str(base / "pipe")) == legacy
        assert agent.snapshot.findings == ()
        assert {p.pid for p in sim.mps_processes(0) or ()} == {100, 101}  # not disturbed
        with pytest.raises(MpsError, match="takes no new client"):
            await agent.mps.ensure(g, LEGACY_TENANT)

        record = record_for(agent.config)
        await record.start()
        try:
            new = _mps_pod(kube, "new", g, 2000)
            await start(agent, record, new, "c0", ["t0"])
            (mount,) = cdi_spec(agent.config.cdi_dir, ["t0"])["mounts"]
            assert Path(mount["hostPath"]) == agent.mps.spec(g, new.tenant).pipe_dir != base / "pipe"
            assert Path(mount["hostPath"]).parent.name == tenant_dir(new.tenant)
            assert sim.add_process(200, g, 1000, new.uid, mps=True, daemon=mount["hostPath"], user=2000)
            await agent.reconcile_once()
            assert agent.snapshot.findings == ()
            # The later pod is no pod the old daemon served: its client there is another tenant's.
            assert sim.add_process(201, g, 1000, new.uid, mps=True, daemon=base / "pipe", user=1000)
            await agent.reconcile_once()
            ((kind, pids, message),) = [(f.kind, f.pids, f.message) for f in agent.snapshot.findings]
            assert kind is FindingKind.MPS_OTHER_TENANT and pids == (201,)
            assert "before the upgrade" in message
        finally:
            await record.stop()

    asyncio.run(main())


def test_a_fault_on_the_old_daemon_is_told_to_its_pods_only(tmp_path: Path, sock_dir: Path) -> None:
    async def main() -> None:
        sim, kube, agent = _node(tmp_path, sock_dir)
        g = sim.devices()[0].uuid
        base = _old_layout(sim, agent.config.state_dir, g)
        old_a = _mps_pod(kube, "old-a", g, 1000)
        old_b = _mps_pod(kube, "old-b", g, 1000, namespace="team-b")
        assert sim.add_process(100, g, 1000, old_a.uid, mps=True, daemon=base / "pipe", user=1000)
        assert sim.add_process(101, g, 1000, old_b.uid, mps=True, daemon=base / "pipe", user=1000)
        await agent.reconcile_once()
        new = _mps_pod(kube, "new", g, 2000)  # after the upgrade: its tenant's daemon, never the old one
        await agent.reconcile_once()
        new_pipe = agent.mps.spec(g, new.tenant).pipe_dir
        assert sim.add_process(200, g, 1000, new.uid, mps=True, daemon=new_pipe, user=2000)
        await agent.reconcile_once()

        sim.mps_fault(g, daemon=base / "pipe", client=100)
        result = await agent.reconcile_once()
        (fault,) = result.faults
        assert fault.tenant == LEGACY_TENANT and "log" in fault.sources
        assert set(fault.pods) == {old_a.key, old_b.key}
        assert {p.pid for p in sim.mps_processes(0) or ()} == {200}  # the new tenant's client ran on
        # The old daemon still answers after the fault: it is kept for its pods, not restarted.
        assert DaemonKey(g, LEGACY_TENANT) in agent.mps.running() and (base / "pipe").is_dir()

        sim.mps_fault(g, daemon=new_pipe, client=200)
        (fault,) = (await agent.reconcile_once()).faults
        assert fault.tenant == new.tenant and fault.pods == (new.key,)

    asyncio.run(main())


def test_the_old_daemon_is_kept_while_its_pods_run_then_stopped_and_its_directory_removed(
    tmp_path: Path, sock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sharegpu.node.mps")

    async def main() -> None:
        sim, kube, agent = _node(tmp_path, sock_dir)
        g = sim.devices()[0].uuid
        base = _old_layout(sim, agent.config.state_dir, g)
        old_a = _mps_pod(kube, "old-a", g, 1000)
        old_b = _mps_pod(kube, "old-b", g, 1000)
        assert sim.add_process(100, g, 1000, old_a.uid, mps=True, daemon=base / "pipe", user=1000)
        await agent.reconcile_once()
        new = _mps_pod(kube, "new", g, 2000)
        await agent.reconcile_once()
        legacy = DaemonKey(g, LEGACY_TENANT)
        new_key = DaemonKey(g, new.tenant)
        assert {legacy, new_key} <= agent.mps.running()

        # old-a's client ends and old-a is deleted: old-b may still start a client there (its CDI spec from before).
        sim.remove_process(100)
        kube.pods.pop(old_a.uid)
        await agent.reconcile_once()
        assert legacy in agent.mps.running() and (base / "pipe" / SimMpsDaemon.MARKER).is_file()
        assert _stopped_lines(caplog) == []

        # old-b finishes: no pod the old daemon served is left, while the later pod still runs there.
        kube.set_phase(old_b.uid, "Succeeded")
        await agent.reconcile_once()
        assert legacy not in agent.mps.running() and agent.mps.legacy() == {}
        assert str(base / "pipe") not in sim.mps_daemons(g)  # the daemon quit
        assert sorted(p.name for p in base.iterdir()) == [tenant_dir(new.tenant)]  # pipe, log, holders removed
        assert new_key in agent.mps.running()  # the later pod's daemon is left alone
        await agent.reconcile_once()
        (line,) = _stopped_lines(caplog)  # once
        assert g in line and "no pod it served before the upgrade" in line

        # Once the later pod is gone too, the unit's directory goes with its last daemon.
        kube.pods.pop(new.uid)
        await agent.reconcile_once()
        assert not base.exists()

    asyncio.run(main())


def test_an_old_directory_whose_daemon_no_longer_answers_is_removed(
    tmp_path: Path, sock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sharegpu.node.mps")

    async def main() -> None:
        sim, kube, agent = _node(tmp_path, sock_dir)
        g = sim.devices()[0].uuid
        base = _old_layout(sim, agent.config.state_dir, g, running=False)
        _mps_pod(kube, "old-a", g, 1000)  # a pod still assigned there does not keep a dead daemon
        await agent.reconcile_once()
        assert not (base / "pipe").exists() and not (base / "log").exists()
        assert DaemonKey(g, LEGACY_TENANT) not in agent.mps.running()
        assert any("no longer answers" in r.getMessage() and g in r.getMessage() for r in caplog.records)

    asyncio.run(main())


def test_an_adopted_old_daemon_that_dies_is_removed_not_restarted(tmp_path: Path, sock_dir: Path) -> None:
    async def main() -> None:
        sim, kube, agent = _node(tmp_path, sock_dir)
        g = sim.devices()[0].uuid
        base = _old_layout(sim, agent.config.state_dir, g)
        old = _mps_pod(kube, "old", g, 1000)
        assert sim.add_process(100, g, 1000, old.uid, mps=True, daemon=base / "pipe", user=1000)
        daemon = SimMpsDaemon(sim)
        agent = NodeAgent(agent.config, sim, kube, daemon)
        await agent.reconcile_once()
        assert DaemonKey(g, LEGACY_TENANT) in agent.mps.running()
        starts = daemon.starts
        daemon.crash(agent.mps.spec(g, LEGACY_TENANT))
        await agent.reconcile_once()
        assert DaemonKey(g, LEGACY_TENANT) not in agent.mps.running()
        assert not (base / "pipe").exists() and str(base / "pipe") not in sim.mps_daemons(g)
        assert daemon.starts == starts  # never started again: new clients go to their tenant's daemon

    asyncio.run(main())


def test_a_restarted_agent_adopts_the_old_daemon_again_with_the_pods_it_served(tmp_path: Path, sock_dir: Path) -> None:
    """The holders are fixed at the first adoption: a pod that came after the upgrade does not keep the old daemon
    after a restart of the new agent."""

    async def main() -> None:
        sim, kube, agent = _node(tmp_path, sock_dir)
        g = sim.devices()[0].uuid
        base = _old_layout(sim, agent.config.state_dir, g)
        old = _mps_pod(kube, "old", g, 1000)
        assert sim.add_process(100, g, 1000, old.uid, mps=True, daemon=base / "pipe", user=1000)
        await agent.reconcile_once()
        new = _mps_pod(kube, "new", g, 2000)
        await agent.reconcile_once()

        again = _agent(tmp_path, sock_dir, sim, kube)  # the new agent restarts; the old daemon still runs
        await again.reconcile_once()
        legacy = DaemonKey(g, LEGACY_TENANT)
        assert legacy in again.mps.running()
        assert again.mps.legacy() == {legacy: frozenset({old.uid})}
        assert {p.pid for p in sim.mps_processes(0) or ()} == {100}
        assert again.snapshot.findings == ()

        sim.remove_process(100)
        kube.pods.pop(old.uid)
        await again.reconcile_once()
        assert legacy not in again.mps.running() and not (base / "pipe").exists()
        assert DaemonKey(g, new.tenant) in again.mps.running()

    asyncio.run(main())


def test_the_dra_driver_keeps_the_old_daemon_while_a_claim_prepared_before_the_upgrade_is_prepared(
    tmp_path: Path,
) -> None:
    """The DRA driver shares the MPS manager: a claim prepared before the upgrade (its CDI spec mounts the old pipe)
    keeps the old daemon; once the kubelet unprepares it, the daemon is stopped and its directory removed."""

    async def main() -> None:
        root = tmp_path
        sim = SimBackend(SimConfig((SimGpuGroup("A100-80GB", 1),)), seed="n1")
        g = sim.devices()[0].uuid
        claims = _Claims()

        def driver() -> DraDriver:
            return DraDriver(
                "n1",
                sim,
                claims,
                MigManager(sim, AgentState(root / "mig.json")),
                _manager(root, sim),
                Checkpoint(root / "checkpoint.json"),
                CdiWriter(root / "cdi"),
                SimTimeSlicer(),
            )

        # The claim prepared before the upgrade, in the checkpoint the new driver finds.
        before = driver()
        old = claims.add("old", g)
        assert (await before.prepare([old]))[old.uid].error == ""
        base = _old_layout(sim, root, g)

        upgraded = driver()
        await upgraded.recover()
        legacy = DaemonKey(g, LEGACY_TENANT)
        assert upgraded.mps.legacy() == {legacy: frozenset({old.uid})}
        new = claims.add("new", g)
        assert (await upgraded.prepare([new]))[new.uid].error == ""
        assert legacy in upgraded.mps.running()
        assert (await upgraded.unprepare([old]))[old.uid] == ""
        assert legacy not in upgraded.mps.running() and not (base / "pipe").exists()
        assert str(base / "pipe") not in sim.mps_daemons(g)

    asyncio.run(main())


def _manager(root: Path, sim: SimBackend) -> MpsManager:
    return MpsManager(root / "mps", SimMpsDaemon(sim))


class _Claims:
    """Allocated MPS claims of the DRA driver's pods, each reserved for one pod of uid 1000."""

    def __init__(self) -> None:
        self.claims: dict[str, ResourceClaim] = {}
        self.pods: dict[str, Pod] = {}

    def add(self, name: str, gpu_uuid: str) -> ClaimRef:
        del gpu_uuid  # the driver's pool names its GPU as gpu-0
        self.pods[f"p-{name}"] = Pod.model_validate(
            {
                "metadata": {"namespace": "ns", "name": f"p-{name}", "uid": f"uid-{name}"},
                "spec": {
                    "containers": [
                        {
                            "name": "c",
                            "securityContext": {"runAsUser": 1000},
                            "resources": {"claims": [{"name": "gpu"}]},
                        }
                    ],
                    "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
                },
            }
        )
        result = {
            "request": "gpu",
            "driver": "gpu.sharegpu.io",
            "pool": "n1",
            "device": "gpu-0",
            "consumedCapacity": {"memory": "10Gi", "compute": "20"},
            "shareID": f"s-{name}",
        }
        self.claims[name] = ResourceClaim.model_validate(
            {
                "metadata": {"namespace": "ns", "name": name, "uid": f"c-{name}"},
                "status": {
                    "allocation": {"devices": {"results": [result], "config": []}},
                    "reservedFor": [{"resource": "pods", "name": f"p-{name}", "uid": f"uid-{name}"}],
                },
            }
        )
        return ClaimRef("ns", f"c-{name}", name)

    async def get_claim(self, namespace: str, name: str) -> ResourceClaim:
        return self.claims[name]

    async def get_pod(self, namespace: str, name: str) -> Pod:
        return self.pods[name]
