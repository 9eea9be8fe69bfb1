"""The node's GPUs as DRA ResourceSlices (``resource.k8s.io/v1``), built from the GPU backend and the catalog.

One pool per node (named after the node). Every GPU is one device, ``gpu-<index>``, that several claims may share
(``allowMultipleAllocations``), each consuming part of its ``memory`` and ``compute`` (percent) capacity; a claim
that asks for no capacity consumes all of it, so a plain claim gets the whole GPU. On a MIG-capable GPU every
valid MIG placement is one more device, ``gpu-<index>-mig-<profile>-<start>``, and the GPU's geometry is a counter
set: one counter per memory slot (``memory-slice-<n>``, each 1, so two instances can never sit on one slot —
a bare slot count would let 3g@0 and 2g@2 overlap) and one ``compute-slices`` counter. The GPU device consumes every
counter, a MIG device its own slots and its slices: the stock kube-scheduler can then never allocate overlapping
instances, nor a partition together with the whole or a shared GPU. Since Kubernetes 1.35 counters and the
devices consuming them sit in different slices of the pool: each GPU gets a counter slice and a device slice.

The builder is pure (no I/O); :mod:`sharegpu.node.dra.publisher` writes the slices to the API server.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sharegpu.model.catalog import DEFAULT_CATALOG, Catalog, GpuModel, MigProfile
from sharegpu.model.contract import (
    ATTR_ARCHITECTURE,
    ATTR_CUDA_COMPUTE_CAPABILITY,
    ATTR_INDEX,
    ATTR_MIG_CAPABLE,
    ATTR_MODEL,
    ATTR_MPS_CAPABLE,
    ATTR_MPS_MULTI_USER,
    ATTR_PARENT_UUID,
    ATTR_PLACEMENT_SIZE,
    ATTR_PLACEMENT_START,
    ATTR_PRODUCT_NAME,
    ATTR_PROFILE,
    ATTR_TYPE,
    ATTR_UUID,
    CAPACITY_COMPUTE,
    CAPACITY_MEMORY,
    CAPACITY_MULTIPROCESSORS,
    COMPUTE_FULL,
    COMPUTE_SLICES_COUNTER,
    DEVICE_TYPE_GPU,
    DEVICE_TYPE_MIG,
    DRIVER,
    counter_set_name,
    gpu_device_name,
    memory_counter,
    mig_device_name,
)
from sharegpu.node.backends.base import DeviceInfo

RESOURCE_API = "resource.k8s.io/v1"
MEMORY_STEP_MIB = 1  # MPS limits memory in MiB


@dataclass(frozen=True, slots=True)
class PublishedDevice:
    """What the driver needs to know again about a device it published, given its name (at Prepare)."""

    name: str
    gpu_index: int
    gpu_uuid: str
    memory_mib: int  # the device's whole memory (the GPU's, or the MIG profile's)
    mig_profile: str | None = None
    mig_start: int | None = None


def node_devices(
    devices: Sequence[DeviceInfo], catalog: Catalog = DEFAULT_CATALOG, healthy_only: bool = True
) -> dict[str, PublishedDevice]:
    """Every device the node publishes, by name (healthy GPUs only: an unhealthy GPU is withdrawn).

    With ``healthy_only=False`` also the devices of unhealthy GPUs, under the names they were published with
    (claims allocated before the GPU failed still name them; the health service reports them).
    """
    out: dict[str, PublishedDevice] = {}
    for d in devices:
        if healthy_only and not d.healthy:
            continue
        out[gpu_device_name(d.index)] = PublishedDevice(gpu_device_name(d.index), d.index, d.uuid, d.memory_mib)
        model = catalog.get(d.model)
        for p in model.mig_profiles:
            for start in p.starts:
                name = mig_device_name(d.index, p.name, start)
                out[name] = PublishedDevice(name, d.index, d.uuid, p.memory_mib, p.name, start)
    return out


def _attrs(d: DeviceInfo, model: GpuModel, mps_multi_user: bool = False) -> dict[str, Any]:
    arch, cc = model.architecture, model.compute_capability
    multi = {ATTR_MPS_MULTI_USER: {"bool": True}} if mps_multi_user else {}
    return {
        ATTR_TYPE: {"string": DEVICE_TYPE_GPU},
        ATTR_INDEX: {"int": d.index},
        ATTR_UUID: {"string": d.uuid},
        ATTR_MODEL: {"string": model.name},
        ATTR_PRODUCT_NAME: {"string": d.product},
        ATTR_ARCHITECTURE: {"string": arch},
        ATTR_CUDA_COMPUTE_CAPABILITY: {"version": cc},
        ATTR_MIG_CAPABLE: {"bool": model.mig_capable},
        ATTR_MPS_CAPABLE: {"bool": model.mps_capable},
        **multi,
    }


def _gpu_device(d: DeviceInfo, model: GpuModel, mps_multi_user: bool = False) -> dict[str, Any]:
    memory = f"{d.memory_mib}Mi"
    device: dict[str, Any] = {
        "name": gpu_device_name(d.index),
        "attributes": _attrs(d, model, mps_multi_user),
        "allowMultipleAllocations": True,
        "capacity": {
            # The defaults are the whole capacity: a claim that asks for none gets the GPU to itself.
            CAPACITY_MEMORY: {
                "value": memory,
                "requestPolicy": {
                    "default": memory,
                    "validRange": {"min": f"{MEMORY_STEP_MIB}Mi", "step": f"{MEMORY_STEP_MIB}Mi"},
                },
            },
            CAPACITY_COMPUTE: {
                "value": str(COMPUTE_FULL),
                "requestPolicy": {"default": str(COMPUTE_FULL), "validRange": {"min": "1", "step": "1"}},
            },
        },
    }
    if model.mig_capable:
        counters = {memory_counter(s): {"value": "1"} for s in range(model.memory_slots)}
        counters[COMPUTE_SLICES_COUNTER] = {"value": str(model.compute_slices)}
        device["consumesCounters"] = [{"counterSet": counter_set_name(d.index), "counters": counters}]
    return device


def _mig_device(
    d: DeviceInfo, model: GpuModel, p: MigProfile, start: int, mps_multi_user: bool = False
) -> dict[str, Any]:
    attrs = _attrs(d, model, mps_multi_user)
    attrs[ATTR_TYPE] = {"string": DEVICE_TYPE_MIG}
    attrs[ATTR_PARENT_UUID] = attrs.pop(ATTR_UUID)
    attrs[ATTR_PROFILE] = {"string": p.name}
    attrs[ATTR_PLACEMENT_START] = {"int": start}
    attrs[ATTR_PLACEMENT_SIZE] = {"int": p.memory_slots}
    counters = {memory_counter(s): {"value": "1"} for s in range(start, start + p.memory_slots)}
    counters[COMPUTE_SLICES_COUNTER] = {"value": str(p.compute_slices)}
    return {
        "name": mig_device_name(d.index, p.name, start),
        "attributes": attrs,
        "capacity": {
            CAPACITY_MEMORY: {"value": f"{p.memory_mib}Mi"},
            CAPACITY_MULTIPROCESSORS: {"value": str(model.profile_sms(p))},
        },
        "consumesCounters": [{"counterSet": counter_set_name(d.index), "counters": counters}],
    }


def _counter_set(d: DeviceInfo, model: GpuModel) -> dict[str, Any]:
    counters = {memory_counter(s): {"value": "1"} for s in range(model.memory_slots)}
    counters[COMPUTE_SLICES_COUNTER] = {"value": str(model.compute_slices)}
    return {"name": counter_set_name(d.index), "counters": counters}


@dataclass(frozen=True, slots=True)
class SliceSpec:
    """One ResourceSlice's name and spec, without the pool generation and slice count (the publisher sets those)."""

    name: str
    spec: Mapping[str, Any]


def slice_name(node: str, kind: str, index: int) -> str:
    return f"{node}-{DRIVER}-gpu-{index}-{kind}"


def build_slices(
    node: str, devices: Sequence[DeviceInfo], catalog: Catalog = DEFAULT_CATALOG, mps_multi_user: bool = False
) -> tuple[SliceSpec, ...]:
    """The node's pool: per GPU a counter slice (MIG-capable GPUs only) and a device slice. ``mps_multi_user``: the
    driver runs one multi-user MPS daemon per unit, which every device says (``mpsMultiUser: true``)."""
    out: list[SliceSpec] = []
    for d in sorted(devices, key=lambda d: d.index):
        if not d.healthy:
            continue  # withdrawn: nothing new lands on it; claims already prepared keep it
        model = catalog.get(d.model)
        base = {"driver": DRIVER, "nodeName": node}
        if model.mig_capable:
            out.append(
                SliceSpec(slice_name(node, "counters", d.index), {**base, "sharedCounters": [_counter_set(d, model)]})
            )
        devs = [_gpu_device(d, model, mps_multi_user)]
        for p in sorted(model.mig_profiles, key=lambda p: (-p.memory_slots, p.name)):
            devs.extend(_mig_device(d, model, p, s, mps_multi_user) for s in p.starts)
        out.append(SliceSpec(slice_name(node, "devices", d.index), {**base, "devices": devs}))
    return tuple(out)


def resource_slice(s: SliceSpec, pool: str, generation: int, count: int, owner: Mapping[str, str]) -> dict[str, Any]:
    """The full object for the API server, owned by the Node so that deleting the Node deletes its slices."""
    return {
        "apiVersion": RESOURCE_API,
        "kind": "ResourceSlice",
        "metadata": {
            "name": s.name,
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Node", "name": owner["name"], "uid": owner["uid"], "controller": True}
            ],
        },
        "spec": {**s.spec, "pool": {"name": pool, "generation": generation, "resourceSliceCount": count}},
    }
