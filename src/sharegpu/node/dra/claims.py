"""A ResourceClaim (:class:`sharegpu.kube.schema.ResourceClaim`) → what this node must prepare for it, or why it cannot.

Everything is checked before anything is touched: the claim's UID is the one the kubelet named (a claim deleted and
re-created under the same name is another claim), it is allocated, every result of our driver lies in this node's
pool and names a device this node publishes, and its config is valid for what was allocated.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Any

from sharegpu.kube.quantity import asked_mib, asked_whole, parse_quantity
from sharegpu.kube.schema import DeviceRequestAllocationResult, ResourceClaim
from sharegpu.model.assignment import Mechanism
from sharegpu.model.catalog import DEFAULT_CATALOG, Catalog
from sharegpu.model.contract import CAPACITY_COMPUTE, CAPACITY_MEMORY, COMPUTE_FULL, DRIVER
from sharegpu.model.request import Isolation
from sharegpu.model.tenant import NO_TENANT
from sharegpu.node.backends.base import DeviceInfo
from sharegpu.node.dra.config import ConfigError, EffectiveConfig, Sharing, TimeSlice, configs_for_request
from sharegpu.node.dra.slices import PublishedDevice, node_devices
from sharegpu.node.errors import NodeError


class ClaimError(NodeError):
    """This claim cannot be prepared; the message goes back to the kubelet (and the pod's events) for this claim only."""


@dataclass(frozen=True, slots=True)
class DevicePlan:
    """One allocated device (or share of one) and how it is to be enforced."""

    request: str
    device: str
    pool: str
    share_id: str | None
    gpu_index: int
    gpu_uuid: str
    mechanism: Mechanism
    compute_percent: int  # of the GPU (100 for exclusive and MIG: the whole unit)
    memory_mib: int  # enforced for MPS; the unit's memory otherwise
    mig_profile: str | None = None
    mig_start: int | None = None
    time_slice: TimeSlice = TimeSlice.DEFAULT

    @property
    def on_mig(self) -> bool:
        """A MIG instance (alone, or shared by the claim's pods through MPS inside it)."""
        return self.mig_profile is not None


@dataclass(frozen=True, slots=True)
class ClaimPlan:
    uid: str
    namespace: str
    name: str
    devices: tuple[DevicePlan, ...]
    # Whose MPS daemon serves the claim's device (sharegpu.model.tenant): the tenant of the pods whose containers use
    # the claim, or the node's one multi-user tenant; NO_TENANT for a claim without MPS.
    tenant: str = NO_TENANT

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


def _quantity(q: Any) -> Decimal:
    value = parse_quantity(q)
    if value is None:
        raise ValueError(f"{q!r} is not a quantity")
    return value


def plan_claim(
    claim: ResourceClaim,
    uid: str,
    node: str,
    gpus: tuple[DeviceInfo, ...],
    catalog: Catalog = DEFAULT_CATALOG,
) -> ClaimPlan:
    meta = claim.metadata
    key = claim.key
    if meta.uid != uid:
        raise ClaimError(
            f"claim {key} has UID {meta.uid or None}, not {uid} as the kubelet asked: it was deleted and re-created; "
            "the pod must be re-created too"
        )
    allocation = claim.status.allocation
    if allocation is None:
        raise ClaimError(f"claim {key} is not allocated; the scheduler allocates it before the pod reaches a node")
    results = [r for r in allocation.devices.results if r.driver == DRIVER]
    if not results:
        raise ClaimError(f"claim {key} has no device of driver {DRIVER}; it is not this driver's to prepare")
    published = node_devices(gpus, catalog)
    devices = {d.index: d for d in gpus}
    plans: list[DevicePlan] = []
    for r in results:
        if r.pool != node:
            raise ClaimError(
                f"claim {key}: device {r.device} was allocated from pool {r.pool}, not from this node {node}"
            )
        pub = published.get(r.device)
        if pub is None:
            raise ClaimError(
                f"claim {key}: device {r.device} is not a healthy device of node {node}; "
                f"its devices are {', '.join(sorted(published)) or 'none'}"
            )
        try:
            config = configs_for_request(allocation.devices.config, r.request, key)
        except ConfigError as e:
            raise ClaimError(str(e)) from None
        plans.append(_plan_device(key, r, pub, devices[pub.gpu_index], config, catalog))
    return ClaimPlan(uid, meta.namespace, meta.name, tuple(plans))


def _plan_device(
    key: str,
    result: DeviceRequestAllocationResult,
    pub: PublishedDevice,
    gpu: DeviceInfo,
    config: EffectiveConfig,
    catalog: Catalog,
) -> DevicePlan:
    request = result.request
    # The whole unit, exclusive: what a MIG device or an unshared GPU gets; shares narrow it below.
    whole = DevicePlan(
        request=request,
        device=pub.name,
        pool=result.pool,
        share_id=result.share_id or None,
        gpu_index=pub.gpu_index,
        gpu_uuid=pub.gpu_uuid,
        mechanism=Mechanism.EXCLUSIVE,
        compute_percent=COMPUTE_FULL,
        memory_mib=pub.memory_mib,
        time_slice=config.timeSliceInterval,
    )
    where = f"claim {key}, request {request} ({pub.name})"
    if pub.mig_profile is not None:
        mig = replace(whole, mechanism=Mechanism.MIG, mig_profile=pub.mig_profile, mig_start=pub.mig_start)
        if config.sharing is Sharing.TIME_SLICING:
            raise ClaimError(
                f"{where}: sharing: TimeSlicing does not apply to a MIG instance (it sets a whole GPU's time slice, "
                "which a GPU in MIG mode does not have); leave sharing out to have the instance to this claim alone, "
                "or use sharing: MPS to let the claim's pods share it through an MPS daemon"
            )
        if config.sharing is Sharing.MPS:
            if config.isolation in (Isolation.FAULT, Isolation.HARDWARE):
                raise ClaimError(
                    f"{where}: isolation: {config.isolation.value} cannot be met by MPS inside the instance (a fault "
                    "in one MPS client ends every client of its server, i.e. the claim's other pods); leave sharing "
                    "out (each pod of the claim then holds its own context in the instance), or lower the isolation"
                )
            # MPS inside the instance: the pods that share this claim run concurrently on it, each held to the
            # instance's memory (the instance itself is the hardware limit towards other claims).
            return replace(mig, mechanism=Mechanism.MPS)
        return mig
    consumed = result.consumed_capacity
    try:
        # What the claim consumes is what it asked (the scheduler's grant of it): rounded up, as the control plane
        # counts it, so that the node enforces no less than the extender and DRA steering model.
        memory = asked_mib(_quantity(consumed[CAPACITY_MEMORY])) if CAPACITY_MEMORY in consumed else pub.memory_mib
        compute = asked_whole(_quantity(consumed[CAPACITY_COMPUTE])) if CAPACITY_COMPUTE in consumed else COMPUTE_FULL
    except ValueError as e:
        raise ClaimError(f"{where}: consumedCapacity is malformed: {e}") from None
    if config.isolation is Isolation.HARDWARE:
        raise ClaimError(
            f"{where}: isolation: hardware needs a MIG partition, and {pub.name} is a whole GPU; "
            "ask for a device of class mig.sharegpu.io, or lower the isolation"
        )
    if memory >= pub.memory_mib and compute >= COMPUTE_FULL:
        return whole
    if config.isolation is Isolation.FAULT:
        if config.sharing is Sharing.MPS:
            raise ClaimError(
                f"{where}: isolation: fault cannot be met by MPS (a fault in one MPS client ends every client of its "
                "server); use sharing: TimeSlicing, or leave sharing out"
            )
        return replace(whole, mechanism=Mechanism.TIME_SLICING, compute_percent=compute, memory_mib=memory)
    if config.sharing is Sharing.TIME_SLICING:
        if config.isolation is Isolation.MEMORY:
            raise ClaimError(
                f"{where}: isolation: memory needs an enforced memory limit, which TimeSlicing does not give; "
                "use sharing: MPS, or isolation: none"
            )
        return replace(whole, mechanism=Mechanism.TIME_SLICING, compute_percent=compute, memory_mib=memory)
    if not catalog.get(gpu.model).mps_capable:
        raise ClaimError(
            f"{where}: {gpu.model} has no MPS with per-client limits; use sharing: TimeSlicing (which enforces "
            "nothing) or ask for the whole GPU"
        )
    return replace(whole, mechanism=Mechanism.MPS, compute_percent=compute, memory_mib=memory)
