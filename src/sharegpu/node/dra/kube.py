"""What the DRA driver asks of the API server, behind a small interface (``lightkube.AsyncClient`` underneath).

It reads the claims the kubelet names, its Node (for the owner reference and the device-path label) and writes
its ResourceSlices, listed by field selector (``spec.nodeName``, ``spec.driver``) so it never sees another node's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from sharegpu.kube.errors import ConfigError, NotFound
from sharegpu.model.contract import DRIVER

FIELD_MANAGER = "sharegpu-dra-driver"


class DraKube(Protocol):
    async def get_claim(self, namespace: str, name: str) -> Mapping[str, Any]: ...

    async def get_pod(self, namespace: str, name: str) -> Mapping[str, Any]: ...

    async def get_node(self, name: str) -> Mapping[str, Any]: ...

    async def label_node(self, name: str, labels: Mapping[str, str | None]) -> None: ...

    async def list_slices(self, node: str) -> list[Mapping[str, Any]]: ...

    async def apply_slice(self, obj: Mapping[str, Any]) -> None:
        """Create or update the slice (server-side apply, our fields only)."""
        ...

    async def delete_slice(self, name: str) -> None: ...

    async def close(self) -> None: ...


class LightkubeDraApi:
    """:class:`DraKube` over :class:`~sharegpu.kube.client.KubeClient`: objects as the API server writes them."""

    def __init__(self, kubeconfig: Path | None = None) -> None:
        from sharegpu.kube.client import KubeClient

        try:
            self._client = KubeClient(kubeconfig, FIELD_MANAGER)
        except ConfigError as e:
            raise ConfigError(f"cannot load Kubernetes credentials: {e}") from None

    async def get_claim(self, namespace: str, name: str) -> Mapping[str, Any]:
        from lightkube.resources.resource_v1 import ResourceClaim

        return await self._client.get(ResourceClaim, name, f"read ResourceClaim {namespace}/{name}", namespace)

    async def get_pod(self, namespace: str, name: str) -> Mapping[str, Any]:
        from lightkube.resources.core_v1 import Pod

        return await self._client.get(Pod, name, f"read pod {namespace}/{name}", namespace)

    async def get_node(self, name: str) -> Mapping[str, Any]:
        from lightkube.resources.core_v1 import Node

        return await self._client.get(Node, name, f"read node {name}")

    async def label_node(self, name: str, labels: Mapping[str, str | None]) -> None:
        from lightkube.resources.core_v1 import Node

        await self._client.merge_patch(Node, name, {"metadata": {"labels": dict(labels)}}, f"label node {name}")

    async def list_slices(self, node: str) -> list[Mapping[str, Any]]:
        from lightkube.resources.resource_v1 import ResourceSlice

        fields = {"spec.nodeName": node, "spec.driver": DRIVER}
        slices, _ = await self._client.list(ResourceSlice, f"list the ResourceSlices of node {node}", fields=fields)
        return list(slices)

    async def apply_slice(self, obj: Mapping[str, Any]) -> None:
        from lightkube.resources.resource_v1 import ResourceSlice

        body = ResourceSlice.from_dict(dict(obj))
        assert isinstance(body, ResourceSlice)
        await self._client.apply(body, f"write ResourceSlice {obj['metadata']['name']}")

    async def delete_slice(self, name: str) -> None:
        from lightkube.resources.resource_v1 import ResourceSlice

        with contextlib.suppress(NotFound):  # already gone: what deleting it was for
            await self._client.delete(ResourceSlice, name, f"delete ResourceSlice {name}")

    async def close(self) -> None:
        await self._client.close()
