"""The node's inventory as the control plane reads it: the ``sharegpu.io/inventory`` annotation and labels.

The annotation's schema lives in :mod:`sharegpu.model.inventory`; this module only fills a
:class:`~sharegpu.model.inventory.NodeSpec` from the backend and patches the Node when something changed.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Callable, Mapping

from sharegpu.model.assignment import MigSlot
from sharegpu.model.catalog import DEFAULT_CATALOG, Catalog, CatalogError
from sharegpu.model.contract import GPU_LABEL_PREFIX, INVENTORY_ANNOTATION
from sharegpu.model.inventory import GpuDevice, MigDevice, NodeSpec
from sharegpu.node.backends.base import BackendError, GpuBackend
from sharegpu.node.kube import KubeApi

log = logging.getLogger(__name__)

_LABEL_VALUE = re.compile(r"[^A-Za-z0-9._-]")


def build_node_spec(
    node_name: str,
    backend: GpuBackend,
    is_managed: Callable[[str], bool],
    mig_mode_ours: Callable[[str], bool],
    cpu_milli: int,
    memory_mib: int,
    catalog: Catalog = DEFAULT_CATALOG,
    *,
    mps_multi_user: bool = False,
) -> NodeSpec:
    """The node's inventory; ``mps_multi_user``: its agent runs one multi-user MPS daemon per unit, so the control
    plane counts one daemon per unit for all its tenants."""
    gpus = []
    for d in backend.devices():
        present: list[MigDevice] = []
        if d.mig_enabled:
            try:
                instances = backend.mig_instances(d.index)
            except BackendError as e:
                log.warning("GPU %d: cannot list MIG instances: %s", d.index, e)
                instances = ()
            model = catalog.get(d.model)
            for i in instances:
                try:
                    model.profile(i.profile)
                except CatalogError:
                    # The control plane could not account for it; it stays out of the inventory, visibly.
                    log.warning(
                        "GPU %d: MIG instance %s has profile %s unknown to the catalog", d.index, i.uuid, i.profile
                    )
                    continue
                present.append(MigDevice(i.profile, i.start, i.uuid, is_managed(i.uuid)))
        gpus.append(
            GpuDevice(
                index=d.index,
                uuid=d.uuid,
                model=d.model,
                healthy=d.healthy,
                mig_instances=tuple(MigSlot(m.profile, m.start) for m in present if not m.managed),
                memory_mib=d.memory_mib,
                sms=d.sms,
                product=d.product,
                mig_enabled=d.mig_enabled,
                mig_pinned=d.mig_enabled and not mig_mode_ours(d.uuid),
                mig_devices=tuple(present),
            )
        )
    return NodeSpec(node_name, cpu_milli, memory_mib, tuple(gpus), mps_multi_user=mps_multi_user)


def node_labels(spec: NodeSpec) -> dict[str, str]:
    """Labels for node selectors: GPU count, the model (or "mixed") and a count per model."""
    if not spec.gpus:
        return {f"{GPU_LABEL_PREFIX}.present": "false", f"{GPU_LABEL_PREFIX}.count": "0"}
    per_model = Counter(_label_value(g.model) for g in spec.gpus)
    labels = {
        f"{GPU_LABEL_PREFIX}.present": "true",
        f"{GPU_LABEL_PREFIX}.count": str(len(spec.gpus)),
        f"{GPU_LABEL_PREFIX}.model": next(iter(per_model)) if len(per_model) == 1 else "mixed",
    }
    for model, n in per_model.items():
        labels[f"{GPU_LABEL_PREFIX}.count.{model}"] = str(n)
    return labels


def _label_value(v: str) -> str:
    return _LABEL_VALUE.sub("-", v).strip("-._")[:63] or "unknown"


class InventoryPublisher:
    def __init__(self, kube: KubeApi, node_name: str) -> None:
        self._kube = kube
        self._node = node_name

    async def publish(
        self, spec: NodeSpec, current_labels: Mapping[str, str], current_annotations: Mapping[str, str]
    ) -> bool:
        """Patch the Node where its labels or inventory differ from ``spec``; True when it patched."""
        want = node_labels(spec)
        labels: dict[str, str | None] = {k: v for k, v in want.items() if current_labels.get(k) != v}
        # Labels of hardware that is gone (a per-model count) must go too.
        labels.update({k: None for k in current_labels if k.startswith(f"{GPU_LABEL_PREFIX}.") and k not in want})
        text = spec.to_json()
        annotations: dict[str, str | None] = {}
        if current_annotations.get(INVENTORY_ANNOTATION) != text:
            annotations[INVENTORY_ANNOTATION] = text
        if not labels and not annotations:
            return False
        await self._kube.patch_node_metadata(self._node, labels, annotations)
        log.info("published inventory of %s (%d GPUs)", self._node, len(spec.gpus))
        return True
