"""The ledger view: Nodes and Pods as the API server lists them → the same :class:`~sharegpu.ledger.Ledger` that
``sharegpu sim`` uses, read by the extender's filter, prioritize and bind.

Like the kube-scheduler's cache, it takes in objects (:meth:`LedgerView.reset`, :meth:`~LedgerView.apply_node`,
:meth:`~LedgerView.apply_pod`) without knowing where they come from — :class:`sharegpu.k8s.cache.view.ClusterView` feeds
it from the API server — and accounts the placements of this process that the API server does not show yet, the
assume cache of :mod:`sharegpu.k8s.cache.assume`, as if they were.

State is rebuilt from the API server alone: node inventories (``sharegpu.io/inventory``, written by the node
agent, schema in :mod:`sharegpu.model.inventory`) and the ``sharegpu.io/assignment`` of every pod that holds one.
A pod holds its assignment from the moment the annotation is written (bound or about to be) until it succeeds,
fails or is deleted. Nothing else is remembered, so a restarted extender rebuilds exactly the state it had.

A pod whose assignment cannot be accounted for (corrupt JSON, another pod's assignment, a GPU the node does not
have, a conflict with other pods) is reported (log and :attr:`LedgerView.problems`) and left out; it never stops
the view.

Node changes are rare (the node agent patches its inventory only when something changed) and change the ledger's
shape, so they mark the ledger stale and the next read rebuilds it; pod changes are applied incrementally.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, replace

from sharegpu.k8s.cache.assume import AssumeCache, Assumed, KeptRoom, Outcome, Phase, room_ledger_name
from sharegpu.k8s.dra_objects import is_dra_node
from sharegpu.k8s.pod_request import asks_for_sharegpu, pod_request, same_request
from sharegpu.kube.api import DELETED
from sharegpu.kube.informer import Tombstones, older
from sharegpu.kube.schema import Node, Pod
from sharegpu.ledger import Ledger, LedgerConflict, LedgerError, MpsTenancy
from sharegpu.model.assignment import Assignment, InvalidAssignment
from sharegpu.model.catalog import DEFAULT_CATALOG, Catalog
from sharegpu.model.contract import (
    ASSIGNMENT_ANNOTATION,
    BENCH_ANNOTATION,
    DEVICE_PATH_DRA,
    DEVICE_PATH_LABEL,
    DRIVER,
    GPU_RESOURCE,
    INVENTORY_ANNOTATION,
)
from sharegpu.model.inventory import InvalidInventory, NodeSpec
from sharegpu.model.request import GpuRequest, InvalidRequest
from sharegpu.placement.fragmentation import Workload

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Problem:
    """An object left out of the accounting, and why (shown by ``sharegpu status`` and logged)."""

    kind: str  # "pod" | "node"
    name: str
    reason: str


class LedgerView:
    """The ledger of the nodes' inventories and the pods' assignments, with this process's assumed placements."""

    def __init__(
        self, catalog: Catalog = DEFAULT_CATALOG, assumed: AssumeCache | None = None, tenancy: MpsTenancy | None = None
    ) -> None:
        self.catalog = catalog
        # How the ledger counts MPS daemons (the cap per GPU or MIG instance, each daemon's memory): the extender's
        # and status's --mps-daemons-per-gpu.
        self.tenancy = tenancy or MpsTenancy()
        self._specs: dict[str, NodeSpec] = {}
        self._parsed: dict[str, tuple[str, NodeSpec]] = {}  # node → (its inventory text, that text parsed)
        self._node_problems: dict[str, str] = {}
        # Every node listed, and those on the DRA path: why a node is not in the ledger (node_problem) differs for a
        # name the cluster lacks, a DRA node and a node without the agent, and each asks the user something else.
        self._node_names: set[str] = set()
        self._dra_nodes: set[str] = set()
        self._bench_notes: dict[str, str] = {}  # node → its strategy-bench annotation (sharegpu.k8s.status.bench_note)
        self._pods: dict[str, Pod] = {}
        self._requests: dict[str, GpuRequest] = {}
        self._pod_problems: dict[str, str] = {}
        self._assumed = assumed if assumed is not None else AssumeCache()
        self._gone = Tombstones()  # deleted pods, so that a late copy of one (the binder's read) never brings it back
        self._ledger: Ledger | None = None
        self.generation = 0  # bumped on every change of the ledger (cache key for per-cycle results)

    # ----- reading ---------------------------------------------------------------------------------------------
    @property
    def ledger(self) -> Ledger:
        if self._ledger is None:
            self._rebuild()
        assert self._ledger is not None
        return self._ledger

    def node_spec(self, name: str) -> NodeSpec | None:
        return self._specs.get(name)

    def bench_note(self, name: str) -> str | None:
        """The node's ``sharegpu bench --publish`` annotation, as written (``sharegpu status`` shows it)."""
        return self._bench_notes.get(name)

    def node_problem(self, name: str) -> str:
        """Why node ``name`` is not in the ledger."""
        if name in self._node_problems:
            return self._node_problems[name]
        if name in self._dra_nodes:
            return (
                f"node {name} is on the DRA path ({DEVICE_PATH_LABEL}={DEVICE_PATH_DRA}): its GPUs are handed out "
                f"through ResourceClaims of the {DRIVER} driver, never as {GPU_RESOURCE}"
            )
        if name not in self._node_names:
            return f"node {name} does not exist (the API server lists no node of that name)"
        return f"node {name} has no {INVENTORY_ANNOTATION} annotation (is the sharegpu node agent running there?)"

    @property
    def problems(self) -> list[Problem]:
        return [Problem("node", n, r) for n, r in sorted(self._node_problems.items())] + [
            Problem("pod", p, r) for p, r in sorted(self._pod_problems.items())
        ]

    def pod(self, key: str) -> Pod | None:
        return self._pods.get(key)

    # ----- issue 10: read-only accessors for status, metrics and the live page ---------------------------------
    def pods(self) -> list[Pod]:
        """Every pod the view holds: those that ask for sharegpu or hold an assignment."""
        return list(self._pods.values())

    def request(self, key: str) -> GpuRequest | None:
        """The parsed sharegpu request of pod ``key`` (None: it asks for none, or it cannot be valid)."""
        return self._requests.get(key)

    def request_of(self, pod: Pod) -> GpuRequest | None:
        """``pod_request(pod)``, taken from the copy of the pod the view holds where that reads the same (filter and
        bind see the version the watch brought); raises :class:`InvalidRequest` as ``pod_request`` does."""
        known = self._requests.get(pod.key)
        if known is not None:
            recorded = self._pods.get(pod.key)
            if recorded is not None and same_request(recorded, pod):
                return known
        return pod_request(pod, self.catalog)

    def requests(self) -> list[GpuRequest]:
        """The parsed requests of every pod the view holds that asks for sharegpu (the workload seen)."""
        return list(self._requests.values())

    def request_count(self) -> int:
        """How many pods the view holds with a sharegpu request (read every cycle: a workload's drift is counted in
        it)."""
        return len(self._requests)

    def workload(self) -> Workload | None:
        """The task shapes of the pods seen (None: none seen yet): what fragmentation is measured against where the
        operator fixed no workload."""
        return Workload.from_requests(self._requests.values()) if self._requests else None

    # ----- changing --------------------------------------------------------------------------------------------
    def reset(self, nodes: Iterable[Node], pods: Iterable[Pod]) -> None:
        """Replace everything with a fresh list from the API server (start, after the connection was lost, and
        every few minutes when a watch ends).

        When the nodes are as they were and no assignment was left out, the ledger is kept and only the pods whose
        assignment may have changed are accounted again: the result equals a ledger rebuilt from the list, but the
        relist of a large cluster costs what changed, and the scheduler's caches (per shape, per node version) stay
        warm. Otherwise the ledger is rebuilt from the list.
        """
        specs_before = dict(self._specs)
        pods_before = dict(self._pods)
        problems_before = bool(self._pod_problems)
        self._specs.clear()
        self._node_problems.clear()
        self._node_names.clear()
        self._dra_nodes.clear()
        self._bench_notes.clear()
        self._pods.clear()
        self._requests.clear()
        self._pod_problems.clear()
        self._gone.clear()
        names = set()
        for n in nodes:
            names.add(n.metadata.name)
            self._ingest_node(n)
        for name in [n for n in self._parsed if n not in names]:
            del self._parsed[name]
        listed: set[str] = set()
        for p in pods:
            listed.add(p.key)
            self._ingest_pod(p)
        for key in list(self._assumed.keys()):
            # A list taken now that lacks the pod was taken after it was deleted.
            if key not in listed and key not in self._pods:
                self._assumed.forget(key)
        unchanged = self._ledger is not None and not problems_before and self._specs == specs_before
        if unchanged and self._account_changes(pods_before):
            return
        self._ledger = None
        self._rebuild()

    def _account_changes(self, pods_before: dict[str, Pod]) -> bool:
        """After a relist that kept the nodes: account again the pods whose assignment may differ from what the
        ledger holds (new, changed, gone, or placed by this process). False (the ledger must be rebuilt) when one
        cannot be accounted: which pod wins a conflict must not depend on the order of the changes."""
        led = self._ledger
        assert led is not None
        room = {r.ledger_name for r in self._assumed.room()}
        keys = set(self._assumed.keys()) | {k for k in led.assignments if k not in self._pods and k not in room}
        keys.update(k for k, pod in self._pods.items() if _holds_differently(pods_before.get(k), pod))
        ordered = sorted(keys)
        for key in ordered:  # everything that may move is taken out first, so that no placement meets a stale one
            if key in led.assignments:
                led.release(key)
        for key in ordered:
            desired = self._desired(key)
            if desired is None:
                continue
            try:
                led.place(desired, check_health=False)
            except LedgerError:
                return False
        if self._pod_problems:
            return False
        self.generation += 1
        return True

    def apply_node(self, event: str, node: Node) -> None:
        name = node.metadata.name
        before = (self._specs.get(name), self._node_problems.get(name))
        if event == DELETED:
            self._specs.pop(name, None)
            self._parsed.pop(name, None)
            self._node_problems.pop(name, None)
            self._node_names.discard(name)
            self._dra_nodes.discard(name)
            self._bench_notes.pop(name, None)
        else:
            self._ingest_node(node)
        if (self._specs.get(name), self._node_problems.get(name)) != before:
            self._ledger = None  # the ledger's shape changed: rebuild on the next read

    def apply_pod(self, event: str, pod: Pod) -> None:
        key = pod.key
        if event == DELETED:
            if not self._forget_pod(key, pod):
                return
        elif not self._ingest_pod(pod):
            return
        if self._ledger is not None:
            self._reconcile(key)

    def _forget_pod(self, key: str, pod: Pod) -> bool:
        """A DELETED event; False when it changes nothing (an old incarnation's, or a pod never relevant)."""
        recorded = self._pods.get(key)
        if recorded is not None and older(pod.metadata.resource_version, recorded.metadata.resource_version):
            return False
        if recorded is None and key not in self._assumed:
            return False  # a pod the view never held
        self._gone.bury(key, pod.metadata.resource_version)
        self._assumed.forget(key)  # gone: it holds nothing (a bind in flight settles without taking the pod back)
        self._pods.pop(key, None)
        self._requests.pop(key, None)
        return True

    def _ingest_node(self, node: Node) -> None:
        name = node.metadata.name
        self._specs.pop(name, None)
        self._node_problems.pop(name, None)
        self._node_names.add(name)
        self._dra_nodes.discard(name)
        note = node.metadata.annotations.get(BENCH_ANNOTATION)
        if note is None:
            self._bench_notes.pop(name, None)
        else:
            self._bench_notes[name] = note
        if is_dra_node(node.metadata.labels):
            self._dra_nodes.add(name)
            return  # its GPUs are handed out through DRA only (see sharegpu.k8s.status.dra): never counted here
        text = node.metadata.annotations.get(INVENTORY_ANNOTATION)
        if text is None:
            return  # not a sharegpu node: no problem to report, node_problem() explains it if asked
        parsed = self._parsed.get(name)
        if parsed is not None and parsed[0] == text:
            self._specs[name] = parsed[1]  # the inventory as last read: a relist need not parse it again
            return
        try:
            spec = NodeSpec.from_json(text, self.catalog)
            if spec.name != name:
                raise InvalidInventory(f"the inventory names node {spec.name!r}")
        except InvalidInventory as e:
            self._node_problem(name, f"{INVENTORY_ANNOTATION} is invalid, so its GPUs are not scheduled: {e}")
            return
        self._specs[name] = spec
        self._parsed[name] = (text, spec)

    def _node_problem(self, name: str, why: str) -> None:
        reason = f"node {name}: {why}"
        if self._node_problems.get(name) != reason:
            log.warning("%s", reason)
        self._node_problems[name] = reason

    def _ingest_pod(self, pod: Pod) -> bool:
        """Remember a pod that matters to sharegpu; False when it changes nothing (it does not matter and never did,
        or it is older than what the view already holds)."""
        key = pod.key
        rv = pod.metadata.resource_version
        recorded = self._pods.get(key)
        if recorded is not None and older(rv, recorded.metadata.resource_version):
            return False  # a late copy (a lagging watch, or the binder's own): never overwrite a newer object
        if not self._gone.admits(key, rv):
            return False  # the copy of a pod already deleted: it must not come back
        if self._assumed.barred(key):
            return False
        relevant = ASSIGNMENT_ANNOTATION in pod.metadata.annotations or asks_for_sharegpu(pod)
        if not relevant:
            if key not in self._pods:
                return False
            self._pods.pop(key)
            self._requests.pop(key, None)
            return True
        self._pods[key] = pod
        self._assumed.observed(key, pod)
        if recorded is not None and key in self._requests and same_request(recorded, pod):
            return True  # the request read from the last copy stands (a bind or status change touches none of it)
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
        assumed = self._assumed.get(key)
        if assumed is not None:
            return assumed.assignment  # a bind of this process in flight, or ended and not yet seen by the watch
        pod = self._pods.get(key)
        if pod is None or pod.finished:
            return None
        text = pod.metadata.annotations.get(ASSIGNMENT_ANNOTATION)
        if text is None:
            return None
        if not pod.spec.node_name:
            # Written by a bind that never completed (the extender stopped between the annotation and the
            # Binding, and could not take it back): it holds nothing, and the pod's next bind overwrites it.
            return None
        try:
            a = Assignment.from_json(text)
        except InvalidAssignment as e:
            self._problem(key, str(e))
            return None
        if a.pod != key:
            self._problem(key, f"the assignment belongs to pod {a.pod}")
            return None
        if pod.spec.node_name != a.node:
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
                # An assignment that exists (the pod holds it, or its bind was decided) keeps a GPU that turned
                # unhealthy since: its pod still runs there and nothing else may be placed on it.
                led.place(desired, check_health=False)
            except LedgerError as e:
                self._problem(key, str(e))
        self.generation += 1

    def _rebuild(self) -> None:
        led = self._new_ledger()
        keys = sorted(set(self._pods) | set(self._assumed.keys()))
        for key in keys:
            desired = self._desired(key)
            if desired is None:
                continue
            try:
                led.place(desired, check_health=False)
            except LedgerError as e:
                self._problem(key, str(e))
        for r in self._assumed.room():
            try:
                led.place(r.assignment, check_health=False)
            except LedgerError as e:  # the node changed under it: the room is lost, preemption decides again
                log.info("room kept for %s no longer fits on %s: %s", r.preemptor, r.assignment.node, e)
                self._assumed.unkeep(r.preemptor)
        self._ledger = led
        self.generation += 1
        log.debug("ledger rebuilt: %d node(s), %d assignment(s)", len(led.nodes), len(led))

    def _new_ledger(self) -> Ledger:
        """A ledger of every node whose inventory it can hold; a node it cannot is reported and left out."""
        try:
            return Ledger(self._specs.values(), self.catalog, self.tenancy)
        except Exception:  # find the node(s) at fault; the rest must keep working
            pass
        for name, spec in list(self._specs.items()):
            try:
                Ledger([spec], self.catalog, self.tenancy)
            except Exception as e:  # whatever an inventory does wrong, only its node is left out
                del self._specs[name]
                self._parsed.pop(name, None)
                self._node_problem(
                    name,
                    f"its {INVENTORY_ANNOTATION} cannot be accounted, so its GPUs are not "
                    f"scheduled: {type(e).__name__}: {e}",
                )
        return Ledger(self._specs.values(), self.catalog, self.tenancy)

    # ----- the assume cache, accounted in the ledger (the binder) --------------------------------------------------
    def pod_keys_by_uid(self) -> dict[str, str]:
        """Pods by UID, those this process placed and the watch has not shown yet included."""
        keys = self._assumed.keys_by_uid()
        keys.update((p.metadata.uid, k) for k, p in self._pods.items() if p.metadata.uid)
        return keys

    def in_flight(self, key: str) -> bool:
        return key in self._assumed

    def phase(self, key: str) -> Phase | None:
        return self._assumed.phase(key)

    def held(self, key: str) -> Assignment | None:
        """What prioritize holds for pod ``key``, if anything."""
        return self._assumed.held(key)

    def hold(self, a: Assignment, uid: str, expires: float) -> None:
        """Account ``a`` for a pod that is being scheduled, until its bind or ``expires`` (time.monotonic()), so
        that the pods scheduled meanwhile see it taken; raises :class:`LedgerConflict`."""
        self.drop_hold(a.pod)
        self._account(Assumed(a, uid, Phase.HELD, expires=expires))

    def drop_hold(self, key: str) -> bool:
        if not self._assumed.drop_hold(key):
            return False
        if self._ledger is not None:
            self._reconcile(key)
        return True

    def expire_holds(self, now: float) -> int:
        """Drop the holds whose bind never came (the scheduler chose another node, or gave up), and the room kept
        past its time."""
        lapsed = self._assumed.lapsed(now)
        for key in lapsed:
            self.drop_hold(key)
        for r in self._assumed.expire_room(now):
            self._release_room(r)
        return len(lapsed)

    def unknown(self, key: str) -> tuple[Assignment | None, str, str]:
        """(assignment, pod UID, the lost Binding's resourceVersion) of a bind of unknown outcome, or (None, "", "")."""
        return self._assumed.unknown(key)

    def drop_holds(self) -> None:
        """Drop every hold and all kept room (this replica no longer leads)."""
        for key in self._assumed.held_keys():
            self.drop_hold(key)
        for r in self._assumed.room():
            self.unkeep_room(r.preemptor)

    # ----- room kept for preemptors (the assume cache's KeptRoom entries) ------------------------------------------
    def keep_room(self, preemptor: str, victim: str | None, a: Assignment, expires: float) -> None:
        """Account ``a`` as room kept for pod ``preemptor`` (a victim's share, or with ``victim`` None the part of
        its room free already) until ``expires``; raises :class:`LedgerConflict` (or ValueError) when it is taken."""
        led = self.ledger
        name = room_ledger_name(preemptor, victim)
        if name in led.assignments:
            raise LedgerConflict(f"room is already kept for {preemptor} ({name})")
        kept = replace(a, pod=name)
        led.place(kept)  # new room: only healthy GPUs
        self._assumed.keep(KeptRoom(preemptor, victim, kept, expires))
        self.generation += 1

    def kept_room(self, preemptor: str, victim: str | None) -> KeptRoom | None:
        return self._assumed.kept(preemptor, victim)

    def room_for(self, preemptor: str) -> list[KeptRoom]:
        """The room kept for pod ``preemptor`` now."""
        return [r for r in self._assumed.room() if r.preemptor == preemptor]

    def unkeep_room(self, preemptor: str) -> None:
        for r in self._assumed.unkeep(preemptor):
            self._release_room(r)

    def _release_room(self, r: KeptRoom) -> None:
        if self._ledger is not None and r.ledger_name in self._ledger.assignments:
            self._ledger.release(r.ledger_name)
            self.generation += 1

    def holds(self) -> int:
        return self._assumed.holds()

    def reserve(self, a: Assignment, uid: str = "") -> None:
        """Account ``a`` now, before its Binding is written (taking over the pod's hold when it is the same
        placement); raises :class:`LedgerConflict`."""
        if self._assumed.bind_held(a, uid):
            return
        self.drop_hold(a.pod)
        self._account(Assumed(a, uid, Phase.BINDING))

    def _account(self, assumed: Assumed) -> None:
        a = assumed.assignment
        led = self.ledger
        if a.pod in led.assignments:
            raise LedgerConflict(f"pod {a.pod} already holds GPUs on {led.assignments[a.pod].node}")
        led.place(a)  # a new placement: only healthy GPUs
        self._assumed.add(assumed)
        self.generation += 1

    def settle(self, key: str, outcome: Outcome, pod: Pod | None = None, rv: str = "") -> None:
        """A bind of ``key`` ended with ``outcome``; ``pod`` is the pod as the binder last read it, if it did.

        BOUND keeps the reservation until the watch delivers the pod bound (so that no older copy of the pod can
        take the assignment away meanwhile); UNKNOWN keeps it until the pod is seen bound, gone, or changed past
        ``rv`` (the Binding's resourceVersion precondition); FAILED releases it now.
        """
        if not self._assumed.settle(key, outcome, rv):
            pod = None  # deleted while binding: it holds nothing, and no copy of it may come back
        elif (seen := self._pods.get(key)) is not None:
            self._assumed.seen_bound(key, seen)  # the watch showed it bound before the Binding's answer came
        if pod is not None:
            self._ingest_pod(pod)
        if self._ledger is not None:
            self._reconcile(key)


def _holds_differently(before: Pod | None, now: Pod) -> bool:
    """Whether what pod ``now`` holds may differ from what its earlier copy ``before`` held: what
    :meth:`LedgerView._desired` reads of a pod (its UID, node, assignment annotation and whether it finished)."""
    if before is None:
        return True
    return (
        before.metadata.uid != now.metadata.uid
        or before.spec.node_name != now.spec.node_name
        or before.finished != now.finished
        or before.metadata.annotations.get(ASSIGNMENT_ANNOTATION) != now.metadata.annotations.get(ASSIGNMENT_ANNOTATION)
    )
