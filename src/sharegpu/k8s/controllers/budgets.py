"""PodDisruptionBudgets as preemption and consolidation count them before evicting: which pods a budget protects
now, which of a set of evictions would break one (counted down across them, as the kube-scheduler does), and the
budgets once some pods are evicted.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from sharegpu.kube.api import DisruptionBudget
from sharegpu.kube.schema import Pod


def budget_protects(budgets: Sequence[DisruptionBudget], pod: Pod) -> bool:
    """Whether a PodDisruptionBudget covering ``pod`` allows no disruption now (its eviction would get a 429)."""
    ns, labels = pod.metadata.namespace, pod.metadata.labels
    return any(b.disruptions_allowed <= 0 and b.covers(ns, labels) for b in budgets)


def budget_violations(budgets: Sequence[DisruptionBudget], pods: Iterable[Pod]) -> set[str]:
    """The keys of ``pods`` whose eviction would break a PodDisruptionBudget if all of ``pods`` were evicted in this
    order: each budget's ``disruptionsAllowed`` is counted down pod by pod (as the kube-scheduler's
    filterPodsWithPDBViolation does over one node's victims), and a pod that takes a budget below zero violates it.
    Two pods under a budget that allows one disruption: the first may go, the second would get a 429."""
    left = [b.disruptions_allowed for b in budgets]
    out: set[str] = set()
    for pod in pods:
        ns, labels = pod.metadata.namespace, pod.metadata.labels
        for i, b in enumerate(budgets):
            if b.covers(ns, labels):
                left[i] -= 1
                if left[i] < 0:
                    out.add(pod.key)
    return out


def spend_budgets(budgets: Sequence[DisruptionBudget], pods: Iterable[Pod]) -> list[DisruptionBudget]:
    """``budgets`` once ``pods`` are evicted: each covering budget allows one disruption fewer (the API server's own
    count, which the kube-controller-manager publishes only later)."""
    out = list(budgets)
    for pod in pods:
        ns, labels = pod.metadata.namespace, pod.metadata.labels
        out = [replace(b, disruptions_allowed=b.disruptions_allowed - 1) if b.covers(ns, labels) else b for b in out]
    return out


def more_important_first(pod: Pod) -> tuple[int, float, str]:
    # The kube-scheduler's MoreImportantPod (as sharegpu.placement.preemption orders victims): higher priority first,
    # then the pod that started earlier (unknown: now, the latest).
    t = pod.started_at
    return (-pod.spec.priority, float("inf") if t is None else t, pod.key)
