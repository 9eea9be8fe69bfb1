"""The kube-scheduler extender: filter, prioritize, bind and preempt over HTTP, on the simulator's ledger and policies.

Protocol: k8s.io/kube-scheduler/extender/v1 (see :mod:`sharegpu.kube.schema`), JSON over HTTP POST to
``<urlPrefix>/<verb>``. Works with ``nodeCacheCapable: true`` (node names in, node names out) and ``false``
(whole Node objects in, the passing ones out, unchanged).

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
- bind: take the held share (or decide on the chosen node), reserve it in the ledger (synchronously, so a
  concurrent bind sees the reservation), then create the Binding, which writes ``spec.nodeName`` and the
  ``sharegpu.io/assignment`` annotation in one request, under the pod's UID and resourceVersion. A reservation is
  released only when the pod is known not to be bound: a lost answer is settled by reading the pod back.
- preempt: keep only the nodes where evicting the proposed victims really frees room for the pod.
- dra/filter (steering, when on): for a pod whose GPUs come from DRA claims, keep only the node the ``dra-steered``
  policy picks (see :mod:`sharegpu.k8s.dra_steer`); a second extender entry of the scheduler profile, filter only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from sharegpu.k8s.answers import FilterAnswer, Fragments, event_safe, first_each, fragments_of
from sharegpu.k8s.assume import Outcome, Phase
from sharegpu.k8s.body_limit import EXTENDER_MAX_BODY, BodyLimit
from sharegpu.k8s.cluster_metrics import ClusterMetrics  # issue 10
from sharegpu.k8s.dra_steer import DraState, follow_dra
from sharegpu.k8s.leader import LeaderElector
from sharegpu.k8s.pod_request import pod_request
from sharegpu.k8s.tls import ServerTls
from sharegpu.k8s.view import ClusterView
from sharegpu.kube.api import ClusterApi
from sharegpu.kube.client import KubeClient
from sharegpu.kube.errors import Conflict, KubeError, NotFound, Unavailable
from sharegpu.kube.schema import (
    MAX_EXTENDER_PRIORITY,
    ExtenderArgs,
    ExtenderBindingArgs,
    ExtenderBindingResult,
    ExtenderFilterResult,
    ExtenderPreemptionArgs,
    ExtenderPreemptionResult,
    MetaVictims,
    Pod,
)
from sharegpu.ledger import Ledger, LedgerError
from sharegpu.model.assignment import Assignment
from sharegpu.model.contract import ASSIGNMENT_ANNOTATION, DEFAULT_SCHEDULER_NAME, FENCE_ANNOTATION
from sharegpu.model.request import GpuRequest, InvalidRequest
from sharegpu.placement.framework import BoolArray, CycleState, Decision, IntArray

log = logging.getLogger(__name__)

NOT_SYNCED = "sharegpu has lost the API server and is reconnecting; no new placements until its view is back in sync"
NOT_LEADER = "this sharegpu extender replica is not the leader; only the leader binds (the scheduler retries)"
NO_NODES = (
    "the filter request names no nodes: it has neither NodeNames (nodeCacheCapable: true) nor Nodes "
    "(nodeCacheCapable: false)"
)
CACHE_SIZE = 256
HOLD_S = 10.0  # how long prioritize's choice stays held for the pod's bind
BIND_ATTEMPTS = 3  # Bindings sent for one bind call (a lost answer or a stale version is retried)
READ_BACK_ATTEMPTS = 3
READ_BACK_BACKOFF_S = 0.2
# Written, under the resourceVersion a lost Binding carried as its precondition, to move the pod past that version.


_NONE = np.zeros(0, dtype=np.int64)
_NO_REJECTS = (_NONE, np.zeros(0, dtype=np.int32), _NONE, np.zeros(0, dtype=np.int32))


@dataclass(frozen=True, slots=True)
class _Feasible:
    request: GpuRequest
    ok: BoolArray
    usable: BoolArray


class Extender:
    def __init__(
        self,
        view: ClusterView,
        api: ClusterApi | None,
        scheduler_name: str = DEFAULT_SCHEDULER_NAME,
        is_leader: Callable[[], bool] = lambda: True,
        hold_s: float = HOLD_S,
        metrics: ClusterMetrics | None = None,  # issue 10
        dra: DraState | None = None,
        narrow: bool = True,
    ) -> None:
        self.view = view
        self.narrow = narrow  # filter leaves only the policy's pick (see _narrowed)
        self.dra = dra  # DRA steering's state (None: steering off, /dra/filter passes every node)
        self.metrics = metrics or ClusterMetrics(view)  # issue 10: recorded by the HTTP layer (make_app)
        self.api = api
        self.scheduler_name = scheduler_name  # /bind binds only pods of this scheduler that ask for sharegpu
        self.is_leader = is_leader  # only the leader holds and binds
        self.hold_s = hold_s
        self._settlers: set[asyncio.Future[None]] = set()
        # Filter's feasibility, reused by the prioritize call of the same cycle while the ledger is unchanged.
        self._feasible: OrderedDict[tuple[str, str, int], _Feasible] = OrderedDict()
        self._names: tuple[Ledger, list[str], IntArray] | None = None
        self._passed: tuple[Ledger, list[str], IntArray] | None = None  # what the last filter passed
        self._frags: Fragments | None = None  # the answers' JSON pieces, per ledger
        # The Pods the scheduler sent to prioritize, for their bind: in a burst the watch may not have delivered a
        # pod yet when its bind comes, and reading it from the API server cost a round trip per such bind.
        self._sent: OrderedDict[str, Pod] = OrderedDict()

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
            req = pod_request(args.Pod, self.view.catalog)
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
        ids = frags.reasons(self.view.scheduler(), req, f.usable, rejected)
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
        sched = self.view.scheduler()
        scores = sched.scores(CycleState(req, f.usable, sched.rng), cand)
        best = sched.pick(cand, scores)
        self._hold(pod, req, best)
        self._remember(pod)
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
        ok, usable = view.scheduler().feasible(req)
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
        if self.dra is None:
            return self._filtered(args, names, {}, {})
        # The DRA pods' own shapes (the claims seen), unless the operator fixed the workload.
        s = self.dra.steer(args.Pod, names, self.view.fixed_workload)
        if s.assignment is not None:
            units = ", ".join(f"GPU {x.gpu_index}" for x in s.assignment.shares) or "no GPU"
            log.info("steered DRA pod %s to %s (%s, first fit: %s)", args.Pod.key, s.keep[0], s.why, units)
        elif args.Pod.spec.model_extra and args.Pod.spec.model_extra.get("resourceClaims"):
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
            req = pod_request(args.Pod, self.view.catalog)
        except InvalidRequest:
            req = None
        idx = self._indices(names)
        if req is None or not self.view.synced or self._not_placeable(args.Pod):
            return names, idx, np.zeros(len(names), dtype=np.int64)
        # What a narrowed filter held for the pod must not count against it: prioritize decides again.
        self.view.drop_hold(args.Pod.key)
        f = self._feasibility(args.Pod, req)
        sched = self.view.scheduler()
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

    def _remember(self, pod: Pod) -> None:
        self._sent[pod.key] = pod
        self._sent.move_to_end(pod.key)
        if len(self._sent) > CACHE_SIZE:
            self._sent.popitem(last=False)

    def _known_pod(self, key: str, uid: str) -> Pod | None:
        """The newest copy of pod ``key`` (of UID ``uid``, when given) that the watch or the scheduler gave: None
        when neither has one. An old copy is harmless: the Binding carries its resourceVersion as a precondition,
        so a pod that changed since is read back and bound again at its current version."""
        best: Pod | None = None
        for pod in (self.view.pod(key), self._sent.get(key)):
            if pod is None or (uid and pod.metadata.uid != uid):
                continue
            if best is None or _newer(pod.metadata.resource_version, best.metadata.resource_version):
                best = pod
        return best

    def _hold(self, pod: Pod, req: GpuRequest, node: int) -> None:
        """Hold what the policy would bind on its pick, so that the pods filtered before this one's bind see it
        taken (the kube-scheduler binds asynchronously)."""
        if self.api is None or not self.is_leader():
            return
        d = self.view.scheduler().decide_on(req, node)
        if not isinstance(d, Decision):
            return
        try:
            self.view.hold(d.assignment, pod.metadata.uid, time.monotonic() + self.hold_s)
        except LedgerError as e:
            log.debug("pod %s: nothing held: %s", pod.key, e)

    def _indices(self, names: list[str]) -> IntArray:
        """Ledger indices of ``names`` (-1: not a sharegpu node). The scheduler sends the same list to every filter,
        and to prioritize the names that filter passed: both are remembered (comparing lists costs far less than
        looking every name up again)."""
        led = self.view.ledger
        for cached in (self._names, self._passed):
            if cached is not None and cached[0] is led and cached[1] == names:
                return cached[2]
        idx = np.array([led.index.get(n, -1) for n in names], dtype=np.int64)
        self._names = (led, names, idx)
        return idx

    # ----- bind ------------------------------------------------------------------------------------------------
    async def bind(self, args: ExtenderBindingArgs) -> ExtenderBindingResult:
        key = f"{args.PodNamespace}/{args.PodName}"
        if self.api is None:
            return ExtenderBindingResult(Error="this extender has no API server connection to bind with")
        if not self.is_leader():
            return ExtenderBindingResult(Error=f"cannot bind {key}: {NOT_LEADER}")
        if not self.view.synced:
            return ExtenderBindingResult(Error=f"cannot bind {key}: {NOT_SYNCED}")
        self.view.expire_holds(time.monotonic())
        if self.view.phase(key) in (Phase.BINDING, Phase.UNKNOWN):
            # An earlier bind of this pod has not settled; settle it before anything else is decided for the pod.
            await self._settle_unknown(key)
            phase = self.view.phase(key)
            if phase is not None and phase is not Phase.HELD:
                return ExtenderBindingResult(
                    Error=f"cannot bind {key}: an earlier bind of it is {phase.value} and not settled yet (its outcome "
                    "is unknown and not settled); the scheduler retries"
                )
        # The watch's (or the scheduler's) copy spares a round trip; a pod neither has, or one that may have been
        # replaced or bound, is read.
        pod = self._known_pod(key, args.PodUID)
        self._sent.pop(key, None)
        if pod is None or pod.spec.node_name:
            try:
                pod = await self.api.get_pod(args.PodNamespace, args.PodName)
            except KubeError as e:
                return ExtenderBindingResult(Error=f"cannot bind {key}: {e}")
        refused = self._refuse(key, args, pod)
        if refused:
            self.view.drop_hold(key)
            return ExtenderBindingResult(Error=f"cannot bind {key}: {refused}")
        try:
            req = pod_request(pod, self.view.catalog)
        except InvalidRequest as e:
            return ExtenderBindingResult(Error=f"cannot bind {key}: {e}")
        if req is None:
            return ExtenderBindingResult(
                Error=f"cannot bind {key}: it asks for no sharegpu.io resource; the sharegpu extender binds only pods "
                "that do"
            )
        # From here to reserve() nothing awaits: the decision and the reservation see one ledger state.
        held = self.view.held(key)
        if held is not None and held.node == args.Node:
            a = held  # what prioritize chose and held for this pod on this node
        else:
            self.view.drop_hold(key)
            n = self.view.ledger.index.get(args.Node)
            if n is None:
                return ExtenderBindingResult(Error=f"cannot bind {key}: {self.view.node_problem(args.Node)}")
            d = self.view.scheduler().decide_on(req, n)
            if not isinstance(d, Decision):
                return ExtenderBindingResult(Error=f"cannot bind {key}: {event_safe(d.reason)}")
            a = d.assignment
        try:
            self.view.reserve(a, pod.metadata.uid)
        except LedgerError as e:
            return ExtenderBindingResult(Error=f"cannot bind {key}: {e}")
        return await self._bind(key, pod, a)

    def _refuse(self, key: str, args: ExtenderBindingArgs, pod: Pod) -> str:
        if args.PodUID and pod.metadata.uid and pod.metadata.uid != args.PodUID:
            return f"it was replaced (UID {pod.metadata.uid})"
        if pod.spec.node_name:
            return f"it is already bound to {pod.spec.node_name}"
        if pod.spec.scheduler_name != self.scheduler_name:
            # The extender binds only what its own scheduler placed: its pods/binding permission is cluster-wide.
            return (
                f"its schedulerName is {pod.spec.scheduler_name or 'unset'}, not {self.scheduler_name}; the sharegpu "
                "extender binds only the pods of its scheduler"
            )
        return ""

    async def _bind(self, key: str, pod: Pod, a: Assignment) -> ExtenderBindingResult:
        """Write the Binding (node and assignment annotation in one request) and settle the reservation.

        Every Binding carries the pod's UID and resourceVersion as preconditions, so at most one Binding sent at a
        given version can apply, and none can once the pod changed. A lost answer or a conflict is settled by
        reading the pod back: bound with this assignment (done), bound otherwise or gone (failed), or unbound (bind
        again at its current version). What cannot be read back stays reserved (UNKNOWN) until it can.
        """
        assert self.api is not None
        ns, name, uid = pod.metadata.namespace, pod.metadata.name, pod.metadata.uid
        annotation = {ASSIGNMENT_ANNOTATION: a.to_json()}
        rv = pod.metadata.resource_version
        lost_rv = ""  # the version of a Binding whose answer was lost and that may still apply
        for _ in range(BIND_ATTEMPTS):
            try:
                await self.api.bind_pod(ns, name, uid, a.node, annotation, rv)
            except (Unavailable, Conflict) as e:
                if isinstance(e, Unavailable):
                    lost_rv = rv
                    log.warning("pod %s: the answer to its Binding was lost (%s); reading it back", key, e)
                judged, judged_why, fresh = await self._read_back(key, uid, a)
                if judged is not None:
                    outcome, why = judged, judged_why
                    break
                if fresh is None:  # cannot be read back
                    outcome, why = (Outcome.UNKNOWN, judged_why) if lost_rv else (Outcome.FAILED, str(e))
                    break
                rv = fresh.metadata.resource_version  # unbound, the same pod: bind again at its current version
                if rv != lost_rv:
                    lost_rv = ""  # the pod moved past the lost Binding's precondition: that one never applies
            except KubeError as e:
                outcome, why = (Outcome.UNKNOWN, str(e)) if lost_rv else (Outcome.FAILED, str(e))
                break
            else:
                outcome, why = Outcome.BOUND, ""
                break
        else:
            if lost_rv:
                outcome, why = Outcome.UNKNOWN, "the API server's answers to its Binding were lost"
            else:
                outcome, why = Outcome.FAILED, "it kept changing while being bound; the scheduler retries"
        self.view.settle(key, outcome, rv=lost_rv)
        if outcome is Outcome.BOUND:
            units = ", ".join(f"{s.gpu_uuid}{'/' + s.mig.profile if s.mig else ''} ({s.sharing})" for s in a.shares)
            log.info("bound %s to %s: %s", key, a.node, units or "no GPU")
            return ExtenderBindingResult()
        if outcome is Outcome.UNKNOWN:
            log.warning("pod %s: bind outcome unknown; its GPUs stay reserved until it is settled: %s", key, why)
            self._spawn_settler(key)
        return ExtenderBindingResult(Error=f"cannot bind {key}: {event_safe(why)}")

    async def _read_back(self, key: str, uid: str, a: Assignment) -> tuple[Outcome | None, str, Pod | None]:
        """The pod as it is now, judged against the Binding of ``a``: (BOUND | FAILED, why, pod) when that settles
        the bind, (None, "", pod) when the pod is unbound and may be bound again, (None, why, None) when it cannot be
        read."""
        assert self.api is not None
        ns, _, name = key.partition("/")
        why = ""
        for attempt in range(READ_BACK_ATTEMPTS):
            if attempt:
                await asyncio.sleep(READ_BACK_BACKOFF_S * attempt)
            try:
                pod = await self.api.get_pod(ns, name)
            except NotFound:
                return Outcome.FAILED, "it was deleted", None
            except KubeError as e:
                why = str(e)
                continue
            if uid and pod.metadata.uid and pod.metadata.uid != uid:
                return Outcome.FAILED, f"it was replaced (UID {pod.metadata.uid})", pod
            if pod.spec.node_name:
                if pod.spec.node_name == a.node and pod.metadata.annotations.get(ASSIGNMENT_ANNOTATION) == a.to_json():
                    return Outcome.BOUND, "", pod
                return Outcome.FAILED, f"it is already bound to {pod.spec.node_name}", pod
            if pod.finished:
                return Outcome.FAILED, "it has finished", pod
            return None, "", pod
        return (
            None,
            (
                f"the API server did not confirm the Binding to {a.node} and the pod cannot be read back ({why}); its "
                "GPUs stay reserved until the pod is seen bound, changed or deleted"
            ),
            None,
        )

    async def _settle_unknown(self, key: str) -> None:
        """Settle a bind whose outcome is unknown: read the pod back and, if it is still unbound at the version the
        lost Binding was sent at, move it past that version (an annotation written under that precondition) so that
        the Binding can never apply. The watch may settle it first."""
        assert self.api is not None
        a, uid, rv = self.view.unknown(key)
        if a is None:
            return
        ns, _, name = key.partition("/")
        outcome, _, pod = await self._read_back(key, uid, a)
        if outcome is None and pod is not None:
            if pod.metadata.resource_version != rv:
                outcome = Outcome.FAILED  # changed past the lost Binding's precondition: it can never apply
            else:
                try:
                    pod = await self.api.patch_pod_annotations(ns, name, {FENCE_ANNOTATION: rv}, rv)
                    outcome = Outcome.FAILED
                except KubeError as e:
                    log.info("pod %s: cannot fence its lost Binding yet: %s", key, e)
        if outcome is not None and self.view.phase(key) is Phase.UNKNOWN:
            self.view.settle(key, outcome, pod=pod, rv=rv)
            log.info("pod %s: its bind of unknown outcome settled: %s", key, outcome.value)

    def _spawn_settler(self, key: str) -> None:
        async def settle_until_known() -> None:
            delay = 1.0
            while self.view.phase(key) is Phase.UNKNOWN:
                await asyncio.sleep(delay)
                await self._settle_unknown(key)
                delay = min(delay * 2, 30.0)

        task = asyncio.ensure_future(settle_until_known())
        self._settlers.add(task)
        task.add_done_callback(self._settlers.discard)

    # ----- preempt ---------------------------------------------------------------------------------------------
    def preempt(self, args: ExtenderPreemptionArgs) -> ExtenderPreemptionResult:
        """Keep the nodes where evicting the victims frees room for the pod (checked on the real ledger, undone)."""
        try:
            req = pod_request(args.Pod, self.view.catalog)
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
        sched = self.view.scheduler()
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
            if fits:
                unique = list({v.UID: v for v in mv.Pods}.values())
                kept[node] = mv if len(unique) == len(mv.Pods) else mv.model_copy(update={"Pods": unique})
        self.view.generation += 1  # the ledger is as it was, but its node versions moved
        return ExtenderPreemptionResult(NodeNameToMetaVictims=kept)


def _readable(reasons: dict[str, str]) -> dict[str, str]:
    return {node: event_safe(r) for node, r in reasons.items()}


def _newer(a: str, b: str) -> bool:
    """Whether resourceVersion ``a`` is newer than ``b`` (integers, as every API server writes them; otherwise not
    compared)."""
    try:
        return int(a) > int(b)
    except ValueError:
        return False


def _shown(pod: Pod) -> str:
    return f"pod {pod.key}" if pod.metadata.name else "a pod without a name"


def _node_names(args: ExtenderArgs) -> list[str]:
    if args.NodeNames is not None:
        return list(args.NodeNames)
    if args.Nodes is not None:
        return args.Nodes.names()
    return []


# ----- HTTP ------------------------------------------------------------------------------------------------------
def _json(answer: BaseModel | FilterAnswer | bytes) -> Response:
    if isinstance(answer, bytes):
        body = answer
    elif isinstance(answer, FilterAnswer):
        body = answer.body
    else:
        body = answer.model_dump_json().encode()
    return Response(body, media_type="application/json")


def _bad_request(e: ValidationError | ValueError, verb: str) -> Response:
    if isinstance(e, ValidationError):
        errors = "; ".join(f"{'.'.join(str(x) for x in err['loc']) or 'body'}: {err['msg']}" for err in e.errors()[:5])
    else:
        errors = str(e)
    return JSONResponse({"error": f"malformed {verb} request: {errors}"}, status_code=400)


def make_app(extender: Extender, max_request_bytes: int = EXTENDER_MAX_BODY) -> Starlette:
    def verb(
        name: str, model: type[BaseModel], handle: Callable[[BaseModel], Awaitable[BaseModel | FilterAnswer | bytes]]
    ) -> Route:
        async def endpoint(request: Request) -> Response:
            body = await request.body()
            t0 = time.perf_counter()  # issue 10
            try:
                args = model.model_validate_json(body)
            except (ValidationError, ValueError) as e:
                extender.metrics.error(name, 400)  # issue 10
                return _bad_request(e, name)
            try:
                result = await handle(args)
                extender.metrics.record(name, args, result, time.perf_counter() - t0)  # issue 10
                return _json(result)
            except Exception as e:  # a bug must not take the scheduler's extender down: report, keep serving
                log.exception("%s failed", name)
                extender.metrics.error(name, 500)  # issue 10
                return JSONResponse({"error": f"{name} failed: {type(e).__name__}: {e}"}, status_code=500)

        return Route(f"/{name}", endpoint, methods=["POST"])

    async def do_filter(a: BaseModel) -> FilterAnswer:
        assert isinstance(a, ExtenderArgs)
        return extender.filter_answer(a)

    async def do_prioritize(a: BaseModel) -> bytes:
        assert isinstance(a, ExtenderArgs)
        return extender.prioritize_answer(a)

    async def do_bind(a: BaseModel) -> BaseModel:
        assert isinstance(a, ExtenderBindingArgs)
        return await extender.bind(a)

    async def do_dra_filter(a: BaseModel) -> BaseModel:
        assert isinstance(a, ExtenderArgs)
        return extender.dra_filter(a)

    async def do_preempt(a: BaseModel) -> BaseModel:
        assert isinstance(a, ExtenderPreemptionArgs)
        return extender.preempt(a)

    async def healthz(request: Request) -> Response:
        return Response("ok\n", media_type="text/plain")

    async def readyz(request: Request) -> Response:
        # Behind the Service, only the leader is ready: the scheduler's calls reach the one replica that binds.
        if not extender.is_leader():
            return Response(NOT_LEADER + "\n", status_code=503, media_type="text/plain")
        if extender.view.synced:
            return Response("in sync\n", media_type="text/plain")
        return Response(NOT_SYNCED + "\n", status_code=503, media_type="text/plain")

    return Starlette(
        routes=[
            verb("filter", ExtenderArgs, do_filter),
            verb("prioritize", ExtenderArgs, do_prioritize),
            verb("bind", ExtenderBindingArgs, do_bind),
            verb("preempt", ExtenderPreemptionArgs, do_preempt),
            verb("dra/filter", ExtenderArgs, do_dra_filter),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
        ],
        middleware=[Middleware(BodyLimit, max_bytes=max_request_bytes, what="extender request")],
    )


async def run_extender(
    view: ClusterView,
    api: ClusterApi,
    host: str,
    port: int,
    stop: asyncio.Event | None = None,
    scheduler_name: str = DEFAULT_SCHEDULER_NAME,
    elector: LeaderElector | None = None,
    tls: ServerTls | None = None,
    health: tuple[str, int] | None = None,
    max_request_bytes: int = EXTENDER_MAX_BODY,
    metrics_listen: tuple[str, int] | None = None,  # issue 10
    dra_client: KubeClient | None = None,
) -> None:
    """Serve the extender (over mutual TLS with ``tls``; ``health``: a plain-HTTP port with only the probes) and
    follow the API server until ``stop`` (or SIGTERM/SIGINT); raises OSError when a port cannot be bound. With an
    ``elector``, only while it holds the Lease does this replica hold, bind and report ready."""
    from sharegpu.k8s.serving import Listener, Site, probes_only, serve

    stop = stop or asyncio.Event()
    dra = DraState(view.catalog, view.seed) if dra_client is not None else None
    extender = Extender(view, api, scheduler_name, is_leader=elector.is_leader if elector else lambda: True, dra=dra)
    app = make_app(extender, max_request_bytes)
    sites = [Site(app, Listener(host, port, tls), "scheduler extender")]
    if health is not None:
        sites.append(Site(probes_only(app), Listener(*health), "health probes"))
    if metrics_listen:  # issue 10: /metrics on its own port (a busy port fails the start with an OSError)
        sites.append(Site(extender.metrics.app(), Listener(*metrics_listen), "metrics"))
    tasks = [asyncio.ensure_future(view.follow(api, stop))]
    if dra is not None and dra_client is not None:
        tasks.append(asyncio.ensure_future(follow_dra(dra, dra_client, stop)))
    if elector is not None:

        def changed(leader: bool) -> None:
            extender.metrics.set_leader(leader)
            if leader:
                view.resync()  # bind only on a ledger listed after the previous leader stopped
            else:
                view.drop_holds()

        elector.on_change = changed
        tasks.append(asyncio.ensure_future(elector.run(stop)))
    try:
        await serve(sites, stop)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await api.close()
        if dra_client is not None:
            await dra_client.close()
