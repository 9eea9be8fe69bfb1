"""The control plane's view of the Kubernetes API, behind a small interface.

:class:`LightkubeClusterApi` talks to a real API server through :class:`~sharegpu.kube.client.KubeClient` (as the
node agent's :mod:`sharegpu.node.kube` does); :class:`memory_api.MemoryClusterApi` (tests/k8s) is the in-memory
stand-in that tests and the benchmark use. Objects cross the interface as the pydantic models of
:mod:`sharegpu.kube.schema`; errors are :class:`~sharegpu.kube.errors.KubeError`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from sharegpu.kube.client import KubeClient
from sharegpu.kube.errors import EvictionBlocked, TooManyRequests
from sharegpu.kube.informer import ADDED, DELETED, MODIFIED
from sharegpu.kube.lease import LeaseRecord, lease_object, lease_record
from sharegpu.kube.names import check_name
from sharegpu.kube.schema import Node, Pod, ResourceClaim, ResourceSlice

__all__ = [
    "ADDED",
    "BINDS_IN_FLIGHT",
    "DELETED",
    "MODIFIED",
    "ClusterApi",
    "DisruptionApi",
    "DisruptionBudget",
    "LightkubeClusterApi",
    "PodEvent",
]

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


@dataclass(frozen=True, slots=True)
class Requirement:
    """One ``matchExpressions`` entry of a label selector."""

    key: str
    operator: str  # In | NotIn | Exists | DoesNotExist
    values: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class DisruptionBudget:
    """A policy/v1 PodDisruptionBudget, as far as preemption needs it: whom it covers and whether one more of them
    may be disrupted now (``status.disruptionsAllowed``, kept by the kube-controller-manager)."""

    namespace: str
    name: str
    match_labels: tuple[tuple[str, str], ...] | None  # None: a null selector, which covers no pod
    match_expressions: tuple[Requirement, ...]
    disruptions_allowed: int

    def covers(self, namespace: str, labels: Mapping[str, str]) -> bool:
        """Whether the budget's selector selects a pod of ``namespace`` with ``labels`` (an empty selector selects
        every pod of its namespace, as policy/v1 says)."""
        if namespace != self.namespace or self.match_labels is None:
            return False
        if any(labels.get(k) != v for k, v in self.match_labels):
            return False
        for r in self.match_expressions:
            present = r.key in labels
            ok = {
                "In": present and labels.get(r.key) in r.values,
                "NotIn": not present or labels.get(r.key) not in r.values,
                "Exists": present,
                "DoesNotExist": not present,
            }.get(r.operator, False)  # an operator the API server would refuse: select nothing rather than all
            if not ok:
                return False
        return True

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> DisruptionBudget:
        meta = obj.get("metadata") or {}
        sel = (obj.get("spec") or {}).get("selector")
        labels = None if sel is None else tuple(sorted((sel.get("matchLabels") or {}).items()))
        exprs = tuple(
            Requirement(e.get("key", ""), e.get("operator", ""), tuple(e.get("values") or ()))
            for e in ((sel or {}).get("matchExpressions") or ())
        )
        allowed = int((obj.get("status") or {}).get("disruptionsAllowed") or 0)
        return cls(meta.get("namespace", ""), meta.get("name", ""), labels, exprs, allowed)


@dataclass(frozen=True, slots=True)
class PodEvent:
    """A core/v1 Event about a pod (``type`` Normal or Warning)."""

    namespace: str
    pod: str
    uid: str
    reason: str
    message: str
    type: str = "Normal"


class DisruptionApi(Protocol):
    """What preemption asks of the API server besides the view's lists and watches."""

    async def evict_pod(self, namespace: str, name: str, uid: str = "") -> None:
        """Evict the pod through the Eviction API (policy/v1), which honours PodDisruptionBudgets; raises
        :class:`~sharegpu.kube.errors.EvictionBlocked` when a budget forbids it now, NotFound when the pod is gone
        (or, with ``uid``, replaced)."""
        ...

    async def set_nominated_node(self, namespace: str, name: str, node: str) -> None:
        """Write ``status.nominatedNodeName`` (the pod's status subresource; "" clears it)."""
        ...

    async def create_event(self, event: PodEvent, component: str) -> None: ...

    async def list_disruption_budgets(self) -> Sequence[DisruptionBudget]: ...


@runtime_checkable
class DraApi(Protocol):
    """The resource.k8s.io/v1 objects the cluster cache follows when DRA steering is on: the ResourceSlices of one
    driver and every ResourceClaim. A list raises :class:`~sharegpu.kube.errors.NotFound` where the API server does
    not serve resource.k8s.io/v1."""

    async def list_slices(self, driver: str) -> tuple[list[ResourceSlice], str]: ...

    def watch_slices(
        self, resource_version: str, timeout_s: int | None, driver: str
    ) -> AsyncIterator[tuple[str, ResourceSlice]]: ...

    async def list_claims(self) -> tuple[list[ResourceClaim], str]: ...

    def watch_claims(
        self, resource_version: str, timeout_s: int | None = None
    ) -> AsyncIterator[tuple[str, ResourceClaim]]: ...


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

    async def list_slices(self, driver: str) -> tuple[list[ResourceSlice], str]:
        from lightkube.resources.resource_v1 import ResourceSlice as KSlice

        items, version = await self.client.list(KSlice, "list ResourceSlices", fields={"spec.driver": driver})
        return [ResourceSlice.model_validate(s) for s in items], version

    async def watch_slices(
        self, resource_version: str, timeout_s: int | None, driver: str
    ) -> AsyncIterator[tuple[str, ResourceSlice]]:
        from lightkube.resources.resource_v1 import ResourceSlice as KSlice

        fields = {"spec.driver": driver}
        async for kind, obj in self.client.watch(
            KSlice, resource_version, "watch ResourceSlices", timeout_s, None, fields
        ):
            yield kind, ResourceSlice.model_validate(obj)

    async def list_claims(self) -> tuple[list[ResourceClaim], str]:
        from lightkube.resources.resource_v1 import ResourceClaim as KClaim

        items, version = await self.client.list(KClaim, "list ResourceClaims", namespace="*")
        return [ResourceClaim.model_validate(c) for c in items], version

    async def watch_claims(
        self, resource_version: str, timeout_s: int | None = None
    ) -> AsyncIterator[tuple[str, ResourceClaim]]:
        from lightkube.resources.resource_v1 import ResourceClaim as KClaim

        async for kind, obj in self.client.watch(KClaim, resource_version, "watch ResourceClaims", timeout_s, "*"):
            yield kind, ResourceClaim.model_validate(obj)

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
        check_name("node", node)  # the target goes in the body, not the URL: a Binding to a bad name binds to nowhere
        meta: dict[str, Any] = {"name": name, "namespace": namespace}
        if uid:
            meta["uid"] = uid
        if resource_version:
            meta["resourceVersion"] = resource_version
        if annotations:
            meta["annotations"] = dict(annotations)
        body = {"apiVersion": "v1", "kind": "Binding", "metadata": meta,
                "target": {"apiVersion": "v1", "kind": "Node", "name": node}}  # fmt: skip
        async with self._binds:
            # The API server answers a Binding with a Status (201), not a Binding.
            await self.client.post_encoded(
                f"/api/v1/namespaces/{namespace}/pods/{name}/binding",
                json.dumps(body, separators=(",", ":")).encode(),
                name,
                namespace,
                f"bind pod {namespace}/{name} to {node}",
            )

    # ----- preemption (sharegpu.k8s.controllers.preemption) ----------------------------------------------------------------
    async def evict_pod(self, namespace: str, name: str, uid: str = "") -> None:
        from lightkube.models.meta_v1 import DeleteOptions, ObjectMeta, Preconditions
        from lightkube.resources.core_v1 import Pod as KPod

        eviction = KPod.Eviction(
            metadata=ObjectMeta(name=name, namespace=namespace),
            # The UID precondition: a pod deleted and created again under the same name is not evicted in its place.
            deleteOptions=DeleteOptions(preconditions=Preconditions(uid=uid)) if uid else None,
        )
        what = f"evict pod {namespace}/{name}"
        try:
            await self.client.post_undecoded(eviction, name, namespace, what)
        except TooManyRequests as e:
            # On an Eviction a 429 is the PodDisruptionBudget's answer, not load shedding.
            raise EvictionBlocked(
                f"cannot {what}: its PodDisruptionBudget allows no disruption now ({e})", 429
            ) from None

    async def set_nominated_node(self, namespace: str, name: str, node: str) -> None:
        from lightkube.resources.core_v1 import Pod as KPod

        body = {"status": {"nominatedNodeName": node or None}}
        await self.client.merge_patch(
            KPod.Status, name, body, f"set the nominated node of pod {namespace}/{name} to {node!r}", namespace
        )

    async def create_event(self, event: PodEvent, component: str) -> None:
        from lightkube.models.core_v1 import EventSource, ObjectReference
        from lightkube.models.meta_v1 import ObjectMeta
        from lightkube.resources.core_v1 import Event

        now = datetime.now(UTC)
        obj = Event(
            metadata=ObjectMeta(generateName=f"{event.pod}.", namespace=event.namespace),
            involvedObject=ObjectReference(
                apiVersion="v1", kind="Pod", name=event.pod, namespace=event.namespace, uid=event.uid or None
            ),
            reason=event.reason,
            message=event.message,
            type=event.type,
            source=EventSource(component=component),
            reportingComponent=component,
            firstTimestamp=now,
            lastTimestamp=now,
            count=1,
        )
        await self.client.create(obj, f"create event {event.reason} on pod {event.namespace}/{event.pod}")

    async def list_disruption_budgets(self) -> list[DisruptionBudget]:
        from lightkube.resources.policy_v1 import PodDisruptionBudget

        items, _ = await self.client.list(PodDisruptionBudget, "list poddisruptionbudgets", namespace="*")
        return [DisruptionBudget.from_object(i) for i in items]

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
