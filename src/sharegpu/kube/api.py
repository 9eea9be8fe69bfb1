"""The control plane's view of the Kubernetes API, behind a small interface.

:class:`LightkubeClusterApi` talks to a real API server through :class:`~sharegpu.kube.client.KubeClient` (as the
node agent's :mod:`sharegpu.node.kube` does); :class:`memory_api.MemoryClusterApi` (tests/k8s) is the in-memory
stand-in that tests and the benchmark use. Objects cross the interface as the pydantic models of
:mod:`sharegpu.kube.schema`; errors are :class:`~sharegpu.kube.errors.KubeError`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, Protocol

from sharegpu.kube.client import KubeClient
from sharegpu.kube.informer import ADDED, DELETED, MODIFIED
from sharegpu.kube.lease import LeaseRecord, lease_object, lease_record
from sharegpu.kube.schema import Node, Pod

__all__ = ["ADDED", "BINDS_IN_FLIGHT", "DELETED", "MODIFIED", "ClusterApi", "LightkubeClusterApi"]

BINDS_IN_FLIGHT = 8


class ClusterApi(Protocol):
    async def list_nodes(self) -> tuple[list[Node], str]:
        """All nodes and the list's resourceVersion (to watch from)."""
        ...

    async def list_pods(self, scheduler_name: str | None = None) -> tuple[list[Pod], str]:
        """All pods (only those of ``scheduler_name``, when given: a field selector the server applies)."""
        ...

    def watch_nodes(self, resource_version: str, timeout_s: int | None = None) -> AsyncIterator[tuple[str, Node]]:
        """(ADDED | MODIFIED | DELETED, node) after ``resource_version``; raises :class:`~sharegpu.kube.errors.KubeError` when it breaks.

        ``timeout_s``: the server-side timeout of the watch (``timeoutSeconds``); the server ends the watch then
        (the stream may end, or the client may resume it by itself)."""
        ...

    def watch_pods(
        self, resource_version: str, timeout_s: int | None = None, scheduler_name: str | None = None
    ) -> AsyncIterator[tuple[str, Pod]]: ...

    async def get_pod(self, namespace: str, name: str) -> Pod: ...

    async def patch_pod_annotations(
        self, namespace: str, name: str, annotations: Mapping[str, str | None], resource_version: str | None
    ) -> Pod:
        """Merge-patch annotations (None removes one); with ``resource_version`` the patch fails with
        :class:`~sharegpu.kube.errors.Conflict` unless the pod is still at that version."""
        ...

    async def bind_pod(
        self,
        namespace: str,
        name: str,
        uid: str,
        node: str,
        annotations: Mapping[str, str] | None = None,
        resource_version: str | None = None,
    ) -> None:
        """Create the pod's Binding: one atomic write that sets ``spec.nodeName`` and adds ``annotations``.

        Fails with :class:`~sharegpu.kube.errors.Conflict` if the pod is bound, its UID differs or (with ``resource_version``) it changed
        since that version; with :class:`~sharegpu.kube.errors.Unavailable` when the outcome is unknown."""
        ...

    async def close(self) -> None: ...


class LightkubeClusterApi:
    """:class:`ClusterApi` (and :class:`~sharegpu.kube.lease.LeaseApi`) over :class:`KubeClient` (in-cluster config,
    or a kubeconfig file)."""

    def __init__(self, kubeconfig: Path | None = None, field_manager: str = "sharegpu-scheduler-extender") -> None:
        """Raises :class:`~sharegpu.kube.errors.ConfigError` for credentials that cannot be loaded."""
        self.client = KubeClient(kubeconfig, field_manager)
        self.server, self.credentials_source = self.client.server, self.client.source
        # Bindings in flight at once. Beyond the connection pool's keep-alive limit (20) each extra one opened a
        # TLS connection, a full handshake on both sides, that was closed after its one request.
        self._binds = asyncio.Semaphore(BINDS_IN_FLIGHT)

    async def list_nodes(self) -> tuple[list[Node], str]:
        from lightkube.resources.core_v1 import Node as KNode

        items, version = await self.client.list(KNode, "list nodes")
        return [Node.model_validate(n) for n in items], version

    async def list_pods(self, scheduler_name: str | None = None) -> tuple[list[Pod], str]:
        from lightkube.resources.core_v1 import Pod as KPod

        items, version = await self.client.list(KPod, "list pods", namespace="*", fields=_of_scheduler(scheduler_name))
        return [Pod.model_validate(p) for p in items], version

    async def watch_nodes(self, resource_version: str, timeout_s: int | None = None) -> AsyncIterator[tuple[str, Node]]:
        from lightkube.resources.core_v1 import Node as KNode

        async for kind, obj in self.client.watch(KNode, resource_version, "watch nodes", timeout_s):
            yield kind, Node.model_validate(obj)

    async def watch_pods(
        self, resource_version: str, timeout_s: int | None = None, scheduler_name: str | None = None
    ) -> AsyncIterator[tuple[str, Pod]]:
        from lightkube.resources.core_v1 import Pod as KPod

        fields = _of_scheduler(scheduler_name)
        async for kind, obj in self.client.watch(KPod, resource_version, "watch pods", timeout_s, "*", fields):
            yield kind, Pod.model_validate(obj)

    async def get_pod(self, namespace: str, name: str) -> Pod:
        from lightkube.resources.core_v1 import Pod as KPod

        return Pod.model_validate(await self.client.get(KPod, name, f"read pod {namespace}/{name}", namespace))

    async def patch_pod_annotations(
        self, namespace: str, name: str, annotations: Mapping[str, str | None], resource_version: str | None
    ) -> Pod:
        from lightkube.resources.core_v1 import Pod as KPod

        meta: dict[str, Any] = {"annotations": dict(annotations)}
        if resource_version:
            # A merge patch that carries metadata.resourceVersion is applied only at that version (else 409).
            meta["resourceVersion"] = resource_version
        pod = await self.client.merge_patch(
            KPod, name, {"metadata": meta}, f"annotate pod {namespace}/{name}", namespace
        )
        return Pod.model_validate(pod)

    async def bind_pod(
        self,
        namespace: str,
        name: str,
        uid: str,
        node: str,
        annotations: Mapping[str, str] | None = None,
        resource_version: str | None = None,
    ) -> None:
        from lightkube.models.core_v1 import ObjectReference
        from lightkube.models.meta_v1 import ObjectMeta
        from lightkube.resources.core_v1 import Pod as KPod

        binding = KPod.Binding(
            metadata=ObjectMeta(
                name=name,
                namespace=namespace,
                uid=uid or None,
                resourceVersion=resource_version or None,
                annotations=dict(annotations) if annotations else None,
            ),
            target=ObjectReference(apiVersion="v1", kind="Node", name=node),
        )
        async with self._binds:
            # The API server answers a Binding with a Status (201), not a Binding.
            await self.client.post_undecoded(binding, name, namespace, f"bind pod {namespace}/{name} to {node}")

    # ----- leases (leader election) ----------------------------------------------------------------------------
    async def get_lease(self, namespace: str, name: str) -> LeaseRecord:
        from lightkube.resources.coordination_v1 import Lease

        return lease_record(await self.client.get(Lease, name, f"read lease {namespace}/{name}", namespace))

    async def create_lease(self, namespace: str, name: str, record: LeaseRecord) -> LeaseRecord:
        from lightkube.resources.coordination_v1 import Lease

        lease = Lease.from_dict(lease_object(namespace, name, record))
        return lease_record(await self.client.create(lease, f"create lease {namespace}/{name}"))

    async def update_lease(self, namespace: str, name: str, record: LeaseRecord) -> LeaseRecord:
        from lightkube.resources.coordination_v1 import Lease

        lease = Lease.from_dict(lease_object(namespace, name, record))
        return lease_record(await self.client.replace(lease, f"update lease {namespace}/{name}"))

    async def close(self) -> None:
        await self.client.close()


def _of_scheduler(name: str | None) -> dict[str, Any] | None:
    # spec.schedulerName is immutable, so a pod never enters or leaves the selection while it exists.
    return {"spec.schedulerName": name} if name else None
