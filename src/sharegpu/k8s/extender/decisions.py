"""The extender's decisions: filter, prioritize and preempt on the simulator's ledger and policies, and the DRA
steering filter.

- filter: of the nodes with room, only the one the policy picks (best score, its tie-break) is left, and its share
  is *held* for the pod (the ledger accounts it) until the pod's bind or a few seconds: the kube-scheduler schedules
  the next pod while this one's bind is still on its way, and without the hold the next pod would be filtered onto
  the same share and its bind refused. With one node left the kube-scheduler skips scoring (its plugins and the
  prioritize call). When no node has room, every node gets a reason a user can act on ("largest free share 12Gi <
  20Gi asked"); the kube-scheduler puts them in the pod's FailedScheduling event.
- prioritize (when a filter left several nodes: ``narrow=False``, or another extender's configuration): the
  policy's scores of the candidates, scaled to 0–10. The node the policy itself would pick gets 10 and every other
  node at most 9, so that with a dominant extender weight the kube-scheduler binds where ``sharegpu sim`` would;
  it decides and holds afresh.
- preempt: keep only the nodes where evicting the proposed victims really frees room for the pod.
- dra/filter (steering, when on): for a pod whose GPUs come from DRA claims, keep only the node the ``dra-steered``
  policy picks (see :mod:`sharegpu.k8s.extender.dra_steer`); a second extender entry of the scheduler profile, filter only.

Nothing here awaits or writes to the API server: a decision is held in the view's assume cache, and the binder
(:mod:`sharegpu.k8s.extender.binding`) takes it from there.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from sharegpu.k8s.cache.view import NOT_SYNCED, ClusterView
from sharegpu.k8s.extender.answers import FilterAnswer, Fragments, event_safe, first_each, fragments_of
from sharegpu.k8s.extender.schedulers import Schedulers
from sharegpu.kube.schema import (
    MAX_EXTENDER_PRIORITY,
    ExtenderArgs,
    ExtenderFilterResult,
    ExtenderPreemptionArgs,
    ExtenderPreemptionResult,
    MetaVictims,
    Pod,
)
from sharegpu.ledger import Ledger, LedgerError
from sharegpu.model.assignment import Assignment
from sharegpu.model.contract import DEFAULT_SCHEDULER_NAME
from sharegpu.model.request import GpuRequest, InvalidRequest
from sharegpu.placement.fragmentation import Workload
from sharegpu.placement.framework import BoolArray, Decision, IntArray

log = logging.getLogger(__name__)

NO_NODES = (
    "the filter request names no nodes: it has neither NodeNames (nodeCacheCapable: true) nor Nodes "
    "(nodeCacheCapable: false)"
)
CACHE_SIZE = 256
HOLD_S = 10.0  # how long prioritize's choice stays held for the pod's bind

_NONE = np.zeros(0, dtype=np.int64)
_NO_REJECTS = (_NONE, np.zeros(0, dtype=np.int32), _NONE, np.zeros(0, dtype=np.int32))


@dataclass(frozen=True, slots=True)
class _Feasible:
    request: GpuRequest
    ok: BoolArray
    usable: BoolArray


class Decisions:
    """Filter, prioritize and preempt over one cluster view; what it chooses for a pod is held for the pod's bind."""

    def __init__(
        self,
        view: ClusterView,
        scheduler_name: str = DEFAULT_SCHEDULER_NAME,
        may_hold: Callable[[], bool] = lambda: True,
        on_chosen: Callable[[Pod], None] = lambda pod: None,
        hold_s: float = HOLD_S,
        narrow: bool = True,
        policy: str = "sharegpu",
        seed: int = 0,
        workload: Workload | None = None,
    ) -> None:
        self.view = view
        # The schedulers over the view's ledgers (the policy's, and DRA steering's when the view follows DRA nodes):
        # the decisions own them; the binder, preemption and consolidation decide through them.
        self.schedulers = Schedulers(view, policy, seed, workload)
        self.narrow = narrow  # filter leaves only the policy's pick (see _narrowed)
        self.scheduler_name = scheduler_name  # only this scheduler's pods are placed
        # Only a replica that can bind holds (one with an API server connection, while it leads): a hold elsewhere
        # would only keep the share from the pods filtered meanwhile.
        self.may_hold = may_hold
        self.on_chosen = on_chosen  # each pod whose node was chosen, as the scheduler sent it (kept for its bind)
        self.hold_s = hold_s
        # Filter's feasibility, reused by the prioritize call of the same cycle while the ledger is unchanged.
        self._feasible: OrderedDict[tuple[str, str, int], _Feasible] = OrderedDict()
        self._names: tuple[Ledger, list[str], IntArray] | None = None
        self._passed: tuple[Ledger, list[str], IntArray] | None = None  # what the last filter passed
        self._prio_names: tuple[Ledger, list[str], IntArray] | None = None  # the last prioritize's own list
        self._frags: Fragments | None = None  # the answers' JSON pieces, per ledger

    # ----- filter ----------------------------------------------------------------------------------------------
    def filter(self, args: ExtenderArgs) -> ExtenderFilterResult:
        return self.filter_answer(args).result()

    def filter_answer(self, args: ExtenderArgs) -> FilterAnswer:
        """Filter's answer as sent: the body, with what the metrics count."""
        if args.NodeNames is None and args.Nodes is None:
            # An answer with no node list would be read as "no node passed"; the Error field says why instead.
            return FilterAnswer.of(ExtenderFilterResult(Error=NO_NODES))
        names = _node_names(args)
        try:
            req = self.view.request_of(args.Pod)
        except InvalidRequest as e:
            # No node and no preemption can help a request that can never be valid.
            return FilterAnswer.of(self._filtered(args, [], {}, dict.fromkeys(names, str(e))))
        if req is None:
            return FilterAnswer.of(self._filtered(args, names, {}, {}))
        if refused := self._not_placeable(args.Pod):
            # Nothing is decided or held for such a pod: the scheduler reports the Error as the cycle's failure.
            return FilterAnswer.of(ExtenderFilterResult(Error=f"sharegpu cannot place {_shown(args.Pod)}: {refused}"))
        if not self.view.synced:
            return FilterAnswer.of(self._filtered(args, [], dict.fromkeys(names, NOT_SYNCED), {}), not_synced=True)
        # The pod is being scheduled (again): what an earlier cycle held for it must not count against it.
        self.view.drop_hold(args.Pod.key)
        self.view.expire_holds(time.monotonic())
        f = self._feasibility(args.Pod, req)
        frags = self._fragments()
        idx = self._indices(names)
        known = idx >= 0
        fits = np.zeros(len(names), dtype=bool)
        fits[known] = f.ok[idx[known]]
        passed_idx = idx[fits]
        if self.narrow and len(passed_idx):
            return self._narrowed(args, req, f, passed_idx)
        passed: list[str] = frags.names[passed_idx].tolist()
        self._passed = (self.view.ledger, passed, passed_idx)
        others = {names[i]: self.view.node_problem(names[i]) for i in np.flatnonzero(~known).tolist()}
        rejected = first_each(idx[known & ~fits], len(frags.names))  # a name given twice is answered once
        ids = frags.reasons(self.schedulers.placement(), req, f.usable, rejected)
        never = frags.never(ids)  # no eviction can help these
        if args.NodeNames is not None:
            others = {n: event_safe(r) for n, r in others.items()}
            body = frags.filter_body(passed_idx, rejected[~never], ids[~never], rejected[never], ids[never], others)
            return FilterAnswer(body, len(passed))
        failed = {frags.names[n]: frags.text(r) for n, r in zip(rejected.tolist(), ids.tolist(), strict=True)}
        unresolvable = others | {n: failed.pop(n) for n in frags.names[rejected[never]].tolist()}
        return FilterAnswer.of(self._filtered(args, passed, failed, unresolvable))

    def _not_placeable(self, pod: Pod) -> str:
        """Why a pod that asks for sharegpu cannot be placed by this extender at all ("" when it can): a share held
        for a pod without a name could never be bound or released by it, and another scheduler's pod would be placed
        only for its bind to be refused (the extenders of a KubeSchedulerConfiguration serve all its profiles)."""
        if not pod.metadata.name or not pod.metadata.namespace:
            return "the Pod in the request has no metadata.name or metadata.namespace"
        if pod.spec.scheduler_name != self.scheduler_name:
            return (
                f"its schedulerName is {pod.spec.scheduler_name or 'unset'}, not {self.scheduler_name}: sharegpu "
                f"places only the pods of its own scheduler (the sharegpu webhook sets it; is --scheduler-name the "
                f"scheduler profile's name?)"
            )
        return ""

    def _narrowed(self, args: ExtenderArgs, req: GpuRequest, f: _Feasible, passed_idx: IntArray) -> FilterAnswer:
        """Only the node the policy picks among those that fit, its share held for the bind. With one node left the
        kube-scheduler skips scoring (its own plugins and the prioritize call): with the extender's weight dominant
        it would pick that node anyway. Rejected nodes need no reason here: nobody reads them when the pod fits."""
        _, best = self._choose(args.Pod, req, f, first_each(passed_idx, len(self.view.ledger.nodes)))
        frags = self._fragments()
        if args.NodeNames is not None:
            return FilterAnswer(frags.filter_body(np.array([best]), *_NO_REJECTS, {}), 1)
        return FilterAnswer.of(self._filtered(args, [frags.names[best]], {}, {}))

    def _choose(self, pod: Pod, req: GpuRequest, f: _Feasible, cand: IntArray) -> tuple[IntArray, int]:
        """The policy's scores of candidate nodes ``cand`` (ledger indices, each once) and its pick, which is held
        for the pod's bind."""
        sched = self.schedulers.placement()
        scores = sched.scores(sched.cycle(req, f.usable), cand)
        best = sched.pick(cand, scores)
        self._hold(pod, req, best)
        self.on_chosen(pod)
        return scores, best

    @staticmethod
    def _filtered(
        args: ExtenderArgs, passed: list[str], failed: dict[str, str], unresolvable: dict[str, str]
    ) -> ExtenderFilterResult:
        if args.NodeNames is None and args.Nodes is not None:
            keep = set(passed)
            # exclude_unset: exactly the fields that came in (unknown ones included) go back out.
            nodes = args.Nodes.model_dump(mode="json", by_alias=True, exclude_unset=True)
            nodes["items"] = [n for n, name in zip(args.Nodes.items, args.Nodes.names(), strict=True) if name in keep]
            return ExtenderFilterResult(
                Nodes=nodes, FailedNodes=_readable(failed), FailedAndUnresolvableNodes=_readable(unresolvable)
            )
        return ExtenderFilterResult(
            NodeNames=passed, FailedNodes=_readable(failed), FailedAndUnresolvableNodes=_readable(unresolvable)
        )

    def _feasibility(self, pod: Pod, req: GpuRequest) -> _Feasible:
        view = self.view
        led = view.ledger
        key = (pod.metadata.uid or pod.key, pod.metadata.resource_version, view.generation)
        hit = self._feasible.get(key)
        if hit is not None:
            return hit
        ok, usable = self.schedulers.placement().feasible(req)
        f = _Feasible(req, ok, usable)
        assert led is view.ledger
        self._feasible[key] = f
        if len(self._feasible) > CACHE_SIZE:
            self._feasible.popitem(last=False)
        return f

    def _fragments(self) -> Fragments:
        self._frags = fragments_of(self._frags, self.view.ledger)
        return self._frags

    # ----- DRA steering ------------------------------------------------------------------------------------------
    def dra_filter(self, args: ExtenderArgs) -> ExtenderFilterResult:
        """The candidates a DRA pod keeps: the ``dra-steered`` pick, or all of them when steering cannot judge it.
        Never binds or reserves: the kube-scheduler allocates the claims on the node left and its binder binds."""
        names = _node_names(args)
        steering = self.schedulers.steering
        if steering is None:
            return self._filtered(args, names, {}, {})
        # The DRA pods' own shapes (the claims seen), unless the operator fixed the workload.
        synced = self.view.synced and not self.view.dra_unavailable
        s = steering.steer(args.Pod, names, self.schedulers.fixed_workload, synced)
        if s.assignment is not None:
            units = ", ".join(f"GPU {x.gpu_index}" for x in s.assignment.shares) or "no GPU"
            log.info("steered DRA pod %s to %s (%s, first fit: %s)", args.Pod.key, s.keep[0], s.why, units)
        elif args.Pod.spec.resource_claims:
            log.info("DRA pod %s not steered: %s", args.Pod.key, s.why)
        keep = set(s.keep)
        # Passed over, not failed: the scheduler's own filters found them able to host the pod.
        failed = {n: f"sharegpu steers this DRA pod to {s.keep[0]}" for n in names if n not in keep} if s.keep else {}
        return self._filtered(args, [n for n in names if n in keep], failed, {})

    # ----- prioritize ------------------------------------------------------------------------------------------
    def prioritize(self, args: ExtenderArgs) -> list[tuple[str, int]]:
        """(Host, Score) per node, in the order given: the HostPriorityList, as plain tuples."""
        names, _, scores = self._priorities(args)
        return list(zip(names, scores.tolist(), strict=True))

    def prioritize_answer(self, args: ExtenderArgs) -> bytes:
        """The HostPriorityList as sent."""
        names, idx, scores = self._priorities(args)
        return self._fragments().prioritize_body(names, idx, scores)

    def _priorities(self, args: ExtenderArgs) -> tuple[list[str], IntArray, IntArray]:
        """(names as given, their ledger indices (-1: not a sharegpu node), score per name)."""
        names = _node_names(args)
        try:
            req = self.view.request_of(args.Pod)
        except InvalidRequest:
            req = None
        idx = self._indices(names, "prioritize")
        if req is None or not self.view.synced or self._not_placeable(args.Pod):
            return names, idx, np.zeros(len(names), dtype=np.int64)
        # What a narrowed filter held for the pod must not count against it: prioritize decides again.
        self.view.drop_hold(args.Pod.key)
        f = self._feasibility(args.Pod, req)
        sched = self.schedulers.placement()
        known = idx >= 0
        fits = np.zeros(len(names), dtype=bool)
        fits[known] = f.ok[idx[known]]
        out = np.zeros(len(names), dtype=np.int64)
        cand = first_each(idx[fits], len(sched.ledger.nodes))  # node order, each node once (a name may repeat)
        if len(cand):
            scores, best = self._choose(args.Pod, req, f, cand)
            lo, hi = int(scores.min()), int(scores.max())
            top = MAX_EXTENDER_PRIORITY - 1
            # Others share 0..9 by score; only the policy's own pick gets 10.
            scaled = np.full(len(cand), top, dtype=np.int64) if hi == lo else (scores - lo) * top // (hi - lo)
            scaled[cand == best] = MAX_EXTENDER_PRIORITY
            by_node = np.zeros(len(sched.ledger.nodes), dtype=np.int64)
            by_node[cand] = scaled
            out[fits] = by_node[idx[fits]]
        return names, idx, out

    def _hold(self, pod: Pod, req: GpuRequest, node: int) -> None:
        """Hold what the policy would bind on its pick, so that the pods filtered before this one's bind see it
        taken (the kube-scheduler binds asynchronously)."""
        if not self.may_hold():
            return
        d = self.schedulers.placement().decide_on(req, node)
        if not isinstance(d, Decision):
            return
        try:
            self.view.hold(d.assignment, pod.metadata.uid, time.monotonic() + self.hold_s)
        except LedgerError as e:
            log.debug("pod %s: nothing held: %s", pod.key, e)

    def _indices(self, names: list[str], verb: str = "filter") -> IntArray:
        """Ledger indices of ``names`` (-1: not a sharegpu node). The scheduler sends the same list to every filter,
        and to prioritize the names that filter passed: both are remembered (comparing lists costs far less than
        looking every name up again). Filter's and prioritize's own lookups are kept apart (issue 34): a prioritize
        of a few names left filter's whole list to be looked up again at the next filter (0.9-1.7 ms at 10,000
        nodes)."""
        led = self.view.ledger
        for cached in (self._names, self._passed, self._prio_names):
            if cached is not None and cached[0] is led and (cached[1] is names or cached[1] == names):
                return cached[2]
        idx = np.array([led.index.get(n, -1) for n in names], dtype=np.int64)
        if verb == "filter":
            self._names = (led, names, idx)
        else:
            self._prio_names = (led, names, idx)
        return idx

    # ----- preempt ---------------------------------------------------------------------------------------------
    def preempt(self, args: ExtenderPreemptionArgs) -> ExtenderPreemptionResult:
        """Keep the nodes where evicting the victims frees room for the pod (checked on the real ledger, undone)."""
        try:
            req = self.view.request_of(args.Pod)
        except InvalidRequest:
            return ExtenderPreemptionResult()
        victims: dict[str, MetaVictims] = {}
        if args.NodeNameToMetaVictims is not None:
            victims = dict(args.NodeNameToMetaVictims)
        elif args.NodeNameToVictims is not None:
            victims = {
                node: MetaVictims.model_validate(
                    {"Pods": [{"UID": p.metadata.uid} for p in v.Pods], "NumPDBViolations": v.NumPDBViolations}
                )
                for node, v in args.NodeNameToVictims.items()
            }
        if req is None:
            return ExtenderPreemptionResult(NodeNameToMetaVictims=victims)
        if not self.view.synced:
            return ExtenderPreemptionResult()
        led = self.view.ledger
        by_uid = self.view.pod_keys_by_uid()
        kept: dict[str, MetaVictims] = {}
        sched = self.schedulers.placement()
        for node, mv in victims.items():
            n = led.index.get(node)
            if n is None:
                continue
            # Each victim once (a body may name one twice), and only those the ledger holds now.
            keys = list(dict.fromkeys(by_uid[p.UID] for p in mv.Pods if p.UID in by_uid))
            released: list[Assignment] = []
            try:
                for k in keys:
                    if k in led.assignments:
                        released.append(led.release(k))
                ok, _ = sched.feasible(req)
                fits = bool(ok[n])
            finally:
                # Exactly what was released goes back, as it was (health is not checked again: it holds already).
                for a in reversed(released):
                    led.place(a, check_health=False)
            # A node that needs no victim is left out: the kube-scheduler's callExtenders takes a candidate without
            # victims for an error, and the pod fits there at its next attempt anyway (as once the extender's own
            # preemption holds room for it).
            if fits and mv.Pods:
                unique = list({v.UID: v for v in mv.Pods}.values())
                kept[node] = mv if len(unique) == len(mv.Pods) else mv.model_copy(update={"Pods": unique})
        self.view.generation += 1  # the ledger is as it was, but its node versions moved
        return ExtenderPreemptionResult(NodeNameToMetaVictims=kept)


def _readable(reasons: dict[str, str]) -> dict[str, str]:
    return {node: event_safe(r) for node, r in reasons.items()}


def _shown(pod: Pod) -> str:
    return f"pod {pod.key}" if pod.metadata.name else "a pod without a name"


def _node_names(args: ExtenderArgs) -> list[str]:
    if args.NodeNames is not None:
        return args.NodeNames  # read, never changed: the very list object lets _indices know it again
    if args.Nodes is not None:
        return args.Nodes.names()
    return []
