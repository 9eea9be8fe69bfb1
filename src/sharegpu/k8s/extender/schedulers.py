"""The schedulers the extender decides with, over the cluster cache's ledgers; :class:`~sharegpu.k8s.extender.
decisions.Decisions` owns them, and the binder, preemption and consolidation decide through them.

The cache (:mod:`sharegpu.k8s.cache`) holds objects and ledgers and builds no scheduler: what a scheduler adds — the
policy, its seed, the workload its fragmentation measure is taken against — is the decision's, as the kube-scheduler's
framework holds its profiles apart from its cache.
"""

from __future__ import annotations

import logging
from collections import Counter

from sharegpu.k8s.cache.view import ClusterView
from sharegpu.k8s.extender.dra_steer import DraSteering
from sharegpu.model.request import GpuRequest
from sharegpu.placement.fragmentation import Workload, workload_drifted
from sharegpu.placement.framework import Policy, Scheduler
from sharegpu.placement.policies import PolicyContext, UnknownPolicy, make_policy

log = logging.getLogger(__name__)

FALLBACK_POLICY = "bestfit"  # needs no workload distribution


class Schedulers:
    """The policy's scheduler over the device-plugin nodes' ledger (rebuilt with the ledger; its policy taken again
    when the workload seen drifts) and DRA steering's over the DRA nodes' ledger (when the view follows them)."""

    def __init__(
        self, view: ClusterView, policy: str = "sharegpu", seed: int = 0, workload: Workload | None = None
    ) -> None:
        check_policy(policy, workload)
        self.view = view
        self.policy_name = policy
        self.seed = seed
        self.fixed_workload = workload  # given at start (None: fragmentation is measured against the pods seen)
        self.active_policy = ""
        self._scheduler: Scheduler | None = None
        self._workload_pods = -1
        self.steering = DraSteering(view.dra, seed) if view.dra is not None else None

    def placement(self) -> Scheduler:
        """The scheduler over the view's ledger now, with the policy rebuilt when the workload seen drifted."""
        led = self.view.ledger
        n = self.view.request_count()
        stale = self.fixed_workload is None and workload_drifted(self._workload_pods, n)
        if self._scheduler is None or self._scheduler.ledger is not led:
            self._scheduler = Scheduler(led, self._make_policy(), self.seed)
        elif stale:
            # Same ledger, new workload: the filter's per-shape results and reasons stay valid.
            self._scheduler = self._scheduler.with_policy(self._make_policy(), self.seed)
        return self._scheduler

    def current(self) -> Scheduler | None:
        """The scheduler :meth:`placement` would return now without building one: None where none is built yet, the
        ledger was replaced (a relist) or the workload drifted (a new policy is due). The warm-up asks this, so that
        when schedulers are built and policies taken stays the decisions' own (warming changes no decision)."""
        s = self._scheduler
        if s is None or s.ledger is not self.view.ledger:
            return None
        if self.fixed_workload is None and workload_drifted(self._workload_pods, self.view.request_count()):
            return None
        return s

    def built_on_ledger(self) -> bool:
        """Whether a scheduler over the view's ledger now is built (current or with a policy due)."""
        return self._scheduler is not None and self._scheduler.ledger is self.view.ledger

    def warm_requests(self, limit: int = 256) -> list[GpuRequest]:
        """One request of each shape (:meth:`GpuRequest.shape_key`) among the pods the view holds, the workload the
        policy's typical shapes are taken from, the most common first (at most ``limit``)."""
        counts: Counter[tuple[object, ...]] = Counter()
        first: dict[tuple[object, ...], GpuRequest] = {}
        for r in self.view.requests():
            k = r.shape_key()
            counts[k] += 1
            first.setdefault(k, r)
        return [first[k] for k, _ in counts.most_common(limit)]

    def _make_policy(self) -> Policy:
        requests = self.view.requests()
        workload = self.fixed_workload
        if workload is None and requests:
            workload = Workload.from_requests(requests)
        self._workload_pods = len(requests)
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
            if workload is not None and self.fixed_workload is None:
                log.info("policy %s: workload distribution rebuilt from %d pod(s)", policy.name, len(requests))
        self.active_policy = policy.name
        return policy


def check_policy(name: str, workload: Workload | None = None) -> None:
    """Raise :class:`UnknownPolicy` (its message names the policies) for a name no policy has: at start, not at the
    first pod."""
    make_policy(name, PolicyContext(workload or Workload.from_requests([GpuRequest("placeholder")])))
