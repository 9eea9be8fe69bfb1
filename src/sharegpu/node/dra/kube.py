"""What the DRA driver asks of the API server, behind a small interface (``lightkube.AsyncClient`` underneath).

It reads the claims the kubelet names, its Node (for the owner reference and the device-path label) and writes
its ResourceSlices, listed by field selector (``spec.nodeName``, ``spec.driver``) so it never sees another node's.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from sharegpu.model.contract import DRIVER
from sharegpu.node.kube import KubeError

FIELD_MANAGER = "sharegpu-dra-driver"


class DraKube(Protocol):
    async def get_claim(self, namespace: str, name: str) -> Mapping[str, Any]: ...

    async def get_node(self, name: str) -> Mapping[str, Any]: ...

    async def label_node(self, name: str, labels: Mapping[str, str | None]) -> None: ...

    async def list_slices(self, node: str) -> list[Mapping[str, Any]]: ...

    async def apply_slice(self, obj: Mapping[str, Any]) -> None:
        """Create or update the slice (server-side apply, our fields only)."""
        ...

    async def delete_slice(self, name: str) -> None: ...

    async def close(self) -> None: ...


class LightkubeDraApi:
    def __init__(self, kubeconfig: Path | None = None) -> None:
        from sharegpu.k8s.kubeconfig import KubeconfigError, load_credentials

        try:
            self._client = load_credentials(kubeconfig).client(FIELD_MANAGER)
        except KubeconfigError as e:
            raise KubeError(f"cannot load Kubernetes credentials: {e}") from None

    async def get_claim(self, namespace: str, name: str) -> Mapping[str, Any]:
        from lightkube.resources.resource_v1 import ResourceClaim

        try:
            claim = await self._client.get(ResourceClaim, name, namespace=namespace)
        except Exception as e:
            raise KubeError(f"cannot read ResourceClaim {namespace}/{name}: {_why(e)}") from None
        out: Mapping[str, Any] = claim.to_dict()
        return out

    async def get_node(self, name: str) -> Mapping[str, Any]:
        from lightkube.resources.core_v1 import Node

        try:
            node = await self._client.get(Node, name)
        except Exception as e:
            raise KubeError(f"cannot read node {name}: {_why(e)}") from None
        out: Mapping[str, Any] = node.to_dict()
        return out

    async def label_node(self, name: str, labels: Mapping[str, str | None]) -> None:
        from lightkube.resources.core_v1 import Node
        from lightkube.types import PatchType

        try:
            await self._client.patch(Node, name, {"metadata": {"labels": dict(labels)}}, patch_type=PatchType.MERGE)
        except Exception as e:
            raise KubeError(f"cannot label node {name}: {_why(e)}") from None

    async def list_slices(self, node: str) -> list[Mapping[str, Any]]:
        from lightkube.resources.resource_v1 import ResourceSlice

        try:
            return [
                s.to_dict()
                async for s in self._client.list(ResourceSlice, fields={"spec.nodeName": node, "spec.driver": DRIVER})
            ]
        except Exception as e:
            raise KubeError(f"cannot list the ResourceSlices of node {node}: {_why(e)}") from None

    async def apply_slice(self, obj: Mapping[str, Any]) -> None:
        from lightkube.resources.resource_v1 import ResourceSlice

        try:
            body = ResourceSlice.from_dict(dict(obj))
            assert isinstance(body, ResourceSlice)
            await self._client.apply(body, force=True)
        except Exception as e:
            raise KubeError(f"cannot write ResourceSlice {obj['metadata']['name']}: {_why(e)}") from None

    async def delete_slice(self, name: str) -> None:
        from lightkube.core.exceptions import ApiError
        from lightkube.resources.resource_v1 import ResourceSlice

        try:
            await self._client.delete(ResourceSlice, name)
        except ApiError as e:
            if e.status.code != 404:
                raise KubeError(f"cannot delete ResourceSlice {name}: {_why(e)}") from None
        except Exception as e:
            raise KubeError(f"cannot delete ResourceSlice {name}: {_why(e)}") from None

    async def close(self) -> None:
        await self._client.close()


def _why(e: Exception) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
