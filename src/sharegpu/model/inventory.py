"""What a node has: CPU, memory and GPUs. The node agent publishes it; the ledger is built from it.

This module also owns the ``sharegpu.io/inventory`` node annotation: :meth:`NodeSpec.to_json` is what the node
agent writes and :meth:`NodeSpec.from_json` is what the control plane reads, so both sides share one schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from sharegpu.model.assignment import MigSlot
from sharegpu.model.catalog import DEFAULT_CATALOG, Catalog, CatalogError

INVENTORY_VERSION = 1


class InvalidInventory(ValueError):
    """A node description that cannot be accounted for."""


@dataclass(frozen=True, slots=True)
class MigDevice:
    """A MIG instance that exists on a GPU right now, as the node agent sees it."""

    profile: str
    start: int
    uuid: str  # the MIG-… UUID a container is given
    managed: bool = True  # created by sharegpu for assignments (False: a static layout made outside sharegpu)


@dataclass(frozen=True, slots=True)
class GpuDevice:
    index: int
    uuid: str
    model: str  # canonical catalog name (or the opaque name of a generic model)
    healthy: bool = True
    # MIG instances that exist on the device and are kept when empty (a static layout made outside sharegpu).
    mig_instances: tuple[MigSlot, ...] = ()
    # What the hardware reports; 0 / "" when unknown (then the catalog's figures stand).
    memory_mib: int = 0
    sms: int = 0
    product: str = ""  # the driver's product name, e.g. "NVIDIA H100 80GB HBM3"
    mig_enabled: bool = False
    # Every MIG instance present now, managed or static, with its UUID.
    mig_devices: tuple[MigDevice, ...] = ()
    # MIG mode that an administrator turned on: sharegpu never turns it off, so only MIG shares can go here (a GPU
    # that sharegpu itself put in MIG mode is not pinned: the node agent takes it out again for a non-MIG share).
    mig_pinned: bool = False


@dataclass(frozen=True, slots=True)
class NodeSpec:
    name: str
    cpu_milli: int
    memory_mib: int
    gpus: tuple[GpuDevice, ...] = ()
    labels: tuple[tuple[str, str], ...] = field(default=())
    # The node runs MPS in multi-user mode (its agent's --mps-multi-user): one daemon per unit serves every user, so
    # all its MPS clients are one tenant (sharegpu.model.tenant.MULTI_USER_TENANT).
    mps_multi_user: bool = False

    def __post_init__(self) -> None:
        if not self.name:
            raise InvalidInventory("a node needs a name")
        if self.cpu_milli < 0 or self.memory_mib < 0:
            raise InvalidInventory(f"node {self.name}: CPU and memory must not be negative")
        if [g.index for g in self.gpus] != list(range(len(self.gpus))):
            raise InvalidInventory(f"node {self.name}: GPU indices must be 0..{len(self.gpus) - 1} in order")
        uuids = [g.uuid for g in self.gpus]
        if len(set(uuids)) != len(uuids):
            raise InvalidInventory(f"node {self.name}: GPU UUIDs must be unique")

    # ----- the sharegpu.io/inventory annotation -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "version": INVENTORY_VERSION,
            "node": self.name,
            "cpuMilli": self.cpu_milli,
            "memoryMiB": self.memory_mib,
            "gpus": [_gpu_to_dict(g) for g in self.gpus],
        }
        if self.labels:
            d["labels"] = {k: v for k, v in self.labels}
        if self.mps_multi_user:
            d["mpsMultiUser"] = True
        return d

    def to_json(self) -> str:
        """The annotation value; canonical (sorted keys, no spaces) so an unchanged node gives identical text."""
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_dict(cls, d: Any, catalog: Catalog = DEFAULT_CATALOG) -> NodeSpec:
        """Parse and check an inventory; anything malformed or impossible raises :class:`InvalidInventory`."""
        try:
            if not isinstance(d, dict):
                raise InvalidInventory("inventory is not a JSON object")
            if d.get("version") != INVENTORY_VERSION:
                raise InvalidInventory(
                    f"inventory version {d.get('version')!r} is not {INVENTORY_VERSION}; "
                    "the node agent and the control plane run different sharegpu versions"
                )
            name = _str(d["node"], "node")
            gpus = d.get("gpus", [])
            if not isinstance(gpus, list):
                raise InvalidInventory("inventory field 'gpus' must be a list")
            labels = d.get("labels", {})
            if not isinstance(labels, dict):
                raise InvalidInventory("inventory field 'labels' must be an object")
            spec = cls(
                name=name,
                cpu_milli=_int(d.get("cpuMilli", 0), "cpuMilli"),
                memory_mib=_int(d.get("memoryMiB", 0), "memoryMiB"),
                gpus=tuple(_gpu_from_dict(g, name, catalog) for g in gpus),
                labels=tuple(sorted((str(k), str(v)) for k, v in labels.items())),
                mps_multi_user=_bool(d.get("mpsMultiUser", False), "mpsMultiUser"),
            )
        except InvalidInventory:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidInventory(f"inventory is malformed: {type(e).__name__}: {e}") from None
        return spec

    @classmethod
    def from_json(cls, text: str, catalog: Catalog = DEFAULT_CATALOG) -> NodeSpec:
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, TypeError) as e:
            raise InvalidInventory(f"inventory is not valid JSON: {e}") from None
        except RecursionError:
            raise InvalidInventory("inventory JSON is nested too deeply") from None
        return cls.from_dict(data, catalog)


def _gpu_to_dict(g: GpuDevice) -> dict[str, Any]:
    return {
        "index": g.index,
        "uuid": g.uuid,
        "model": g.model,
        "product": g.product,
        "healthy": g.healthy,
        "memoryMiB": g.memory_mib,
        "sms": g.sms,
        "migEnabled": g.mig_enabled,
        "migPinned": g.mig_pinned,
        "migStatic": [{"profile": s.profile, "start": s.start} for s in g.mig_instances],
        "migInstances": [
            {"profile": m.profile, "start": m.start, "uuid": m.uuid, "managed": m.managed} for m in g.mig_devices
        ],
    }


def _gpu_from_dict(g: Any, node: str, catalog: Catalog) -> GpuDevice:
    if not isinstance(g, dict):
        raise InvalidInventory(f"node {node}: every GPU must be a JSON object")
    index = _int(g["index"], "index")
    where = f"node {node} GPU {index}"
    dev = GpuDevice(
        index=index,
        uuid=_str(g["uuid"], "uuid"),
        model=_str(g["model"], "model"),
        healthy=_bool(g.get("healthy", True), "healthy"),
        mig_instances=tuple(
            MigSlot(_str(s["profile"], "profile"), _int(s["start"], "start")) for s in _list(g, "migStatic")
        ),
        memory_mib=_int(g.get("memoryMiB", 0), "memoryMiB"),
        sms=_int(g.get("sms", 0), "sms"),
        product=_str(g.get("product", ""), "product", empty_ok=True),
        mig_enabled=_bool(g.get("migEnabled", False), "migEnabled"),
        mig_pinned=_bool(g.get("migPinned", False), "migPinned"),
        mig_devices=tuple(
            MigDevice(
                _str(m["profile"], "profile"),
                _int(m["start"], "start"),
                _str(m["uuid"], "uuid"),
                _bool(m.get("managed", True), "managed"),
            )
            for m in _list(g, "migInstances")
        ),
    )
    if dev.memory_mib < 0 or dev.sms < 0:
        raise InvalidInventory(f"{where}: memory and SM count must not be negative")
    _check_mig(dev, where, catalog)
    return dev


def _check_mig(dev: GpuDevice, where: str, catalog: Catalog) -> None:
    """MIG instances must be real placements of the model's profiles and must not overlap."""
    slots = [(m.profile, m.start) for m in dev.mig_devices]
    static_list = [(s.profile, s.start) for s in dev.mig_instances]
    static = set(static_list)
    if len(static) != len(static_list):
        twice = next(s for s in static_list if static_list.count(s) > 1)
        raise InvalidInventory(f"{where}: static MIG instance {twice[0]}@{twice[1]} is listed twice")
    if dev.mig_pinned and not dev.mig_enabled:
        raise InvalidInventory(f"{where}: migPinned needs migEnabled")
    if (dev.mig_devices or dev.mig_instances) and not dev.mig_enabled:
        raise InvalidInventory(f"{where}: lists MIG instances but MIG mode is off")
    if not static <= set(slots) and dev.mig_devices:
        raise InvalidInventory(f"{where}: a static MIG instance is missing from the present instances")
    model = catalog.get(dev.model)
    covered = 0
    for profile_name, start in set(slots) | static:
        try:
            profile = model.profile(profile_name)
        except CatalogError as e:
            raise InvalidInventory(f"{where}: {e}") from None
        if start not in profile.starts:
            raise InvalidInventory(
                f"{where}: {profile_name} cannot start at slot {start}; valid starts: {list(profile.starts)}"
            )
    for profile_name, start in slots or static_list:
        profile = model.profile(profile_name)
        mask = ((1 << profile.memory_slots) - 1) << start
        if covered & mask:
            raise InvalidInventory(f"{where}: MIG instances overlap at slot {start}")
        covered |= mask
    uuids = [m.uuid for m in dev.mig_devices]
    if len(set(uuids)) != len(uuids):
        raise InvalidInventory(f"{where}: MIG instance UUIDs must be unique")


def _list(g: dict[str, Any], key: str) -> list[Any]:
    v = g.get(key, [])
    if not isinstance(v, list):
        raise InvalidInventory(f"inventory field {key!r} must be a list")
    for item in v:
        if not isinstance(item, dict):
            raise InvalidInventory(f"every entry of {key!r} must be a JSON object")
    return v


def _int(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvalidInventory(f"inventory field {what!r}: expected an integer, got {v!r}")
    return v


def _bool(v: Any, what: str) -> bool:
    if not isinstance(v, bool):
        raise InvalidInventory(f"inventory field {what!r}: expected true or false, got {v!r}")
    return v


def _str(v: Any, what: str, empty_ok: bool = False) -> str:
    if not isinstance(v, str) or (not v and not empty_ok):
        raise InvalidInventory(f"inventory field {what!r}: expected a non-empty string, got {v!r}")
    return v


def sim_gpus(node: str, model: str, count: int) -> tuple[GpuDevice, ...]:
    """Devices for a simulated node, with stable UUID-like names."""
    return tuple(GpuDevice(i, f"GPU-{node}-{i}", model) for i in range(count))
