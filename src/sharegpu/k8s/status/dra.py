"""Nodes on the DRA path in ``sharegpu status``: shown from ResourceSlices and ResourceClaims.

A GPU is handed out by one path only. A node labelled ``sharegpu.io/device-path=dra`` (the DRA driver sets it on
start; the chart's node selectors use it) belongs to the DRA path: the kube-scheduler's DRA allocator places claims
on its GPUs, so the extender must not count them, and ``sharegpu status`` reads them from the driver's slices and
the claims allocated on them instead of from the node agent's inventory.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sharegpu.k8s.dra_objects import claimed_mib, claimed_percent, slice_devices
from sharegpu.kube.quantity import capacity_mib, quantity_or_zero
from sharegpu.kube.schema import ResourceClaim, ResourceSlice
from sharegpu.model.contract import (
    COMPUTE_FULL,
    DEVICE_TYPE_GPU,
    DEVICE_TYPE_MIG,
    DRIVER,
    gpu_device_name,
)


def _mig_compute_pct(model: str, profile: str) -> float:
    """The share of its GPU's compute (percent) a MIG instance of ``profile`` holds: its compute slices of the
    model's (0 where the catalog does not know them)."""
    from sharegpu.model.catalog import DEFAULT_CATALOG, CatalogError

    try:
        gpu = DEFAULT_CATALOG.strict(model)
        return round(100 * gpu.profile(profile).compute_slices / gpu.compute_slices, 1) if gpu.compute_slices else 0.0
    except (CatalogError, ValueError, KeyError):
        return 0.0


def dra_status(slices: Iterable[ResourceSlice], claims: Iterable[ResourceClaim]) -> list[dict[str, Any]]:
    """Per DRA node and GPU: model, memory, what the allocated claims consume, the MIG partitions and the claims."""
    gpus: dict[tuple[str, str], dict[str, Any]] = {}  # (pool, gpu device name) → row
    # (pool, mig device) → (gpu device, profile, start, memory MiB, compute percent)
    mig_parent: dict[tuple[str, str], tuple[str, str, int, int, float]] = {}
    for s in slices:
        pool = s.spec.pool.name
        for d in slice_devices(s):  # none for another driver's slice
            if d.type == DEVICE_TYPE_GPU:
                gpus[(pool, d.name)] = {
                    "index": d.index,
                    "uuid": d.uuid or "",
                    "model": d.model,
                    "memory_mib_total": capacity_mib(quantity_or_zero(d.memory)),
                    "memory_mib_used": 0,
                    "compute_pct_used": 0.0,
                    "mechanism": "free",
                    "mig": [],
                    "claims": [],
                }
            elif d.type == DEVICE_TYPE_MIG:
                mig_parent[(pool, d.name)] = (
                    gpu_device_name(d.index),
                    d.profile,
                    d.placement_start,
                    capacity_mib(quantity_or_zero(d.memory)),
                    _mig_compute_pct(d.model, d.profile),
                )
    for c in claims:
        key = c.key
        allocation = c.status.allocation
        for r in allocation.devices.results if allocation is not None else ():
            if r.driver != DRIVER:
                continue
            pool, device = r.pool, r.device
            if (pool, device) in mig_parent:
                parent, profile, start, memory, compute = mig_parent[(pool, device)]
                row = gpus.get((pool, parent))
                if row is not None:
                    row["mig"].append({"profile": profile, "start": start, "claim": key})
                    row["claims"].append(key)
                    row["mechanism"] = "mig"
                    # The instance is the claim's whole: its memory and its share of the GPU's compute are taken.
                    row["memory_mib_used"] += memory
                    row["compute_pct_used"] = round(row["compute_pct_used"] + compute, 1)
                continue
            row = gpus.get((pool, device))
            if row is None:
                continue
            consumed = r.consumed_capacity
            claimed = claimed_mib(consumed)
            used = row["memory_mib_total"] if claimed is None else claimed
            compute = claimed_percent(consumed)
            row["memory_mib_used"] += used
            row["compute_pct_used"] += compute
            row["claims"].append(key)
            whole = used >= row["memory_mib_total"] and compute >= COMPUTE_FULL
            row["mechanism"] = "exclusive" if whole and len(row["claims"]) == 1 else "shared"
    nodes: dict[str, list[dict[str, Any]]] = {}
    for (pool, _), row in sorted(gpus.items(), key=lambda kv: (kv[0][0], kv[1]["index"])):
        row["mig"].sort(key=lambda m: m["start"])
        nodes.setdefault(pool, []).append(row)
    return [{"name": name, "path": "dra", "gpus": rows} for name, rows in nodes.items()]
