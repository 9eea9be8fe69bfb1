"""The node agent's view of the Kubernetes API: its Node and the pods bound to it, behind a small interface.

:class:`LightkubeApi` talks to a real API server through ``lightkube.AsyncClient``; tests use an in-memory fake.
Only the pods bound to this node are ever listed (a field selector on ``spec.nodeName``), so the agent cannot
act on another node's pods.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from sharegpu.kube.errors import ConfigError
from sharegpu.kube.quantity import asked_whole, capacity_mib, capacity_milli, quantity_or_zero
from sharegpu.model.contract import GPU_RESOURCE
from sharegpu.model.demand import ContainerDemand, pod_demand


@dataclass(frozen=True, slots=True)
class ContainerInfo:
    name: str
    gpus: int  # the container's sharegpu.io/gpu limit
    sidecar: bool = False  # an init container with restartPolicy: Always


@dataclass(frozen=True, slots=True)
class PodInfo:
    namespace: str
    name: str
    uid: str
    node_name: str
    phase: str = "Pending"
    created: str = ""  # RFC 3339, so string order is time order
    annotations: Mapping[str, str] = field(default_factory=dict)
    containers: tuple[ContainerInfo, ...] = ()
    init_containers: tuple[ContainerInfo, ...] = ()
    deleting: bool = False
    reason: str = ""  # status.reason: set when the kubelet rejected or evicted the pod

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def finished(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    def container(self, name: str) -> ContainerInfo | None:
        return next((c for c in (*self.init_containers, *self.containers) if c.name == name), None)

    @property
    def gpu_demand(self) -> int:
        """How many sharegpu.io/gpu the pod holds at its peak: what its assignment must have shares for."""
        return pod_demand(
            [
                *(ContainerDemand(c.name, c.gpus, init=True, sidecar=c.sidecar) for c in self.init_containers),
                *(ContainerDemand(c.name, c.gpus) for c in self.containers),
            ]
        )


@dataclass(frozen=True, slots=True)
class NodeInfo:
    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    cpu_milli: int = 0  # allocatable
    memory_mib: int = 0


class KubeApi(Protocol):
    async def get_node(self, name: str) -> NodeInfo: ...

    async def patch_node_metadata(
        self, name: str, labels: Mapping[str, str | None], annotations: Mapping[str, str | None]
    ) -> None:
        """Merge-patch labels and annotations; a None value removes the key."""
        ...

    async def pods_on_node(self, node: str) -> list[PodInfo]: ...

    async def close(self) -> None: ...


def pod_info_from_dict(d: Mapping[str, Any]) -> PodInfo:
    """A pod as the API server returns it (JSON) → :class:`PodInfo`."""
    meta = d.get("metadata") or {}
    spec = d.get("spec") or {}
    status = d.get("status") or {}
    return PodInfo(
        namespace=str(meta.get("namespace", "")),
        name=str(meta.get("name", "")),
        uid=str(meta.get("uid", "")),
        node_name=str(spec.get("nodeName") or ""),
        phase=str(status.get("phase") or "Pending"),
        created=_time(meta.get("creationTimestamp")),
        annotations={str(k): str(v) for k, v in (meta.get("annotations") or {}).items()},
        containers=tuple(_container(c) for c in spec.get("containers") or ()),
        init_containers=tuple(_container(c, init=True) for c in spec.get("initContainers") or ()),
        deleting=meta.get("deletionTimestamp") is not None,
        reason=str(status.get("reason") or ""),
    )


def node_info_from_dict(d: Mapping[str, Any]) -> NodeInfo:
    meta = d.get("metadata") or {}
    alloc = (d.get("status") or {}).get("allocatable") or {}
    return NodeInfo(
        name=str(meta.get("name", "")),
        labels={str(k): str(v) for k, v in (meta.get("labels") or {}).items()},
        annotations={str(k): str(v) for k, v in (meta.get("annotations") or {}).items()},
        # What the node has: rounded down (through Decimal: a float would lose a milli-CPU of "1.001").
        cpu_milli=capacity_milli(quantity_or_zero(alloc.get("cpu"))),
        memory_mib=capacity_mib(quantity_or_zero(alloc.get("memory"))),
    )


def _container(c: Mapping[str, Any], init: bool = False) -> ContainerInfo:
    limits = (c.get("resources") or {}).get("limits") or {}
    sidecar = init and c.get("restartPolicy") == "Always"
    return ContainerInfo(str(c.get("name", "")), asked_whole(quantity_or_zero(limits.get(GPU_RESOURCE))), sidecar)


def _time(t: Any) -> str:
    if isinstance(t, datetime):
        return t.isoformat()
    return str(t) if t else ""


class LightkubeApi:
    """:class:`KubeApi` over :class:`~sharegpu.kube.client.KubeClient` (in-cluster config, or a kubeconfig file)."""

    def __init__(self, kubeconfig: Path | None = None) -> None:
        from sharegpu.kube.client import KubeClient

        try:
            self._client = KubeClient(kubeconfig, "sharegpu-node-agent")
        except ConfigError as e:
            raise ConfigError(f"cannot load Kubernetes credentials: {e}") from None
        self.server = self._client.server

    async def get_node(self, name: str) -> NodeInfo:
        from lightkube.resources.core_v1 import Node

        return node_info_from_dict(await self._client.get(Node, name, f"read node {name}"))

    async def patch_node_metadata(
        self, name: str, labels: Mapping[str, str | None], annotations: Mapping[str, str | None]
    ) -> None:
        from lightkube.resources.core_v1 import Node

        body = {"metadata": {"labels": dict(labels), "annotations": dict(annotations)}}
        await self._client.merge_patch(Node, name, body, f"update node {name}")

    async def pods_on_node(self, node: str) -> list[PodInfo]:
        from lightkube.resources.core_v1 import Pod

        what = f"list the pods of node {node}"
        pods, _ = await self._client.list(Pod, what, namespace="*", fields={"spec.nodeName": node})
        return [pod_info_from_dict(p) for p in pods]

    async def close(self) -> None:
        await self._client.close()
