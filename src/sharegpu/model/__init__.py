"""The pure model shared by every adapter: catalog, requests, assignments, inventories."""

from sharegpu.model.assignment import Assignment, GpuShare, InvalidAssignment, Mechanism, MigSlot
from sharegpu.model.catalog import DEFAULT_CATALOG, Catalog, CatalogError, GpuModel, MigProfile
from sharegpu.model.inventory import GpuDevice, InvalidInventory, NodeSpec
from sharegpu.model.request import FULL_MILLI, GpuRequest, InvalidRequest, Isolation, Sharing

__all__ = [
    "DEFAULT_CATALOG",
    "FULL_MILLI",
    "Assignment",
    "Catalog",
    "CatalogError",
    "GpuDevice",
    "GpuModel",
    "GpuRequest",
    "GpuShare",
    "InvalidAssignment",
    "InvalidInventory",
    "InvalidRequest",
    "Isolation",
    "Mechanism",
    "MigProfile",
    "MigSlot",
    "NodeSpec",
    "Sharing",
]
