"""The GPU backend interface: what the node agent needs from a GPU driver, and the errors it can raise.

Two implementations stand behind it: :mod:`sharegpu.node.backends.nvml` (the real driver through NVML) and
:mod:`sharegpu.node.backends.sim` (a simulated node that follows the same MIG rules). Everything above this
interface — device plugin, MIG and MPS managers, metrics — is the same for both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from sharegpu.node.errors import NodeError


class BackendError(NodeError):
    """A GPU operation failed; the message says what and, where it can, what to do."""


class GpuNotFound(BackendError):
    pass


class MigNotEnabled(BackendError):
    pass


class MigUnsupported(BackendError):
    pass


class InsufficientResources(BackendError):
    """The driver refused an instance: no room at that placement, or too few compute slices left."""


class InvalidPlacement(BackendError):
    """A start slot that the profile cannot use on this GPU model."""


class InstanceInUse(BackendError):
    """An instance (or a GPU whose MIG mode should change) still runs processes."""


class MigInstanceNotFound(BackendError):
    pass


class MigModePending(BackendError):
    """The driver took a MIG-mode change but could not activate it.

    ``still_pending`` says whether the request is left pending (it then takes effect at the GPU's next reset,
    whoever causes it) or was withdrawn.
    """

    def __init__(self, message: str, still_pending: bool) -> None:
        super().__init__(message)
        self.still_pending = still_pending


class MigModeInUse(MigModePending, InstanceInUse):
    """Activation failed because the GPU is in use (NVML_ERROR_IN_USE)."""


class ResetRequired(MigModePending):
    """Activation needs a GPU reset (NVML_ERROR_RESET_REQUIRED), e.g. on GPUs that cannot reset on their own."""


@dataclass(frozen=True, slots=True)
class MigPlacement:
    start: int
    size: int  # width on the memory-slot axis


@dataclass(frozen=True, slots=True)
class MigProfileInfo:
    """A GPU-instance profile as the driver reports it, named as in the catalog (e.g. ``3g.40gb``)."""

    name: str
    compute_slices: int
    memory_mib: int
    placements: tuple[MigPlacement, ...]


@dataclass(frozen=True, slots=True)
class MigInstanceInfo:
    """A GPU instance with its (single, full-size) compute instance."""

    gpu_index: int
    profile: str
    start: int
    size: int
    uuid: str  # MIG-… UUID of the compute instance's device


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    index: int
    uuid: str
    product: str  # driver's name, e.g. "NVIDIA H100 80GB HBM3"
    model: str  # catalog name the product resolves to
    memory_mib: int
    sms: int
    mig_enabled: bool
    healthy: bool = True


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """A process that holds a context on a GPU or on one of its MIG instances."""

    pid: int
    gpu_index: int
    unit_uuid: str  # the GPU's UUID, or the MIG instance's when the process runs inside one
    used_memory_mib: int


# The MPS server's executable. Its /proc/<pid>/comm is cut to 15 characters ("nvidia-cuda-mps"), so a name
# read there is compared with :func:`is_mps_server_name`, never with this string alone.
MPS_SERVER_NAME = "nvidia-cuda-mps-server"
_COMM_LEN = 15


def is_mps_server_name(name: str) -> bool:
    """Whether a process name (an executable's base name, or its /proc comm) is the MPS server's."""
    return name == MPS_SERVER_NAME or name == MPS_SERVER_NAME[:_COMM_LEN]


@dataclass(frozen=True, slots=True)
class XidEvent:
    """A critical Xid error the driver reported: on a GPU, or on one of its MIG instances (``unit_uuid``)."""

    gpu_index: int
    unit_uuid: str  # the MIG instance's UUID where the driver named one, else the GPU's
    xid: int


@dataclass(frozen=True, slots=True)
class Utilization:
    gpu_percent: int  # share of time a kernel ran (NVML's / DCGM's GPU utilisation)
    memory_percent: int  # share of time device memory was read or written


class GpuBackend(Protocol):
    """What the node agent asks of a GPU driver. Indices are the driver's device indices (0..n-1)."""

    def devices(self) -> tuple[DeviceInfo, ...]: ...

    def mig_profiles(self, gpu_index: int) -> tuple[MigProfileInfo, ...]:
        """The GPU-instance profiles and their valid placements; empty for a GPU without MIG."""
        ...

    def mig_instances(self, gpu_index: int) -> tuple[MigInstanceInfo, ...]: ...

    def set_mig_mode(self, gpu_index: int, enabled: bool) -> None:
        """Switch MIG mode; refused while the GPU runs processes or (to disable) still has instances."""
        ...

    def create_mig_instance(self, gpu_index: int, profile: str, start: int | None = None) -> MigInstanceInfo:
        """Create a GPU instance and its full compute instance.

        With ``start`` the instance goes exactly there or fails; without it the driver picks a placement,
        which can leave no aligned room for a later, larger instance — callers that plan a layout pass it.
        """
        ...

    def destroy_mig_instance(self, gpu_index: int, start: int) -> None:
        """Destroy the instance at ``start``; refused with :class:`InstanceInUse` while it runs processes."""
        ...

    def processes(self, gpu_index: int) -> tuple[ProcessInfo, ...]: ...

    def utilization(self, gpu_index: int) -> Utilization: ...

    def memory_used_mib(self, gpu_index: int) -> int:
        """Device memory in use on the whole GPU (all processes and instances)."""
        ...

    def process_utilization(self, gpu_index: int) -> dict[int, int] | None:
        """SM utilisation per pid over the last sampling period: empty where the driver has no sample (no process
        ran on the SMs), None where it could not answer (an error: nothing is known, not 0 for everyone).

        Under MPS the driver reports the MPS server's pid only, with the figure of all its clients together
        (measured on an H200, driver 580); time-sliced and exclusive processes have their own figures.
        """
        ...

    def mps_processes(self, gpu_index: int) -> tuple[ProcessInfo, ...] | None:
        """The processes that run as clients of an MPS server (NVML's MPS-aware query), with their own memory.

        :meth:`processes` lists them too, beside the MPS server itself; a process in :meth:`processes` that is
        missing here holds a context of its own. None where the driver cannot tell.
        """
        ...

    def process_name(self, pid: int) -> str | None:
        """The process's executable name (base name), or None where it cannot be read."""
        ...

    def xid_events(self) -> tuple[XidEvent, ...]:
        """The critical Xid errors reported since the last call, without waiting; empty where events are unsupported."""
        ...

    def pod_uid_of(self, pid: int) -> str | None:
        """The Kubernetes pod UID a process belongs to, or None for processes outside any pod."""
        ...

    def mps_pipe_dir(self, pid: int) -> str | None:
        """The host-side MPS pipe directory a process reaches its control daemon by (an MPS client), or was started
        with (an MPS server); None where it cannot be read. NVML does not say which server a client belongs to:
        this tells which daemon it is, and so which tenant's."""
        ...

    def device_nodes(self, gpu_index: int) -> tuple[str, ...]:
        """The host device nodes a container needs for this GPU (or any MIG instance on it), only those that exist.

        They go into CDI specs, and the container runtime fails a container whose spec names a missing node.
        """
        ...

    def close(self) -> None: ...


def device(backend: GpuBackend, gpu_index: int) -> DeviceInfo:
    for d in backend.devices():
        if d.index == gpu_index:
            return d
    raise GpuNotFound(f"this node has no GPU with index {gpu_index}")
