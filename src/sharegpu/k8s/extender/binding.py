"""The extender's bind: take the held share (or decide on the chosen node), reserve it in the view's assume cache
(synchronously, so a concurrent bind sees the reservation), then create the Binding, which writes ``spec.nodeName``
and the ``sharegpu.io/assignment`` annotation in one request, under the pod's UID and resourceVersion.

A reservation is released only when the pod is known not to be bound: a lost answer or a conflict is settled by
reading the pod back, and a bind whose outcome stays unknown is settled in the background — by fencing the lost
Binding (an annotation written under the resourceVersion it carried as its precondition, so that it can never
apply) or by the watch showing the pod.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from sharegpu.k8s.cache.assume import Outcome, Phase
from sharegpu.k8s.cache.view import NOT_SYNCED, ClusterView
from sharegpu.k8s.extender.answers import event_safe
from sharegpu.k8s.extender.schedulers import Schedulers
from sharegpu.kube.api import ClusterApi
from sharegpu.kube.errors import Conflict, KubeError, NotFound, Unavailable
from sharegpu.kube.names import InvalidName, check_name
from sharegpu.kube.schema import ExtenderBindingArgs, ExtenderBindingResult, Pod
from sharegpu.ledger import LedgerError
from sharegpu.model.assignment import Assignment
from sharegpu.model.contract import ASSIGNMENT_ANNOTATION, DEFAULT_SCHEDULER_NAME, FENCE_ANNOTATION, GPU_RESOURCE
from sharegpu.model.request import InvalidRequest
from sharegpu.placement.framework import Decision

log = logging.getLogger(__name__)

NOT_LEADER = "this sharegpu extender replica is not the leader; only the leader binds (the scheduler retries)"
SENT_PODS = 256  # pods the scheduler sent that are kept for their bind
BIND_ATTEMPTS = 3  # Bindings sent for one bind call (a lost answer or a stale version is retried)
READ_BACK_ATTEMPTS = 3
READ_BACK_BACKOFF_S = 0.2


class Binder:
    """Binds the pods the decisions placed, one Binding at a time per pod, and settles what it reserved."""

    def __init__(
        self,
        view: ClusterView,
        api: ClusterApi | None,
        schedulers: Schedulers,
        scheduler_name: str = DEFAULT_SCHEDULER_NAME,
        is_leader: Callable[[], bool] = lambda: True,
    ) -> None:
        self.view = view
        self.schedulers = schedulers  # the decisions' (a bind on a node the filter did not pick decides there)
        self.api = api
        self.scheduler_name = scheduler_name  # binds only pods of this scheduler that ask for sharegpu
        self.is_leader = is_leader  # only the leader binds
        self._settlers: set[asyncio.Future[None]] = set()
        # The Pods the scheduler sent to prioritize, for their bind: in a burst the watch may not have delivered a
        # pod yet when its bind comes, and reading it from the API server cost a round trip per such bind.
        self._sent: OrderedDict[str, Pod] = OrderedDict()

    def remember(self, pod: Pod) -> None:
        """Keep the Pod the scheduler sent with a decision, for its bind."""
        self._sent[pod.key] = pod
        self._sent.move_to_end(pod.key)
        if len(self._sent) > SENT_PODS:
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

    async def bind(self, args: ExtenderBindingArgs) -> ExtenderBindingResult:
        try:
            # The names go into API paths (and the node into the Binding): checked before anything else is done.
            check_name("namespace", args.PodNamespace)
            check_name("pod", args.PodName)
            check_name("node", args.Node)
        except InvalidName as e:
            return ExtenderBindingResult(Error=f"cannot bind: {e}")
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
            await self.settle_unknown(key)
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
            req = self.view.request_of(pod)
        except InvalidRequest as e:
            return ExtenderBindingResult(Error=f"cannot bind {key}: {e}")
        if req is None or not req.wants_gpu:
            # sharegpu.io/gpu: 0 names a resource but asks for nothing: bound, it would carry an assignment of no GPU.
            what = "no sharegpu.io resource" if req is None else f"{GPU_RESOURCE}: 0 (no GPU)"
            return ExtenderBindingResult(
                Error=f"cannot bind {key}: it asks for {what}; the sharegpu extender binds only pods that ask for at "
                f"least one GPU (ask for {GPU_RESOURCE}: 1 or more, or drop the sharegpu.io resources)"
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
            d = self.schedulers.placement().decide_on(req, n)
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

    async def settle_unknown(self, key: str) -> None:
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
                await self.settle_unknown(key)
                delay = min(delay * 2, 30.0)

        task = asyncio.ensure_future(settle_until_known())
        self._settlers.add(task)
        task.add_done_callback(self._settlers.discard)


def _newer(a: str, b: str) -> bool:
    """Whether resourceVersion ``a`` is newer than ``b`` (integers, as every API server writes them; otherwise not
    compared)."""
    try:
        return int(a) > int(b)
    except ValueError:
        return False
