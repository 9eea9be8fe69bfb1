"""The cluster view: Nodes and Pods from the API server → the same :class:`~sharegpu.ledger.Ledger` that
``sharegpu sim`` uses.

State is rebuilt from the API server alone: node inventories (``sharegpu.io/inventory``, written by the node
agent, schema in :mod:`sharegpu.model.inventory`) and the ``sharegpu.io/assignment`` of every pod that holds one.
A pod holds its assignment from the moment the annotation is written (bound or about to be) until it succeeds,
fails or is deleted. Nothing else is remembered, so a restarted extender rebuilds exactly the state it had.

A pod whose assignment cannot be accounted for (corrupt JSON, another pod's assignment, a GPU the node does not
have, a conflict with other pods) is reported (log and :attr:`ClusterView.problems`) and left out; it never stops
the view.

Node changes are rare (the node agent patches its inventory only when something changed) and change the ledger's
shape, so they mark the ledger stale and the next read rebuilds it; pod changes are applied incrementally.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from sharegpu.k8s.api import DELETED, ApiError, ClusterApi
from sharegpu.k8s.pod_request import ASSIGNMENT_ANNOTATION, asks_for_sharegpu, pod_request
from sharegpu.k8s.schema import Node, Pod
from sharegpu.ledger import Ledger, LedgerConflict, LedgerError
from sharegpu.model.assignment import Assignment, InvalidAssignment
from sharegpu.model.catalog import DEFAULT_CATALOG, Catalog
from sharegpu.model.inventory import INVENTORY_ANNOTATION, InvalidInventory, NodeSpec
from sharegpu.model.request import GpuRequest, InvalidRequest
from sharegpu.placement.fragmentation import Workload
from sharegpu.placement.framework import Policy, Scheduler
from sharegpu.placement.policies import PolicyContext, UnknownPolicy, make_policy

log = logging.getLogger(__name__)

FALLBACK_POLICY = "bestfit"  # needs no workload distribution
WORKLOAD_DRIFT = 0.1  # rebuild the workload distribution when the pods seen grew or shrank by this fraction


@dataclass(frozen=True, slots=True)
class Problem:
    """An object left out of the accounting, and why (shown by ``sharegpu status`` and logged)."""

    kind: str  # "pod" | "node"
    name: str
    reason: str


class ClusterView:
    def __init__(
        self,
        policy: str = "sharegpu",
        catalog: Catalog = DEFAULT_CATALOG,
        seed: int = 0,
        workload: Workload | None = None,
    ) -> None:
        self.catalog = catalog
        self.policy_name = policy
        self.seed = seed
        self._fixed_workload = workload
        make_policy(policy, PolicyContext(workload or _placeholder_workload()))  # fail early on a bad name
        self._specs: dict[str, NodeSpec] = {}
        self._node_problems: dict[str, str] = {}
        self._pods: dict[str, Pod] = {}
        self._requests: dict[str, GpuRequest] = {}
        self._pod_problems: dict[str, str] = {}
        self._inflight: dict[str, Assignment] = {}
        self._ledger: Ledger | None = None
        self._scheduler: Scheduler | None = None
        self._workload_pods = -1
        self.generation = 0  # bumped on every change of the ledger (cache key for per-cycle results)
        self.synced = False  # True while the view follows the API server (listed and watching)
        self.active_policy = ""

    # ----- reading ---------------------------------------------------------------------------------------------
    @property
    def ledger(self) -> Ledger:
        if self._ledger is None:
            self._rebuild()
        assert self._ledger is not None
        return self._ledger

    def scheduler(self) -> Scheduler:
        """The scheduler over the current ledger, with the policy rebuilt when the workload seen drifted."""
        led = self.ledger
        n = len(self._requests)
        stale = self._fixed_workload is None and (
            self._workload_pods != n
            and (self._workload_pods <= 0 or abs(n - self._workload_pods) >= WORKLOAD_DRIFT * self._workload_pods)
        )
        if self._scheduler is None or self._scheduler.ledger is not led or stale:
            self._scheduler = Scheduler(led, self._make_policy(), self.seed)
        return self._scheduler

    def _make_policy(self) -> Policy:
        workload = self._fixed_workload
        if workload is None and self._requests:
            workload = Workload.from_requests(self._requests.values())
        self._workload_pods = len(self._requests)
        try:
            policy = make_policy(self.policy_name, PolicyContext(workload))
        except UnknownPolicy:
            # Only fragmentation-aware policies need a workload, and only until the first pod is seen.
            if self.active_policy != FALLBACK_POLICY:
                log.info(
                    "policy %s needs the workload's typical pod shapes and no sharegpu pod has been seen yet; "
                    "placing with %s until one is",
                    self.policy_name,
                    FALLBACK_POLICY,
                )
            policy = make_policy(FALLBACK_POLICY, PolicyContext())
        else:
            if workload is not None and self._fixed_workload is None:
                log.info("policy %s: workload distribution rebuilt from %d pod(s)", policy.name, len(self._requests))
        self.active_policy = policy.name
        return policy

    def node_spec(self, name: str) -> NodeSpec | None:
        return self._specs.get(name)

    def node_problem(self, name: str) -> str:
        """Why node ``name`` is not in the ledger."""
        return self._node_problems.get(
            name,
            f"node {name} has no {INVENTORY_ANNOTATION} annotation (is the sharegpu node agent running there?)",
        )

    @property
    def problems(self) -> list[Problem]:
        return [Problem("node", n, r) for n, r in sorted(self._node_problems.items())] + [
            Problem("pod", p, r) for p, r in sorted(self._pod_problems.items())
        ]

    def pod(self, key: str) -> Pod | None:
        return self._pods.get(key)

    # ----- changing --------------------------------------------------------------------------------------------
    def reset(self, nodes: Iterable[Node], pods: Iterable[Pod]) -> None:
        """Replace everything with a fresh list from the API server (start, or after the connection was lost)."""
        self._specs.clear()
        self._node_problems.clear()
        self._pods.clear()
        self._requests.clear()
        self._pod_problems.clear()
        for n in nodes:
            self._ingest_node(n)
        for p in pods:
            self._ingest_pod(p)
        self._ledger = None
        self._rebuild()

    def apply_node(self, event: str, node: Node) -> None:
        name = node.metadata.name
        before = (self._specs.get(name), self._node_problems.get(name))
        if event == DELETED:
            self._specs.pop(name, None)
            self._node_problems.pop(name, None)
        else:
            self._ingest_node(node)
        if (self._specs.get(name), self._node_problems.get(name)) != before:
            self._ledger = None  # the ledger's shape changed: rebuild on the next read

    def apply_pod(self, event: str, pod: Pod) -> None:
        key = pod.key
        if event == DELETED:
            if self._pods.pop(key, None) is None:
                return
            self._requests.pop(key, None)
        elif not self._ingest_pod(pod):
            return
        if self._ledger is not None:
            self._reconcile(key)

    def _ingest_node(self, node: Node) -> None:
        name = node.metadata.name
        self._specs.pop(name, None)
        self._node_problems.pop(name, None)
        text = node.metadata.annotations.get(INVENTORY_ANNOTATION)
        if text is None:
            return  # not a sharegpu node: no problem to report, node_problem() explains it if asked
        try:
            spec = NodeSpec.from_json(text, self.catalog)
            if spec.name != name:
                raise InvalidInventory(f"the inventory names node {spec.name!r}")
        except InvalidInventory as e:
            reason = f"node {name}: {INVENTORY_ANNOTATION} is invalid, so its GPUs are not scheduled: {e}"
            if self._node_problems.get(name) != reason:
                log.warning("%s", reason)
            self._node_problems[name] = reason
            return
        self._specs[name] = spec

    def _ingest_pod(self, pod: Pod) -> bool:
        """Remember a pod that matters to sharegpu; False when it does not (and never did)."""
        key = pod.key
        relevant = ASSIGNMENT_ANNOTATION in pod.metadata.annotations or asks_for_sharegpu(pod)
        if not relevant:
            if key not in self._pods:
                return False
            self._pods.pop(key)
            self._requests.pop(key, None)
            return True
        self._pods[key] = pod
        try:
            req = pod_request(pod, self.catalog)
        except InvalidRequest:
            req = None  # the webhook rejects these; the extender's filter says why if one gets through
        if req is None:
            self._requests.pop(key, None)
        else:
            self._requests[key] = req
        return True

    def _desired(self, key: str) -> Assignment | None:
        """The assignment pod ``key`` holds now, or None; records why one cannot be accounted."""
        self._pod_problems.pop(key, None)  # judged afresh on every change of the pod
        pod = self._pods.get(key)
        if pod is None or pod.finished:
            return self._inflight.get(key)
        text = pod.metadata.annotations.get(ASSIGNMENT_ANNOTATION)
        if text is None:
            return self._inflight.get(key)
        try:
            a = Assignment.from_json(text)
        except InvalidAssignment as e:
            self._problem(key, str(e))
            return None
        if a.pod != key:
            self._problem(key, f"the assignment belongs to pod {a.pod}")
            return None
        if pod.spec.node_name and pod.spec.node_name != a.node:
            self._problem(key, f"the assignment is for node {a.node} but the pod runs on {pod.spec.node_name}")
            return None
        if a.node not in self._specs:
            self._problem(key, f"its node {a.node} has no valid sharegpu inventory")
            return None
        return a

    def _problem(self, key: str, reason: str) -> None:
        text = f"pod {key}: {ASSIGNMENT_ANNOTATION} is not accounted for: {reason}"
        if self._pod_problems.get(key) != text:
            log.warning("%s", text)
        self._pod_problems[key] = text

    def _reconcile(self, key: str) -> None:
        led = self._ledger
        assert led is not None
        desired = self._desired(key)
        current = led.assignments.get(key)
        if current == desired:
            return
        if current is not None:
            led.release(key)
        if desired is not None:
            try:
                led.place(desired)
            except LedgerError as e:
                self._problem(key, str(e))
        self.generation += 1

    def _rebuild(self) -> None:
        led = Ledger(self._specs.values(), self.catalog)
        keys = sorted(set(self._pods) | set(self._inflight))
        for key in keys:
            desired = self._desired(key)
            if desired is None:
                continue
            try:
                led.place(desired)
            except LedgerError as e:
                self._problem(key, str(e))
        self._ledger = led
        self.generation += 1
        log.debug("ledger rebuilt: %d node(s), %d assignment(s)", len(led.nodes), len(led))

    # ----- reservations (the binder) -----------------------------------------------------------------------------
    def forget_unbound(self, key: str) -> None:
        """Release what unbound pod ``key`` holds from an earlier bind attempt, before its bind is retried."""
        led = self.ledger
        if key in led.assignments and key not in self._inflight:
            led.release(key)
            self.generation += 1

    def pod_keys_by_uid(self) -> dict[str, str]:
        return {p.metadata.uid: k for k, p in self._pods.items() if p.metadata.uid}

    def reserve(self, a: Assignment) -> None:
        """Account ``a`` now, before its annotation is written; raises :class:`LedgerConflict`."""
        led = self.ledger
        if a.pod in self._inflight:
            raise LedgerConflict(f"a bind of pod {a.pod} is already in progress")
        if a.pod in led.assignments:
            led.release(a.pod)  # a stale reservation of an earlier attempt (the pod is not bound)
            self.generation += 1
        led.place(a)
        self._inflight[a.pod] = a
        self.generation += 1

    def settle(self, key: str, pod: Pod | None) -> None:
        """A bind of ``key`` ended: ``pod`` is the pod as it now is (bound and annotated, or not), if known."""
        self._inflight.pop(key, None)
        if pod is not None:
            self._ingest_pod(pod)
        if self._ledger is not None:
            self._reconcile(key)

    # ----- following the API server ----------------------------------------------------------------------------
    async def follow(self, api: ClusterApi, stop: asyncio.Event, max_backoff_s: float = 30.0) -> None:
        """List, then watch Nodes and Pods until ``stop``; on any API error relist after a backoff, for ever."""
        backoff = 0.2
        while not stop.is_set():
            try:
                nodes, node_rv = await api.list_nodes()
                pods, pod_rv = await api.list_pods()
                self.reset(nodes, pods)
                self.synced = True
                log.info(
                    "cluster view in sync: %d sharegpu node(s), %d pod(s) with assignments",
                    len(self._specs),
                    len(self.ledger),
                )
                backoff = 0.2
                await self._watch(api, node_rv, pod_rv, stop)
            except Exception as e:  # an API error, or an object the view cannot read: relist rather than go stale
                if not isinstance(e, ApiError):
                    log.exception("cluster view: unexpected error while following the API server; relisting")
                if self.synced:
                    log.warning("lost the API server (%s); no new binds until the view is back in sync", e)
                else:
                    log.warning("cannot sync with the API server (%s); retrying in %.1fs", e, backoff)
                self.synced = False
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), backoff)
                backoff = min(backoff * 2, max_backoff_s)
        self.synced = False

    async def _watch(self, api: ClusterApi, node_rv: str, pod_rv: str, stop: asyncio.Event) -> None:
        async def nodes() -> None:
            async for event, node in api.watch_nodes(node_rv):
                self.apply_node(event, node)

        async def pods() -> None:
            async for event, pod in api.watch_pods(pod_rv):
                self.apply_pod(event, pod)

        tasks = [asyncio.ensure_future(nodes()), asyncio.ensure_future(pods()), asyncio.ensure_future(stop.wait())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()  # re-raises a watch's ApiError
            if not stop.is_set():
                raise ApiError("a watch ended without an error")
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _placeholder_workload() -> Workload:
    return Workload.from_requests([GpuRequest("placeholder")])
