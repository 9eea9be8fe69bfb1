"""An in-memory API server: the :class:`~sharegpu.kube.api.ClusterApi` that the tests run against (a test fake,
so it lives under tests/, not in the package).

It keeps objects as JSON dicts with a cluster-wide resourceVersion, enforces the preconditions the real server
enforces (resourceVersion on patches and bindings, one Binding per pod, UID on bindings, a Binding's
annotations written with it) and can be switched off
(:attr:`MemoryClusterApi.down`) or have its watches broken, to exercise reconnection.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from collections.abc import AsyncIterator, Mapping
from typing import Any

from sharegpu.kube.api import ADDED, DELETED, MODIFIED, DisruptionBudget, PodEvent
from sharegpu.kube.errors import Conflict, EvictionBlocked, KubeError, NotFound, Unavailable
from sharegpu.kube.lease import LeaseRecord
from sharegpu.kube.schema import Node, Pod, ResourceClaim, ResourceSlice
from sharegpu.model.contract import INVENTORY_ANNOTATION
from sharegpu.model.inventory import NodeSpec


class MemoryClusterApi:
    def __init__(self, latency_s: float = 0.0) -> None:
        self.nodes: dict[str, dict[str, Any]] = {}
        self.pods: dict[str, dict[str, Any]] = {}
        self.rv = 0
        self.down = False
        self.latency_s = latency_s  # added to writes, so that concurrent binds interleave as on a real server
        self.calls: list[str] = []
        self._events: list[tuple[int, str, str, dict[str, Any]]] = []  # (rv, "node"|"pod", type, object)
        self._waiters: set[asyncio.Event] = set()
        self._epoch = 0  # bumped by break_watches()
        self.watch_timeouts: list[int | None] = []  # the server-side timeout each watch asked for
        # Faults of the next binds: applied but answered with a lost connection, or lost before they arrive.
        self.lose_bind_answers = 0
        self.drop_binds = 0
        self.leases: dict[str, LeaseRecord] = {}
        # Preemption: budgets by namespace/name (disruptionsAllowed is decremented by each eviction, as the
        # kube-controller-manager would recompute it), the events created, and the evictions asked for.
        self.pdbs: dict[str, DisruptionBudget] = {}
        self.events: list[PodEvent] = []
        self.evictions: list[str] = []
        self.evict_deletes = False  # True: an evicted pod is deleted at once (no grace period), else it terminates
        # resource.k8s.io/v1: ResourceSlices by name, ResourceClaims by namespace/name; dra_refused: what a list or
        # watch of them raises (None: served; NotFound: not served; Forbidden: RBAC refuses these credentials).
        self.slices: dict[str, dict[str, Any]] = {}
        self.claims: dict[str, dict[str, Any]] = {}
        self.dra_refused: KubeError | None = None

    # ----- test helpers --------------------------------------------------------------------------------------
    def _bump(self, obj: dict[str, Any]) -> None:
        self.rv += 1
        obj.setdefault("metadata", {})["resourceVersion"] = str(self.rv)

    def _emit(self, kind: str, type_: str, obj: dict[str, Any]) -> None:
        self._events.append((self.rv, kind, type_, copy.deepcopy(obj)))
        for waiter in self._waiters:
            waiter.set()

    def put_node(self, name: str, spec: NodeSpec | str | None = None, labels: Mapping[str, str] | None = None) -> None:
        """Create or replace a Node; ``spec`` becomes its inventory annotation (a str is written as is)."""
        annotations = {}
        if spec is not None:
            annotations[INVENTORY_ANNOTATION] = spec if isinstance(spec, str) else spec.to_json()
        obj = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "uid": f"uid-node-{name}",
                "annotations": annotations,
                "labels": dict(labels or {}),
            },
            "status": {"allocatable": {"cpu": "64", "memory": "256Gi"}},
        }
        type_ = MODIFIED if name in self.nodes else ADDED
        self._bump(obj)
        self.nodes[name] = obj
        self._emit("node", type_, obj)

    def put_pod(self, pod: Mapping[str, Any]) -> dict[str, Any]:
        """Create or replace a pod (a dict as the API server returns it); returns the stored object."""
        obj = copy.deepcopy(dict(pod))
        meta = obj.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        meta.setdefault("uid", f"uid-{meta['namespace']}-{meta['name']}")
        key = f"{meta['namespace']}/{meta['name']}"
        type_ = MODIFIED if key in self.pods else ADDED
        self._bump(obj)
        self.pods[key] = obj
        self._emit("pod", type_, obj)
        return obj

    def set_phase(self, key: str, phase: str) -> None:
        obj = self.pods[key]
        obj.setdefault("status", {})["phase"] = phase
        self._bump(obj)
        self._emit("pod", MODIFIED, obj)

    def delete_pod(self, key: str) -> None:
        obj = self.pods.pop(key)
        self._bump(obj)
        self._emit("pod", DELETED, obj)

    def put_slice(self, obj: Mapping[str, Any]) -> None:
        o = copy.deepcopy(dict(obj))
        name = o["metadata"]["name"]
        type_ = MODIFIED if name in self.slices else ADDED
        self._bump(o)
        self.slices[name] = o
        self._emit("slice", type_, o)

    def put_claim(self, obj: Mapping[str, Any]) -> None:
        o = copy.deepcopy(dict(obj))
        meta = o["metadata"]
        key = f"{meta['namespace']}/{meta['name']}"
        type_ = MODIFIED if key in self.claims else ADDED
        self._bump(o)
        self.claims[key] = o
        self._emit("claim", type_, o)

    def break_watches(self) -> None:
        """End every open watch with a connection error, as a dropped connection would."""
        self._epoch += 1
        self._emit("none", "BREAK", {})

    # ----- ClusterApi ----------------------------------------------------------------------------------------
    def _check(self, call: str) -> None:
        self.calls.append(call)
        if self.down:
            raise Unavailable(f"cannot {call}: connection refused (the in-memory API server is down)")

    async def list_nodes(self) -> tuple[list[Node], str]:
        self._check("list nodes")
        return [Node.model_validate(n) for n in self.nodes.values()], str(self.rv)

    async def list_pods(self, scheduler_name: str | None = None) -> tuple[list[Pod], str]:
        self._check("list pods")
        pods = [p for p in self.pods.values() if _of(p, scheduler_name)]
        return [Pod.model_validate(p) for p in pods], str(self.rv)

    async def _watch(
        self, kind: str, resource_version: str, timeout_s: int | None
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        self._check(f"watch {kind}s")
        self.watch_timeouts.append(timeout_s)
        since = int(resource_version or 0)
        epoch = self._epoch
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        pos = next((i for i, e in enumerate(self._events) if e[0] > since), len(self._events))
        while True:
            while pos < len(self._events):
                _, k, type_, obj = self._events[pos]
                pos += 1
                if k == kind:
                    yield type_, copy.deepcopy(obj)
            if self.down or self._epoch != epoch:
                raise Unavailable(f"watch {kind}s: the connection was closed")
            # No await between the check above and registering the waiter: an event emitted meanwhile is not missed.
            waiter = asyncio.Event()
            self._waiters.add(waiter)
            try:
                if deadline is None:
                    await waiter.wait()
                else:
                    try:
                        await asyncio.wait_for(waiter.wait(), max(deadline - loop.time(), 0))
                    except TimeoutError:
                        return  # the server's timeout: the watch ends without an error
            finally:
                self._waiters.discard(waiter)

    async def watch_nodes(self, resource_version: str, timeout_s: int | None = None) -> AsyncIterator[tuple[str, Node]]:
        async for type_, obj in self._watch("node", resource_version, timeout_s):
            yield type_, Node.model_validate(obj)

    async def watch_pods(
        self, resource_version: str, timeout_s: int | None = None, scheduler_name: str | None = None
    ) -> AsyncIterator[tuple[str, Pod]]:
        async for type_, obj in self._watch("pod", resource_version, timeout_s):
            if _of(obj, scheduler_name):
                yield type_, Pod.model_validate(obj)

    def _check_dra(self, call: str) -> None:
        self._check(call)
        if self.dra_refused is not None:
            raise self.dra_refused

    async def list_slices(self, driver: str) -> tuple[list[ResourceSlice], str]:
        self._check_dra("list ResourceSlices")
        mine = [s for s in self.slices.values() if (s.get("spec") or {}).get("driver") == driver]
        return [ResourceSlice.model_validate(s) for s in mine], str(self.rv)

    async def watch_slices(
        self, resource_version: str, timeout_s: int | None, driver: str
    ) -> AsyncIterator[tuple[str, ResourceSlice]]:
        self._check_dra("watch ResourceSlices")
        async for type_, obj in self._watch("slice", resource_version, timeout_s):
            if (obj.get("spec") or {}).get("driver") == driver:
                yield type_, ResourceSlice.model_validate(obj)

    async def list_claims(self) -> tuple[list[ResourceClaim], str]:
        self._check_dra("list ResourceClaims")
        return [ResourceClaim.model_validate(c) for c in self.claims.values()], str(self.rv)

    async def watch_claims(
        self, resource_version: str, timeout_s: int | None = None
    ) -> AsyncIterator[tuple[str, ResourceClaim]]:
        self._check_dra("watch ResourceClaims")
        async for type_, obj in self._watch("claim", resource_version, timeout_s):
            yield type_, ResourceClaim.model_validate(obj)

    async def get_pod(self, namespace: str, name: str) -> Pod:
        self._check(f"get pod {namespace}/{name}")
        obj = self.pods.get(f"{namespace}/{name}")
        if obj is None:
            raise NotFound(f"pod {namespace}/{name} not found")
        return Pod.model_validate(copy.deepcopy(obj))

    async def patch_pod_annotations(
        self, namespace: str, name: str, annotations: Mapping[str, str | None], resource_version: str | None
    ) -> Pod:
        self._check(f"annotate pod {namespace}/{name}")
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        obj = self.pods.get(f"{namespace}/{name}")
        if obj is None:
            raise NotFound(f"pod {namespace}/{name} not found")
        if resource_version and obj["metadata"]["resourceVersion"] != resource_version:
            raise Conflict(
                f"Operation cannot be fulfilled on pods {name!r}: the object has been modified; "
                "please apply your changes to the latest version and try again"
            )
        ann = obj["metadata"].setdefault("annotations", {})
        for k, v in annotations.items():
            if v is None:
                ann.pop(k, None)
            else:
                ann[k] = v
        self._bump(obj)
        self._emit("pod", MODIFIED, obj)
        return Pod.model_validate(copy.deepcopy(obj))

    async def bind_pod(
        self,
        namespace: str,
        name: str,
        uid: str,
        node: str,
        annotations: Mapping[str, str] | None = None,
        resource_version: str | None = None,
    ) -> None:
        self._check(f"bind pod {namespace}/{name}")
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        if self.drop_binds:
            self.drop_binds -= 1
            raise Unavailable(f"cannot bind pod {namespace}/{name}: ReadTimeout (the request was lost)")
        obj = self.pods.get(f"{namespace}/{name}")
        if obj is None:
            raise NotFound(f"pod {namespace}/{name} not found")
        meta = obj["metadata"]
        if uid and meta.get("uid") != uid:
            raise Conflict(f"pod {namespace}/{name}: UID {uid} does not match {meta.get('uid')}")
        if resource_version and meta["resourceVersion"] != resource_version:
            raise Conflict(
                f"Operation cannot be fulfilled on pods {name!r}: Precondition failed: ResourceVersion in "
                f"precondition: {resource_version}, ResourceVersion in object meta: {meta['resourceVersion']}"
            )
        spec = obj.setdefault("spec", {})
        if spec.get("nodeName"):
            raise Conflict(f"pod {namespace}/{name} is already assigned to node {spec['nodeName']!r}")
        if node not in self.nodes:
            raise NotFound(f"node {node} not found")
        spec["nodeName"] = node
        if annotations:
            meta.setdefault("annotations", {}).update(annotations)
        self._bump(obj)
        self._emit("pod", MODIFIED, obj)
        if self.lose_bind_answers:
            self.lose_bind_answers -= 1
            raise Unavailable(f"cannot bind pod {namespace}/{name}: RemoteProtocolError (the answer was lost)")

    def terminate(self, key: str) -> None:
        """A terminating pod's kubelet is done: the pod is deleted."""
        self.delete_pod(key)

    # ----- preemption ---------------------------------------------------------------------------------------
    async def evict_pod(self, namespace: str, name: str, uid: str = "") -> None:
        key = f"{namespace}/{name}"
        self._check(f"evict pod {key}")
        obj = self.pods.get(key)
        if obj is None or (uid and obj["metadata"].get("uid") != uid):
            raise NotFound(f"pod {key} not found")
        labels = obj["metadata"].get("labels") or {}
        budgets = [k for k, b in self.pdbs.items() if b.covers(namespace, labels)]
        if len(budgets) > 1:
            raise KubeError(f"cannot evict pod {key}: it matches several PodDisruptionBudgets", 500)
        if budgets and self.pdbs[budgets[0]].disruptions_allowed <= 0:
            raise EvictionBlocked(
                f"cannot evict pod {key}: Cannot evict pod as it would violate the pod's disruption budget.", 429
            )
        if budgets:
            b = self.pdbs[budgets[0]]
            self.pdbs[budgets[0]] = dataclasses.replace(b, disruptions_allowed=b.disruptions_allowed - 1)
        self.evictions.append(key)
        if self.evict_deletes or not obj.get("spec", {}).get("nodeName"):
            self.delete_pod(key)
            return
        obj["metadata"].setdefault("deletionTimestamp", "2026-01-01T00:00:00Z")
        self._bump(obj)
        self._emit("pod", MODIFIED, obj)

    async def set_nominated_node(self, namespace: str, name: str, node: str) -> None:
        key = f"{namespace}/{name}"
        self._check(f"set nominated node of {key}")
        obj = self.pods.get(key)
        if obj is None:
            raise NotFound(f"pod {key} not found")
        obj.setdefault("status", {})["nominatedNodeName"] = node
        self._bump(obj)
        self._emit("pod", MODIFIED, obj)

    async def create_event(self, event: PodEvent, component: str) -> None:
        self._check(f"create event {event.reason}")
        self.events.append(event)

    async def list_disruption_budgets(self) -> list[DisruptionBudget]:
        self._check("list poddisruptionbudgets")
        return list(self.pdbs.values())

    # ----- leases ---------------------------------------------------------------------------------------------
    async def get_lease(self, namespace: str, name: str) -> LeaseRecord:
        self._check(f"get lease {namespace}/{name}")
        record = self.leases.get(f"{namespace}/{name}")
        if record is None:
            raise NotFound(f"lease {namespace}/{name} not found")
        return record

    async def create_lease(self, namespace: str, name: str, record: LeaseRecord) -> LeaseRecord:
        self._check(f"create lease {namespace}/{name}")
        key = f"{namespace}/{name}"
        if key in self.leases:
            raise Conflict(f"lease {key} already exists")
        self.rv += 1
        self.leases[key] = dataclasses.replace(record, resource_version=str(self.rv))
        return self.leases[key]

    async def update_lease(self, namespace: str, name: str, record: LeaseRecord) -> LeaseRecord:
        self._check(f"update lease {namespace}/{name}")
        key = f"{namespace}/{name}"
        current = self.leases.get(key)
        if current is None:
            raise NotFound(f"lease {key} not found")
        if record.resource_version != current.resource_version:
            raise Conflict(f"lease {key}: the object has been modified")
        self.rv += 1
        self.leases[key] = dataclasses.replace(record, resource_version=str(self.rv))
        return self.leases[key]

    async def close(self) -> None:
        return None


def _of(pod: Mapping[str, Any], scheduler_name: str | None) -> bool:
    """The field selector spec.schedulerName=NAME (the server's default scheduler name when unset)."""
    return scheduler_name is None or pod.get("spec", {}).get("schedulerName", "default-scheduler") == scheduler_name
