"""NVML through nvidia-ml-py (``pynvml``): the only code that touches pynvml and ctypes, run only on a GPU node.

:class:`NvmlApi` is what :class:`~sharegpu.node.backends.nvml.NvmlBackend` needs of NVML, in NVML's own terms (handles,
profile constants, bytes); :class:`PynvmlApi` implements it over pynvml. Tests drive the backend through a fake of
:class:`NvmlApi` and this layer through a stand-in ``libnvidia-ml`` (tests/node/test_node_pynvml_ctypes.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


class NvmlCallError(Exception):
    """An NVML call failed; ``kind`` is one of insufficient, in_use, invalid, not_supported, not_found,
    reset_required, gpu_lost, other."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class GiProfile:
    id: int  # NVML's profile id, used to create instances
    slices: int
    memory_mb: int


@dataclass(frozen=True, slots=True)
class GiInfo:
    id: int
    profile_id: int
    start: int
    size: int


@dataclass(frozen=True, slots=True)
class NvmlProcess:
    pid: int
    used_bytes: int
    gpu_instance_id: int | None  # None outside MIG


@dataclass(frozen=True, slots=True)
class NvmlEvent:
    """One event out of an NVML event set."""

    gpu_uuid: str  # of the device the event names
    event_type: int  # NVML's nvmlEventType* bit
    data: int  # for an Xid event, the Xid
    gpu_instance_id: int | None  # the MIG GPU instance the driver names; None where it names none


XID_CRITICAL_ERROR = 0x8  # nvmlEventTypeXidCriticalError
_NO_INSTANCE = 0xFFFFFFFF


class NvmlApi(Protocol):
    """What :class:`NvmlBackend` needs from NVML, in plain Python values (handles are opaque)."""

    def init(self) -> None: ...
    def shutdown(self) -> None: ...
    def device_count(self) -> int: ...
    def handle(self, index: int) -> Any: ...
    def uuid(self, h: Any) -> str: ...
    def name(self, h: Any) -> str: ...
    def memory(self, h: Any) -> tuple[int, int]: ...  # total and used, bytes
    def sm_count(self, h: Any) -> int | None: ...
    def mig_mode(self, h: Any) -> tuple[bool, bool]: ...  # current, pending
    def set_mig_mode(self, h: Any, enabled: bool) -> bool: ...  # True when active now (no reset needed)
    def gi_profiles(self, h: Any) -> list[GiProfile]: ...  # ascending NVML profile constant
    def gi_placements(self, h: Any, profile_id: int) -> list[tuple[int, int]]: ...
    def gpu_instances(self, h: Any, profile_id: int) -> list[Any]: ...
    def gi_info(self, gi: Any) -> GiInfo: ...
    def create_gi(self, h: Any, profile_id: int, start: int | None, size: int) -> Any: ...
    def create_full_ci(self, gi: Any, slices: int) -> None: ...
    def destroy_gi(self, gi: Any) -> None: ...  # its compute instances first
    def mig_uuids(self, h: Any) -> dict[int, str]: ...  # GPU-instance id → MIG UUID
    def processes(self, h: Any) -> list[NvmlProcess]: ...
    def utilization(self, h: Any) -> tuple[int, int]: ...
    def process_utilization(self, h: Any) -> dict[int, int]: ...
    def minor_number(self, h: Any) -> int: ...  # N of the GPU's /dev/nvidiaN
    def mps_processes(self, h: Any) -> list[NvmlProcess]: ...  # clients of MPS servers only
    def event_set(self) -> Any: ...
    def register_events(self, h: Any, event_types: int, event_set: Any) -> None: ...
    def wait_event(self, event_set: Any, timeout_ms: int) -> NvmlEvent | None: ...  # None: nothing within the timeout
    def free_event_set(self, event_set: Any) -> None: ...


# The driver's control nodes every CUDA container needs beside its GPU's own /dev/nvidiaN.


class PynvmlApi:
    """:class:`NvmlApi` over pynvml (nvidia-ml-py). Needs libnvidia-ml.so, i.e. a node with the NVIDIA driver."""

    def __init__(self) -> None:
        import pynvml

        self._n: Any = pynvml

    def _call(self, fn: str, *args: Any) -> Any:
        n = self._n
        try:
            return getattr(n, fn)(*args)
        except n.NVMLError as e:
            kinds = {
                n.NVML_ERROR_INSUFFICIENT_RESOURCES: "insufficient",
                n.NVML_ERROR_IN_USE: "in_use",
                n.NVML_ERROR_INVALID_ARGUMENT: "invalid",
                n.NVML_ERROR_NOT_SUPPORTED: "not_supported",
                n.NVML_ERROR_NOT_FOUND: "not_found",
                n.NVML_ERROR_RESET_REQUIRED: "reset_required",
                n.NVML_ERROR_GPU_IS_LOST: "gpu_lost",
                n.NVML_ERROR_TIMEOUT: "timeout",
            }
            raise NvmlCallError(kinds.get(e.value, "other"), f"{fn}: {e}") from None

    def init(self) -> None:
        self._call("nvmlInit")

    def shutdown(self) -> None:
        self._call("nvmlShutdown")

    def device_count(self) -> int:
        return int(self._call("nvmlDeviceGetCount"))

    def handle(self, index: int) -> Any:
        return self._call("nvmlDeviceGetHandleByIndex", index)

    def minor_number(self, h: Any) -> int:
        return int(self._call("nvmlDeviceGetMinorNumber", h))

    def uuid(self, h: Any) -> str:
        return _text(self._call("nvmlDeviceGetUUID", h))

    def name(self, h: Any) -> str:
        return _text(self._call("nvmlDeviceGetName", h))

    def memory(self, h: Any) -> tuple[int, int]:
        m = self._call("nvmlDeviceGetMemoryInfo", h)
        return int(m.total), int(m.used)

    def sm_count(self, h: Any) -> int | None:
        try:
            return int(self._call("nvmlDeviceGetAttributes_v2", h).multiprocessorCount)
        except NvmlCallError:
            return None  # only MIG device handles report it on some drivers; the catalog knows

    def mig_mode(self, h: Any) -> tuple[bool, bool]:
        current, pending = self._call("nvmlDeviceGetMigMode", h)
        return bool(current), bool(pending)

    def set_mig_mode(self, h: Any, enabled: bool) -> bool:
        n = self._n
        status = self._call(
            "nvmlDeviceSetMigMode", h, n.NVML_DEVICE_MIG_ENABLE if enabled else n.NVML_DEVICE_MIG_DISABLE
        )
        # The call succeeded; activationStatus (an nvmlReturn_t) says whether the new mode is active.
        if status == n.NVML_SUCCESS:
            return True
        if status == n.NVML_ERROR_IN_USE:
            raise NvmlCallError("in_use", "nvmlDeviceSetMigMode: activation failed: the GPU is in use")
        return False  # NVML_ERROR_RESET_REQUIRED and the like: pending until a reset

    def gi_profiles(self, h: Any) -> list[GiProfile]:
        out = []
        for const in range(self._n.NVML_GPU_INSTANCE_PROFILE_COUNT):
            try:
                info = self._call("nvmlDeviceGetGpuInstanceProfileInfo", h, const)
            except NvmlCallError:
                continue  # a profile this GPU lacks
            out.append(GiProfile(int(info.id), int(info.sliceCount), int(info.memorySizeMB)))
        return out

    def gi_placements(self, h: Any, profile_id: int) -> list[tuple[int, int]]:
        import ctypes

        n = self._n
        arr = (n.c_nvmlGpuInstancePlacement_t * 8)()
        count = ctypes.c_uint(len(arr))
        self._call("nvmlDeviceGetGpuInstancePossiblePlacements", h, profile_id, arr, ctypes.byref(count))
        return [(int(arr[i].start), int(arr[i].size)) for i in range(count.value)]

    def gpu_instances(self, h: Any, profile_id: int) -> list[Any]:
        import ctypes

        n = self._n
        arr = (n.c_nvmlGpuInstance_t * 8)()
        count = ctypes.c_uint(0)
        self._call("nvmlDeviceGetGpuInstances", h, profile_id, arr, ctypes.byref(count))
        return [arr[i] for i in range(count.value)]

    def gi_info(self, gi: Any) -> GiInfo:
        info = self._call("nvmlGpuInstanceGetInfo", gi)
        return GiInfo(int(info.id), int(info.profileId), int(info.placement.start), int(info.placement.size))

    def create_gi(self, h: Any, profile_id: int, start: int | None, size: int) -> Any:
        if start is None:
            return self._call("nvmlDeviceCreateGpuInstance", h, profile_id)
        import ctypes

        placement = self._n.c_nvmlGpuInstancePlacement_t()
        placement.start, placement.size = start, size
        # The C API takes ``const nvmlGpuInstancePlacement_t *`` and pynvml's wrapper passes its argument through
        # unchanged (no argtypes): the struct must go by reference, or NVML reads the two uints as an address.
        return self._call("nvmlDeviceCreateGpuInstanceWithPlacement", h, profile_id, ctypes.byref(placement))

    def create_full_ci(self, gi: Any, slices: int) -> None:
        n = self._n
        for const in range(n.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
            try:
                info = self._call(
                    "nvmlGpuInstanceGetComputeInstanceProfileInfo",
                    gi,
                    const,
                    n.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
                )
            except NvmlCallError:
                continue
            if int(info.sliceCount) == slices:
                self._call("nvmlGpuInstanceCreateComputeInstance", gi, info.id)
                return
        raise NvmlCallError("not_supported", f"no compute-instance profile spans {slices} slices")

    def destroy_gi(self, gi: Any) -> None:
        import ctypes

        n = self._n
        for const in range(n.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
            arr = (n.c_nvmlComputeInstance_t * 8)()
            count = ctypes.c_uint(0)
            try:
                self._call("nvmlGpuInstanceGetComputeInstances", gi, const, arr, ctypes.byref(count))
            except NvmlCallError:
                continue
            for i in range(count.value):
                self._call("nvmlComputeInstanceDestroy", arr[i])
        self._call("nvmlGpuInstanceDestroy", gi)

    def mig_uuids(self, h: Any) -> dict[int, str]:
        out: dict[int, str] = {}
        for i in range(int(self._call("nvmlDeviceGetMaxMigDeviceCount", h))):
            try:
                mig = self._call("nvmlDeviceGetMigDeviceHandleByIndex", h, i)
            except NvmlCallError:
                continue  # an empty slot
            out[int(self._call("nvmlDeviceGetGpuInstanceId", mig))] = _text(self._call("nvmlDeviceGetUUID", mig))
        return out

    def processes(self, h: Any) -> list[NvmlProcess]:
        return [_process(p) for p in self._call("nvmlDeviceGetComputeRunningProcesses", h)]

    def mps_processes(self, h: Any) -> list[NvmlProcess]:
        return [_process(p) for p in self._call("nvmlDeviceGetMPSComputeRunningProcesses", h)]

    def event_set(self) -> Any:
        return self._call("nvmlEventSetCreate")

    def register_events(self, h: Any, event_types: int, event_set: Any) -> None:
        self._call("nvmlDeviceRegisterEvents", h, event_types, event_set)

    def wait_event(self, event_set: Any, timeout_ms: int) -> NvmlEvent | None:
        try:
            data = self._call("nvmlEventSetWait", event_set, timeout_ms)
        except NvmlCallError as e:
            if e.kind == "timeout":
                return None
            raise
        gi = int(data.gpuInstanceId)
        return NvmlEvent(
            _text(self._call("nvmlDeviceGetUUID", data.device)),
            int(data.eventType),
            int(data.eventData),
            None if gi == _NO_INSTANCE else gi,
        )

    def free_event_set(self, event_set: Any) -> None:
        self._call("nvmlEventSetFree", event_set)

    def utilization(self, h: Any) -> tuple[int, int]:
        u = self._call("nvmlDeviceGetUtilizationRates", h)
        return int(u.gpu), int(u.memory)

    def process_utilization(self, h: Any) -> dict[int, int]:
        return {int(s.pid): int(s.smUtil) for s in self._call("nvmlDeviceGetProcessUtilization", h, 0)}


def _process(p: Any) -> NvmlProcess:
    gi = getattr(p, "gpuInstanceId", _NO_INSTANCE)
    return NvmlProcess(int(p.pid), int(p.usedGpuMemory or 0), None if gi == _NO_INSTANCE else int(gi))


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
