"""What the DRA driver asks of the API server, behind a small interface (``lightkube.AsyncClient`` underneath).

It reads the claims the kubelet names, their pods, its Node (for the owner reference), the pods bound to the node (for
the audit) and its ResourceSlices, listed by field selector (``spec.nodeName``, ``spec.driver``) so it never sees
another node's, as :mod:`sharegpu.kube.schema` objects (the ones the control plane reads); it labels its Node, posts
the audit's Events on it (a process of no pod) and writes its slices as JSON.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from sharegpu.kube.errors import ConfigError, NotFound
from sharegpu.kube.schema import Node, Pod, ResourceClaim, ResourceSlice
from sharegpu.model.contract import DRIVER
from sharegpu.node.kube import post_node_event

FIELD_MANAGER = "sharegpu-dra-driver"


class DraKube(Protocol):
    async def get_claim(self, namespace: str, name: str) -> ResourceClaim: ...

    async def get_pod(self, namespace: str, name: str) -> Pod: ...

    async def get_node(self, name: str) -> Node: ...

    async def pods_on_node(self, node: str) -> list[Pod]:
        """The pods bound to ``node`` (a field selector on ``spec.nodeName``): the audit's and fault watch's."""
        ...

    async def label_node(self, name: str, labels: Mapping[str, str | None]) -> None: ...

    async def create_node_event(self, node: str, reason: str, message: str, component: str) -> None:
        """A Warning Event on the Node (the audit's process of no pod), where ``kubectl describe node`` finds it."""
        ...

    async def list_slices(self, node: str) -> list[ResourceSlice]: ...

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

    async def get_claim(self, namespace: str, name: str) -> ResourceClaim:
        from lightkube.resources.resource_v1 import ResourceClaim as KClaim

        what = f"read ResourceClaim {namespace}/{name}"
        return ResourceClaim.model_validate(await self._client.get(KClaim, name, what, namespace))

    async def get_pod(self, namespace: str, name: str) -> Pod:
        from lightkube.resources.core_v1 import Pod as KPod

        return Pod.model_validate(await self._client.get(KPod, name, f"read pod {namespace}/{name}", namespace))

    async def get_node(self, name: str) -> Node:
        from lightkube.resources.core_v1 import Node as KNode

        return Node.model_validate(await self._client.get(KNode, name, f"read node {name}"))

    async def pods_on_node(self, node: str) -> list[Pod]:
        from lightkube.resources.core_v1 import Pod as KPod

        what = f"list the pods of node {node}"
        pods, _ = await self._client.list(KPod, what, namespace="*", fields={"spec.nodeName": node})
        return [Pod.model_validate(p) for p in pods]

    async def label_node(self, name: str, labels: Mapping[str, str | None]) -> None:
        from lightkube.resources.core_v1 import Node

        await self._client.merge_patch(Node, name, {"metadata": {"labels": dict(labels)}}, f"label node {name}")

    async def create_node_event(self, node: str, reason: str, message: str, component: str) -> None:
        await post_node_event(self._client, node, reason, message, component)

    async def list_slices(self, node: str) -> list[ResourceSlice]:
        from lightkube.resources.resource_v1 import ResourceSlice as KSlice

        fields = {"spec.nodeName": node, "spec.driver": DRIVER}
        slices, _ = await self._client.list(KSlice, f"list the ResourceSlices of node {node}", fields=fields)
        return [ResourceSlice.model_validate(s) for s in slices]

    async def apply_slice(self, obj: Mapping[str, Any]) -> None:
        from lightkube.resources.resource_v1 import ResourceSlice as KSlice

        body = KSlice.from_dict(dict(obj))
        assert isinstance(body, KSlice)
        name = body.metadata.name if body.metadata else None
        await self._client.apply(body, f"write ResourceSlice {name}")

    async def delete_slice(self, name: str) -> None:
        from lightkube.resources.resource_v1 import ResourceSlice as KSlice

        with contextlib.suppress(NotFound):  # already gone: what deleting it was for
            await self._client.delete(KSlice, name, f"delete ResourceSlice {name}")

    async def close(self) -> None:
        await self._client.close()
