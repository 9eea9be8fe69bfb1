"""The simulated node's YAML file: which GPUs it has, in which MIG mode, and where it keeps its state.

The smallest useful file is ``gpus: [{model: H100-80GB, count: 2}, {model: A30-24GB, count: 1}]``. Every key:

.. code-block:: yaml

    gpus:
      - model: H100-80GB        # a catalog name or alias
        count: 2                # default 1
        mig: true               # MIG mode at start (default false, as on a new GPU)
        healthy: true
        migInstances:           # a static layout that exists before the agent starts (needs mig: true)
          - {profile: 1g.10gb, start: 0}
    uuidSeed: node-a            # UUIDs are derived from it (default: the agent's node name)
    stateFile: /var/lib/sharegpu/sim-state.json   # keeps MIG mode and instances across agent restarts
    healthFile: /var/lib/sharegpu/sim-health.yaml # optional: GPU health changed while the agent runs (see SimBackend)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from sharegpu.model.assignment import MigSlot
from sharegpu.model.catalog import DEFAULT_CATALOG, Catalog, CatalogError
from sharegpu.node.errors import NodeError

MAX_SIM_GPUS = 64


class SimConfigError(NodeError, ValueError):
    """A simulated-node configuration that cannot be used; the message names the file and the entry."""


@dataclass(frozen=True, slots=True)
class SimGpuGroup:
    model: str  # canonical catalog name
    count: int = 1
    mig: bool = False
    healthy: bool = True
    mig_instances: tuple[MigSlot, ...] = ()


@dataclass(frozen=True, slots=True)
class SimConfig:
    gpus: tuple[SimGpuGroup, ...]
    uuid_seed: str | None = None
    state_file: Path | None = None
    health_file: Path | None = None

    @property
    def gpu_count(self) -> int:
        return sum(g.count for g in self.gpus)


def load_sim_config(path: Path, catalog: Catalog = DEFAULT_CATALOG) -> SimConfig:
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise SimConfigError(f"cannot read simulated-node config {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise SimConfigError(
            f"simulated-node config {path} is not a text file (byte {e.start} is not UTF-8); give the YAML of the "
            "simulated GPUs, e.g. gpus: [{model: H100-80GB, count: 2}]"
        ) from None
    return parse_sim_config(text, str(path), catalog)


def parse_sim_config(text: str, source: str = "<sim config>", catalog: Catalog = DEFAULT_CATALOG) -> SimConfig:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise SimConfigError(f"{source} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise SimConfigError(f"{source}: expected a mapping with a 'gpus' list, e.g. gpus: [{{model: H100-80GB}}]")
    unknown = set(data) - {"gpus", "uuidSeed", "stateFile", "healthFile"}
    if unknown:
        raise SimConfigError(
            f"{source}: unknown keys {sorted(unknown)}; allowed: gpus, uuidSeed, stateFile, healthFile"
        )
    groups_raw = data.get("gpus")
    if not isinstance(groups_raw, list) or not groups_raw:
        raise SimConfigError(f"{source}: 'gpus' must be a non-empty list, e.g. gpus: [{{model: H100-80GB, count: 2}}]")
    groups = tuple(_group(g, f"{source}: gpus[{i}]", catalog) for i, g in enumerate(groups_raw))
    total = sum(g.count for g in groups)
    if total > MAX_SIM_GPUS:
        raise SimConfigError(f"{source}: {total} GPUs is more than the {MAX_SIM_GPUS} a node can have")
    seed = data.get("uuidSeed")
    if seed is not None and (not isinstance(seed, str) or not seed):
        raise SimConfigError(f"{source}: 'uuidSeed' must be a non-empty string")
    state = data.get("stateFile")
    if state is not None and (not isinstance(state, str) or not state):
        raise SimConfigError(f"{source}: 'stateFile' must be a path")
    health = data.get("healthFile")
    if health is not None and (not isinstance(health, str) or not health):
        raise SimConfigError(f"{source}: 'healthFile' must be a path")
    return SimConfig(groups, seed, Path(state) if state else None, Path(health) if health else None)


def _group(g: Any, where: str, catalog: Catalog) -> SimGpuGroup:
    if not isinstance(g, dict):
        raise SimConfigError(f"{where}: expected a mapping such as {{model: H100-80GB, count: 2}}")
    unknown = set(g) - {"model", "count", "mig", "healthy", "migInstances"}
    if unknown:
        raise SimConfigError(
            f"{where}: unknown keys {sorted(unknown)}; allowed: model, count, mig, healthy, migInstances"
        )
    name = g.get("model")
    if not isinstance(name, str):
        raise SimConfigError(f"{where}: 'model' must be a GPU model name such as H100-80GB")
    try:
        model = catalog.strict(name)
    except CatalogError as e:
        raise SimConfigError(f"{where}: {e}") from None
    count = g.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise SimConfigError(f"{where}: 'count' must be a whole number of at least 1, not {count!r}")
    mig = g.get("mig", False)
    healthy = g.get("healthy", True)
    if not isinstance(mig, bool) or not isinstance(healthy, bool):
        raise SimConfigError(f"{where}: 'mig' and 'healthy' must be true or false")
    if mig and not model.mig_capable:
        raise SimConfigError(f"{where}: {model.name} has no MIG; remove 'mig: true'")
    raw_instances = g.get("migInstances", [])
    if not isinstance(raw_instances, list):
        raise SimConfigError(f"{where}: 'migInstances' must be a list of {{profile, start}}")
    instances = []
    for j, inst in enumerate(raw_instances):
        if (
            not isinstance(inst, dict)
            or not isinstance(inst.get("profile"), str)
            or isinstance(inst.get("start"), bool)
            or not isinstance(inst.get("start"), int)
        ):
            raise SimConfigError(f"{where}.migInstances[{j}]: expected {{profile: 1g.10gb, start: 0}}")
        instances.append(MigSlot(inst["profile"], inst["start"]))
    if instances and not mig:
        raise SimConfigError(f"{where}: 'migInstances' needs 'mig: true'")
    return SimGpuGroup(model.name, count, mig, healthy, tuple(instances))
