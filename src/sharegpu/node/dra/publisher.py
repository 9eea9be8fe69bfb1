"""Keeps the node's ResourceSlices equal to its GPUs: the pool's generation goes up on every change, every slice of
the pool carries it (the scheduler ignores a pool whose slices disagree), and slices no longer wanted are deleted.

A change is anything in the built slices (a GPU gone or unhealthy, a model resolved differently) or a slice the API
server lost or holds beside ours. The first publish after a start always writes, one generation above what it finds.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from sharegpu.model.catalog import DEFAULT_CATALOG, Catalog
from sharegpu.node.backends.base import DeviceInfo
from sharegpu.node.dra.kube import DraKube
from sharegpu.node.dra.slices import SliceSpec, build_slices, resource_slice

log = logging.getLogger(__name__)


class SlicePublisher:
    def __init__(
        self, node: str, kube: DraKube, catalog: Catalog = DEFAULT_CATALOG, *, mps_multi_user: bool = False
    ) -> None:
        self.node = node
        self._kube = kube
        self._catalog = catalog
        self._multi_user = mps_multi_user  # the devices say so (the control plane's DRA ledger reads it)
        self.generation = 0
        self._published: str | None = None  # fingerprint of what was last written
        self._owner: Mapping[str, str] | None = None

    async def publish(self, devices: Sequence[DeviceInfo]) -> bool:
        """Write the slices if anything changed; True when it wrote."""
        wanted = build_slices(self.node, devices, self._catalog, self._multi_user)
        existing = await self._kube.list_slices(self.node)
        names = {s.metadata.name for s in existing}
        fingerprint = _fingerprint(wanted)
        if fingerprint == self._published and names == {s.name for s in wanted}:
            return False
        if self._owner is None:
            meta = (await self._kube.get_node(self.node)).metadata
            self._owner = {"name": meta.name or self.node, "uid": meta.uid}
        found = max((s.spec.pool.generation for s in existing), default=0)
        self.generation = max(self.generation, found) + 1
        for s in wanted:
            await self._kube.apply_slice(resource_slice(s, self.node, self.generation, len(wanted), self._owner))
        for name in sorted(names - {s.name for s in wanted}):
            await self._kube.delete_slice(name)
        self._published = fingerprint
        log.info("published %d ResourceSlice(s) for pool %s, generation %d", len(wanted), self.node, self.generation)
        return True


def _fingerprint(slices: tuple[SliceSpec, ...]) -> str:
    data: list[Any] = [[s.name, s.spec] for s in slices]
    return json.dumps(data, sort_keys=True)
