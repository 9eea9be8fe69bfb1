"""Consolidation in the running system (issue 19 item 2): when a pod waits only because free GPU room is fragmented
(enough in total, no GPU or node fits) and preemption cannot help it (no lower-priority pod to evict), the leader
moves a few movable pods so that it fits. Off by default (``sharegpu scheduler-extender --consolidation``).

It runs inside the preemption controller's rounds (:class:`sharegpu.k8s.controllers.preemption.PreemptionController` calls
:meth:`Consolidator.consolidate` for a candidate whose preemption found no room) and shares its pieces rather than
copying them: the same candidates (refused by the scheduler, fitting nowhere for GPU room), the ledger as it will be
once what is leaving has left, the Eviction API loop (a budget's 429 ends the plan), and the reservation that holds
the freed room for the waiting pod once the moved pods are gone (and keeps it from anyone else meanwhile).

A pod is movable when it opted in (``sharegpu.io/movable: "true"``), is owned by a controller (an ownerReference with
``controller: true``, which recreates it once evicted), is bound and running, is not of higher priority than the
waiting pod, and no PodDisruptionBudget forbids its eviction now. The plan comes from
:func:`sharegpu.placement.consolidation.plan_consolidation` on that future ledger: nothing is evicted unless the
waiting pod then fits on a node the kube-scheduler passed for it and every moved pod has a place elsewhere.
Moves are rate-limited (``max_moves_per_minute``, a sliding window): a plan is made only within what is left.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from prometheus_client import CollectorRegistry, Counter

from sharegpu.k8s.controllers.budgets import budget_protects, budget_violations
from sharegpu.k8s.controllers.preemption import PreemptionController
from sharegpu.kube.api import DisruptionBudget, PodEvent
from sharegpu.kube.schema import Pod
from sharegpu.model.contract import MOVABLE_ANNOTATION
from sharegpu.model.request import GpuRequest
from sharegpu.placement.consolidation import AlreadyFits, ConsolidationError, NotEnoughRoom, plan_consolidation

log = logging.getLogger(__name__)

WINDOW_S = 60.0  # the rate limit's window: moves per minute
BUDGET_REPLANS = 2  # plans made again without the pods whose moves their PodDisruptionBudgets would refuse


class PlanOutcome(StrEnum):
    """``outcome`` of ``sharegpu_consolidation_plans_total``."""

    MOVED = "moved"  # moved pods evicted, room reserved for the waiting pod
    NOT_FRAGMENTED = "not_fragmented"  # too little free room in total: moving pods cannot help
    ALREADY_FITS = "already_fits"  # it fits as things are (it waits for its next scheduling cycle)
    NO_PLAN = "no_plan"  # no target within the bounds where every moved pod has a place
    RATE_LIMITED = "rate_limited"  # the moves of the last minute used the budget up
    BLOCKED = "blocked"  # a PodDisruptionBudget refused an eviction (429): the plan stopped there
    FAILED = "failed"  # the API server refused or could not be reached


@dataclass(frozen=True)
class ConsolidationConfig:
    max_moves_per_minute: int = 4  # pods evicted to be moved, in any 60 s
    max_moves: int = 4  # per plan
    max_targets: int = 8  # target nodes tried per plan

    def __post_init__(self) -> None:
        if self.max_moves_per_minute < 1 or self.max_moves < 1 or self.max_targets < 1:
            raise ValueError(
                f"consolidation limits must be at least 1 (max_moves_per_minute={self.max_moves_per_minute}, "
                f"max_moves={self.max_moves}, max_targets={self.max_targets})"
            )


class ConsolidationMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.moves = Counter(
            "sharegpu_consolidation_moves",
            "Pods evicted so that a pod waiting for fragmented GPU room fits (their controllers recreate them).",
            registry=registry,
        )
        self.plans = Counter(
            "sharegpu_consolidation_plans", "Consolidation attempts, by outcome.", ["outcome"], registry=registry
        )
        for o in PlanOutcome:
            self.plans.labels(o.value)

    def count(self, outcome: PlanOutcome) -> None:
        self.plans.labels(outcome.value).inc()


def is_movable(pod: Pod) -> bool:
    """Opted in with ``sharegpu.io/movable: "true"`` and owned by a controller that will recreate it."""
    if pod.metadata.annotations.get(MOVABLE_ANNOTATION, "").lower() != "true":
        return False
    return any(o.controller is True for o in pod.metadata.owner_references)


class Consolidator:
    """Consolidation for the pods a :class:`PreemptionController` cannot help; :meth:`attach` wires it in."""

    def __init__(
        self,
        ctrl: PreemptionController,
        metrics: ConsolidationMetrics,
        config: ConsolidationConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ctrl, self.metrics = ctrl, metrics
        self.config = config or ConsolidationConfig()
        self.clock = clock
        self._moves: deque[float] = deque()  # when each move of the last WINDOW_S was made (clock)

    def attach(self) -> None:
        self.ctrl.no_room = self.consolidate

    def moves_left(self) -> int:
        now = self.clock()
        while self._moves and now - self._moves[0] >= WINDOW_S:
            self._moves.popleft()
        return self.config.max_moves_per_minute - len(self._moves)

    def movable(self, pod: Pod, budgets: Sequence[DisruptionBudget], placed: Sequence[str]) -> dict[str, GpuRequest]:
        """The pods of ``placed`` that may move for ``pod``, with the requests they were placed with."""
        view = self.ctrl.view
        prio = pod.spec.priority
        out: dict[str, GpuRequest] = {}
        for key in placed:
            p = view.pod(key)
            if p is None or not p.spec.node_name or p.metadata.deletion_timestamp or view.in_flight(key):
                continue  # not a running pod: a hold, a bind in progress, one already leaving
            if not is_movable(p) or p.spec.priority > prio or budget_protects(budgets, p):
                continue
            if (req := view.request(key)) is not None:
                out[key] = req
        return out

    async def consolidate(self, pod: Pod, budgets: Sequence[DisruptionBudget]) -> tuple[str, tuple[str, ...]]:
        """Move pods so that ``pod`` fits: ("", moved) when its room is on its way, (why not, ()) otherwise."""
        ctrl, view = self.ctrl, self.ctrl.view
        key = pod.key
        req = view.request(key)
        if req is None:
            return "its request cannot be read", ()
        left = self.moves_left()
        if left <= 0:
            self.metrics.count(PlanOutcome.RATE_LIMITED)
            return f"consolidation waits: {self.config.max_moves_per_minute} move(s) in the last minute already", ()
        future = ctrl.future_ledger()
        movable = self.movable(pod, budgets, list(future.assignments))
        try:
            for _ in range(BUDGET_REPLANS + 1):
                plan = plan_consolidation(
                    future,
                    req,
                    self.ctrl.schedulers.placement().policy,
                    movable,
                    max_moves=min(left, self.config.max_moves),
                    max_targets=self.config.max_targets,
                )
                # Each budget allows so many disruptions in all: two moved pods under a budget that allows one would
                # get a 429 for the second (counted down in the plan's order). Plan again without those.
                over = budget_violations(budgets, [p for m in plan.moves if (p := view.pod(m.pod)) is not None])
                if not over:
                    break
                movable = {k: r for k, r in movable.items() if k not in over}
            else:
                raise ConsolidationError(
                    f"every plan for {key} moves more pods than their PodDisruptionBudgets allow now"
                )
        except ConsolidationError as e:
            outcome = (
                PlanOutcome.NOT_FRAGMENTED
                if isinstance(e, NotEnoughRoom)
                else PlanOutcome.ALREADY_FITS
                if isinstance(e, AlreadyFits)
                else PlanOutcome.NO_PLAN
            )
            self.metrics.count(outcome)
            log.log(ctrl.said.level(key, f"consolidation: {type(e).__name__}"), "no consolidation for %s: %s", key, e)
            return str(e), ()
        if plan.node_index not in ctrl.nodes_of(pod):
            # The planner does not know the kube-scheduler's own filters (affinity, taints, CPU): never move pods
            # for a node the waiting pod could not use anyway.
            self.metrics.count(PlanOutcome.NO_PLAN)
            return f"consolidation's target {plan.node} is not among the nodes the scheduler passed for {key}", ()
        moved = [m.pod for m in plan.moves]
        assert all(m in movable for m in moved), plan  # the planner moves only what it was given
        # Reserve before evicting: the same hold as a preemption's (the moved pods keep their share until they are
        # gone, the part of the room free already is held at once, then the room is the waiting pod's until it binds
        # or the reservation lapses): the moved pods' controllers recreate them the moment they are evicted, and a
        # replica must not take that part beside its terminating original.
        ctrl.reserve(pod, pod.spec.priority, plan.node, plan.assignment, moved)
        ctrl.settle()
        evicted = await ctrl.evict(moved)
        now = self.clock()
        self._moves.extend(now for _ in evicted.done)
        self.metrics.moves.inc(len(evicted.done))
        if evicted.failure is not None:
            ctrl.cancel(key)
            self.metrics.count(PlanOutcome.BLOCKED if evicted.blocked else PlanOutcome.FAILED)
            ctrl.back_off(key)
            why = evicted.failure + (f" (already moved: {', '.join(evicted.done)})" if evicted.done else "")
            log.warning("consolidation for %s given up: %s", key, why)
            ctrl.event(
                PodEvent(
                    pod.metadata.namespace,
                    pod.metadata.name,
                    pod.metadata.uid,
                    "ConsolidationBlocked" if evicted.blocked else "ConsolidationFailed",
                    f"sharegpu could not move pods so that this pod fits: {why}",
                    "Warning",
                )
            )
            return why, ()
        self.metrics.count(PlanOutcome.MOVED)
        log.info("consolidating for %s on %s: moving %s", key, plan.node, ", ".join(moved))
        await ctrl.nominate(pod, plan.node)
        for m in plan.moves:
            ctrl.pod_event(m.pod, "Consolidated", f"moved off node {m.source} so that {key} fits")
        ctrl.pod_event(
            key,
            "Consolidating",
            f"Moving {len(moved)} pod(s) so that this pod fits on node {plan.node}: {', '.join(moved)}",
        )
        ctrl.settle()  # moved pods evicted without a grace period may be gone already
        return "", tuple(evicted.done)


def enable_consolidation(config: ConsolidationConfig) -> Callable[[PreemptionController, CollectorRegistry], None]:
    """For :func:`sharegpu.k8s.controllers.preemption.run_preemption`'s ``setup``: consolidation in its controller's rounds."""

    def setup(ctrl: PreemptionController, registry: CollectorRegistry) -> None:
        Consolidator(ctrl, ConsolidationMetrics(registry), config).attach()
        log.info("consolidation on (at most %d move(s) a minute)", config.max_moves_per_minute)

    return setup
