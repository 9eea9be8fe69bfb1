"""Every name and format that crosses a process boundary, defined once.

The user-facing contract (DESIGN §2) and what sharegpu's processes write for one another — the extender, the
webhook, the node agent, the DRA driver, the chart and the containers — meet only through these strings: a resource
name the kubelet advertises and the extender reads, an annotation one process writes and another parses, a device
name the node publishes and the control plane takes apart again. Each lives here, so that a writer and its readers
cannot drift apart, and so that the control plane (``sharegpu.k8s``) and the node (``sharegpu.node``) need not
import each other to agree on a name. Pure constants and pure functions: no I/O.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

# ----- extended resources: container limits (DESIGN §2) ------------------------------------------------------------
GPU_RESOURCE: Final = "sharegpu.io/gpu"  # GPUs (or MIG instances); the one the kubelet's device plugin serves
MEMORY_RESOURCE: Final = "sharegpu.io/gpu-memory"  # GPU memory per GPU, a Kubernetes quantity
COMPUTE_RESOURCE: Final = "sharegpu.io/gpu-compute"  # percent of one GPU's compute per GPU
RESOURCES: Final = (GPU_RESOURCE, MEMORY_RESOURCE, COMPUTE_RESOURCE)

# ----- pod annotations -------------------------------------------------------------------------------------------
ANNOTATION_PREFIX: Final = "sharegpu.io/"  # the webhook refuses an unknown annotation under it (a typo)
ISOLATION_ANNOTATION: Final = "sharegpu.io/isolation"
SHARING_ANNOTATION: Final = "sharegpu.io/sharing"
MODEL_ANNOTATION: Final = "sharegpu.io/gpu-model"
MIG_PROFILE_ANNOTATION: Final = "sharegpu.io/mig-profile"
REQUEST_ANNOTATIONS: Final = (ISOLATION_ANNOTATION, SHARING_ANNOTATION, MODEL_ANNOTATION, MIG_PROFILE_ANNOTATION)
# "true": the pod may be evicted and recreated by its controller elsewhere so that a pod waiting for fragmented GPU
# room fits (consolidation, issue 19; the extender's --consolidation). Not a request: it changes no placement.
MOVABLE_ANNOTATION: Final = "sharegpu.io/movable"
POD_ANNOTATIONS: Final = (*REQUEST_ANNOTATIONS, MOVABLE_ANNOTATION)  # every sharegpu.io/ annotation a pod may set
# Written by the extender alone: where the pod's shares are (the source of truth the node enforces and the
# control plane rebuilds its state from), and the fence that moves a pod past a lost Binding's resourceVersion.
ASSIGNMENT_ANNOTATION: Final = "sharegpu.io/assignment"
FENCE_ANNOTATION: Final = "sharegpu.io/bind-fence"
# On a Node: `sharegpu bench --publish` writes its result there (JSON: sharegpu.k8s.status.bench_note).
BENCH_ANNOTATION: Final = "sharegpu.io/strategy-bench"
DEFAULT_SCHEDULER_NAME: Final = "sharegpu-scheduler"  # the chart's scheduler profile that places sharegpu pods

# ----- node annotations and labels ---------------------------------------------------------------------------------
INVENTORY_ANNOTATION: Final = "sharegpu.io/inventory"  # the node agent's GPUs (schema: sharegpu.model.inventory)
# The node agent's labels for node selectors: <prefix>.present, .count, .model and .count.<model>.
GPU_LABEL_PREFIX: Final = "sharegpu.io/gpu"
# Which way in a node's GPUs are handed out: the DRA driver labels its node "dra", and the extender then leaves the
# node's GPUs to the kube-scheduler's DRA allocator.
DEVICE_PATH_LABEL: Final = "sharegpu.io/device-path"
DEVICE_PATH_DRA: Final = "dra"

# ----- DRA (resource.k8s.io/v1) ------------------------------------------------------------------------------------
DRIVER: Final = "gpu.sharegpu.io"  # the DRA driver's name: ResourceSlices, allocation results, plugin sockets
SHARED_CLASS: Final = "gpu.sharegpu.io"  # DeviceClass: a share of a GPU (memory and compute capacity)
WHOLE_CLASS: Final = "whole-gpu.sharegpu.io"  # DeviceClass: a GPU to itself
MIG_CLASS: Final = "mig.sharegpu.io"  # DeviceClass: a MIG partition, its profile chosen by a CEL selector
# The driver's opaque config in DeviceClasses and claims (node.dra.config parses it).
DRA_CONFIG_API_VERSION: Final = f"{DRIVER}/v1alpha1"
DRA_CONFIG_KIND: Final = "GpuConfig"

_GPU_DEVICE = re.compile(r"^gpu-(\d+)$")
_MIG_DEVICE = re.compile(r"^gpu-(\d+)-mig-")
_MIG_DEVICE_PARTS = re.compile(r"^gpu-(\d+)-mig-([a-z0-9]+)-(\d+)$")


def gpu_device_name(index: int) -> str:
    """The published device of a whole (or shared) GPU."""
    return f"gpu-{index}"


def mig_profile_token(profile: str) -> str:
    """A MIG profile as it appears in device names, which are DNS labels: "3g.40gb" becomes "3g40gb"."""
    return re.sub(r"[^a-z0-9]", "", profile.lower())


def mig_device_name(index: int, profile: str, start: int) -> str:
    """The published device of one MIG placement: ``gpu-<index>-mig-<profile token>-<start>``."""
    return f"gpu-{index}-mig-{mig_profile_token(profile)}-{start}"


@dataclass(frozen=True, slots=True)
class DeviceName:
    """A published device name taken apart again (the inverse of :func:`gpu_device_name` and
    :func:`mig_device_name`)."""

    gpu_index: int
    mig_token: str | None = None  # the profile's token (see mig_profile_token); None: the GPU itself, or unreadable
    mig_start: int | None = None

    @property
    def is_mig(self) -> bool:
        return self.mig_token is not None


def parse_device_name(name: str) -> DeviceName | None:
    """The GPU (and MIG placement) a device name names; None for a name of another shape. A ``gpu-<i>-mig-…`` name
    whose rest cannot be read still names GPU ``i``, with no placement."""
    m = _GPU_DEVICE.match(name) or _MIG_DEVICE.match(name)
    if m is None:
        return None
    parts = _MIG_DEVICE_PARTS.match(name)
    if parts is None:
        return DeviceName(int(m.group(1)))
    return DeviceName(int(m.group(1)), parts.group(2), int(parts.group(3)))


# ----- DRA ResourceSlice devices: what the driver publishes and the control plane reads back -----------------------
# Attributes of a device (each a typed value: {"string": …}, {"int": …}, {"bool": …}, {"version": …}).
ATTR_TYPE: Final = "type"  # DEVICE_TYPE_GPU or DEVICE_TYPE_MIG
DEVICE_TYPE_GPU: Final = "gpu"
DEVICE_TYPE_MIG: Final = "mig"
ATTR_INDEX: Final = "index"  # the GPU's index on its node (a MIG device: its parent's)
ATTR_UUID: Final = "uuid"  # a GPU's UUID
ATTR_PARENT_UUID: Final = "parentUUID"  # a MIG device's GPU's UUID
ATTR_MODEL: Final = "model"  # the catalog's model name
ATTR_PRODUCT_NAME: Final = "productName"
ATTR_ARCHITECTURE: Final = "architecture"
ATTR_CUDA_COMPUTE_CAPABILITY: Final = "cudaComputeCapability"
ATTR_MIG_CAPABLE: Final = "migCapable"
ATTR_MPS_CAPABLE: Final = "mpsCapable"
# Published (true) only by a driver in multi-user mode (--mps-multi-user): one MPS daemon per GPU or MIG instance
# serves the claims of every tenant (sharegpu.model.tenant.MULTI_USER_TENANT), as NodeSpec.mps_multi_user says for a
# device-plugin node.
ATTR_MPS_MULTI_USER: Final = "mpsMultiUser"
ATTR_PROFILE: Final = "profile"  # a MIG device's profile ("3g.40gb"); MIG claims select it by CEL
ATTR_PLACEMENT_START: Final = "placementStart"  # a MIG device's first memory slot
ATTR_PLACEMENT_SIZE: Final = "placementSize"  # ... and its number of memory slots
# Capacities: a GPU's memory (a quantity) and compute (percent of the GPU) that claims consume part of; a MIG
# device's memory and multiprocessors.
CAPACITY_MEMORY: Final = "memory"
CAPACITY_COMPUTE: Final = "compute"
CAPACITY_MULTIPROCESSORS: Final = "multiprocessors"
COMPUTE_FULL: Final = 100  # a GPU's compute capacity: percent
# Counters of a GPU's geometry (its counter set): one per memory slot, and its compute slices.
COMPUTE_SLICES_COUNTER: Final = "compute-slices"


def memory_counter(slot: int) -> str:
    """The counter of one memory slot of a MIG-capable GPU (each 1: two instances can never hold one slot)."""
    return f"memory-slice-{slot}"


def counter_set_name(index: int) -> str:
    """The counter set of GPU ``index``'s geometry."""
    return f"gpu-{index}-counters"


@dataclass(frozen=True, slots=True)
class SliceDevice:
    """One device of the driver's ResourceSlices, read back (the inverse of what the driver publishes)."""

    name: str
    type: str  # DEVICE_TYPE_GPU, DEVICE_TYPE_MIG, or another (not ours to read)
    index: int
    uuid: str | None  # a GPU's UUID (None: not published)
    model: str
    profile: str  # a MIG device's profile ("" otherwise)
    placement_start: int  # a MIG device's first memory slot (0 otherwise)
    memory: str  # the memory capacity as published, a Kubernetes quantity ("0" when absent)
    mps_multi_user: bool = False  # the node runs one multi-user MPS daemon per unit (ATTR_MPS_MULTI_USER)


def _attr(attrs: Mapping[str, Any], name: str, kind: str) -> Any:
    return (attrs.get(name) or {}).get(kind)


def read_slice_device(device: Mapping[str, Any]) -> SliceDevice:
    """A device of a ResourceSlice (the API object's ``spec.devices[]`` entry) as this driver publishes it."""
    attrs = device.get("attributes") or {}
    capacity = device.get("capacity") or {}
    return SliceDevice(
        name=str(device.get("name", "")),
        type=str(_attr(attrs, ATTR_TYPE, "string") or ""),
        index=int(_attr(attrs, ATTR_INDEX, "int") or 0),
        uuid=None if (uuid := _attr(attrs, ATTR_UUID, "string")) is None else str(uuid),
        model=str(_attr(attrs, ATTR_MODEL, "string") or ""),
        profile=str(_attr(attrs, ATTR_PROFILE, "string") or ""),
        placement_start=int(_attr(attrs, ATTR_PLACEMENT_START, "int") or 0),
        memory=str((capacity.get(CAPACITY_MEMORY) or {}).get("value", "0")),
        mps_multi_user=_attr(attrs, ATTR_MPS_MULTI_USER, "bool") is True,
    )


# ----- CDI (what the kubelet passes to the container runtime) ---------------------------------------------------
CDI_KIND: Final = "sharegpu.io/gpu"  # fully qualified device IDs are <kind>=<name>
_CDI_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_.:-]")
CDI_ALLOCATION_PREFIX: Final = "dp-"  # the CDI device names of device-plugin allocations


def cdi_device_id(name: str) -> str:
    """The fully qualified CDI device ID the kubelet passes to the runtime: ``<kind>=<name>``."""
    return f"{CDI_KIND}={name}"


def cdi_claim_device_name(claim_uid: str, request: str, device: str) -> str:
    """The CDI device name of one device of a prepared DRA claim: its claim UID, request and device, so that two
    claims sharing one GPU never clash."""
    # CDI device names allow letters, digits and "_.:-"; request names of subrequests carry a "/".
    return _CDI_NAME_UNSAFE.sub("_", f"{claim_uid}-{request}-{device}")


def cdi_allocation_name(device_ids: Iterable[str]) -> str:
    """The CDI device name of one device-plugin allocation: a digest of its device IDs (order-free).

    The kubelet gives a device ID to one pod at a time, so while a pod runs the name is its alone; Allocate can name
    it before anyone knows the pod, and PreStartContainer writes its spec.
    """
    digest = hashlib.sha256("\n".join(sorted(device_ids)).encode()).hexdigest()[:24]
    return f"{CDI_ALLOCATION_PREFIX}{digest}"


# ----- the environment the node gives a container -------------------------------------------------------------------
NVIDIA_VISIBLE_DEVICES_ENV: Final = "NVIDIA_VISIBLE_DEVICES"
CUDA_VISIBLE_DEVICES_ENV: Final = "CUDA_VISIBLE_DEVICES"
MECHANISM_ENV: Final = "SHAREGPU_MECHANISM"  # the mechanism(s) enforced, Mechanism values
SHARES_ENV: Final = "SHAREGPU_SHARES"  # the device plugin path's shares, one per GPU
MPS_ENV_PREFIX: Final = "CUDA_MPS_"  # the MPS client settings: a pod may set none of them itself (the webhook)
MPS_PIPE_DIRECTORY_ENV: Final = "CUDA_MPS_PIPE_DIRECTORY"
MPS_THREAD_PERCENTAGE_ENV: Final = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
MPS_MEMORY_LIMIT_ENV: Final = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
