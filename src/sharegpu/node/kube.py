"""The node agent's view of the Kubernetes API: its Node and the pods bound to it, behind a small interface.

:class:`LightkubeApi` talks to a real API server through ``lightkube.AsyncClient``; tests use an in-memory fake.
Only the pods bound to this node are ever listed (a field selector on ``spec.nodeName``), so the agent cannot
act on another node's pods. What it reads is parsed into :mod:`sharegpu.kube.schema`'s Pod and Node, the objects
the control plane reads too; :class:`PodInfo` and :class:`NodeInfo` are frozen projections of them (:func:`pod_info`,
:func:`node_info`) that the agent keeps in its state and compares between rounds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from sharegpu.kube.errors import ConfigError
from sharegpu.kube.quantity import asked_whole, capacity_mib, capacity_milli, quantity_or_zero
from sharegpu.model.contract import GPU_RESOURCE
from sharegpu.model.demand import ContainerDemand, pod_demand
from sharegpu.model.tenant import tenant_of

EVENT_MESSAGE_MAX = 1024  # events.k8s.io/v1 refuses a longer note; a core/v1 Event is kept under it too

if TYPE_CHECKING:
    # Imported where an object is parsed (LightkubeApi): the GPU check (bench/gpu_node_check.py) imports the node
    # code that uses PodInfo on a bare GPU machine, which has no pydantic.
    from sharegpu.kube.client import KubeClient
    from sharegpu.kube.schema import Container, Node, Pod


@dataclass(frozen=True, slots=True)
class ContainerInfo:
    name: str
    gpus: int  # the container's sharegpu.io/gpu (ResourceRequirements.amount: its limit, else its request)
    sidecar: bool = False  # an init container with restartPolicy: Always
    user: int | None = None  # the UID it runs as where the pod declares it (kube.schema.Pod.run_as_user)


@dataclass(frozen=True, slots=True)
class PodInfo:
    """The part of a :class:`~sharegpu.kube.schema.Pod` the agent acts on (built by :func:`pod_info` only)."""

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
    host_users: bool | None = None  # spec.hostUsers: false runs it in a user namespace of its own
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def tenant(self) -> str:
        """Who may share an MPS daemon with it (sharegpu.model.tenant), from the containers that hold a GPU, as the
        control plane computes it (k8s.pod_request.gpu_tenant). Raises TenantConflict when they declare different
        UIDs (the webhook refuses such a pod)."""
        users = [(c.name, c.user) for c in (*self.init_containers, *self.containers) if c.gpus]
        return tenant_of(self.namespace, self.uid or self.key, users, self.host_users)

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
    """The part of a :class:`~sharegpu.kube.schema.Node` the agent reads (built by :func:`node_info` only)."""

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

    async def create_node_event(self, node: str, reason: str, message: str, component: str) -> None:
        """A Warning Event on the Node, where `kubectl describe node` shows it (as the kubelet records its own: in
        the default namespace, the involved object's UID being the node's name)."""
        ...

    async def close(self) -> None: ...


def pod_info(pod: Pod) -> PodInfo:
    """The agent's projection of a pod."""
    return PodInfo(
        namespace=pod.metadata.namespace,
        name=pod.metadata.name,
        uid=pod.metadata.uid,
        node_name=pod.spec.node_name,
        phase=pod.status.phase or "Pending",
        created=pod.metadata.creation_timestamp,
        annotations=dict(pod.metadata.annotations),
        containers=tuple(_container(c, pod.run_as_user(c)) for c in pod.spec.containers),
        init_containers=tuple(_container(c, pod.run_as_user(c), init=True) for c in pod.spec.init_containers),
        deleting=pod.metadata.deletion_timestamp is not None,
        reason=pod.status.reason,
        host_users=pod.spec.host_users,
        labels=dict(pod.metadata.labels),
    )


def node_info(node: Node) -> NodeInfo:
    """The agent's projection of its Node."""
    alloc = node.status.allocatable
    return NodeInfo(
        name=node.metadata.name,
        labels=dict(node.metadata.labels),
        annotations=dict(node.metadata.annotations),
        # What the node has: rounded down (through Decimal: a float would lose a milli-CPU of "1.001").
        cpu_milli=capacity_milli(quantity_or_zero(alloc.get("cpu"))),
        memory_mib=capacity_mib(quantity_or_zero(alloc.get("memory"))),
    )


def _container(c: Container, user: int | None, init: bool = False) -> ContainerInfo:
    # The count the control plane reads too (kube.schema.ResourceRequirements.amount: the limit, else the request).
    gpus = asked_whole(quantity_or_zero(c.resources.amount(GPU_RESOURCE)))
    return ContainerInfo(c.name, gpus, sidecar=init and c.restart_policy == "Always", user=user)


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
        from lightkube.resources.core_v1 import Node as KNode

        from sharegpu.kube.schema import Node

        return node_info(Node.model_validate(await self._client.get(KNode, name, f"read node {name}")))

    async def patch_node_metadata(
        self, name: str, labels: Mapping[str, str | None], annotations: Mapping[str, str | None]
    ) -> None:
        from lightkube.resources.core_v1 import Node as KNode

        body = {"metadata": {"labels": dict(labels), "annotations": dict(annotations)}}
        await self._client.merge_patch(KNode, name, body, f"update node {name}")

    async def pods_on_node(self, node: str) -> list[PodInfo]:
        from lightkube.resources.core_v1 import Pod as KPod

        from sharegpu.kube.schema import Pod

        what = f"list the pods of node {node}"
        pods, _ = await self._client.list(KPod, what, namespace="*", fields={"spec.nodeName": node})
        return [pod_info(Pod.model_validate(p)) for p in pods]

    async def create_node_event(self, node: str, reason: str, message: str, component: str) -> None:
        await post_node_event(self._client, node, reason, message, component)

    async def close(self) -> None:
        await self._client.close()


async def post_node_event(client: KubeClient, node: str, reason: str, message: str, component: str) -> None:
    """A Warning Event on Node ``node`` from ``component`` (the node agent, the DRA driver), where the kubelet records
    a Node's Events and ``kubectl describe node`` finds them: the default namespace, the involved object's UID the
    node's name. The message is cut to :data:`EVENT_MESSAGE_MAX`."""
    from lightkube.models.core_v1 import EventSource, ObjectReference
    from lightkube.models.meta_v1 import ObjectMeta
    from lightkube.resources.core_v1 import Event

    now = datetime.now(UTC)
    obj = Event(
        metadata=ObjectMeta(generateName=f"{node}.", namespace="default"),
        involvedObject=ObjectReference(apiVersion="v1", kind="Node", name=node, uid=node),
        reason=reason,
        message=message[:EVENT_MESSAGE_MAX],
        type="Warning",
        source=EventSource(component=component, host=node),
        reportingComponent=component,
        reportingInstance=node,
        firstTimestamp=now,
        lastTimestamp=now,
        count=1,
    )
    await client.create(obj, f"create event {reason} on node {node}")
