"""The enforcement audit, honest per-pod usage under MPS, and the MPS fault watch.

Two sources: a fake NVML that answers exactly what the H200 answered under MPS (driver 580; gpu-evidence
h200-2026-11-26 §4: the server's pid with 66 MiB in the plain list, clients with 500 and 730 MiB, utilisation for the
server's pid only), and the simulated backend driven through the agent's reconcile.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from node_fakes import SIM_YAML, FakeKube, agent_config, assignment, pod, share
from test_node_nvml_backend import FakeGi, FakeGpu, FakeNvml

from sharegpu.kube.api import PodEvent
from sharegpu.kube.errors import EvictionBlocked
from sharegpu.model.assignment import Mechanism, MigSlot
from sharegpu.model.tenant import user_tenant
from sharegpu.node.agent import NodeAgent
from sharegpu.node.audit import (
    MPS_CLIENT_CONTEXT_MIB,
    OWN_CONTEXT_MIB,
    Finding,
    FindingKind,
    GpuReading,
    ProcView,
    Role,
    attribute,
    audit,
    context_allowance_mib,
    pod_usage,
    read_gpu,
    unit_shares,
)
from sharegpu.node.backends.base import MPS_SERVER_NAME, BackendError, XidEvent
from sharegpu.node.backends.nvml import NvmlBackend
from sharegpu.node.backends.nvml_api import XID_CRITICAL_ERROR, NvmlCallError, NvmlEvent, NvmlProcess
from sharegpu.node.backends.sim import MPS_SERVER_MEMORY_MIB, SimBackend
from sharegpu.node.backends.sim_config import parse_sim_config
from sharegpu.node.enforcement import FAULT_MESSAGE, FAULT_REASON, EnforcementWatch
from sharegpu.node.kube import NodeInfo, PodInfo
from sharegpu.node.metrics import new_registry
from sharegpu.node.mps import DaemonKey, SimMpsDaemon
from sharegpu.node.mps_faults import FaultSignal, LogTail, MpsLogWatch, ServerWatch, fault_lines, is_fault, parse_line

MIB = 2**20
SERVER, CLIENT_A, CLIENT_B = 466, 503, 504  # the pids the H200 run showed


class FakeNotifier:
    """The API server's Events and Eviction endpoints, in memory."""

    def __init__(self) -> None:
        self.events: list[PodEvent] = []
        self.evicted: list[tuple[str, str, str]] = []
        self.block_evictions = False

    async def create_event(self, event: PodEvent, component: str) -> None:
        assert component == "sharegpu-node-agent"
        self.events.append(event)

    async def evict_pod(self, namespace: str, name: str, uid: str = "") -> None:
        if self.block_evictions:
            raise EvictionBlocked("its PodDisruptionBudget allows no disruption now", 429)
        self.evicted.append((namespace, name, uid))

    async def close(self) -> None:
        pass

    def reasons(self, pod_name: str) -> list[str]:
        return [e.reason for e in self.events if e.pod == pod_name]


# ----- NVML as the H200 answered -------------------------------------------------------------------------------------
def _h200_under_mps(tmp_path: Path) -> tuple[NvmlBackend, FakeNvml]:
    gpu = FakeGpu(
        "NVIDIA H200",
        procs=[NvmlProcess(SERVER, 66 * MIB, None), NvmlProcess(CLIENT_B, 730 * MIB, None)],
        mps_procs=[NvmlProcess(CLIENT_B, 730 * MIB, None)],
        sm={SERVER: 36},
    )
    gpu.procs.append(NvmlProcess(CLIENT_A, 500 * MIB, None))
    gpu.mps_procs.append(NvmlProcess(CLIENT_A, 500 * MIB, None))
    api = FakeNvml(gpu)
    proc = tmp_path / "proc"
    for pid, argv0, pod_uid in (
        (SERVER, f"/usr/bin/{MPS_SERVER_NAME}", None),
        (CLIENT_A, "python3", "0a1b2c3d-0000-1111-2222-00000000000a"),
        (CLIENT_B, "python3", "0a1b2c3d-0000-1111-2222-00000000000b"),
    ):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cmdline").write_bytes(argv0.encode() + b"\0--flag\0")
        cgroup = f"0::/kubepods/besteffort/pod{pod_uid}/abc\n" if pod_uid else "0::/system.slice/x.service\n"
        (proc / str(pid) / "cgroup").write_text(cgroup)
    return NvmlBackend(api, proc_root=proc), api


def _reading(backend: NvmlBackend) -> GpuReading:
    (d,) = backend.devices()
    return read_gpu(backend, d)


def _pods(*names: str) -> dict[str, object]:
    return {p.uid: p for p in (pod(n, None, uid=f"0a1b2c3d-0000-1111-2222-00000000000{n[-1]}") for n in names)}


def test_h200_mps_reading_gives_the_server_figure_to_a_sole_client_pod_and_unknown_to_several(tmp_path: Path) -> None:
    backend, _ = _h200_under_mps(tmp_path)
    r = _reading(backend)
    views = attribute(r, backend.pod_uid_of, backend.process_name)
    assert {v.pid: v.role for v in views} == {SERVER: Role.SERVER, CLIENT_A: Role.MPS_CLIENT, CLIENT_B: Role.MPS_CLIENT}
    # Two pods on the server: each pod's SM figure is unknown (None), never 0; the unit keeps the server's figure.
    pods = _pods("pod-a", "pod-b")
    rows, units = pod_usage(views, r.sm_percent, pods)  # type: ignore[arg-type]
    assert [(row.memory_mib, row.sm_percent) for row in rows] == [(500, None), (730, None)]
    assert [(u.sm_percent, u.client_pods) for u in units] == [(36, 2)]
    # One pod (both clients its own): the server's figure is that pod's.
    one = {uid: p for uid, p in pods.items() if p.name == "pod-a"}  # type: ignore[attr-defined]
    only_a = tuple(v for v in views if v.pid != CLIENT_B)
    rows, units = pod_usage(only_a, r.sm_percent, one)  # type: ignore[arg-type]
    assert [(row.memory_mib, row.sm_percent) for row in rows] == [(500, 36)]
    assert units[0].client_pods == 1
    # The server's own memory is nobody's: it is no pod's process and no finding either.
    assert audit(views, pods, {}, {0: True}) != ()  # pods without shares are on a GPU they hold none of…
    assert all(f.pids != (SERVER,) for f in audit(views, pods, {}, {0: True}))  # …but the server is never named


def test_the_mps_server_is_told_by_its_comm_name_too(tmp_path: Path) -> None:
    backend, _ = _h200_under_mps(tmp_path)
    (tmp_path / "proc" / str(SERVER) / "cmdline").unlink()  # comm only: cut to 15 characters
    (tmp_path / "proc" / str(SERVER) / "comm").write_text("nvidia-cuda-mps\n")
    assert backend.process_name(SERVER) == "nvidia-cuda-mps"
    roles = {v.pid: v.role for v in attribute(_reading(backend), backend.pod_uid_of, backend.process_name)}
    assert roles[SERVER] is Role.SERVER
    # No name at all (no hostPID): a pod-less process beside MPS clients is taken for the server.
    (tmp_path / "proc" / str(SERVER) / "comm").unlink()
    roles = {v.pid: v.role for v in attribute(_reading(backend), backend.pod_uid_of, backend.process_name)}
    assert roles[SERVER] is Role.SERVER


def test_xid_events_are_polled_without_waiting_and_tied_to_their_mig_instance() -> None:
    backend = NvmlBackend(
        api := FakeNvml(FakeGpu("NVIDIA H100 80GB HBM3", mig=True), FakeGpu("NVIDIA H100 80GB HBM3", events=False))
    )
    backend.create_mig_instance(0, "3g.40gb", 4)
    mig_uuid = backend.mig_instances(0)[0].uuid
    assert backend.xid_events() == ()
    assert api.registered == [(0, XID_CRITICAL_ERROR)]  # GPU 1's refusal is logged, not raised
    api.queued += [
        NvmlEvent("GPU-0", XID_CRITICAL_ERROR, 31, 1),
        NvmlEvent("GPU-0", 0x4, 0, None),  # a P-state event: not an Xid
        NvmlEvent("GPU-0", XID_CRITICAL_ERROR, 79, None),
    ]
    assert backend.xid_events() == (XidEvent(0, mig_uuid, 31), XidEvent(0, "GPU-0", 79))
    assert backend.xid_events() == ()
    backend.close()
    assert api.sets_freed == 1


class OldDriver(FakeNvml):
    """A driver without the MPS-aware query."""

    def mps_processes(self, h: FakeGpu) -> list[NvmlProcess]:
        raise NvmlCallError("not_supported", "Not Supported")


def test_without_the_mps_query_pods_beside_a_named_server_are_taken_for_its_clients(tmp_path: Path) -> None:
    _, api = _h200_under_mps(tmp_path)
    old = NvmlBackend(OldDriver(*api.gpus), proc_root=tmp_path / "proc")
    assert old.mps_processes(0) is None
    r = _reading(old)
    assert r.mps_clients is None
    views = attribute(r, old.pod_uid_of, old.process_name)
    assert {v.pid: v.role for v in views} == {SERVER: Role.SERVER, CLIENT_A: Role.MPS_CLIENT, CLIENT_B: Role.MPS_CLIENT}
    rows, _ = pod_usage(views, r.sm_percent, _pods("pod-a", "pod-b"))  # type: ignore[arg-type]
    assert [row.sm_percent for row in rows] == [None, None]  # still unknown, not each pod's own 0
    # …and no bypass is claimed, since the driver cannot say who is a client.
    shares = {
        uid: unit_shares(assignment(p.name, share(0, "GPU-0", Mechanism.MPS, 500)), {})  # type: ignore[attr-defined]
        for uid, p in _pods("pod-a", "pod-b").items()
    }
    assert audit(views, _pods("pod-a", "pod-b"), shares, {0: False}) == ()  # type: ignore[arg-type]


# ----- the audit's findings --------------------------------------------------------------------------------------------
def _sim() -> tuple[SimBackend, list[str]]:
    sim = SimBackend(parse_sim_config(SIM_YAML), seed="node-a")
    return sim, [d.uuid for d in sim.devices()]


def test_each_finding_kind(tmp_path: Path) -> None:
    sim, g = _sim()
    sim.set_mig_mode(1, True)
    mig = sim.create_mig_instance(1, "3g.40gb", 4)
    other = sim.create_mig_instance(1, "3g.40gb", 0)
    a = pod("a", None, uid="uid-a")
    b = pod("b", None, uid="uid-b")
    c = pod("c", None, uid="uid-c")
    pods = {p.uid: p for p in (a, b, c)}
    shares = {
        "uid-a": unit_shares(assignment("a", share(0, g[0], Mechanism.MPS, 500, 4096)), {}),
        "uid-b": unit_shares(
            assignment("b", share(1, g[1], Mechanism.MIG, 1000, 0, MigSlot("3g.40gb", 4), Mechanism.EXCLUSIVE)),
            {1: sim.mig_instances(1)},
        ),
    }
    assert shares["uid-b"][0].unit_uuid == mig.uuid
    sim.add_process(10, g[0], 3000, "uid-a", mps=True)  # an honest MPS client…
    # …and one beside MPS: bypass, and 6000 MiB > 4096 and the two processes' contexts (640 + 1024) together
    sim.add_process(11, g[0], 3000, "uid-a")
    sim.add_process(12, other.uuid, 100, "uid-b")  # the other instance of the same GPU: wrong unit
    sim.add_process(13, g[2], 100, "uid-c")  # a pod with no share at all
    sim.add_process(14, g[2], 100)  # no pod
    views = [
        v
        for i in range(3)
        for v in attribute(
            GpuReading(
                sim.devices()[i],
                sim.utilization(i),
                0,
                sim.processes(i),
                frozenset(p.pid for p in sim.mps_processes(i) or ()),
                sim.process_utilization(i),
            ),
            sim.pod_uid_of,
            sim.process_name,
        )
    ]
    found = {(f.kind, f.pod, f.pids) for f in audit(views, pods, shares, {0: True, 1: True, 2: True})}
    assert found == {
        (FindingKind.MPS_BYPASS, "a", (11,)),
        (FindingKind.MEMORY_OVER_SHARE, "a", (10, 11)),
        (FindingKind.WRONG_UNIT, "b", (12,)),
        (FindingKind.WRONG_UNIT, "c", (13,)),
        (FindingKind.NO_POD, "", (14,)),
    }
    # Where the driver cannot list MPS clients, no bypass is claimed (the memory finding stays).
    found = {f.kind for f in audit(views, pods, shares, {0: False}) if f.pod == "a"}
    assert found == {FindingKind.MEMORY_OVER_SHARE}


@pytest.mark.parametrize(
    ("roles", "allowance"),
    [
        ((Role.MPS_CLIENT,), MPS_CLIENT_CONTEXT_MIB),
        ((Role.OWN_CONTEXT,), OWN_CONTEXT_MIB),
        ((Role.MPS_CLIENT, Role.MPS_CLIENT, Role.OWN_CONTEXT), 2 * MPS_CLIENT_CONTEXT_MIB + OWN_CONTEXT_MIB),
    ],
)
def test_memory_over_share_allows_each_process_its_cuda_context(roles: tuple[Role, ...], allowance: int) -> None:
    """NVML counts a process's CUDA context as its memory (500 and 730 MiB for the H200's MPS clients holding 128 MiB
    each): a pod whose data fills its share exactly is not over it; beyond the share and its processes' contexts it
    is. With --evict-on-audit, flagging a pod at its share evicted it."""
    p = pod("a", None, uid="uid-a")
    mech = Mechanism.MPS if Role.MPS_CLIENT in roles else Mechanism.TIME_SLICING
    shares = {"uid-a": unit_shares(assignment("a", share(0, "GPU-0", mech, 500, 8192)), {})}

    def found(total_mib: int) -> list[Finding]:
        first = total_mib - 100 * (len(roles) - 1)  # the others 100 MiB each
        views = [ProcView(10 + i, 0, "GPU-0", first if i == 0 else 100, r, "uid-a") for i, r in enumerate(roles)]
        return list(audit(views, {"uid-a": p}, shares, {0: False}))

    assert context_allowance_mib([ProcView(1, 0, "GPU-0", 66, Role.SERVER, None)]) == 0  # a server is nobody's
    assert found(8192) == []  # exactly the share
    assert found(8192 + allowance - 1) == []
    assert found(8192 + allowance) == []  # the share and the contexts, exactly
    (f,) = found(8192 + allowance + 1)
    assert f.kind is FindingKind.MEMORY_OVER_SHARE and f.pids == tuple(range(10, 10 + len(roles)))
    assert f"above its share of 8192 MiB ({mech.value}) and the {allowance} MiB allowed" in f.message


# ----- the sim backend through the agent's reconcile -------------------------------------------------------------------
U1000 = user_tenant("default", 1000)  # infer-1 and infer-2: one tenant, one daemon


def _agent(tmp: Path, sim: SimBackend, kube: FakeKube, notifier: FakeNotifier, **kw: object) -> NodeAgent:
    config = agent_config(tmp, tmp, tokens_per_gpu=2, **kw)
    return NodeAgent(config, sim, kube, SimMpsDaemon(sim), notifier=notifier)


def _mps_pair(tmp: Path, **kw: object) -> tuple[SimBackend, list[str], FakeKube, FakeNotifier, NodeAgent]:
    sim, g = _sim()
    kube = FakeKube(NodeInfo("node-a", {}, {}, 32000, 256 * 1024))
    for name in ("infer-1", "infer-2"):
        kube.add(pod(name, assignment(name, share(0, g[0], Mechanism.MPS, 400, 8192)), phase="Running", user=1000))
    notifier = FakeNotifier()
    return sim, g, kube, notifier, _agent(tmp, sim, kube, notifier, **kw)


def _pipe(agent: NodeAgent, unit: str, tenant: str) -> Path:
    """The pipe directory of ``tenant``'s daemon on ``unit``: what its clients reach it by."""
    return agent.mps.spec(unit, tenant).pipe_dir


def _text(agent: NodeAgent) -> str:
    from prometheus_client import generate_latest

    return generate_latest(new_registry(lambda: agent.snapshot)).decode()


def test_sim_under_mps_reports_like_the_h200_and_never_a_false_zero(tmp_path: Path) -> None:
    async def main() -> None:
        sim, g, _, _, agent = _mps_pair(tmp_path)
        await agent.reconcile_once()
        daemon = _pipe(agent, g[0], U1000)
        sim.add_process(501, g[0], 500, "uid-default-infer-1", sm_percent=20, mps=True, daemon=daemon, user=1000)
        sim.add_process(502, g[0], 730, "uid-default-infer-2", sm_percent=16, mps=True, daemon=daemon, user=1000)
        server = sim.mps_server_pid(g[0])
        assert server is not None
        assert {(p.pid, p.used_memory_mib) for p in sim.processes(0)} == {
            (server, MPS_SERVER_MEMORY_MIB),
            (501, 500),
            (502, 730),
        }
        assert sim.process_utilization(0) == {server: 36}
        assert {p.pid for p in sim.mps_processes(0) or ()} == {501, 502}
        await agent.reconcile_once()
        usage = {u.pod: (u.memory_used_mib, u.sm_util_percent) for u in agent.snapshot.pod_usage}
        assert usage == {"infer-1": (500, None), "infer-2": (730, None)}
        text = _text(agent)
        assert "sharegpu_pod_gpu_sm_utilization_percent{" not in text  # unknown is absent, not 0
        assert f'sharegpu_mps_unit_sm_utilization_percent{{UUID="{g[0]}",gpu="0",tenant="{U1000}"}} 36.0' in text
        assert agent.snapshot.findings == ()  # honest clients, in their shares
        sim.remove_process(502)  # one client pod left: the server's figure is its own
        await agent.reconcile_once()
        assert {u.pod: u.sm_util_percent for u in agent.snapshot.pod_usage} == {"infer-1": 20}

    asyncio.run(main())


def test_pods_of_different_tenants_on_one_gpu_each_get_their_own_servers_figure(tmp_path: Path) -> None:
    """A daemon per tenant: two pods of different users on one GPU are each the one client pod of their own server,
    so each has a real figure (an undeclared pod always has one), where one shared server left both unknown."""

    async def main() -> None:
        sim, g = _sim()
        kube = FakeKube(NodeInfo("node-a", {}, {}, 32000, 256 * 1024))
        a = kube.add(pod("a", assignment("a", share(0, g[0], Mechanism.MPS, 300, 8192)), phase="Running", user=1000))
        anon = kube.add(pod("anon", assignment("anon", share(0, g[0], Mechanism.MPS, 300, 8192)), phase="Running"))
        agent = _agent(tmp_path, sim, kube, FakeNotifier())
        await agent.reconcile_once()
        assert {k.tenant for k in agent.mps.running()} == {a.tenant, anon.tenant}
        assert sim.add_process(501, g[0], 500, a.uid, 30, mps=True, daemon=_pipe(agent, g[0], a.tenant), user=1000)
        # The undeclared pod's image runs as root; its own daemon serves it at once (no wait behind uid 1000).
        assert sim.add_process(601, g[0], 700, anon.uid, 45, mps=True, daemon=_pipe(agent, g[0], anon.tenant))
        servers = {p.pid for p in sim.processes(0)} - {501, 601}
        assert len(servers) == 2  # two servers side by side on one GPU
        await agent.reconcile_once()
        assert {u.pod: (u.memory_used_mib, u.sm_util_percent) for u in agent.snapshot.pod_usage} == {
            "a": (500, 30),
            "anon": (700, 45),
        }
        assert {(u.tenant, u.sm_percent, u.client_pods) for u in agent.snapshot.mps_units} == {
            (a.tenant, 30, 1),
            (anon.tenant, 45, 1),
        }
        # A client of no pod on the anonymous pod's daemon: its server's figure is no longer that pod's alone.
        sim.add_process(777, g[0], 100, None, 50, mps=True, daemon=_pipe(agent, g[0], anon.tenant))
        await agent.reconcile_once()
        assert {u.pod: u.sm_util_percent for u in agent.snapshot.pod_usage} == {"a": 30, "anon": None}

    asyncio.run(main())


def test_a_client_connected_to_another_tenants_daemon_is_found_and_told(tmp_path: Path) -> None:
    async def main() -> None:
        sim, g, kube, notifier, agent = _mps_pair(tmp_path)
        other = kube.add(pod("other", assignment("other", share(0, g[0], Mechanism.MPS, 100, 1024)), phase="Running"))
        await agent.reconcile_once()
        sim.add_process(501, g[0], 500, "uid-default-infer-1", mps=True, daemon=_pipe(agent, g[0], U1000), user=1000)
        # "other" (a tenant of its own) reached uid 1000's daemon (say, a hostPath volume of the state directory).
        sim.add_process(601, g[0], 500, other.uid, mps=True, daemon=_pipe(agent, g[0], U1000), user=1000)
        await agent.reconcile_once()
        (f,) = agent.snapshot.findings
        assert (f.kind, f.pod, f.pids) == (FindingKind.MPS_OTHER_TENANT, "other", (601,))
        assert "uid 1000 in default" in f.message and f"pod {other.uid} alone" in f.message
        assert notifier.reasons("other") == ["GpuAuditMpsOtherTenant"] and notifier.reasons("infer-1") == []
        # Its own daemon: nothing to find.
        sim.remove_process(601)
        sim.add_process(602, g[0], 500, other.uid, mps=True, daemon=_pipe(agent, g[0], other.tenant))
        await agent.reconcile_once()
        assert agent.snapshot.findings == ()

    asyncio.run(main())


def test_a_bypassing_client_gets_one_event_a_metric_and_no_eviction_by_default(tmp_path: Path) -> None:
    async def main() -> None:
        sim, g, _, notifier, agent = _mps_pair(tmp_path)
        await agent.reconcile_once()
        sim.add_process(501, g[0], 500, "uid-default-infer-1", mps=True, daemon=_pipe(agent, g[0], U1000), user=1000)
        sim.add_process(777, g[0], 500, "uid-default-infer-2")  # could not reach the daemon: no MPS, no limits
        for _ in range(3):
            await agent.reconcile_once()
        assert notifier.reasons("infer-2") == ["GpuAuditMpsBypassed"]  # once, not every reconcile
        assert notifier.events[0].type == "Warning" and "777" in notifier.events[0].message
        assert notifier.reasons("infer-1") == []
        assert notifier.evicted == []
        text = _text(agent)
        labels = f'UUID="{g[0]}",gpu="0",kind="mps-bypass",namespace="default",pod="infer-2"'
        assert f"sharegpu_audit_findings{{{labels}}} 1.0" in text
        assert 'sharegpu_audit_findings_seen_total{gpu="0",kind="mps-bypass"} 1.0' in text
        sim.remove_process(777)  # gone: the finding clears; a recurrence is told again
        await agent.reconcile_once()
        assert agent.snapshot.findings == ()
        sim.add_process(778, g[0], 500, "uid-default-infer-2")
        await agent.reconcile_once()
        assert notifier.reasons("infer-2") == ["GpuAuditMpsBypassed"] * 2

    asyncio.run(main())


def test_evict_on_audit_evicts_through_the_eviction_api_and_retries_a_blocked_one(tmp_path: Path) -> None:
    async def main() -> None:
        sim, g, _, notifier, agent = _mps_pair(tmp_path, evict_on_audit=True)
        await agent.reconcile_once()
        notifier.block_evictions = True
        sim.add_process(777, g[0], 500, "uid-default-infer-2")
        await agent.reconcile_once()
        assert notifier.evicted == []
        notifier.block_evictions = False
        await agent.reconcile_once()
        await agent.reconcile_once()
        assert notifier.evicted == [("default", "infer-2", "uid-default-infer-2")]  # once
        assert notifier.reasons("infer-2") == ["GpuAuditMpsBypassed", "GpuAuditEvicted"]
        assert 'sharegpu_audit_evictions_total{kind="mps-bypass"} 1.0' in _text(agent)

    asyncio.run(main())


def _three_tenants(tmp: Path) -> tuple[SimBackend, list[str], FakeKube, FakeNotifier, NodeAgent, PodInfo]:
    """infer-1 and infer-2 (uid 1000) and "root" (uid 0) MPS on GPU 0, "solo" time-sliced on GPU 1."""
    sim, g, kube, notifier, agent = _mps_pair(tmp)
    root = kube.add(pod("root", assignment("root", share(0, g[0], Mechanism.MPS, 200, 4096)), phase="Running", user=0))
    kube.add(pod("solo", assignment("solo", share(1, g[1], Mechanism.TIME_SLICING, 500)), phase="Running"))
    return sim, g, kube, notifier, agent, root


def test_a_fault_ends_only_its_own_daemons_clients_and_tells_only_its_pods(tmp_path: Path) -> None:
    """As on the H200 with driver 580: the server log gets the driver's two lines, no Xid is reported, every client
    of that server ends, and the daemon serves the next client; the unit's other daemon and a time-sliced neighbour
    run on, and their pods are not told."""

    async def main() -> None:
        sim, g, kube, notifier, agent, root = _three_tenants(tmp_path)
        await agent.reconcile_once()
        ours, theirs = _pipe(agent, g[0], U1000), _pipe(agent, g[0], root.tenant)
        sim.add_process(501, g[0], 500, "uid-default-infer-1", mps=True, daemon=ours, user=1000)
        sim.add_process(502, g[0], 730, "uid-default-infer-2", mps=True, daemon=ours, user=1000)
        sim.add_process(503, g[0], 300, root.uid, mps=True, daemon=theirs, user=0)
        sim.add_process(601, g[1], 300, "uid-default-solo")
        await agent.reconcile_once()
        server = sim.mps_server_pid(g[0], ours)
        assert sim.mps_fault(g[0], daemon=ours, client=502) == (501, 502)
        assert {p.pid for p in sim.processes(0)} == {server, sim.mps_server_pid(g[0], theirs), 503}
        assert sim.xid_events() == ()
        kube.set_phase("uid-default-infer-1", "Failed")  # its container died of it; the pod is finished already
        result = await agent.reconcile_once()
        (fault,) = result.faults
        assert (fault.unit_uuid, fault.tenant, fault.sources) == (g[0], U1000, ("log",))
        assert sorted(fault.pods) == ["default/infer-1", "default/infer-2"]
        for name in ("infer-1", "infer-2"):
            (event,) = [e for e in notifier.events if e.pod == name]
            assert event.reason == FAULT_REASON and event.type == "Warning"
            assert event.message.startswith(FAULT_MESSAGE) and "encountered a fatal GPU error" in event.message
        assert notifier.reasons("root") == [] and notifier.reasons("solo") == []
        # The daemon was healthy: left alone, and the same server serves the next client at once.
        assert [s.restarts for s in agent.mps.status() if s.tenant == U1000] == [0]
        assert sim.add_process(504, g[0], 100, "uid-default-infer-2", mps=True, daemon=ours, user=1000)
        assert sim.mps_server_pid(g[0], ours) == server
        text = _text(agent)
        assert f'sharegpu_mps_faults_total{{UUID="{g[0]}",gpu="0",tenant="{U1000}"}} 1.0' in text
        assert "sharegpu_gpu_xid_errors_total{" not in text
        await agent.reconcile_once()
        assert len(notifier.events) == 2  # told once

    asyncio.run(main())


def test_a_crashed_daemon_is_restarted_alone_and_its_pods_told(tmp_path: Path) -> None:
    async def main() -> None:
        sim, g, _, notifier, agent, root = _three_tenants(tmp_path)
        await agent.reconcile_once()
        ours, theirs = _pipe(agent, g[0], U1000), _pipe(agent, g[0], root.tenant)
        sim.add_process(501, g[0], 500, "uid-default-infer-1", mps=True, daemon=ours, user=1000)
        sim.add_process(503, g[0], 300, root.uid, mps=True, daemon=theirs, user=0)
        await agent.reconcile_once()
        agent.mps._daemon.crash(agent.mps.spec(g[0], U1000))  # type: ignore[attr-defined]
        assert {p.pid for p in sim.mps_processes(0) or ()} == {503}  # its server and clients ended; root's run on
        (fault,) = (await agent.reconcile_once()).faults
        assert (fault.tenant, fault.sources) == (U1000, ("server-gone",))
        assert sorted(fault.pods) == ["default/infer-1", "default/infer-2"] and notifier.reasons("root") == []
        assert {(s.tenant, s.restarts, s.up) for s in agent.mps.status()} == {(U1000, 1, True), (root.tenant, 0, True)}
        assert await agent.mps._daemon.healthy(agent.mps.spec(g[0], U1000))  # type: ignore[attr-defined]

    asyncio.run(main())


def test_a_server_stopped_by_the_agent_is_no_fault(tmp_path: Path) -> None:
    async def main() -> None:
        sim, g, kube, notifier, agent = _mps_pair(tmp_path)
        await agent.reconcile_once()
        sim.add_process(501, g[0], 500, "uid-default-infer-1", mps=True, daemon=_pipe(agent, g[0], U1000), user=1000)
        await agent.reconcile_once()
        kube.pods.clear()  # every pod gone: the agent stops the daemon, and its server ends
        sim.remove_process(501)
        result = await agent.reconcile_once()
        assert result.faults == () and notifier.events == []
        assert sim.mps_server_pid(g[0]) is None and sim.mps_daemons() == ()

    asyncio.run(main())


# ----- the signals one by one ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("line", "fault"),
    [
        ("[2026-11-26 10:00:00.000 Server 466] Client 503 encountered a fatal GPU exception", True),
        ("[2026-11-26 10:00:00.000 Control 400] Server 466 exited with status 1", True),
        ("[2026-11-26 10:00:00.000 Server 466] Xid 31 reported", True),
        ("illegal memory access was encountered", True),
        ("[2026-11-26 10:00:00.000 Server 466] Server is in FAULT state", True),
        ("[2026-11-26 10:00:00.000 Control 400] Server 466 exited with status 0", False),
        ("[2026-11-26 10:00:00.000 Server 466] New client 503 connected", False),
        ("[2026-11-26 10:00:00.000 Control 400] Cmd:get_server_status 466 FAULT", False),
        ("[2026-11-26 10:00:00.000 Server 466] Client 503 disconnected", False),
    ],
)
def test_log_lines(line: str, fault: bool) -> None:
    assert is_fault(parse_line("server.log", line)) is fault


def test_parse_line_reads_the_header() -> None:
    parsed = parse_line("server.log", "[2013-08-05 13:00:09.269 Server 13929] New client 14781 connected\n")
    assert (parsed.stamp, parsed.writer, parsed.pid, parsed.text) == (
        "2013-08-05 13:00:09.269",
        "Server",
        13929,
        "New client 14781 connected",
    )


def test_log_tail_reads_each_complete_line_once(tmp_path: Path) -> None:
    f = tmp_path / "server.log"
    f.write_text("old fatal line\n")
    tail = LogTail(f, from_end=True)
    assert tail.read() == []  # there before the agent looked: not reported again after a restart
    with f.open("a") as out:
        out.write("one\ntwo (half")
    assert tail.read() == ["one"]
    with f.open("a") as out:
        out.write(")\n")
    assert tail.read() == ["two (half)"]
    f.write_text("new\n")  # replaced by a new daemon's file (shorter): from its start
    assert tail.read() == ["new"]


def test_log_watch_reads_a_file_that_appears_later_from_its_start(tmp_path: Path) -> None:
    watch = MpsLogWatch()
    key = DaemonKey("GPU-x", U1000)
    logs = tmp_path / "GPU-x" / "log"
    assert watch.scan({key: logs}) == []
    logs.mkdir(parents=True)
    (logs / "control.log").write_text("[t Control 1] Server 2 exited with status 139\n[t Control 1] NEW UI\n")
    (signal,) = watch.scan({key: logs})
    assert (signal.daemon, signal.source) == (key, "log") and "status 139" in signal.detail


RECORDED = [
    line
    for line in (Path(__file__).parent / "fixtures" / "mps_fault_driver580.txt").read_text().splitlines()
    if line and not line.startswith("#")
]


def test_the_recorded_driver_580_fault_lines_are_faults() -> None:
    """What driver 580 wrote on the H200 (a fixture copied from the run's record, not the simulator's output)."""
    assert RECORDED == [
        "Client {PID: 910, Context: 1} encountered a fatal GPU error.",
        "Server is handling a fatal GPU error.",
    ]
    for text in RECORDED:
        line = parse_line("server.log", f"[2026-11-26 10:00:00.000 Server 466] {text}")
        assert (line.writer, line.pid, line.text) == ("Server", 466, text)
        assert is_fault(line), text


def test_the_simulated_fault_writes_the_recorded_lines_and_the_watch_reads_them(tmp_path: Path) -> None:
    sim, g = _sim()
    sim.start_mps_daemon(g[0], tmp_path / "a" / "pipe", log_dir=tmp_path / "a" / "log")
    sim.start_mps_daemon(g[0], tmp_path / "b" / "pipe", log_dir=tmp_path / "b" / "log")
    sim.add_process(501, g[0], 500, "uid-x", mps=True, daemon=tmp_path / "a" / "pipe")
    sim.add_process(502, g[0], 500, "uid-y", mps=True, daemon=tmp_path / "a" / "pipe")
    sim.add_process(503, g[0], 500, "uid-z", mps=True, daemon=tmp_path / "b" / "pipe", user=1000)
    server = sim.mps_server_pid(g[0], tmp_path / "a" / "pipe")
    (tmp_path / "a" / "log" / "control.log").parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "a" / "log" / "control.log").write_text(
        "[t Control 9] Cmd:get_server_list\n[t Control 9] Server 5 exited with status 0\n"
    )
    assert fault_lines(tmp_path / "a" / "log") == []
    with pytest.raises(BackendError, match="name the daemon"):
        sim.mps_fault(g[0])  # two daemons with clients: whose client faulted must be said
    assert sim.mps_fault(g[0], daemon=tmp_path / "a" / "pipe", client=502) == (501, 502)
    lines = fault_lines(tmp_path / "a" / "log")
    assert [(ln.file, ln.writer, ln.pid) for ln in lines] == [("server.log", "Server", server)] * 2
    assert [ln.text.replace("PID: 502,", "PID: 910,") for ln in lines] == RECORDED
    assert fault_lines(tmp_path / "b" / "log") == []  # the other daemon's server saw nothing
    # Only that server's clients ended; it stays (same pid); no Xid; the other daemon's client runs on.
    assert {p.pid for p in sim.mps_processes(0) or ()} == {503}
    assert sim.mps_server_pid(g[0], tmp_path / "a" / "pipe") == server and sim.xid_events() == ()


def test_server_watch() -> None:
    w = ServerWatch()
    u, v = DaemonKey("U", U1000), DaemonKey("U", "pod/x")
    assert w.update({u: [5], v: [7]}, [u, v], [u, v]) == []
    assert w.update({v: [7]}, [u, v], [v]) == []  # no pod of u's tenant shares the unit any more: a normal end
    w.update({u: [6], v: [7]}, [u, v], [u, v])
    (s,) = w.update({v: [7]}, [u, v], [u, v])
    assert (s.source, s.daemon) == ("server-gone", u) and "6" in s.detail


def test_fault_signals_within_the_window_are_one_incident() -> None:
    async def main() -> None:
        clock = [0.0]
        notifier = FakeNotifier()
        watch = EnforcementWatch(notifier, fault_window_s=60, clock=lambda: clock[0])
        p = pod("p", None, uid="u")
        gpu0 = DaemonKey("GPU-0", U1000)
        xid = XidEvent(0, "GPU-0", 31)
        assert len(await watch.faults([], [xid], {gpu0: 0}, {gpu0: [p]})) == 1  # the GPU's one daemon
        clock[0] = 30
        assert await watch.faults([], [xid], {gpu0: 0}, {gpu0: [p]}) == []
        clock[0] = 200
        assert len(await watch.faults([], [xid], {gpu0: 0}, {gpu0: [p]})) == 1
        assert watch.counts().faults == ((0, "GPU-0", U1000, 2),) and watch.counts().xids == ((0, "GPU-0", 31, 3),)
        # An Xid on a GPU with several daemons cannot say whose client faulted: it is told to none of them alone…
        a, b, other = DaemonKey("MIG-a", U1000), DaemonKey("MIG-b", "pod/x"), DaemonKey("GPU-0", "pod/y")
        daemons = {a: 1, b: 1, other: 0}
        assert await watch.faults([], [XidEvent(1, "GPU-1", 79)], daemons, {}) == []
        # …and adds to the daemon that shows a sign of its own.
        sign = FaultSignal("MIG-b", "log", "server.log: Server is handling a fatal GPU error.", "pod/x")
        (f,) = await watch.faults([sign], [XidEvent(1, "GPU-1", 79)], daemons, {})
        assert (f.daemon, f.sources) == (b, ("log", "xid"))
        # An Xid that names a MIG instance without an MPS daemon is no other instance's fault.
        clock[0] = 400
        assert await watch.faults([], [XidEvent(1, "MIG-c", 31)], daemons, {}) == []
        assert len(await watch.faults([], [XidEvent(1, "MIG-a", 31)], daemons, {})) == 1

    asyncio.run(main())


def test_an_xid_naming_a_mig_instance_is_not_told_to_the_one_mps_instance_beside_it() -> None:
    """Issue 33: an Xid naming MIG instance A (exclusive, or shared without MPS) was told to the pods of MPS instance
    B on the same GPU. With B the GPU's only daemon nothing masks it (with two, the several-daemons rule would)."""

    async def main() -> None:
        watch = EnforcementWatch(FakeNotifier(), fault_window_s=60, clock=lambda: 0.0)
        b = DaemonKey("MIG-b", U1000)
        p = pod("p", None, uid="u")
        assert await watch.faults([], [XidEvent(1, "MIG-a", 31)], {b: 1}, {b: [p]}) == []
        # The same Xid naming B is its fault, told to its pod.
        (f,) = await watch.faults([], [XidEvent(1, "MIG-b", 31)], {b: 1}, {b: [p]})
        assert (f.daemon, f.pods) == (b, ("default/p",))

    asyncio.run(main())


class SmErrorNvml(FakeNvml):
    """A driver whose per-process utilisation query fails with ``sm_error`` (None: answers as FakeNvml does)."""

    sm_error: str | None = None

    def process_utilization(self, h: FakeGpu) -> dict[int, int]:
        if self.sm_error is not None:
            raise NvmlCallError(self.sm_error, f"nvmlDeviceGetProcessUtilization: {self.sm_error}")
        return super().process_utilization(h)


P_UID = "0a1b2c3d-0000-1111-2222-00000000000f"


def _usage_through_the_agent(tmp_path: Path, gpu: FakeGpu, sm_error: str | None, mig: MigSlot | None) -> list[object]:
    """One reconcile of the agent over NVML on one H100 running pod p's process 77 (2 GiB, time-sliced; on the MIG
    instance ``mig`` names where given): the SM figures of the agent's metrics snapshot."""
    api = SmErrorNvml(gpu)
    api.sm_error = sm_error
    backend = NvmlBackend(api, proc_root=tmp_path / "proc")
    gi = None
    if mig is not None:
        gi = next(g.id for g in api.gpus[0].gis if g.start == mig.start)
    api.gpus[0].procs = [NvmlProcess(77, 2048 * MIB, gi)]
    (tmp_path / "proc" / "77").mkdir(parents=True)
    (tmp_path / "proc" / "77" / "cgroup").write_text(f"0::/kubepods/besteffort/pod{P_UID}/abc\n")
    (tmp_path / "proc" / "77" / "cmdline").write_bytes(b"python3\0")
    kube = FakeKube(NodeInfo("node-a", {}, {}, 32000, 256 * 1024))
    inner = Mechanism.TIME_SLICING if mig is not None else None
    mech = Mechanism.MIG if mig is not None else Mechanism.TIME_SLICING
    kube.add(pod("p", assignment("p", share(0, "GPU-0", mech, 500, 0, mig, inner)), uid=P_UID, phase="Running"))
    agent = NodeAgent(agent_config(tmp_path, tmp_path), backend, kube, SimMpsDaemon())
    asyncio.run(agent.reconcile_once())
    assert [(u.pod, u.memory_used_mib) for u in agent.snapshot.pod_usage] == [("p", 2048)]
    return [u.sm_util_percent for u in agent.snapshot.pod_usage]


@pytest.mark.parametrize("error", ["unknown", "gpu_lost", "not_supported", "timeout"])
def test_after_an_nvml_error_every_pods_sm_figure_is_unknown_not_zero(tmp_path: Path, error: str) -> None:
    """A non-MIG GPU: NVML_ERROR_NOT_FOUND means no sample (no process ran on the SMs: 0 is true); any other error
    says nothing, and every pod's figure is unknown (absent from the metrics), not 0."""
    assert _usage_through_the_agent(tmp_path, FakeGpu("NVIDIA H100 80GB HBM3"), error, None) == [None]


def test_no_sample_on_a_gpu_is_zero_and_a_sample_is_the_pods(tmp_path: Path) -> None:
    assert _usage_through_the_agent(tmp_path / "idle", FakeGpu("NVIDIA H100 80GB HBM3", sm=None), None, None) == [0]
    assert _usage_through_the_agent(tmp_path / "busy", FakeGpu("NVIDIA H100 80GB HBM3", sm={77: 40}), None, None) == [
        40
    ]


def test_no_per_process_figures_on_a_mig_gpu_are_unknown_not_zero(tmp_path: Path) -> None:
    """In MIG mode NVML keeps no per-process figures: its empty answer there is unknown, through the agent's own
    reading of the GPU (not a flag a test passes in)."""
    gpu = FakeGpu("NVIDIA H100 80GB HBM3", mig=True, gis=[FakeGi(1, 9, 4, 4)], sm=None)  # 3g.40gb at slot 4
    assert _usage_through_the_agent(tmp_path / "a", gpu, None, MigSlot("3g.40gb", 4)) == [None]
    gpu = FakeGpu("NVIDIA H100 80GB HBM3", mig=True, gis=[FakeGi(1, 9, 4, 4)])
    assert _usage_through_the_agent(tmp_path / "b", gpu, "not_supported", MigSlot("3g.40gb", 4)) == [None]
    # A driver that does keep them in MIG mode: the figure is the process's.
    gpu = FakeGpu("NVIDIA H100 80GB HBM3", mig=True, gis=[FakeGi(1, 9, 4, 4)], sm={77: 25})
    assert _usage_through_the_agent(tmp_path / "c", gpu, None, MigSlot("3g.40gb", 4)) == [25]
    # The reading says so itself, for any caller of pod_usage.
    backend = NvmlBackend(FakeNvml(FakeGpu("NVIDIA H100 80GB HBM3", mig=True)))
    assert not read_gpu(backend, backend.devices()[0]).sm_known


def test_a_client_whose_daemon_cannot_be_read_leaves_a_unit_of_several_servers_unknown() -> None:
    a, b = DaemonKey("GPU-0", U1000), DaemonKey("GPU-0", "pod/x")
    pods = _pods("pod-a", "pod-b")
    ua, ub = sorted(pods)

    def views(client_b: DaemonKey | None, server_b: DaemonKey | None) -> list[ProcView]:
        return [
            ProcView(1, 0, "GPU-0", 66, Role.SERVER, None, a),
            ProcView(2, 0, "GPU-0", 66, Role.SERVER, None, server_b),
            ProcView(10, 0, "GPU-0", 500, Role.MPS_CLIENT, ua, a),
            ProcView(11, 0, "GPU-0", 700, Role.MPS_CLIENT, ub, client_b),
        ]

    sm = {1: 30, 2: 45}
    rows, units = pod_usage(views(b, b), sm, pods)  # type: ignore[arg-type]
    assert [r.sm_percent for r in rows] == [30, 45] and {u.tenant for u in units} == {U1000, "pod/x"}
    rows, _ = pod_usage(views(None, b), sm, pods)  # type: ignore[arg-type]
    assert [r.sm_percent for r in rows] == [None, None]  # which server it runs on cannot be told: nothing is claimed
    # Its server's daemon unread, its own read: the one server of unknown daemon is its.
    rows, _ = pod_usage(views(b, None), sm, pods)  # type: ignore[arg-type]
    assert [r.sm_percent for r in rows] == [30, 45]
