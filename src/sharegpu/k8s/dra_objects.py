"""Reading the DRA path's objects: which node is on it, what a claim's capacity map asks or holds, and whose MPS
daemon a claim's pod reaches.

Shared by the cluster cache (which leaves DRA nodes out of the device-plugin ledger and models their claims) and
``sharegpu status`` (which shows them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sharegpu.kube.quantity import asked_mib, asked_whole, quantity_or_zero
from sharegpu.kube.schema import Pod, ResourceSlice
from sharegpu.model.contract import (
    CAPACITY_COMPUTE,
    CAPACITY_MEMORY,
    COMPUTE_FULL,
    DEVICE_PATH_DRA,
    DEVICE_PATH_LABEL,
    DRIVER,
    SliceDevice,
    read_slice_device,
)
from sharegpu.model.tenant import tenant_of


def is_dra_node(labels: Mapping[str, str]) -> bool:
    return labels.get(DEVICE_PATH_LABEL) == DEVICE_PATH_DRA


# A claim's capacity map (its request's ``capacity.requests``, or its allocation's ``consumedCapacity``) is an ask:
# rounded up, as the driver enforces it and as the extender counts a pod's ask.
def claimed_mib(capacity: Mapping[str, Any]) -> int | None:
    """The GPU memory a claim's capacity map names, in MiB rounded up (None: it names none, i.e. the whole)."""
    return asked_mib(quantity_or_zero(capacity[CAPACITY_MEMORY])) if CAPACITY_MEMORY in capacity else None


def claimed_percent(capacity: Mapping[str, Any]) -> int:
    """The compute (percent of the GPU) a claim's capacity map names, rounded up (none named: the whole)."""
    if CAPACITY_COMPUTE not in capacity:
        return COMPUTE_FULL
    return asked_whole(quantity_or_zero(capacity[CAPACITY_COMPUTE]))


def slice_devices(s: ResourceSlice) -> list[SliceDevice]:
    """The devices of one of this driver's ResourceSlices, as it publishes them (none for another driver's slice)."""
    if s.spec.driver != DRIVER:
        return []
    return [read_slice_device(d.model_dump(by_alias=True, exclude_none=True)) for d in s.spec.devices]


def claim_tenant(pod: Pod, claim_name: str) -> str | None:
    """The MPS tenant of ``pod`` as a user of ResourceClaim ``claim_name`` (:mod:`sharegpu.model.tenant`), from the
    containers that use the claim only (None: none does; a sidecar that uses no claim decides nothing). The node's
    DRA driver reads a claim's tenant the same way (``sharegpu.node.dra.driver.claim_tenant``, which the control plane
    may not import; a test holds the two equal). Raises :class:`~sharegpu.model.tenant.TenantConflict` when those
    containers declare different UIDs."""
    users = [(c.name, pod.run_as_user(c)) for c in pod.claim_containers(claim_name)]
    if not users:
        return None
    return tenant_of(pod.metadata.namespace, pod.metadata.uid or pod.key, users, pod.spec.host_users)
