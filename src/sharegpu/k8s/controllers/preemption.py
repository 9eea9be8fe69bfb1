"""Preemption for GPU shortfalls in the running system (issue 19): the extender's leader evicts lower-priority pods so
that a pending pod that fits nowhere for GPU room gets it, and holds the freed room for that pod.

The kube-scheduler cannot do this itself: it counts ``sharegpu.io/gpu`` as opaque tokens, so a pod short of GPU
memory, compute, MIG slots or whole GPUs finds no victims in its own preemption. This controller runs beside the
extender, on its ledger, every ``interval_s`` while its replica is the leader:

1. candidates: pods of this scheduler that ask for sharegpu, are unbound, were refused by the scheduler
   (``PodScheduled=False``, reason ``Unschedulable``) and fit on no node for GPU room now (the ``gpu-busy`` class of
   :func:`sharegpu.k8s.pending.pending_pods`, the same judgement ``sharegpu status`` shows); highest
   ``spec.priority`` first; ``preemptionPolicy: Never`` waits instead;
2. plan with :func:`sharegpu.placement.preemption.plan_preemption` on the ledger as it will be once what is already
   leaving has left (terminating pods gone, earlier reservations placed), so that two preemptors never count on the
   same freed room and a pod already terminating is never chosen again; facts from the API objects (priorities,
   start times, PodDisruptionBudgets, whose ``disruptionsAllowed`` is counted down across the victims of one node as
   the kube-scheduler does, so that a node whose victims break no budget is preferred);
3. evict the victims through the Eviction API (a plan whose victims would break a budget is not started; a budget
   that refuses anyway, 429, ends the plan: recorded, retried after a back-off), set the preemptor's
   ``status.nominatedNodeName``, write Events and count metrics;
4. reserve: while the victims terminate they keep their share in the ledger (a terminating pod holds its
   assignment until it is deleted or finishes), so nothing else can be placed there; the moment the last one is
   gone (:meth:`PreemptionController.settle`, called by the view on every pod change, before any later filter can
   run) the room is held for the preemptor in the view (a HELD reservation, as filter's own), until it binds or
   ``reserve_s`` passes. The preemptor's own filter drops its hold first and so sees the room; any other pod's does
   not. The reservations themselves are kept by :mod:`sharegpu.k8s.controllers.reservations`; this module plans, evicts,
   nominates, tells (Events, metrics) and adopts.

Only the leader acts; reservations live in this process, and a new leader adopts a preemption in progress from the
API server's objects alone (a pending pod nominated to a node where lower-priority pods terminate).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from sharegpu.k8s.cache.view import ClusterView
from sharegpu.k8s.controllers.budgets import budget_violations, more_important_first, spend_budgets
from sharegpu.k8s.controllers.reservations import Reservation, Reservations, Settled
from sharegpu.k8s.extender.schedulers import Schedulers
from sharegpu.k8s.pending import pending_pods
from sharegpu.kube.api import DisruptionApi, DisruptionBudget, PodEvent
from sharegpu.kube.errors import EvictionBlocked, KubeError, NotFound
from sharegpu.kube.schema import ExtenderArgs, Pod
from sharegpu.ledger import Ledger
from sharegpu.model.assignment import Assignment
from sharegpu.model.contract import DEFAULT_SCHEDULER_NAME
from sharegpu.placement.preemption import (
    PodFacts,
    PreemptionError,
    PreemptionPlan,
    PreemptionPolicy,
    Preemptor,
    kube_candidate_limit,
    plan_preemption,
)
from sharegpu.placement.reasons import ReasonKind

log = logging.getLogger(__name__)

COMPONENT = "sharegpu-preemption"
# A priority no preemptor reaches (pod priorities are int32): pods that must never be chosen as victims (already
# terminating, not bound yet, or held for another preemptor) are given it in the planner's facts.
EXEMPT = 2**31


class Outcome(StrEnum):
    """``outcome`` of ``sharegpu_preemptions_total``."""

    PREEMPTED = "preempted"  # victims evicted, room reserved on the nominated node
    ADOPTED = "adopted"  # room already on its way (pods terminating there): reserved without evicting
    BLOCKED = "blocked"  # a PodDisruptionBudget refused an eviction: the plan was given up
    FAILED = "failed"  # the API server refused or could not be reached
    NO_ROOM = "no_room"  # no node where evicting lower-priority pods makes it fit
    NEVER = "never"  # preemptionPolicy Never: it waits
    BOUND = "bound"  # a preemptor bound after its preemption
    EXPIRED = "expired"  # a reservation lapsed: victims never left, or the preemptor never came to bind


@dataclass(frozen=True)
class PreemptionConfig:
    interval_s: float = 2.0  # between two rounds
    reserve_s: float = 60.0  # how long freed room stays held for a preemptor that has not bound yet
    victims_timeout_s: float = 600.0  # give a reservation up when its victims have not left by then
    backoff_s: float = 20.0  # before a preemptor whose plan failed (budget, API error, no room) is planned again
    max_per_round: int = 16  # preemptions started per round: evictions come in bounded bursts


class PreemptionMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.preemptions = Counter(
            "sharegpu_preemptions", "Preemption attempts for GPU room, by outcome.", ["outcome"], registry=registry
        )
        self.victims = Counter(
            "sharegpu_preemption_victims", "Pods evicted to make GPU room for higher-priority pods.", registry=registry
        )
        self.reservations = Gauge(
            "sharegpu_preemption_reservations",
            "Preemptors whose room is being freed or held for them now.",
            registry=registry,
        )
        self.time_to_bind = Histogram(
            "sharegpu_preemption_bind_seconds",
            "From a preemption's evictions to its preemptor seen bound.",
            buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600),
            registry=registry,
        )
        for o in Outcome:
            self.preemptions.labels(o.value)

    def count(self, outcome: Outcome) -> None:
        self.preemptions.labels(outcome.value).inc()


@dataclass(frozen=True)
class RoundReport:
    """What one round did (for logs and tests)."""

    candidates: int
    preempted: tuple[str, ...] = ()  # preemptors whose victims were evicted (or room adopted)
    evicted: tuple[str, ...] = ()
    refused: Mapping[str, str] = field(default_factory=dict)  # preemptor → why not


async def run_preemption(
    view: ClusterView,
    schedulers: Schedulers,
    api: DisruptionApi,
    registry: CollectorRegistry,
    scheduler_name: str,
    is_leader: Callable[[], bool],
    config: PreemptionConfig,
    stop: asyncio.Event,
    filters: list[Callable[[ExtenderArgs], None]],
    setup: Callable[[PreemptionController, CollectorRegistry], None] | None = None,
) -> None:
    """Preemption beside a running extender (its view, its metrics' registry, its leadership) until ``stop``."""
    ctrl = PreemptionController(view, schedulers, api, PreemptionMetrics(registry), scheduler_name, is_leader, config)
    ctrl.attach()
    if setup is not None:  # e.g. consolidation (sharegpu.k8s.controllers.consolidation.enable_consolidation)
        setup(ctrl, registry)
    filters.append(ctrl.saw_filter)
    log.info("preemption for GPU room on (a round every %gs, while this replica leads)", config.interval_s)
    await ctrl.run(stop)


# ----- reading pods -----------------------------------------------------------------------------------------------
def preemption_policy(pod: Pod) -> PreemptionPolicy:
    """The pod's ``spec.preemptionPolicy`` as placement's type (anything but ``Never`` preempts, the default)."""
    never = pod.spec.preemption_policy == PreemptionPolicy.NEVER.value
    return PreemptionPolicy.NEVER if never else PreemptionPolicy.PREEMPT_LOWER_PRIORITY


class SaidOnce:
    """What was last said about each pod: a round every 2 s would repeat the same "no preemption" line for every
    pending pod. :meth:`level` is INFO the first time a pod gets a reason (or when its reason changes), DEBUG after."""

    def __init__(self) -> None:
        self._last: dict[str, str] = {}

    def level(self, pod: str, reason: str) -> int:
        if self._last.get(pod) == reason:
            return logging.DEBUG
        self._last[pod] = reason
        return logging.INFO

    def forget(self, pod: str) -> None:
        self._last.pop(pod, None)

    def keep_only(self, alive: Callable[[str], bool]) -> None:
        for pod in [p for p in self._last if not alive(p)]:
            del self._last[pod]


@dataclass(frozen=True)
class Evicted:
    """What :meth:`PreemptionController.evict` did: ``done`` evicted; ``failure`` says why it stopped (None: all
    evicted), ``blocked`` when a PodDisruptionBudget refused (429)."""

    done: tuple[str, ...]
    failure: str | None = None
    blocked: bool = False


class PreemptionController:
    def __init__(
        self,
        view: ClusterView,
        schedulers: Schedulers,
        api: DisruptionApi,
        metrics: PreemptionMetrics,
        scheduler_name: str = DEFAULT_SCHEDULER_NAME,
        is_leader: Callable[[], bool] = lambda: True,
        config: PreemptionConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.view, self.api, self.metrics = view, api, metrics
        self.schedulers = schedulers  # the extender's decisions' (preemption plans with the policy they place with)
        self.scheduler_name = scheduler_name
        self.is_leader = is_leader
        self.config = config or PreemptionConfig()
        self.clock = clock
        # The room being freed for preemptors and held for them as it frees (sharegpu.k8s.controllers.reservations).
        self._reserved = Reservations(view, schedulers, self.config.victims_timeout_s, self.config.reserve_s)
        self._backoff: dict[str, float] = {}  # preemptor → not before (clock)
        self._never_seen: set[str] = set()  # Never pods counted once each (by UID)
        self._events: set[asyncio.Future[None]] = set()
        # The nodes the kube-scheduler's own filters passed for each pod at its last filter call (by pod, with its
        # UID): preemption never evicts on a node the pod cannot use (affinity, taints, CPU it counts).
        self._passed: dict[str, tuple[str, tuple[str, ...]]] = {}
        # What to try for a pod that preemption cannot help (no lower-priority victims anywhere): consolidation
        # (sharegpu.k8s.controllers.consolidation) when it is on. It answers as _preempt does: ("", moved) or (why not, ()).
        self.no_room: Callable[[Pod, Sequence[DisruptionBudget]], Awaitable[tuple[str, tuple[str, ...]]]] | None = None
        # Why a pod got no preemption (or consolidation), said at INFO once per pod and reason, DEBUG when repeated.
        self.said = SaidOnce()

    # ----- the view's hook ----------------------------------------------------------------------------------------
    def attach(self) -> None:
        """Settle reservations on every pod change the view applies, so that freed room is held before the next
        filter call can see it (the view applies watch events synchronously, between two extender calls)."""
        self.view.pod_listeners.append(self.settle)

    def saw_filter(self, args: ExtenderArgs) -> None:
        """A filter call for a pod: remember the nodes the kube-scheduler sent (those its own filters passed)."""
        pod = args.Pod
        if not pod.metadata.name:
            return
        names = args.NodeNames if args.NodeNames is not None else (args.Nodes.names() if args.Nodes else [])
        self._passed[pod.key] = (pod.metadata.uid, tuple(names))

    def reservations(self) -> dict[str, str]:
        """Preemptor → nominated node, of the reservations in progress."""
        return self._reserved.nodes()

    def drop_all(self) -> None:
        """This replica is no longer the leader: forget the reservations and the room they kept."""
        self._reserved.clear()
        self._backoff.clear()
        self.metrics.reservations.set(0)

    def settle(self) -> None:
        """Hold the room for each preemptor whose victims are all gone; end reservations that are done."""
        if not len(self._reserved) or not self.view.synced:
            return
        for s in self._reserved.settle(self.clock()):
            r = s.reservation
            self.metrics.reservations.set(len(self._reserved))
            if s.how is Settled.BOUND:
                self.metrics.count(Outcome.BOUND)
                self.metrics.time_to_bind.observe(max(s.at - r.started, 0.0))
                log.info("preemptor %s bound %.1fs after its preemption", r.pod, s.at - r.started)
            elif s.how is Settled.VICTIMS_STAYED:
                self.metrics.count(Outcome.EXPIRED)
                log.warning("preemption for %s given up: its victims did not leave in time", r.pod)
            elif s.how is Settled.NOT_BOUND:
                self.metrics.count(Outcome.EXPIRED)
                log.info(
                    "room held for %s on %s released: it did not bind in %.0fs", r.pod, r.node, self.config.reserve_s
                )

    def _end(self, key: str, outcome: Outcome | None) -> None:
        self._reserved.end(key)
        self.metrics.reservations.set(len(self._reserved))
        if outcome is not None:
            self.metrics.count(outcome)

    # ----- rounds --------------------------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """A round every ``interval_s`` while this replica leads and its view is in sync, until ``stop``."""
        try:
            while not stop.is_set():
                if self.is_leader() and self.view.synced:
                    try:
                        await self.round()
                    except Exception:  # a bug must not end preemption for the life of the process
                        log.exception("preemption round failed")
                elif len(self._reserved):
                    self.drop_all()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.config.interval_s)
        finally:
            if self._events:
                await asyncio.gather(*self._events, return_exceptions=True)

    async def round(self) -> RoundReport:
        self.settle()
        candidates = self._candidates()
        if not candidates:
            return RoundReport(0)
        try:
            budgets: Sequence[DisruptionBudget] = await self.api.list_disruption_budgets()
        except KubeError as e:
            log.warning("preemption waits: cannot list PodDisruptionBudgets: %s", e)
            return RoundReport(len(candidates))
        preempted: list[str] = []
        evicted: list[str] = []
        refused: dict[str, str] = {}
        for pod in candidates[: self.config.max_per_round]:
            if not (self.is_leader() and self.view.synced):
                break  # lost the lead (or the API server) in the middle of the round
            why, victims = await self._preempt(pod, budgets)
            if why:
                refused[pod.key] = why
            else:
                preempted.append(pod.key)
                evicted.extend(victims)
                # The budgets were listed once for the round: the evictions just made count against them for the
                # preemptors after this one.
                budgets = spend_budgets(budgets, [p for v in victims if (p := self.view.pod(v)) is not None])
        return RoundReport(len(candidates), tuple(preempted), tuple(evicted), refused)

    def _candidates(self) -> list[Pod]:
        view = self.view
        now = self.clock()
        out: list[Pod] = []
        for gone in [k for k in self._passed if view.pod(k) is None]:
            del self._passed[gone]
        self.said.keep_only(lambda k: view.pod(k) is not None)
        sched = self.schedulers.placement()
        for p in pending_pods(view):
            if (
                p.reason not in (ReasonKind.GPU_ROOM, ReasonKind.FITS)
                or p.pod in self._reserved
                or self._backoff.get(p.pod, 0.0) > now
            ):
                continue
            pod = view.pod(p.pod)
            if pod is None or pod.spec.scheduler_name != self.scheduler_name or not pod.unschedulable:
                continue
            idx = self.nodes_of(pod)
            req = view.request(p.pod)
            if not idx or req is None:
                continue  # no filter call seen for it yet (the scheduler retries it soon), or nowhere to go
            ok, _ = sched.feasible(req)
            if ok[idx].any():
                continue  # it fits on a node the scheduler may use: it waits for its next cycle, not for room
            if preemption_policy(pod) is PreemptionPolicy.NEVER:
                if pod.metadata.uid not in self._never_seen:
                    self._never_seen.add(pod.metadata.uid)
                    self.metrics.count(Outcome.NEVER)
                continue
            out.append(pod)
        out.sort(key=lambda pod: (-pod.spec.priority, pod.metadata.creation_timestamp, pod.key))
        return out

    def nodes_of(self, pod: Pod) -> list[int]:
        """Ledger indices of the nodes the kube-scheduler passed for ``pod`` at its last filter call."""
        seen = self._passed.get(pod.key)
        if seen is None or seen[0] != pod.metadata.uid:
            return []
        index = self.view.ledger.index
        return sorted({index[n] for n in seen[1] if n in index})

    def _facts(self, led: Ledger, budgets: Sequence[DisruptionBudget], below: int) -> PodFacts:
        """Facts about the pods placed on ``led``; a pod that is not a bound, running pod of the view (a hold, a
        reservation, one leaving) is never a victim (``EXEMPT``, also the default).

        A pod violates its budget when evicting it beside the other possible victims of its node (the pods of
        priority ``below`` the preemptor's), the more important first, would take a budget below zero: the
        budgets are counted down across one node's victims, as the kube-scheduler's dry run does, so that two
        victims under a budget that allows one disruption are not both taken for free."""
        view = self.view
        priority: dict[str, int] = {}
        start: dict[str, float] = {}
        victims: dict[str, list[Pod]] = {}  # node → its possible victims
        for key in led.assignments:
            pod = view.pod(key)
            if pod is None or not pod.spec.node_name or pod.metadata.deletion_timestamp or view.in_flight(key):
                # Not a running pod (a hold or bind of this process, or one already leaving): never a victim.
                priority[key] = EXEMPT
                continue
            priority[key] = pod.spec.priority
            if (t := pod.started_at) is not None:
                start[key] = t
            if priority[key] < below:
                victims.setdefault(led.assignments[key].node, []).append(pod)
        protected: set[str] = set()
        for pods in victims.values():
            protected |= budget_violations(budgets, sorted(pods, key=more_important_first))
        return PodFacts(priority, start, protected.__contains__, default_priority=EXEMPT)

    def future_ledger(self) -> Ledger:
        """The ledger once what is leaving has left: terminating pods gone, every reservation's room taken."""
        return self._reserved.future_ledger()

    async def _preempt(self, pod: Pod, budgets: Sequence[DisruptionBudget]) -> tuple[str, tuple[str, ...]]:
        """Preempt for ``pod``: ("", victims) when done, (why not, ()) otherwise."""
        view = self.view
        key = pod.key
        req = view.request(key)
        if req is None:
            return "its request cannot be read", ()
        prio = pod.spec.priority
        future = self.future_ledger()
        try:
            plan = plan_preemption(
                future,
                Preemptor(req, prio, preemption_policy(pod)),
                self.schedulers.placement().policy,
                self._facts(future, budgets, prio),
                nodes=self.nodes_of(pod),
                max_candidates=kube_candidate_limit(len(future.nodes)),
            )
        except PreemptionError as e:
            self.metrics.count(Outcome.NO_ROOM)
            self.back_off(key)
            # The reason's kind, not its text: the text counts the cluster's pods, which change all the time.
            log.log(self.said.level(key, f"preemption: {type(e).__name__}"), "no preemption for %s: %s", key, e)
            if self.no_room is not None:
                return await self.no_room(pod, budgets)
            return str(e), ()
        # Never a victim of equal or higher priority: the planner guarantees it; a violation here is a bug.
        assert all(v.priority < prio for v in plan.victims), plan
        if not plan.victims:
            return await self._adopt(pod, prio, plan)
        if plan.pdb_violations:
            # The best node still needs evictions that the budgets refuse now (the planner preferred nodes that need
            # fewer): the Eviction API would answer 429 to one of them after the others were evicted for nothing.
            broken = ", ".join(v.pod for v in plan.victims if v.violates_pdb)
            return self._gave_up(
                pod,
                Outcome.BLOCKED,
                f"every node where evictions make room needs more evictions than the PodDisruptionBudgets allow now "
                f"(on {plan.node}: {broken} too), so none was evicted",
                (),
            )
        # Reserve before evicting: the evictions are awaited, and a filter that ran meanwhile could take the part of
        # the room that is free already.
        self.reserve(pod, prio, plan.node, plan.assignment, plan.victim_pods)
        self.settle()
        # No victim breaks a budget as they were listed; a budget that changed since still answers 429, which ends
        # the plan (the pods after it are left alone).
        evicted = await self.evict([v.pod for v in plan.victims])
        if evicted.failure is not None:
            self.cancel(key)
            outcome = Outcome.BLOCKED if evicted.blocked else Outcome.FAILED
            return self._gave_up(pod, outcome, evicted.failure, evicted.done)
        done = list(evicted.done)
        self.metrics.victims.inc(len(done))
        self.metrics.count(Outcome.PREEMPTED)
        log.info(
            "preempting %d pod(s) on %s for %s (priority %d): %s",
            len(done),
            plan.node,
            key,
            prio,
            ", ".join(f"{v.pod} (priority {v.priority})" for v in plan.victims),
        )
        await self.nominate(pod, plan.node)
        for v in plan.victims:
            self.pod_event(v.pod, "Preempted", f"preempted by {key} (priority {prio}) for GPU room on node {plan.node}")
        self.pod_event(
            key,
            "Preempting",
            f"Preempting {len(plan.victims)} pod(s) on node {plan.node}: " + ", ".join(v.pod for v in plan.victims),
        )
        self.settle()  # victims evicted without a grace period may be gone already
        return "", tuple(done)

    async def _adopt(self, pod: Pod, prio: int, plan: PreemptionPlan) -> tuple[str, tuple[str, ...]]:
        """The pod fits once pods already terminating have left (a preemption of an earlier leader, or pods
        deleted by their owners): reserve that room for it, evicting nothing."""
        key = pod.key
        leaving = frozenset(
            k
            for k in self.view.ledger.node_pods[plan.node_index]
            if (p := self.view.pod(k)) is not None and p.metadata.deletion_timestamp
        )
        self.reserve(pod, prio, plan.node, plan.assignment, leaving)
        self.metrics.count(Outcome.ADOPTED)
        log.info(
            "room leaving %s reserved for %s (priority %d): %d pod(s) terminating there",
            plan.node,
            key,
            prio,
            len(leaving),
        )
        if pod.status.nominated_node_name != plan.node:
            await self.nominate(pod, plan.node)
        self.settle()
        return "", ()

    async def evict(self, pods: Sequence[str]) -> Evicted:
        """Evict ``pods`` in order through the Eviction API, stopping at the first refusal (a budget's 429 or an
        API error): the pods after it are left alone, so a plan that cannot complete disrupts as little as it can."""
        done: list[str] = []
        for key in pods:
            pod = self.view.pod(key)
            ns, _, name = key.partition("/")
            try:
                await self.api.evict_pod(ns, name, pod.metadata.uid if pod is not None else "")
            except NotFound:
                pass  # gone already: its room comes anyway
            except EvictionBlocked as e:
                return Evicted(tuple(done), f"eviction of {key} refused by its PodDisruptionBudget: {e}", True)
            except KubeError as e:
                return Evicted(tuple(done), f"eviction of {key} failed: {e}")
            done.append(key)
        return Evicted(tuple(done))

    def reserve(
        self,
        pod: Pod,
        prio: int,
        node: str,
        assignment: Assignment | None,
        leaving: Iterable[str],
    ) -> None:
        """Hold the room ``leaving`` pods free on ``node`` for ``pod`` once they are gone (see :meth:`settle`); they
        keep their share until then, and the part of the room free already is held from now on. Call before
        evicting (and :meth:`cancel` if the evictions fail), so that no filter runs between the two."""
        leaving = frozenset(leaving)
        self._reserved.add(
            Reservation(
                pod.key,
                pod.metadata.uid,
                prio,
                node,
                assignment,
                leaving,
                self.clock(),
                kept=self._assignments(leaving),
            )
        )
        self.metrics.reservations.set(len(self._reserved))

    def cancel(self, key: str) -> None:
        """Forget pod ``key``'s reservation (its evictions failed) and release the room it kept."""
        self._end(key, None)

    def _assignments(self, pods: Iterable[str]) -> dict[str, Assignment]:
        led = self.view.ledger
        return {p: led.assignments[p] for p in pods if p in led.assignments}

    def back_off(self, key: str) -> None:
        """Plan for pod ``key`` again (preemption or consolidation) only after ``backoff_s``."""
        self._backoff[key] = self.clock() + self.config.backoff_s

    def _gave_up(self, pod: Pod, outcome: Outcome, what: str, evicted: Sequence[str]) -> tuple[str, tuple[str, ...]]:
        self.metrics.count(outcome)
        self.metrics.victims.inc(len(evicted))
        self.back_off(pod.key)
        why = what + (f" (already evicted: {', '.join(evicted)})" if evicted else "")
        log.warning("preemption for %s given up: %s", pod.key, why)
        self.event(
            PodEvent(
                pod.metadata.namespace,
                pod.metadata.name,
                pod.metadata.uid,
                "PreemptionBlocked" if outcome is Outcome.BLOCKED else "PreemptionFailed",
                f"sharegpu could not preempt for GPU room: {why}; retrying in {self.config.backoff_s:.0f}s",
                "Warning",
            )
        )
        return why, ()

    async def nominate(self, pod: Pod, node: str) -> None:
        try:
            await self.api.set_nominated_node(pod.metadata.namespace, pod.metadata.name, node)
        except KubeError as e:
            # The reservation, not the nomination, holds the room: go on without it.
            log.warning("cannot nominate %s for %s: %s", node, pod.key, e)

    def pod_event(self, key: str, reason: str, message: str) -> None:
        """A Normal Event on pod ``key`` (namespace/name) of the view, even if it is gone from the view already."""
        ns, _, name = key.partition("/")
        pod = self.view.pod(key)
        self.event(PodEvent(ns, name, pod.metadata.uid if pod is not None else "", reason, message, "Normal"))

    def event(self, event: PodEvent) -> None:
        """Create an Event without waiting for it: Events are best effort and must not slow preemption down."""

        async def create() -> None:
            try:
                await self.api.create_event(event, COMPONENT)
            except KubeError as e:
                log.info("cannot record event %s on %s/%s: %s", event.reason, event.namespace, event.pod, e)

        task = asyncio.ensure_future(create())
        self._events.add(task)
        task.add_done_callback(self._events.discard)

    async def flush_events(self) -> None:
        if self._events:
            await asyncio.gather(*self._events, return_exceptions=True)
