"""Every name and format that crosses a process boundary, defined once.

The user-facing contract (DESIGN §2) and what sharegpu's processes write for one another — the extender, the
webhook, the node agent, the DRA driver, the chart and the containers — meet only through these strings: a resource
name the kubelet advertises and the extender reads, an annotation one process writes and another parses, a device
name the node publishes and the control plane takes apart again. Each lives here, so that a writer and its readers
cannot drift apart, and so that the control plane (``sharegpu.k8s``) and the node (``sharegpu.node``) need not
import each other to agree on a name. Pure constants and pure functions: no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

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


# ----- CDI (what the kubelet passes to the container runtime) ---------------------------------------------------
CDI_KIND: Final = "sharegpu.io/gpu"  # fully qualified device IDs are <kind>=<name>

# ----- the environment the node gives a container -------------------------------------------------------------------
NVIDIA_VISIBLE_DEVICES_ENV: Final = "NVIDIA_VISIBLE_DEVICES"
CUDA_VISIBLE_DEVICES_ENV: Final = "CUDA_VISIBLE_DEVICES"
MECHANISM_ENV: Final = "SHAREGPU_MECHANISM"  # the mechanism(s) enforced, Mechanism values
SHARES_ENV: Final = "SHAREGPU_SHARES"  # the device plugin path's shares, one per GPU
MPS_ENV_PREFIX: Final = "CUDA_MPS_"  # the MPS client settings: a pod may set none of them itself (the webhook)
MPS_PIPE_DIRECTORY_ENV: Final = "CUDA_MPS_PIPE_DIRECTORY"
MPS_THREAD_PERCENTAGE_ENV: Final = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
MPS_MEMORY_LIMIT_ENV: Final = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
