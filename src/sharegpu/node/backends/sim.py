"""A simulated GPU node that follows the hardware's rules, so everything above the backend runs unchanged.

It keeps the catalog's MIG geometry and the driver's refusals: an instance at an explicit placement that
overlaps another fails, compute slices run out, MIG mode cannot change under running processes, and an
instance with processes cannot be destroyed. Without an explicit placement it picks the highest free valid
start, as the driver tends to, which is exactly what lets small instances created first block a later 3g.
Processes and utilisation are put in by tests (or a demo) through :meth:`SimBackend.add_process`.

MPS is reported as an H200 with driver 580 reported it. A unit can run several MPS control daemons side by side
(:meth:`SimBackend.start_mps_daemon`, named by their pipe directory, as :class:`~sharegpu.node.mps.SimMpsDaemon`
registers them), each with a server of its own (66 MiB, no pod) that its first client brings up
(``add_process(..., mps=True, daemon=<pipe directory>)``; without a ``daemon``, the unit's only one, or one started
for it). :meth:`SimBackend.processes` lists each server and each client with its own memory,
:meth:`SimBackend.mps_processes` the clients only, and :meth:`SimBackend.process_utilization` has each server's pid
alone, with its own clients' figures summed. A process added with ``mps=False`` on a unit whose pods share it through
MPS is a client that bypassed its daemon (no limits).

A server serves one Unix user at a time (``user``; a multi-user daemon, ``-M``, serves every user): a client of
another uid arriving while the server has clients **waits** in CUDA initialisation, listed nowhere
(:meth:`SimBackend.mps_waiting`; ``add_process`` answers False), and so does every client after it on that daemon;
when the running server's last client ends, the daemon replaces the server with one for the first waiting client's
user (a new pid) and its clients of that user run. An idle server of another user is replaced at once. (H200: a
root client beside a uid-1000 client on one daemon waited 13.1 s, until the uid-1000 client had exited, then ran.)

:meth:`SimBackend.mps_fault` plays a fatal fault in one client, as driver 580 showed it on the H200: the server's log
gets ``Client {PID: …, Context: 1} encountered a fatal GPU error.`` and ``Server is handling a fatal GPU error.``
(:data:`MPS_FAULT_LINES`), every client of that server ends, no Xid is reported (unless a test asks for one), and the
server stays to serve the next client. Clients of the unit's other daemons and processes with contexts of their own
(time-sliced neighbours) run on.

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
XID_MMU_FAULT = 31  # the Xid of a GPU memory page fault, as an illegal address gives (none reached NVML on the H200)
# What the MPS server of driver 580 wrote to server.log when one of its clients hit an illegal address (H200,
# BENCHMARKS.md "On a real GPU", check fault.told), after the "[<stamp> Server <pid>]" header. {client}: its pid.
MPS_FAULT_LINES = (
    "Client {{PID: {client}, Context: 1}} encountered a fatal GPU error.",
    "Server is handling a fatal GPU error.",
)


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
    daemon: str | None = None  # the MPS daemon it is a client (or the server) of
    user: int = 0  # the Unix UID it runs as
    waiting: bool = False  # an MPS client waiting in CUDA initialisation for a server of its user: no context yet


@dataclass(slots=True)
class _SimDaemon:
    """One MPS control daemon: named by its pipe directory, on one unit, running at most one server at a time."""

    name: str
    unit_uuid: str
    multi_user: bool = False
    log_dir: Path | None = None
    pipe_dir: str | None = None  # None: one a test started without a directory
    server: int | None = None  # pid of its server
    server_user: int | None = None  # whom the server serves (None with a multi-user daemon: everyone)
    waiting: list[int] = field(default_factory=list)  # clients in CUDA initialisation, in arrival order


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
        self._daemons: dict[str, _SimDaemon] = {}  # by name: its pipe directory
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
        servers = {d.server for d in self._daemons.values() if d.server is not None}
        for p in self._procs_on(gpu_index):
            if p.mps_client:
                d = self._daemons.get(p.daemon or "")
                if d is not None and d.server is not None:
                    out[d.server] = min(100, out.get(d.server, 0) + p.sm_percent)
            elif p.info.pid not in servers:
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

    def mps_pipe_dir(self, pid: int) -> str | None:
        p = self._procs.get(pid)
        d = self._daemons.get(p.daemon or "") if p is not None else None
        return d.pipe_dir if d is not None else None

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
        daemon: str | Path | None = None,
        user: int = 0,
    ) -> bool:
        """A process that opens a context on a GPU or MIG instance (named by UUID), running as ``user``.

        With ``mps`` it is a client of MPS daemon ``daemon`` (its pipe directory; None: the unit's only daemon, or one
        started for it), whose server starts with its first client. Returns False when the client waits in CUDA
        initialisation instead (the server serves another user now: see the module's docstring); it then holds no
        context and is listed nowhere until it runs. Without ``mps`` it holds its own context, which on a unit shared
        through MPS is a client that bypassed its daemon.
        """
        gpu_index = self._unit_gpu(unit_uuid)
        proc = _SimProcess(
            ProcessInfo(pid, gpu_index, unit_uuid, used_memory_mib), pod_uid, sm_percent, mps_client=mps, user=user
        )
        if not mps:
            self._procs[pid] = proc
            return True
        d = self._daemon_for(unit_uuid, daemon)
        proc.daemon = d.name
        busy = bool(self._clients(d))
        self._procs[pid] = proc
        if not d.waiting and (d.server is None or d.multi_user or d.server_user == user or not busy):
            self._serve(d, user)  # its user's server, started now, or one of another user that was idle: replaced
            return True
        proc.waiting = True  # another user's clients hold the server (or others wait before it)
        d.waiting.append(pid)
        return False

    def remove_process(self, pid: int) -> None:
        """The process ends. An MPS server's clients are left to the caller (see :meth:`mps_fault`); a client that
        was the last of its server's user lets the clients waiting for another user run."""
        p = self._procs.pop(pid, None)
        if p is None:
            return
        for d in self._daemons.values():
            if d.server == pid:
                d.server, d.server_user = None, None
            if pid in d.waiting:
                d.waiting.remove(pid)
        own = self._daemons.get(p.daemon or "")
        if own is not None and p.mps_client:
            self._settle(own)

    def start_mps_daemon(
        self,
        unit_uuid: str,
        pipe_dir: str | Path | None = None,
        *,
        multi_user: bool = False,
        log_dir: Path | None = None,
    ) -> str:
        """An MPS control daemon for ``unit_uuid`` with its pipe directory (``multi_user``: started with -M, one server
        for every user); its name (the pipe directory). Starting one that runs already changes nothing."""
        self._unit_gpu(unit_uuid)
        name = str(pipe_dir) if pipe_dir is not None else unit_uuid
        d = self._daemons.get(name)
        if d is None:
            d = self._daemons[name] = _SimDaemon(
                name, unit_uuid, multi_user, log_dir, str(pipe_dir) if pipe_dir else None
            )
        elif d.unit_uuid != unit_uuid:
            raise BackendError(f"the MPS daemon of {name} serves {d.unit_uuid}, not {unit_uuid}")
        return name

    def stop_mps_daemon(self, daemon: str | Path) -> None:
        """The daemon quits: its server ends, and its clients (those waiting too)."""
        d = self._daemons.pop(str(daemon), None)
        if d is None:
            return
        for p in [p for p in self._procs.values() if p.daemon == d.name]:
            del self._procs[p.info.pid]

    def mps_daemons(self, unit_uuid: str | None = None) -> tuple[str, ...]:
        """The daemons that run (on ``unit_uuid``), by name."""
        return tuple(sorted(n for n, d in self._daemons.items() if unit_uuid is None or d.unit_uuid == unit_uuid))

    def start_mps_server(self, unit_uuid: str, daemon: str | Path | None = None, user: int = 0) -> int:
        """The server of ``daemon`` on ``unit_uuid`` (started now for ``user`` if it has none); its pid."""
        d = self._daemon_for(unit_uuid, daemon)
        if d.server is None:
            self._serve(d, user)
        assert d.server is not None
        return d.server

    def mps_server_pid(self, unit_uuid: str, daemon: str | Path | None = None) -> int | None:
        """The pid of ``daemon``'s server; without ``daemon``, of the unit's one server (None: none runs)."""
        if daemon is not None:
            d = self._daemons.get(str(daemon))
            return d.server if d is not None else None
        servers = [d.server for d in self._daemons.values() if d.unit_uuid == unit_uuid and d.server is not None]
        if len(servers) > 1:
            raise BackendError(f"{unit_uuid} runs {len(servers)} MPS servers; name the daemon")
        return servers[0] if servers else None

    def mps_server_user(self, daemon: str | Path) -> int | None:
        """Whom ``daemon``'s server serves now (None: no server, or a multi-user one)."""
        d = self._daemons.get(str(daemon))
        return d.server_user if d is not None else None

    def mps_waiting(self, daemon: str | Path | None = None) -> tuple[int, ...]:
        """The clients waiting in CUDA initialisation (of ``daemon``, else of every daemon), in arrival order."""
        return tuple(
            pid for d in self._daemons.values() if daemon is None or d.name == str(daemon) for pid in d.waiting
        )

    def stop_mps_server(self, unit_uuid: str) -> None:
        """Every daemon of the unit quits: their servers end, and their clients with them."""
        for d in [d for d in self._daemons.values() if d.unit_uuid == unit_uuid]:
            self.stop_mps_daemon(d.name)

    def mps_fault(
        self,
        unit_uuid: str,
        log_dir: Path | None = None,
        xid: int | None = None,
        *,
        daemon: str | Path | None = None,
        client: int | None = None,
    ) -> tuple[int, ...]:
        """A fatal fault (an illegal address) in one MPS client of ``daemon`` on ``unit_uuid`` (None: the unit's one
        daemon with clients), by default its first: every client of that server ends, the server stays and serves
        the next client. The server's log (``log_dir``, else the daemon's own) gets driver 580's two lines
        (:data:`MPS_FAULT_LINES`); ``xid`` queues that critical Xid, which driver 580 did not report. Returns the
        pids that ended."""
        if daemon is not None:
            d = self._daemons.get(str(daemon))
            if d is None or d.unit_uuid != unit_uuid:
                raise BackendError(f"no MPS daemon {daemon} runs on {unit_uuid}")
        else:
            busy = [d for d in self._daemons.values() if d.unit_uuid == unit_uuid and self._clients(d)]
            if len(busy) > 1:
                raise BackendError(f"{unit_uuid} has clients on {len(busy)} MPS daemons; name the daemon")
            d = busy[0] if busy else None
        clients = self._clients(d) if d is not None else []
        if d is None or d.server is None or not clients:
            raise BackendError(f"no MPS client runs on {unit_uuid}: nothing to fault")
        culprit = client if client is not None else clients[0]
        if culprit not in clients:
            raise BackendError(f"process {culprit} is no client of the MPS daemon {d.name}")
        log_dir = log_dir if log_dir is not None else d.log_dir
        if log_dir is not None:
            stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
            log_dir.mkdir(parents=True, exist_ok=True)
            with (log_dir / SERVER_LOG).open("a") as f:
                for line in MPS_FAULT_LINES:
                    f.write(f"[{stamp} Server {d.server}] {line.format(client=culprit)}\n")
        if xid is not None:
            self._xids.append(XidEvent(self._unit_gpu(unit_uuid), unit_uuid, xid))
        for pid in clients:
            del self._procs[pid]
        self._settle(d)
        return tuple(clients)

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
        """The processes that hold a context on the GPU (a client waiting in CUDA initialisation holds none)."""
        return [p for p in self._procs.values() if p.info.gpu_index == gpu_index and not p.waiting]

    def _daemon_for(self, unit_uuid: str, daemon: str | Path | None) -> _SimDaemon:
        if daemon is not None:
            name = self.start_mps_daemon(unit_uuid, daemon)  # one the agent started before this backend existed
            return self._daemons[name]
        on_unit = [d for d in self._daemons.values() if d.unit_uuid == unit_uuid]
        if len(on_unit) > 1:
            raise BackendError(f"{unit_uuid} runs {len(on_unit)} MPS daemons; name the client's daemon")
        return on_unit[0] if on_unit else self._daemons[self.start_mps_daemon(unit_uuid)]

    def _clients(self, d: _SimDaemon) -> list[int]:
        """The clients that run on ``d``'s server (not those waiting), by pid."""
        return sorted(p.info.pid for p in self._procs.values() if p.daemon == d.name and p.mps_client and not p.waiting)

    def _serve(self, d: _SimDaemon, user: int) -> None:
        """``d``'s server serves ``user`` (a multi-user one, everyone): one of another user is replaced."""
        wanted = None if d.multi_user else user
        if d.server is not None and d.server_user == wanted:
            return
        if d.server is not None:
            self._procs.pop(d.server, None)
        pid = self._next_server_pid
        self._next_server_pid += 1
        d.server, d.server_user = pid, wanted
        self._procs[pid] = _SimProcess(
            ProcessInfo(pid, self._unit_gpu(d.unit_uuid), d.unit_uuid, MPS_SERVER_MEMORY_MIB),
            None,
            0,
            name=MPS_SERVER_NAME,
            daemon=d.name,
            user=0 if wanted is None else wanted,
        )

    def _settle(self, d: _SimDaemon) -> None:
        """Once ``d``'s server has no client left, the first waiting client's user gets the server, and every waiting
        client of that user runs (in order, up to one of another user)."""
        if not d.waiting or self._clients(d):
            return
        user = self._procs[d.waiting[0]].user
        self._serve(d, user)
        while d.waiting and (d.multi_user or self._procs[d.waiting[0]].user == user):
            self._procs[d.waiting.pop(0)].waiting = False

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
