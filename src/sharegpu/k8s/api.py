"""The control plane's view of the Kubernetes API, behind a small interface.

:class:`LightkubeClusterApi` talks to a real API server through ``lightkube.AsyncClient`` (as the node agent's
:mod:`sharegpu.node.kube` does); :class:`sharegpu.k8s.memory.MemoryClusterApi` is the in-memory stand-in that
tests and the benchmark use. Objects cross the interface as the pydantic models of :mod:`sharegpu.k8s.schema`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, Protocol

from sharegpu.k8s.kubeconfig import load_credentials, request_server
from sharegpu.k8s.schema import Node, Pod

ADDED, MODIFIED, DELETED = "ADDED", "MODIFIED", "DELETED"


class ApiError(Exception):
    """The API server refused a request or could not be reached; the message says which and why."""


class Unavailable(ApiError):
    """No answer from the API server (connection refused, timeout, credentials not loadable)."""


class Conflict(ApiError):
    """A precondition (resourceVersion, UID) failed: the object changed since it was read."""


class NotFound(ApiError):
    pass


class ClusterApi(Protocol):
    async def list_nodes(self) -> tuple[list[Node], str]:
        """All nodes and the list's resourceVersion (to watch from)."""
        ...

    async def list_pods(self) -> tuple[list[Pod], str]: ...

    def watch_nodes(self, resource_version: str, timeout_s: int | None = None) -> AsyncIterator[tuple[str, Node]]:
        """(ADDED | MODIFIED | DELETED, node) after ``resource_version``; raises :class:`ApiError` when it breaks.

        ``timeout_s``: the server-side timeout of the watch (``timeoutSeconds``); the server ends the watch then
        (the stream may end, or the client may resume it by itself)."""
        ...

    def watch_pods(self, resource_version: str, timeout_s: int | None = None) -> AsyncIterator[tuple[str, Pod]]: ...

    async def get_pod(self, namespace: str, name: str) -> Pod: ...

    async def patch_pod_annotations(
        self, namespace: str, name: str, annotations: Mapping[str, str | None], resource_version: str | None
    ) -> Pod:
        """Merge-patch annotations (None removes one); with ``resource_version`` the patch fails with
        :class:`Conflict` unless the pod is still at that version."""
        ...

    async def bind_pod(self, namespace: str, name: str, uid: str, node: str) -> None:
        """Create the pod's Binding (fails with :class:`Conflict` if the pod is bound or its UID differs)."""
        ...

    async def close(self) -> None: ...


class LightkubeClusterApi:
    """:class:`ClusterApi` over ``lightkube.AsyncClient`` (in-cluster config, or a kubeconfig file)."""

    def __init__(self, kubeconfig: Path | None = None, field_manager: str = "sharegpu-scheduler-extender") -> None:
        """Raises :class:`~sharegpu.k8s.kubeconfig.KubeconfigError` for credentials that cannot be loaded."""
        creds = load_credentials(kubeconfig)
        self.server, self.credentials_source = creds.server, creds.source
        self._client = creds.client(field_manager)

    async def list_nodes(self) -> tuple[list[Node], str]:
        from lightkube.resources.core_v1 import Node as KNode

        try:
            it = self._client.list(KNode)
            nodes = [Node.model_validate(n.to_dict()) async for n in it]
            return nodes, self._version(it)
        except Exception as e:
            raise _translate(e, "list nodes") from None

    async def list_pods(self) -> tuple[list[Pod], str]:
        from lightkube.resources.core_v1 import Pod as KPod

        try:
            it = self._client.list(KPod, namespace="*")
            pods = [Pod.model_validate(p.to_dict()) async for p in it]
            return pods, self._version(it)
        except Exception as e:
            raise _translate(e, "list pods") from None

    @staticmethod
    def _version(it: Any) -> str:
        try:
            return str(it.resourceVersion)
        except Exception:  # lightkube's NotReadyError: the server sent no resourceVersion
            return ""

    async def watch_nodes(self, resource_version: str, timeout_s: int | None = None) -> AsyncIterator[tuple[str, Node]]:
        from lightkube.resources.core_v1 import Node as KNode

        try:
            async for kind, obj in self._client.watch(
                KNode, resource_version=resource_version or None, server_timeout=timeout_s
            ):
                yield kind, Node.model_validate(obj.to_dict())
        except Exception as e:
            raise _translate(e, "watch nodes") from None

    async def watch_pods(self, resource_version: str, timeout_s: int | None = None) -> AsyncIterator[tuple[str, Pod]]:
        from lightkube.resources.core_v1 import Pod as KPod

        # lightkube resumes a watch the server ended by itself (from the last resourceVersion it saw).
        try:
            async for kind, obj in self._client.watch(
                KPod, namespace="*", resource_version=resource_version or None, server_timeout=timeout_s
            ):
                yield kind, Pod.model_validate(obj.to_dict())
        except Exception as e:
            raise _translate(e, "watch pods") from None

    async def get_pod(self, namespace: str, name: str) -> Pod:
        from lightkube.resources.core_v1 import Pod as KPod

        try:
            pod = await self._client.get(KPod, name, namespace=namespace)
        except Exception as e:
            raise _translate(e, f"read pod {namespace}/{name}") from None
        return Pod.model_validate(pod.to_dict())

    async def patch_pod_annotations(
        self, namespace: str, name: str, annotations: Mapping[str, str | None], resource_version: str | None
    ) -> Pod:
        from lightkube.resources.core_v1 import Pod as KPod
        from lightkube.types import PatchType

        meta: dict[str, Any] = {"annotations": dict(annotations)}
        if resource_version:
            # A merge patch that carries metadata.resourceVersion is applied only at that version (else 409).
            meta["resourceVersion"] = resource_version
        try:
            pod = await self._client.patch(
                KPod, name, {"metadata": meta}, namespace=namespace, patch_type=PatchType.MERGE
            )
        except Exception as e:
            raise _translate(e, f"annotate pod {namespace}/{name}") from None
        return Pod.model_validate(pod.to_dict())

    async def bind_pod(self, namespace: str, name: str, uid: str, node: str) -> None:
        from lightkube.models.core_v1 import ObjectReference
        from lightkube.models.meta_v1 import ObjectMeta
        from lightkube.resources.core_v1 import Pod as KPod

        binding = KPod.Binding(
            metadata=ObjectMeta(name=name, namespace=namespace, uid=uid),
            target=ObjectReference(apiVersion="v1", kind="Node", name=node),
        )
        try:
            await self._client.create(binding, name=name, namespace=namespace)
        except Exception as e:
            raise _translate(e, f"bind pod {namespace}/{name} to {node}") from None

    async def close(self) -> None:
        await self._client.close()


def _translate(e: Exception, what: str) -> ApiError:
    from lightkube.core.exceptions import ApiError as LkApiError

    if isinstance(e, ApiError):
        return e
    if isinstance(e, LkApiError):
        code = e.status.code
        message = e.status.message or str(e)
        if code == 409:
            return Conflict(f"cannot {what}: {message}")
        if code == 404:
            return NotFound(f"cannot {what}: {message}")
        return ApiError(f"cannot {what}: HTTP {code}: {message}")
    # Anything else is the connection (httpx errors, timeouts, a closed stream): name the server that did not answer.
    why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    server = request_server(e)
    return Unavailable(
        f"cannot {what}: the API server at {server} did not answer: {why}" if server else f"cannot {what}: {why}"
    )
