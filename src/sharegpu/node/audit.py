"""The enforcement audit: what runs on each GPU and MIG instance, held against the pods' assignments.

An assignment says where a pod may run and how its unit is shared; only the driver says where its processes really
are. On every reconcile the agent reads NVML's processes of each GPU (the plain list, and the MPS-aware list of MPS
clients), ties each process to its pod (``/proc/<pid>/cgroup``) and reports what breaks the promise:

- ``wrong-unit``: a pod's process on a GPU or MIG instance the pod holds no share of (or a pod with no share at all);
- ``mps-bypass``: a process of a pod whose share on the unit is MPS, holding its own context instead of being an MPS
  client: it runs without the daemon's limits (a client that cannot reach its control daemon runs without MPS);
- ``mps-other-tenant``: a pod's MPS client connected to the daemon of another tenant (:mod:`sharegpu.model.tenant`)
  than its own: it shares a server, and a fault domain, with pods that were never meant to be its neighbours (and
  waits on them where they run as another user). The daemon is told by the pipe directory the process reaches
  it by (:meth:`~sharegpu.node.backends.base.GpuBackend.mps_pipe_dir`); where that cannot be read, nothing is claimed.
  A unit's legacy daemon (one daemon per unit, from an agent before tenants, adopted after an upgrade) is the own
  daemon of every pod it may serve (``served``), whatever their tenants: they were its clients before the upgrade;
- ``memory-over-share``: a pod's processes on a unit use more memory than its share and their CUDA contexts
  (:func:`context_allowance_mib`) together (shares with a memory figure);
- ``no-pod``: a process on the GPU that belongs to no pod (the MPS servers themselves excepted).

The pod of ``sharegpu bench``'s own Job (:func:`bench_pods`) runs on the node's GPUs without an assignment, by
design: its processes are not findings.

The same reading gives each pod's usage (:func:`pod_usage`): memory per process always; SM utilisation per process
except under MPS, where NVML reports each server's pid only, so a pod's figure is known only when it is the one client
pod of its daemon's server (a unit runs a daemon per tenant). Everything here is pure: the agent passes in what the
backend read.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from sharegpu.model.assignment import Assignment, Mechanism
from sharegpu.model.contract import ASSIGNMENT_ANNOTATION
from sharegpu.model.tenant import describe
from sharegpu.node.backends.base import (
    DeviceInfo,
    GpuBackend,
    MigInstanceInfo,
    ProcessInfo,
    Utilization,
    is_mps_server_name,
)
from sharegpu.node.kube import PodInfo
from sharegpu.node.mps import DaemonKey, tenant_words

# What a process holds on the GPU beyond its own data: its CUDA context, its libraries' workspaces and its allocator's
# rounding, which NVML counts as the process's memory and no share does (an MPS client's pinned-memory limit holds its
# allocations only). Measured on the H200 (driver 580, PyTorch 2.11; gpu-evidence h200-2026-11-26 §4 and
# gpucheck2.json): two MPS clients, each holding one 128 MiB bf16 matrix, read 500 and 730 MiB (up to 602 MiB beyond
# it); two processes with contexts of their own (time-slicing: the same PyTorch client, and a CuPy client that
# allocated nothing) read 612 and 966 MiB (up to 838 MiB beyond the matrix). Each rounded up, per process.
MPS_CLIENT_CONTEXT_MIB = 640
OWN_CONTEXT_MIB = 1024


# The labels of the pod of the chart's `sharegpu bench` Job (deploy/helm/sharegpu/templates/bench-job.yaml), which
# measures the node's GPUs itself: no assignment, bound by nodeName. Recognised only in sharegpu's own namespace
# (the agent's), where users do not create pods: elsewhere anyone could label a pod so.
BENCH_POD_LABELS: Mapping[str, str] = {
    "app.kubernetes.io/name": "sharegpu-bench",
    "app.kubernetes.io/component": "bench",
}


class FindingKind(StrEnum):
    WRONG_UNIT = "wrong-unit"
    MPS_BYPASS = "mps-bypass"
    MPS_OTHER_TENANT = "mps-other-tenant"
    MEMORY_OVER_SHARE = "memory-over-share"
    NO_POD = "no-pod"


class Role(StrEnum):
    SERVER = "mps-server"  # an MPS server: holds the context its clients run in
    MPS_CLIENT = "mps-client"  # listed by NVML's MPS-aware query
    OWN_CONTEXT = "own-context"  # a process with a context of its own (time-slicing, exclusive, MIG, or a bypass)


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One GPU as the backend read it in one reconcile."""

    device: DeviceInfo
    utilization: Utilization
    memory_used_mib: int
    processes: tuple[ProcessInfo, ...]  # NVML's plain list: MPS servers, MPS clients, everything else
    mps_clients: frozenset[int] | None  # pids of the MPS-aware list; None where the driver cannot tell
    sm_percent: Mapping[int, int]  # per pid; under MPS only the server's pid has one
    instances: tuple[MigInstanceInfo, ...] = ()
    sm_read: bool = True  # False: the driver answered the per-process query with an error

    @property
    def sm_known(self) -> bool:
        """Whether a process missing from :attr:`sm_percent` really used no SM: the driver answered, and, on a GPU
        in MIG mode (where NVML keeps no per-process figures), answered with some. Otherwise every figure is
        unknown, never 0."""
        return self.sm_read and (bool(self.sm_percent) or not self.device.mig_enabled)


@dataclass(frozen=True, slots=True)
class ProcView:
    """A process on a unit, with its role and its pod."""

    pid: int
    gpu_index: int
    unit_uuid: str
    memory_mib: int
    role: Role
    pod_uid: str | None
    daemon: DaemonKey | None = None  # the MPS daemon it is a client (or the server) of, where known


def read_gpu(backend: GpuBackend, device: DeviceInfo) -> GpuReading:
    """One GPU's processes (both lists), utilisation and MIG instances; raises :class:`BackendError` for a GPU that
    cannot be read."""
    mps = backend.mps_processes(device.index)
    sm = backend.process_utilization(device.index)
    return GpuReading(
        device,
        backend.utilization(device.index),
        backend.memory_used_mib(device.index),
        backend.processes(device.index),
        None if mps is None else frozenset(p.pid for p in mps),
        sm or {},
        backend.mig_instances(device.index) if device.mig_enabled else (),
        sm_read=sm is not None,
    )


def attribute(
    reading: GpuReading,
    pod_uid_of: Callable[[int], str | None],
    name_of: Callable[[int], str | None],
    daemon_of: Callable[[int], DaemonKey | None] | None = None,
) -> tuple[ProcView, ...]:
    """Each process of the plain list with its role, its pod and (``daemon_of``, for MPS clients and servers) its
    MPS daemon.

    An MPS server is a process the MPS-aware query does not list whose name is the server's; where the name cannot
    be read, one that belongs to no pod and sits on a unit that has MPS clients. Where the driver cannot list MPS
    clients at all, a pod's process on a unit that has an MPS server is taken for a client (its SM figure is the
    server's, not its own 0).
    """
    clients = reading.mps_clients or frozenset()
    units_with_clients = {p.unit_uuid for p in reading.processes if p.pid in clients}
    names = {p.pid: name_of(p.pid) for p in reading.processes if p.pid not in clients}
    uids = {p.pid: pod_uid_of(p.pid) for p in reading.processes}
    named_servers = {pid for pid, name in names.items() if name is not None and is_mps_server_name(name)}
    units_with_server = {p.unit_uuid for p in reading.processes if p.pid in named_servers}
    out = []
    for p in reading.processes:
        uid = uids[p.pid]
        if p.pid in clients:
            role = Role.MPS_CLIENT
        elif p.pid in named_servers or (names[p.pid] is None and uid is None and p.unit_uuid in units_with_clients):
            role = Role.SERVER
        elif reading.mps_clients is None and uid is not None and p.unit_uuid in units_with_server:
            role = Role.MPS_CLIENT
        else:
            role = Role.OWN_CONTEXT
        daemon = daemon_of(p.pid) if daemon_of is not None and role is not Role.OWN_CONTEXT else None
        out.append(ProcView(p.pid, p.gpu_index, p.unit_uuid, p.used_memory_mib, role, uid, daemon))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Finding:
    kind: FindingKind
    gpu_index: int
    unit_uuid: str
    namespace: str  # empty for a process of no pod
    pod: str
    pod_uid: str
    pids: tuple[int, ...]
    message: str  # for a person: what is wrong, and what it means

    @property
    def key(self) -> tuple[str, str, str]:
        """What identifies a finding across reconciles (a persisting one keeps its key)."""
        who = self.pod_uid or ",".join(str(p) for p in self.pids)
        return (self.kind.value, self.unit_uuid, who)


@dataclass(frozen=True, slots=True)
class UnitShare:
    """A pod's share of one unit, the unit named by the UUID its processes show (the GPU's, or the MIG instance's)."""

    unit_uuid: str
    gpu_index: int
    sharing: Mechanism  # how the unit is shared: exclusive, time-slicing or mps
    memory_mib: int
    label: str  # "GPU 0" or "GPU 1 MIG 3g.40gb@4", for messages


def unit_shares(assignment: Assignment, instances: Mapping[int, Iterable[MigInstanceInfo]]) -> tuple[UnitShare, ...]:
    """The units of an assignment; a MIG share whose instance is not there (yet) has none."""
    out = []
    for s in assignment.shares:
        if s.mig is None:
            out.append(UnitShare(s.gpu_uuid, s.gpu_index, s.sharing, s.memory_mib, f"GPU {s.gpu_index}"))
            continue
        for i in instances.get(s.gpu_index, ()):
            if i.start == s.mig.start and i.profile == s.mig.profile:
                label = f"GPU {s.gpu_index} MIG {s.mig.profile}@{s.mig.start}"
                out.append(UnitShare(i.uuid, s.gpu_index, s.sharing, s.memory_mib, label))
    return tuple(out)


def bench_pods(pods: Iterable[PodInfo], namespace: str) -> frozenset[str]:
    """The UIDs of the pods of ``sharegpu bench``'s Job among ``pods``: labelled as the chart labels it, in
    ``namespace`` (sharegpu's own; empty: none is recognised), holding no sharegpu GPU and no assignment."""
    return frozenset(
        p.uid
        for p in pods
        if namespace
        and p.namespace == namespace
        and all(p.labels.get(k) == v for k, v in BENCH_POD_LABELS.items())
        and p.gpu_demand == 0
        and ASSIGNMENT_ANNOTATION not in p.annotations
    )


def audit(
    procs: Iterable[ProcView],
    pods: Mapping[str, PodInfo],
    shares: Mapping[str, tuple[UnitShare, ...]],
    mps_known: Mapping[int, bool],
    tenants: Mapping[str, str] | None = None,
    exempt: Collection[str] = (),
    served: Mapping[str, Collection[DaemonKey]] | None = None,
) -> tuple[Finding, ...]:
    """The findings of one reading.

    ``pods``: the node's pods by UID; ``shares``: each pod's units by pod UID (a pod without an assignment has none);
    ``mps_known``: per GPU index, whether the driver answered the MPS-aware query (a bypass can only be told then);
    ``tenants``: per pod UID, the tenant whose daemon serves it on this node (a client of another tenant's daemon is
    told; a pod missing here is not checked); ``exempt``: pod UIDs whose processes are sharegpu's own use of the GPUs
    (:func:`bench_pods`), never a finding; ``served``: per pod UID, the daemons beside its tenant's whose clients it
    may have (a unit's legacy daemon, for the pods it served before an upgrade).
    """
    findings: list[Finding] = []
    per_pod_unit: dict[tuple[str, str], list[ProcView]] = {}
    no_pod: dict[tuple[int, str], list[int]] = {}
    for p in procs:
        if p.role is Role.SERVER or (p.pod_uid is not None and p.pod_uid in exempt):
            continue
        owner = pods.get(p.pod_uid) if p.pod_uid else None
        if owner is None:
            no_pod.setdefault((p.gpu_index, p.unit_uuid), []).append(p.pid)
            continue
        per_pod_unit.setdefault((owner.uid, p.unit_uuid), []).append(p)
    for (gpu, unit), pids in sorted(no_pod.items()):
        findings.append(
            Finding(
                FindingKind.NO_POD,
                gpu,
                unit,
                "",
                "",
                "",
                tuple(sorted(pids)),
                f"process(es) {', '.join(map(str, sorted(pids)))} on GPU {gpu} ({unit}) belong to no pod: "
                "they use the GPU outside every share sharegpu accounts for",
            )
        )
    for (uid, unit), ps in sorted(per_pod_unit.items()):
        findings += _pod_findings(
            pods[uid],
            unit,
            ps,
            shares.get(uid, ()),
            mps_known.get(ps[0].gpu_index, False),
            (tenants or {}).get(uid),
            (served or {}).get(uid, ()),
        )
    return tuple(findings)


def _pod_findings(
    owner: PodInfo,
    unit: str,
    ps: list[ProcView],
    held: tuple[UnitShare, ...],
    mps_known: bool,
    tenant: str | None = None,
    served: Collection[DaemonKey] = (),
) -> list[Finding]:
    """The findings of one pod's processes on one unit."""
    pids = tuple(sorted(p.pid for p in ps))
    gpu = ps[0].gpu_index
    share = next((s for s in held if s.unit_uuid == unit), None)

    def finding(kind: FindingKind, message: str, which: tuple[int, ...] = pids) -> Finding:
        return Finding(kind, gpu, unit, owner.namespace, owner.name, owner.uid, which, message)

    if share is None:
        names = ", ".join(s.label for s in held) or "no GPU share at all"
        return [
            finding(
                FindingKind.WRONG_UNIT,
                f"process(es) {_pids(pids)} of this pod run on GPU {gpu} ({unit}), which the pod holds no share "
                f"of (it holds: {names}); nothing enforces its limits there",
            )
        ]
    out = []
    if share.sharing is Mechanism.MPS and mps_known:
        own = tuple(p.pid for p in ps if p.role is Role.OWN_CONTEXT)
        if own:
            out.append(
                finding(
                    FindingKind.MPS_BYPASS,
                    f"process(es) {_pids(own)} of this pod on {share.label} are not clients of the unit's MPS "
                    "daemon: they run outside MPS, without its compute and memory limits (a client that cannot "
                    "reach its daemon's pipe directory runs without MPS); check CUDA_MPS_PIPE_DIRECTORY and the "
                    "mounted pipe directory",
                    own,
                )
            )
    foreign = [p for p in ps if p.role is Role.MPS_CLIENT and p.daemon is not None and tenant is not None]
    foreign = [p for p in foreign if p.daemon is not None and p.daemon.tenant != tenant and p.daemon not in served]
    for other in sorted({p.daemon for p in foreign if p.daemon is not None}):
        which = tuple(sorted(p.pid for p in foreign if p.daemon == other))
        out.append(
            finding(
                FindingKind.MPS_OTHER_TENANT,
                f"process(es) {_pids(which)} of this pod on {share.label} are clients of the MPS daemon of "
                f"{tenant_words(other.tenant)}, not of its own ({describe(tenant or '')}): they share that server and its "
                "fault domain with pods of another tenant; check the pod's volumes and CUDA_MPS_PIPE_DIRECTORY (only "
                "its own daemon's pipe directory is mounted for it)",
                which,
            )
        )
    used = sum(p.memory_mib for p in ps)
    contexts = context_allowance_mib(ps)
    if share.memory_mib > 0 and used > share.memory_mib + contexts:
        out.append(
            finding(
                FindingKind.MEMORY_OVER_SHARE,
                f"this pod uses {used} MiB on {share.label}, above its share of {share.memory_mib} MiB "
                f"({share.sharing.value}) and the {contexts} MiB allowed for its {len(ps)} process(es)' CUDA "
                "contexts; other pods on the unit may not get the memory they were promised",
            )
        )
    return out


def context_allowance_mib(procs: Iterable[ProcView]) -> int:
    """What a pod's processes on a unit may hold beyond their share: each one's CUDA context (an MPS client's is
    smaller, its server holding the shared part); an MPS server is nobody's."""
    return sum(
        MPS_CLIENT_CONTEXT_MIB if p.role is Role.MPS_CLIENT else OWN_CONTEXT_MIB
        for p in procs
        if p.role is not Role.SERVER
    )


def _pids(pids: Iterable[int]) -> str:
    return ", ".join(str(p) for p in pids)


@dataclass(frozen=True, slots=True)
class UsageRow:
    """One pod's use of one unit. ``sm_percent`` None: unknown (several pods share the unit's MPS server)."""

    pod_uid: str
    gpu_index: int
    unit_uuid: str
    memory_mib: int
    sm_percent: int | None


@dataclass(frozen=True, slots=True)
class MpsUnitUsage:
    """An MPS server's SM figure: all its clients together. A unit runs a server per daemon (per tenant)."""

    gpu_index: int
    unit_uuid: str
    sm_percent: int
    client_pods: int
    tenant: str | None = None  # the tenant of the server's daemon (None: not known)


_Server = tuple[str, DaemonKey | None]  # (unit, daemon): one MPS server


def pod_usage(
    procs: Iterable[ProcView], sm_percent: Mapping[int, int], pods: Mapping[str, PodInfo], sm_known: bool = True
) -> tuple[tuple[UsageRow, ...], tuple[MpsUnitUsage, ...]]:
    """Each pod's memory and SM use per unit, and each MPS server's figure.

    Memory is per process under every mechanism. SM utilisation is per process too, except for MPS clients: NVML
    gives each server's pid the figure of all its clients, so a pod that is the one client pod of its daemon's server
    gets the server's figure, and one that shares the server with another pod (or with a client of no pod) has an
    unknown figure (None), never 0. A client is tied to its server by its daemon (:attr:`ProcView.daemon`); one
    whose daemon (or its server's) is unknown belongs to the unit's server where the unit has one, and leaves every
    figure of the unit unknown where it has several (or none is listed). ``sm_known`` False
    (:attr:`GpuReading.sm_known`: the driver's per-process query failed, or a GPU in MIG mode, where NVML keeps no
    figures, gave none) leaves every SM figure unknown.
    """
    procs = list(procs)
    servers: dict[_Server, int] = {}
    for p in procs:
        if p.role is Role.SERVER:
            server = (p.unit_uuid, p.daemon)
            servers[server] = servers.get(server, 0) + sm_percent.get(p.pid, 0)
    on_unit: dict[str, list[_Server]] = {}
    for server in servers:
        on_unit.setdefault(server[0], []).append(server)

    def server_of(p: ProcView) -> _Server | None:
        """The server of client ``p``: its daemon's, else the one server of its unit it can be; None where it cannot
        be told (several, or none listed)."""
        here = on_unit.get(p.unit_uuid, [])
        if p.daemon is not None:
            if (p.unit_uuid, p.daemon) in servers:
                return (p.unit_uuid, p.daemon)
            here = [k for k in here if k[1] is None]  # servers whose daemon could not be read
        return here[0] if len(here) == 1 else None

    client_pods: dict[_Server, set[str]] = {}
    shared: set[_Server] = set()  # servers with a client of no (known) pod beside their pods
    unclear: set[str] = set()  # units with a client whose server cannot be told
    for p in procs:
        if p.role is not Role.MPS_CLIENT:
            continue
        of = server_of(p)
        if of is None:
            unclear.add(p.unit_uuid)
        elif p.pod_uid is not None and p.pod_uid in pods:
            client_pods.setdefault(of, set()).add(p.pod_uid)
        else:
            shared.add(of)
    memory: dict[tuple[str, str], int] = {}
    own: dict[tuple[str, str], int] = {}  # SM of the pod's own contexts
    via: dict[tuple[str, str], set[_Server | None]] = {}  # the servers its MPS clients run on (None: not told)
    gpu_of: dict[str, int] = {}
    for p in procs:
        if p.role is Role.SERVER or p.pod_uid is None or p.pod_uid not in pods:
            continue
        key = (p.pod_uid, p.unit_uuid)
        gpu_of[p.unit_uuid] = p.gpu_index
        memory[key] = memory.get(key, 0) + p.memory_mib
        if p.role is Role.MPS_CLIENT:
            via.setdefault(key, set()).add(None if p.unit_uuid in unclear else server_of(p))
        else:
            own[key] = own.get(key, 0) + sm_percent.get(p.pid, 0)

    def mps_part(key: tuple[str, str]) -> int | None:
        """The pod's part of its servers' figures: theirs where it is their one client pod, else unknown."""
        total = 0
        for on in via.get(key, ()):
            if on is None or on in shared or len(client_pods.get(on, ())) != 1:
                return None
            total += servers.get(on, 0)
        return total

    rows = []
    for key, mem in sorted(memory.items()):
        share = mps_part(key) if sm_known else None
        sm = None if share is None else min(100, own.get(key, 0) + share)
        rows.append(UsageRow(key[0], gpu_of[key[1]], key[1], mem, sm))
    gpu_of_unit = {p.unit_uuid: p.gpu_index for p in procs}
    units = tuple(
        MpsUnitUsage(
            gpu_of_unit[unit],
            unit,
            min(100, sm),
            len(client_pods.get((unit, daemon), ())),
            daemon.tenant if daemon is not None else None,
        )
        for (unit, daemon), sm in sorted(servers.items(), key=lambda kv: (kv[0][0], str(kv[0][1] or "")))
        if sm_known
    )
    return tuple(rows), units
