"""A simulated GPU node that follows the hardware's rules, so everything above the backend runs unchanged.

It keeps the catalog's MIG geometry and the driver's refusals: an instance at an explicit placement that
overlaps another fails, compute slices run out, MIG mode cannot change under running processes, and an
instance with processes cannot be destroyed. Without an explicit placement it picks the highest free valid
start, as the driver tends to, which is exactly what lets small instances created first block a later 3g.
Processes and utilisation are put in by tests (or a demo) through :meth:`SimBackend.add_process`.

MPS is reported as an H200 with driver 580 reported it: the first client of a unit (``add_process(..., mps=True)``)
brings up an MPS server process on that unit (66 MiB, no pod); :meth:`SimBackend.processes` lists the server and each
client with its own memory, :meth:`SimBackend.mps_processes` the clients only, and
:meth:`SimBackend.process_utilization` has the server's pid alone, with its clients' figures summed. A process added
with ``mps=False`` on a unit whose pods share it through MPS is a client that bypassed its daemon (no limits).
:meth:`SimBackend.mps_fault` plays a fatal fault in one client: every client of the server ends, the server too, the
server log gets its line and a critical Xid is queued.

GPU health can change while the process runs through the config's ``healthFile``: a YAML mapping
``unhealthy: [1, GPU-…]`` (GPU indices or UUIDs). While the file exists it decides every GPU's health (those listed
are unhealthy, the others healthy); without it the config's ``healthy`` and :meth:`SimBackend.set_health` do. It is
read again whenever it changes, so a driver or agent in another process sees an edit at its next ``devices()``.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from sharegpu.model.catalog import DEFAULT_CATALOG, Catalog, GpuModel, MigProfile
from sharegpu.node.backends.base import (
    MPS_SERVER_NAME,
    BackendError,
    DeviceInfo,
    GpuNotFound,
    InstanceInUse,
    InsufficientResources,
    InvalidPlacement,
    MigInstanceInfo,
    MigInstanceNotFound,
    MigNotEnabled,
    MigPlacement,
    MigProfileInfo,
    MigUnsupported,
    ProcessInfo,
    Utilization,
    XidEvent,
)
from sharegpu.node.backends.sim_config import SimConfig, SimConfigError
from sharegpu.node.durable import write_atomic

log = logging.getLogger(__name__)
_UUID_NAMESPACE = uuid.UUID("6b1f0c52-6a53-4c0e-9a55-3c1b8c0de001")
MPS_SERVER_MEMORY_MIB = 66  # what NVML listed for the MPS server on the H200
SERVER_LOG = "server.log"
_FIRST_SERVER_PID = 900_000  # simulated servers get pids far from those tests give clients
XID_MMU_FAULT = 31  # the Xid of a GPU memory page fault, as an illegal address gives


@dataclass(slots=True)
class _SimInstance:
    profile: MigProfile
    uuid: str


@dataclass(slots=True)
class _SimProcess:
    info: ProcessInfo
    pod_uid: str | None
    sm_percent: int
    mps_client: bool = False
    name: str = "python3"


@dataclass(slots=True)
class _SimGpu:
    index: int
    uuid: str
    model: GpuModel
    mig_enabled: bool
    healthy: bool
    instances: dict[int, _SimInstance] = field(default_factory=dict)
    utilization: Utilization = field(default_factory=lambda: Utilization(0, 0))


class SimBackend:
    """A GPU node in memory; with ``state_file`` its MIG layout outlives the agent, as on real hardware."""

    def __init__(self, config: SimConfig, seed: str = "sim", catalog: Catalog = DEFAULT_CATALOG) -> None:
        self._seed = config.uuid_seed or seed
        self._state_file = config.state_file
        self._health_file = config.health_file
        self._health_seen: tuple[int, int] | None = None  # (mtime_ns, size) of the health file last read
        self._unhealthy: frozenset[str] | None = None  # from the health file; None while there is none
        self._serial = 0
        self._gpus: list[_SimGpu] = []
        self._procs: dict[int, _SimProcess] = {}
        self._servers: dict[str, int] = {}  # unit UUID → pid of its MPS server
        self._next_server_pid = _FIRST_SERVER_PID
        self._xids: list[XidEvent] = []
        for group in config.gpus:
            model = catalog.strict(group.model)
            for _ in range(group.count):
                i = len(self._gpus)
                gpu_uuid = f"GPU-{uuid.uuid5(_UUID_NAMESPACE, f'{self._seed}/{i}')}"
                self._gpus.append(_SimGpu(i, gpu_uuid, model, group.mig, group.healthy))
        if self._state_file is not None and self._state_file.exists():
            self._load_state(self._state_file)
            return
        for group_start, group in _group_starts(config):
            for i in range(group_start, group_start + group.count):
                for slot in group.mig_instances:
                    try:
                        self.create_mig_instance(i, slot.profile, slot.start)
                    except BackendError as e:
                        raise SimConfigError(f"GPU {i} ({group.model}): static MIG layout is impossible: {e}") from None

    # ----- GpuBackend --------------------------------------------------------------------------------------
    def devices(self) -> tuple[DeviceInfo, ...]:
        self._read_health_file()
        return tuple(
            DeviceInfo(
                index=g.index,
                uuid=g.uuid,
                product=f"Simulated {g.model.name}",
                model=g.model.name,
                memory_mib=g.model.memory_mib,
                sms=g.model.sms,
                mig_enabled=g.mig_enabled,
                healthy=g.healthy if self._unhealthy is None else not ({str(g.index), g.uuid} & self._unhealthy),
            )
            for g in self._gpus
        )

    def mig_profiles(self, gpu_index: int) -> tuple[MigProfileInfo, ...]:
        g = self._gpu(gpu_index)
        return tuple(
            MigProfileInfo(p.name, p.compute_slices, p.memory_mib, tuple(MigPlacement(s, n) for s, n in p.placements()))
            for p in g.model.mig_profiles
        )

    def mig_instances(self, gpu_index: int) -> tuple[MigInstanceInfo, ...]:
        g = self._gpu(gpu_index)
        return tuple(
            MigInstanceInfo(g.index, inst.profile.name, start, inst.profile.memory_slots, inst.uuid)
            for start, inst in sorted(g.instances.items())
        )

    def set_mig_mode(self, gpu_index: int, enabled: bool) -> None:
        g = self._gpu(gpu_index)
        if enabled == g.mig_enabled:
            return
        if enabled and not g.model.mig_capable:
            raise MigUnsupported(f"GPU {gpu_index} ({g.model.name}) has no MIG")
        if self._procs_on(gpu_index):
            raise InstanceInUse(f"GPU {gpu_index} runs processes; MIG mode can change only on an idle GPU")
        if not enabled and g.instances:
            raise InstanceInUse(f"GPU {gpu_index} still has MIG instances; destroy them before disabling MIG")
        g.mig_enabled = enabled
        self._save_state()

    def create_mig_instance(self, gpu_index: int, profile: str, start: int | None = None) -> MigInstanceInfo:
        g = self._gpu(gpu_index)
        if not g.model.mig_capable:
            raise MigUnsupported(f"GPU {gpu_index} ({g.model.name}) has no MIG")
        if not g.mig_enabled:
            raise MigNotEnabled(f"MIG mode is off on GPU {gpu_index}; enable it before creating instances")
        try:
            p = g.model.profile(profile)
        except ValueError as e:
            raise MigUnsupported(str(e)) from None
        used_slices = sum(i.profile.compute_slices for i in g.instances.values())
        if used_slices + p.compute_slices > g.model.compute_slices:
            raise InsufficientResources(
                f"GPU {gpu_index}: {p.name} needs {p.compute_slices} compute slices, "
                f"{g.model.compute_slices - used_slices} are free"
            )
        if start is None:
            free = [s for s in p.starts if not self._overlaps(g, s, p.memory_slots)]
            if not free:
                raise InsufficientResources(f"GPU {gpu_index}: no free placement for {p.name} (Insufficient Resources)")
            start = max(free)
        elif start not in p.starts:
            raise InvalidPlacement(f"{p.name} cannot start at slot {start} on {g.model.name}; valid: {list(p.starts)}")
        elif self._overlaps(g, start, p.memory_slots):
            raise InsufficientResources(
                f"GPU {gpu_index}: {p.name} at slot {start} overlaps an existing instance (Insufficient Resources)"
            )
        self._serial += 1
        mig_uuid = f"MIG-{uuid.uuid5(_UUID_NAMESPACE, f'{g.uuid}/{p.name}@{start}#{self._serial}')}"
        g.instances[start] = _SimInstance(p, mig_uuid)
        self._save_state()
        return MigInstanceInfo(gpu_index, p.name, start, p.memory_slots, mig_uuid)

    def destroy_mig_instance(self, gpu_index: int, start: int) -> None:
        g = self._gpu(gpu_index)
        inst = g.instances.get(start)
        if inst is None:
            raise MigInstanceNotFound(f"GPU {gpu_index} has no MIG instance at slot {start}")
        if any(p.info.unit_uuid == inst.uuid for p in self._procs.values()):
            raise InstanceInUse(f"MIG instance {inst.uuid} on GPU {gpu_index} runs processes; it cannot be destroyed")
        del g.instances[start]
        self._save_state()

    def processes(self, gpu_index: int) -> tuple[ProcessInfo, ...]:
        self._gpu(gpu_index)
        return tuple(p.info for p in self._procs_on(gpu_index))

    def utilization(self, gpu_index: int) -> Utilization:
        return self._gpu(gpu_index).utilization

    def memory_used_mib(self, gpu_index: int) -> int:
        self._gpu(gpu_index)
        return sum(p.info.used_memory_mib for p in self._procs_on(gpu_index))

    def process_utilization(self, gpu_index: int) -> dict[int, int]:
        out: dict[int, int] = {}
        for p in self._procs_on(gpu_index):
            if p.mps_client:
                server = self._servers.get(p.info.unit_uuid)
                if server is not None:
                    out[server] = min(100, out.get(server, 0) + p.sm_percent)
            elif p.info.pid not in self._servers.values():
                out[p.info.pid] = p.sm_percent
        return out

    def mps_processes(self, gpu_index: int) -> tuple[ProcessInfo, ...] | None:
        self._gpu(gpu_index)
        return tuple(p.info for p in self._procs_on(gpu_index) if p.mps_client)

    def process_name(self, pid: int) -> str | None:
        p = self._procs.get(pid)
        return p.name if p else None

    def xid_events(self) -> tuple[XidEvent, ...]:
        out, self._xids = tuple(self._xids), []
        return out

    def pod_uid_of(self, pid: int) -> str | None:
        p = self._procs.get(pid)
        return p.pod_uid if p else None

    def device_nodes(self, gpu_index: int) -> tuple[str, ...]:
        # A simulated GPU has no device node: containers get its environment and mounts only.
        self._gpu(gpu_index)
        return ()

    def close(self) -> None:
        pass

    # ----- driving the simulation ---------------------------------------------------------------------------
    def add_process(
        self,
        pid: int,
        unit_uuid: str,
        used_memory_mib: int,
        pod_uid: str | None = None,
        sm_percent: int = 0,
        *,
        mps: bool = False,
    ) -> None:
        """A process that opened a context on a GPU or MIG instance (named by UUID).

        With ``mps`` it is a client of the unit's MPS server, started with it when it is the first; without, it holds
        its own context, which on a unit shared through MPS is a client that bypassed its daemon.
        """
        gpu_index = self._unit_gpu(unit_uuid)
        if mps:
            self.start_mps_server(unit_uuid)
        self._procs[pid] = _SimProcess(
            ProcessInfo(pid, gpu_index, unit_uuid, used_memory_mib), pod_uid, sm_percent, mps_client=mps
        )

    def remove_process(self, pid: int) -> None:
        """The process ends (an MPS server's clients are left to the caller: see :meth:`mps_fault`)."""
        self._procs.pop(pid, None)
        self._servers = {u: s for u, s in self._servers.items() if s != pid}

    def start_mps_server(self, unit_uuid: str) -> int:
        """The unit's MPS server (started now if it has none, as the daemon does for a first client); its pid."""
        if unit_uuid in self._servers:
            return self._servers[unit_uuid]
        gpu_index = self._unit_gpu(unit_uuid)
        pid = self._next_server_pid
        self._next_server_pid += 1
        self._servers[unit_uuid] = pid
        self._procs[pid] = _SimProcess(
            ProcessInfo(pid, gpu_index, unit_uuid, MPS_SERVER_MEMORY_MIB), None, 0, name=MPS_SERVER_NAME
        )
        return pid

    def mps_server_pid(self, unit_uuid: str) -> int | None:
        return self._servers.get(unit_uuid)

    def stop_mps_server(self, unit_uuid: str) -> None:
        """The daemon quit: its server ends, and its clients with it."""
        pid = self._servers.pop(unit_uuid, None)
        if pid is not None:
            self._procs.pop(pid, None)
        for p in [p for p in self._procs.values() if p.mps_client and p.info.unit_uuid == unit_uuid]:
            del self._procs[p.info.pid]

    def mps_fault(
        self, unit_uuid: str, log_dir: Path | None = None, xid: int | None = XID_MMU_FAULT
    ) -> tuple[int, ...]:
        """A fatal fault in one MPS client of ``unit_uuid`` (an illegal address): every client of the server ends,
        and the server. With ``log_dir`` (the daemon's log directory) the server's log gets its line; with ``xid``
        the driver reports that critical Xid. Returns the pids that ended."""
        server = self._servers.get(unit_uuid)
        clients = sorted(p.info.pid for p in self._procs.values() if p.mps_client and p.info.unit_uuid == unit_uuid)
        if server is None or not clients:
            raise BackendError(f"no MPS client runs on {unit_uuid}: nothing to fault")
        if log_dir is not None:
            stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
            log_dir.mkdir(parents=True, exist_ok=True)
            with (log_dir / SERVER_LOG).open("a") as f:
                f.write(
                    f"[{stamp} Server {server}] Client {clients[0]} encountered a fatal GPU exception "
                    "(illegal memory access); all clients of this server are terminated\n"
                )
        if xid is not None:
            self._xids.append(XidEvent(self._unit_gpu(unit_uuid), unit_uuid, xid))
        self.stop_mps_server(unit_uuid)
        return (*clients, server)

    def set_health(self, gpu_index: int, healthy: bool) -> None:
        self._gpu(gpu_index).healthy = healthy

    def set_utilization(self, gpu_index: int, gpu_percent: int, memory_percent: int = 0) -> None:
        self._gpu(gpu_index).utilization = Utilization(gpu_percent, memory_percent)

    # ----- internals ------------------------------------------------------------------------------------------
    def _read_health_file(self) -> None:
        if self._health_file is None:
            return
        try:
            st = self._health_file.stat()
        except FileNotFoundError:
            self._health_seen, self._unhealthy = None, None
            return
        except OSError as e:
            raise BackendError(
                f"cannot read the simulated health file {self._health_file}: {e.strerror or e}"
            ) from None
        if self._health_seen == (st.st_mtime_ns, st.st_size):
            return
        self._health_seen = (st.st_mtime_ns, st.st_size)
        try:
            data: Any = yaml.safe_load(self._health_file.read_text()) or {}
            listed = (data.get("unhealthy") or []) if isinstance(data, dict) else None
            if not isinstance(listed, list) or set(data) - {"unhealthy"}:
                raise ValueError("expected a mapping such as unhealthy: [1, GPU-…]")
        except (OSError, ValueError, yaml.YAMLError) as e:
            # A half-written edit must not flip every GPU: keep what was read last, say why once per version.
            log.warning("simulated health file %s ignored: %s", self._health_file, e)
            return
        self._unhealthy = frozenset(str(x) for x in listed)

    def _gpu(self, gpu_index: int) -> _SimGpu:
        if not 0 <= gpu_index < len(self._gpus):
            raise GpuNotFound(f"this node has no GPU with index {gpu_index}; it has {len(self._gpus)}")
        return self._gpus[gpu_index]

    def _unit_gpu(self, unit_uuid: str) -> int:
        for g in self._gpus:
            if g.uuid == unit_uuid or any(i.uuid == unit_uuid for i in g.instances.values()):
                return g.index
        raise GpuNotFound(f"no GPU or MIG instance has UUID {unit_uuid}")

    def _procs_on(self, gpu_index: int) -> list[_SimProcess]:
        return [p for p in self._procs.values() if p.info.gpu_index == gpu_index]

    @staticmethod
    def _overlaps(g: _SimGpu, start: int, size: int) -> bool:
        return any(s < start + size and start < s + i.profile.memory_slots for s, i in g.instances.items())

    def _save_state(self) -> None:
        if self._state_file is None:
            return
        state = {
            "serial": self._serial,
            "gpus": [
                {
                    "uuid": g.uuid,
                    "mig": g.mig_enabled,
                    "instances": [
                        {"start": s, "profile": i.profile.name, "uuid": i.uuid} for s, i in g.instances.items()
                    ],
                }
                for g in self._gpus
            ],
        }
        write_atomic(self._state_file, json.dumps(state))

    def _load_state(self, path: Path) -> None:
        try:
            state: Any = json.loads(path.read_text())
            self._serial = int(state["serial"])
            saved = state["gpus"]
            if [s["uuid"] for s in saved] != [g.uuid for g in self._gpus]:
                raise SimConfigError(
                    f"simulated state {path} describes other GPUs than the config; delete it to start afresh"
                )
            for g, s in zip(self._gpus, saved, strict=True):
                g.mig_enabled = bool(s["mig"])
                g.instances = {
                    int(i["start"]): _SimInstance(g.model.profile(str(i["profile"])), str(i["uuid"]))
                    for i in s["instances"]
                }
        except SimConfigError:
            raise
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SimConfigError(f"simulated state {path} is unreadable ({e}); delete it to start afresh") from None


def _group_starts(config: SimConfig) -> list[tuple[int, Any]]:
    out = []
    start = 0
    for group in config.gpus:
        out.append((start, group))
        start += group.count
    return out
