"""The real GPU backend: :class:`NvmlBackend` maps what NVML returns (through
:class:`~sharegpu.node.backends.nvml_api.NvmlApi`, the only layer that touches pynvml) to sharegpu's terms — catalog
model and profile names, placements, MIG UUIDs, typed errors. Tests drive it through a fake of ``NvmlApi``.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from sharegpu.kube.quantity import capacity_mib
from sharegpu.model.catalog import DEFAULT_CATALOG, Catalog, GpuModel
from sharegpu.node.backends.base import (
    BackendError,
    DeviceInfo,
    GpuNotFound,
    InstanceInUse,
    InsufficientResources,
    InvalidPlacement,
    MigInstanceInfo,
    MigInstanceNotFound,
    MigModeInUse,
    MigModePending,
    MigNotEnabled,
    MigPlacement,
    MigProfileInfo,
    MigUnsupported,
    ProcessInfo,
    ResetRequired,
    Utilization,
    XidEvent,
)
from sharegpu.node.backends.nvml_api import (
    XID_CRITICAL_ERROR,
    GiProfile,
    NvmlApi,
    NvmlCallError,
    NvmlProcess,
)

log = logging.getLogger(__name__)

_EVENTS_PER_POLL = 256  # a storm of Xids is drained over several reconciles, never in one unbounded loop


NVIDIA_CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")

_ERRORS: dict[str, type[BackendError]] = {
    "insufficient": InsufficientResources,
    "in_use": InstanceInUse,
    "invalid": InvalidPlacement,
    "not_supported": MigUnsupported,
    "not_found": MigInstanceNotFound,
}


def _err(e: NvmlCallError, what: str) -> BackendError:
    return _ERRORS.get(e.kind, BackendError)(f"{what}: {e}")


def resolve_model(product: str, memory_mib: int, catalog: Catalog = DEFAULT_CATALOG) -> GpuModel:
    """The catalog model for a driver product name such as "NVIDIA H100 80GB HBM3" or "Tesla T4"."""
    name = re.sub(r"^(NVIDIA|Tesla|GeForce)\s+", "", product.strip(), flags=re.I).strip()
    dashed = re.sub(r"\s+", "-", name)
    for candidate in (dashed, name, product):
        if candidate and catalog.known(candidate):
            return catalog.get(candidate)
    family = re.split(r"[-\s]", name.upper())[0] if name else ""
    same_family = [m for m in catalog if not m.generic and m.name.upper().split("-")[0] == family]
    if same_family:
        return min(same_family, key=lambda m: abs(m.memory_mib - memory_mib))
    return catalog.get(dashed or "unknown-gpu")


def pod_uid_from_cgroup(text: str) -> str | None:
    """The pod UID in a process's /proc/<pid>/cgroup (cgroupfs and systemd spellings)."""
    m = re.search(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})", text)
    return m.group(1).replace("_", "-") if m else None


DEFAULT_MPS_PIPE_DIRECTORY = "/tmp/nvidia-mps"  # where CUDA looks without CUDA_MPS_PIPE_DIRECTORY


def _unescape_mount_path(text: str) -> str:
    # mountinfo writes space, tab, newline and backslash in a path as octal escapes (\040 …).
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


def host_pipe_dir(environ: bytes, mountinfo: str) -> str | None:
    """The MPS pipe directory a process uses, as a path on the host's side of its mounts.

    ``environ``: its /proc/<pid>/environ (CUDA_MPS_PIPE_DIRECTORY, else CUDA's default); ``mountinfo``: its
    /proc/<pid>/mountinfo. The path is resolved through the mount that holds it: the mount's root (the directory of its
    filesystem that is mounted there) joined with the rest of the path. A container's ``/run/sharegpu/mps`` bind mount
    thus resolves to the daemon's directory, as a path inside the filesystem that holds it (the host's path where that
    is the root filesystem); None where no mount holds the path.
    """
    pipe = DEFAULT_MPS_PIPE_DIRECTORY
    for item in environ.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key == b"CUDA_MPS_PIPE_DIRECTORY" and value:
            pipe = value.decode(errors="replace")
    pipe = "/" + "/".join(part for part in pipe.split("/") if part and part != ".")
    best: tuple[int, str] | None = None
    for line in mountinfo.splitlines():
        fields = line.split(" ")
        if len(fields) < 5:
            continue
        root, point = _unescape_mount_path(fields[3]), _unescape_mount_path(fields[4])
        if pipe == point or pipe.startswith(point.rstrip("/") + "/"):
            rest = pipe[len(point.rstrip("/")) :]
            if best is None or len(point) >= best[0]:  # the last of equal mount points is the one on top
                best = (len(point), root.rstrip("/") + rest if rest else root)
    return best[1] if best is not None else None


class NvmlBackend:
    def __init__(
        self,
        api: NvmlApi,
        catalog: Catalog = DEFAULT_CATALOG,
        proc_root: Path = Path("/proc"),
        dev_root: Path = Path("/dev"),
    ) -> None:
        self._api = api
        self._catalog = catalog
        self._proc = proc_root
        self._dev = dev_root
        try:
            api.init()
        except NvmlCallError as e:
            raise BackendError(
                f"cannot initialise NVML: {e}; is the NVIDIA driver installed and the GPU visible?"
            ) from None
        self._profiles: dict[int, list[tuple[MigProfileInfo, int]]] = {}
        self._last: dict[int, DeviceInfo] = {}  # the last good reading of each GPU, for when it is lost
        self._events: Any = None  # the Xid event set, made at the first poll
        self._events_on: set[str] = set()  # UUIDs of the GPUs registered with it
        self._events_refused: set[str] = set()  # GPUs whose driver refused Xid events (told once)
        self._events_unavailable = False  # no event set could be made (told once; tried again each poll)

    def devices(self) -> tuple[DeviceInfo, ...]:
        """Every GPU; one that fails its queries (fell off the bus, needs a reset) is reported unhealthy.

        A failing GPU keeps the identity it was last read with, so its tokens turn unhealthy rather than vanish,
        and the others keep being served. A GPU that fails before it was ever read is left out (with a warning)
        unless at least its UUID can be read.
        """
        try:
            count = self._api.device_count()
        except NvmlCallError as e:
            if not self._last:
                raise _err(e, "listing GPUs") from None
            log.warning("cannot count GPUs (%s); reporting the last known ones as unhealthy", e)
            return tuple(replace(d, healthy=False) for _, d in sorted(self._last.items()))
        out = []
        for i in range(count):
            try:
                info = self._read_device(i)
            except NvmlCallError as e:
                last = self._last.get(i)
                if last is None:
                    last = self._unknown_device(i)
                if last is None:
                    log.warning("GPU %d fails every query and was never read: left out (%s)", i, e)
                    continue
                if last.healthy:
                    log.warning("GPU %d (%s) stopped answering: reported unhealthy: %s", i, last.uuid, e)
                self._last[i] = replace(last, healthy=False)
                out.append(self._last[i])
                continue
            self._last[i] = info
            out.append(info)
        return tuple(out)

    def _read_device(self, i: int) -> DeviceInfo:
        h = self._api.handle(i)
        uuid = self._api.uuid(h)
        total, _ = self._api.memory(h)
        product = self._api.name(h)
        model = resolve_model(product, capacity_mib(total), self._catalog)
        try:
            current, _ = self._api.mig_mode(h)
        except NvmlCallError as e:
            if e.kind in ("gpu_lost", "reset_required"):
                raise
            current = False  # not MIG-capable
        healthy = True
        try:
            self._api.utilization(h)  # a GPU that fell off the bus fails every query
        except NvmlCallError as e:
            healthy = e.kind == "not_supported"
        return DeviceInfo(
            index=i,
            uuid=uuid,
            product=product,
            model=model.name,
            memory_mib=capacity_mib(total),
            sms=self._api.sm_count(h) or model.sms,
            mig_enabled=current,
            healthy=healthy,
        )

    def _unknown_device(self, i: int) -> DeviceInfo | None:
        """A GPU never read whole: its UUID alone, if the driver still gives it, under a generic model."""
        try:
            uuid = self._api.uuid(self._api.handle(i))
        except NvmlCallError:
            return None
        model = self._catalog.get("unknown-gpu")
        return DeviceInfo(i, uuid, "unknown", model.name, 0, model.sms, False, healthy=False)

    def mig_profiles(self, gpu_index: int) -> tuple[MigProfileInfo, ...]:
        return tuple(p for p, _ in self._profile_table(gpu_index))

    def mig_instances(self, gpu_index: int) -> tuple[MigInstanceInfo, ...]:
        h = self._handle(gpu_index)
        out = []
        try:
            uuids = self._api.mig_uuids(h)
            for profile, pid in self._profile_table(gpu_index):
                for gi in self._api.gpu_instances(h, pid):
                    info = self._api.gi_info(gi)
                    uuid = uuids.get(info.id)
                    if uuid is None:
                        continue  # a GPU instance without a compute instance is no usable device
                    out.append(MigInstanceInfo(gpu_index, profile.name, info.start, info.size, uuid))
        except NvmlCallError as e:
            raise _err(e, f"GPU {gpu_index}: listing MIG instances") from None
        return tuple(sorted(out, key=lambda i: i.start))

    def set_mig_mode(self, gpu_index: int, enabled: bool) -> None:
        h = self._handle(gpu_index)
        if enabled and any(self.processes(gpu_index)):
            raise InstanceInUse(f"GPU {gpu_index} runs processes; MIG mode can change only on an idle GPU")
        try:
            kind = "" if self._api.set_mig_mode(h, enabled) else "reset_required"
        except NvmlCallError as e:
            if e.kind not in ("in_use", "reset_required"):
                raise _err(e, f"GPU {gpu_index}: switching MIG mode") from None
            kind = e.kind
        if not kind:
            return
        still_pending = self._withdraw_pending(h, enabled)
        cls: type[MigModePending] = MigModeInUse if kind == "in_use" else ResetRequired
        why = "the GPU is in use" if kind == "in_use" else f"it needs a GPU reset (nvidia-smi -r -i {gpu_index})"
        left = (
            "the request is still pending and takes effect at the GPU's next reset"
            if still_pending
            else "the request was withdrawn"
        )
        mode = "on" if enabled else "off"
        raise cls(f"GPU {gpu_index}: MIG mode {mode} could not be activated: {why}; {left}", still_pending)

    def _withdraw_pending(self, h: Any, enabled: bool) -> bool:
        """Undo a MIG-mode request that did not activate; True when it is still pending afterwards."""
        try:
            current, pending = self._api.mig_mode(h)
            if pending != enabled or current == enabled:
                return False
            with contextlib.suppress(NvmlCallError):
                self._api.set_mig_mode(h, current)  # asking for the current mode clears the pending one
            current, pending = self._api.mig_mode(h)
        except NvmlCallError:
            return True  # cannot tell: assume the worst
        return pending == enabled and current != enabled

    def create_mig_instance(self, gpu_index: int, profile: str, start: int | None = None) -> MigInstanceInfo:
        h = self._handle(gpu_index)
        try:
            if not self._api.mig_mode(h)[0]:
                raise MigNotEnabled(f"MIG mode is off on GPU {gpu_index}; enable it before creating instances")
        except NvmlCallError as e:
            raise MigUnsupported(f"GPU {gpu_index} has no MIG: {e}") from None
        match = [(p, pid) for p, pid in self._profile_table(gpu_index) if p.name == profile]
        if not match:
            known = ", ".join(p.name for p, _ in self._profile_table(gpu_index)) or "none"
            raise MigUnsupported(f"GPU {gpu_index} has no MIG profile {profile}; it has: {known}")
        info, pid = match[0]
        size = info.placements[0].size if info.placements else 0
        if start is not None and start not in {p.start for p in info.placements}:
            raise InvalidPlacement(
                f"{profile} cannot start at slot {start}; valid: {[p.start for p in info.placements]}"
            )
        try:
            gi = self._api.create_gi(h, pid, start, size)
        except NvmlCallError as e:
            where = f"at slot {start}" if start is not None else "where the driver chose"
            raise _err(e, f"GPU {gpu_index}: creating {profile} {where}") from None
        try:
            self._api.create_full_ci(gi, info.compute_slices)
            gi_info = self._api.gi_info(gi)
            uuid = self._api.mig_uuids(h)[gi_info.id]
        except (NvmlCallError, KeyError) as e:
            self._api.destroy_gi(gi)  # never leave a GPU instance that no container can use
            raise BackendError(f"GPU {gpu_index}: {profile} created but its compute instance failed: {e}") from None
        return MigInstanceInfo(gpu_index, profile, gi_info.start, gi_info.size, uuid)

    def destroy_mig_instance(self, gpu_index: int, start: int) -> None:
        h = self._handle(gpu_index)
        target = next((i for i in self.mig_instances(gpu_index) if i.start == start), None)
        if target is None:
            raise MigInstanceNotFound(f"GPU {gpu_index} has no MIG instance at slot {start}")
        if any(p.unit_uuid == target.uuid for p in self.processes(gpu_index)):
            raise InstanceInUse(f"MIG instance {target.uuid} on GPU {gpu_index} runs processes; it cannot be destroyed")
        try:
            for _, pid in self._profile_table(gpu_index):
                for gi in self._api.gpu_instances(h, pid):
                    if self._api.gi_info(gi).start == start:
                        self._api.destroy_gi(gi)
                        return
        except NvmlCallError as e:
            raise _err(e, f"GPU {gpu_index}: destroying the instance at slot {start}") from None

    def processes(self, gpu_index: int) -> tuple[ProcessInfo, ...]:
        try:
            return self._listed(gpu_index, self._api.processes)
        except NvmlCallError as e:
            raise _err(e, f"GPU {gpu_index}: listing processes") from None

    def _listed(self, gpu_index: int, query: Callable[[Any], list[NvmlProcess]]) -> tuple[ProcessInfo, ...]:
        """The processes one of NVML's process queries lists, each on its unit (the GPU, or its MIG instance)."""
        h = self._handle(gpu_index)
        gpu_uuid = self._api.uuid(h)
        uuids = self._api.mig_uuids(h) if self._api.mig_mode(h)[0] else {}
        return tuple(
            ProcessInfo(
                p.pid,
                gpu_index,
                uuids.get(p.gpu_instance_id, gpu_uuid) if p.gpu_instance_id is not None else gpu_uuid,
                capacity_mib(p.used_bytes),
            )
            for p in query(h)
        )

    def utilization(self, gpu_index: int) -> Utilization:
        try:
            gpu, mem = self._api.utilization(self._handle(gpu_index))
        except NvmlCallError as e:
            if e.kind == "not_supported":  # in MIG mode the whole-GPU counters are not kept
                return Utilization(0, 0)
            raise _err(e, f"GPU {gpu_index}: reading utilisation") from None
        return Utilization(gpu, mem)

    def memory_used_mib(self, gpu_index: int) -> int:
        try:
            return capacity_mib(self._api.memory(self._handle(gpu_index))[1])
        except NvmlCallError as e:
            raise _err(e, f"GPU {gpu_index}: reading memory") from None

    def process_utilization(self, gpu_index: int) -> dict[int, int] | None:
        try:
            return self._api.process_utilization(self._handle(gpu_index))
        except NvmlCallError as e:
            if e.kind == "not_found":
                return {}  # NVML_ERROR_NOT_FOUND: no sample in the period, no process ran on the SMs
            # Any other error (not supported, in MIG mode too; a lost GPU; unknown): no figure is known.
            log.debug("GPU %d: no per-process SM figures: %s", gpu_index, e)
            return None

    def mps_processes(self, gpu_index: int) -> tuple[ProcessInfo, ...] | None:
        try:
            return self._listed(gpu_index, self._api.mps_processes)
        except NvmlCallError as e:
            if e.kind == "not_supported":
                return None
            raise _err(e, f"GPU {gpu_index}: listing MPS clients") from None

    def process_name(self, pid: int) -> str | None:
        # argv[0] first: comm is cut to 15 characters. Either can be unreadable (the process ended, no hostPID).
        try:
            argv0 = (self._proc / str(pid) / "cmdline").read_bytes().split(b"\0", 1)[0]
            if argv0:
                return Path(argv0.decode(errors="replace")).name
        except OSError:
            pass
        try:
            return (self._proc / str(pid) / "comm").read_text().strip() or None
        except OSError:
            return None

    def xid_events(self) -> tuple[XidEvent, ...]:
        """Polls the event set (timeout 0); GPUs are registered as they appear, a refusal is logged once."""
        try:
            if self._events is None:
                self._events = self._api.event_set()
        except NvmlCallError as e:
            if not self._events_unavailable:
                self._events_unavailable = True
                log.warning("NVML events are unavailable (%s): Xid errors are not watched", e)
            return ()
        index_of: dict[str, int] = {}
        for d in self.devices():
            index_of[d.uuid] = d.index
            if d.uuid in self._events_on or d.uuid in self._events_refused or not d.healthy:
                continue
            try:
                self._api.register_events(self._api.handle(d.index), XID_CRITICAL_ERROR, self._events)
                self._events_on.add(d.uuid)
            except NvmlCallError as e:
                self._events_refused.add(d.uuid)
                log.warning("GPU %d: the driver refused Xid events (%s): its Xid errors are not watched", d.index, e)
        out: list[XidEvent] = []
        for _ in range(_EVENTS_PER_POLL):
            try:
                ev = self._api.wait_event(self._events, 0)
            except NvmlCallError as e:
                log.warning("reading NVML events failed: %s", e)
                break
            if ev is None:
                break
            if not ev.event_type & XID_CRITICAL_ERROR or ev.gpu_uuid not in index_of:
                continue
            gpu = index_of[ev.gpu_uuid]
            unit = ev.gpu_uuid
            if ev.gpu_instance_id is not None:
                # The instance may be gone already: the GPU is then the best the event still names.
                with contextlib.suppress(NvmlCallError):
                    unit = self._api.mig_uuids(self._api.handle(gpu)).get(ev.gpu_instance_id, ev.gpu_uuid)
            out.append(XidEvent(gpu, unit, ev.data))
        return tuple(out)

    def pod_uid_of(self, pid: int) -> str | None:
        try:
            return pod_uid_from_cgroup((self._proc / str(pid) / "cgroup").read_text())
        except OSError:
            return None

    def mps_pipe_dir(self, pid: int) -> str | None:
        # Both need the agent's hostPID and root (environ is readable by the process's owner and root only).
        try:
            environ = (self._proc / str(pid) / "environ").read_bytes()
            mountinfo = (self._proc / str(pid) / "mountinfo").read_text(errors="replace")
        except OSError:
            return None
        return host_pipe_dir(environ, mountinfo)

    def device_nodes(self, gpu_index: int) -> tuple[str, ...]:
        h = self._handle(gpu_index)
        try:
            minor = self._api.minor_number(h)
        except NvmlCallError as e:
            raise _err(e, f"GPU {gpu_index}: reading its device minor number") from None
        # MIG instances are reached through the GPU's node and the nvidia-caps capabilities, which the NVIDIA
        # container runtime adds from NVIDIA_VISIBLE_DEVICES; only nodes present here are named.
        wanted = (*NVIDIA_CONTROL_NODES, f"/dev/nvidia{minor}")
        return tuple(p for p in wanted if (self._dev / p.removeprefix("/dev/")).exists())

    def close(self) -> None:
        if self._events is not None:
            with contextlib.suppress(NvmlCallError):
                self._api.free_event_set(self._events)
            self._events = None
        with contextlib.suppress(NvmlCallError):
            self._api.shutdown()

    # ----- internals ------------------------------------------------------------------------------------------
    def _handle(self, gpu_index: int) -> Any:
        try:
            if not 0 <= gpu_index < self._api.device_count():
                raise GpuNotFound(f"this node has no GPU with index {gpu_index}")
            return self._api.handle(gpu_index)
        except NvmlCallError as e:
            raise _err(e, f"GPU {gpu_index}") from None

    def _profile_table(self, gpu_index: int) -> list[tuple[MigProfileInfo, int]]:
        """Profiles named as in the catalog (matched on compute slices and memory-slot width), with NVML ids."""
        if gpu_index in self._profiles:
            return self._profiles[gpu_index]
        h = self._handle(gpu_index)
        try:
            total, _ = self._api.memory(h)
            model = resolve_model(self._api.name(h), capacity_mib(total), self._catalog)
            raw = self._api.gi_profiles(h)
            table: list[tuple[MigProfileInfo, int]] = []
            seen: set[str] = set()
            for p in raw:
                placements = tuple(MigPlacement(s, n) for s, n in self._api.gi_placements(h, p.id))
                name = _profile_name(model, p, placements)
                if name in seen:
                    continue  # a later variant (e.g. "+me" media extensions) of a profile already named
                seen.add(name)
                table.append((MigProfileInfo(name, p.slices, p.memory_mb, placements), p.id))
        except NvmlCallError as e:
            if e.kind == "not_supported":
                table = []
            else:
                raise _err(e, f"GPU {gpu_index}: reading MIG profiles") from None
        self._profiles[gpu_index] = table
        return table


def _profile_name(model: GpuModel, p: GiProfile, placements: Sequence[MigPlacement]) -> str:
    width = placements[0].size if placements else 0
    for cp in model.mig_profiles:
        if cp.compute_slices == p.slices and cp.memory_slots == width:
            return cp.name
    return f"{p.slices}g.{-(-p.memory_mb // 1024)}gb"  # a model the catalog lacks: the driver's own naming
