"""PodDisruptionBudgets counted down across the victims of one node (issue 28 item 6), as the kube-scheduler's
filterPodsWithPDBViolation does: two victims under a budget that allows one disruption are one violation, not
none, so a node whose victims break no budget wins, and a plan that would break one is not started (the Eviction API
would refuse its second eviction after the first was made for nothing).

Two shares fill a GPU at 39 GiB each: their pods declare no user, so each runs an MPS daemon of its own, which takes
66 MiB of the GPU as well."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
from k8s_helpers import pod_obj
from test_k8s_consolidation import ON, events, share
from test_k8s_preemption import HIGH, Harness, run

from sharegpu.k8s.controllers.budgets import budget_violations, spend_budgets
from sharegpu.k8s.controllers.consolidation import PlanOutcome
from sharegpu.k8s.controllers.preemption import Outcome
from sharegpu.kube.api import DisruptionBudget
from sharegpu.kube.schema import Pod

DB = {"app": "db"}


def budget(allowed: int, name: str = "db") -> DisruptionBudget:
    return DisruptionBudget("default", name, (("app", name),), (), allowed)


def _pod(name: str, app: str | None = "db") -> Pod:
    obj = pod_obj(name)
    obj["metadata"]["labels"] = {"app": app} if app else {}
    return Pod.model_validate(obj)


def test_budgets_are_counted_down_pod_by_pod() -> None:
    a, b, c, other = _pod("a"), _pod("b"), _pod("c"), _pod("x", "web")
    assert budget_violations([budget(1)], [a, b]) == {"default/b"}  # the second takes it below zero
    assert budget_violations([budget(1)], [b, a]) == {"default/a"}
    assert budget_violations([budget(2)], [a, b]) == set()
    assert budget_violations([budget(0)], [a]) == {"default/a"}
    assert budget_violations([budget(1)], [a, other, b, c]) == {"default/b", "default/c"}
    assert budget_violations([], [a, b]) == set()
    assert [x.disruptions_allowed for x in spend_budgets([budget(2), budget(5, "web")], [a, b, other])] == [0, 4]


def test_the_node_whose_two_victims_share_a_budget_of_one_is_not_chosen() -> None:
    """n1: two victims under one budget allowing one disruption; n2, equally good, no budget. The old count judged
    each victim alone (1 allowed > 0: no violation), tied the nodes, took n1 by name, evicted one victim for nothing
    and got a 429 on the second (the preemptor then backed off 20 s)."""

    async def body(h: Harness) -> None:
        await h.nodes("n1", "n2")
        await h.placed("a1", "n1", memory="39Gi", labels=DB)
        await h.placed("a2", "n1", memory="39Gi", labels=DB)
        b1 = await h.placed("b1", "n2", memory="39Gi")
        b2 = await h.placed("b2", "n2", memory="39Gi")
        h.api.pdbs["default/db"] = budget(1)
        high = await h.waiting("high")
        report = await h.ctrl.round()
        assert report.refused == {} and report.preempted == (high,)
        assert sorted(h.api.evictions) == [b1, b2]
        assert h.nominated(high) == "n2"
        assert h.api.pdbs["default/db"].disruptions_allowed == 1  # nothing under the budget was touched
        assert h.metric("sharegpu_preemptions_total", outcome=Outcome.BLOCKED.value) == 0

    run(body)


def test_a_plan_that_would_break_a_budget_evicts_nobody() -> None:
    """Only n1 can make room, and its two victims share a budget allowing one: no eviction at all (the old code
    evicted one, then got a 429 on the other)."""

    async def body(h: Harness) -> None:
        await h.nodes("n1")
        a1 = await h.placed("a1", "n1", memory="39Gi", labels=DB)
        a2 = await h.placed("a2", "n1", memory="39Gi", labels=DB)
        h.api.pdbs["default/db"] = budget(1)
        high = await h.waiting("high")
        report = await h.ctrl.round()
        assert high in report.refused and "PodDisruptionBudgets allow now" in report.refused[high]
        assert h.api.evictions == [] and not h.terminating(a1) and not h.terminating(a2)
        assert not any(c.startswith("evict pod") for c in h.api.calls)
        assert h.ctrl.reservations() == {} and h.nominated(high) == ""
        await h.ctrl.flush_events()
        assert [e.reason for e in h.api.events] == ["PreemptionBlocked"]
        assert h.metric("sharegpu_preemptions_total", outcome=Outcome.BLOCKED.value) == 1

    run(body)


def test_a_budget_of_one_still_lets_one_victim_go() -> None:
    async def body(h: Harness) -> None:
        await h.nodes("n1")
        await h.placed("a1", "n1", memory="39Gi", labels=DB)
        a2 = await h.placed("a2", "n1", memory="39Gi", labels=DB, priority=10)
        h.api.pdbs["default/db"] = budget(1)
        high = await h.waiting("high", memory="40Gi")
        report = await h.ctrl.round()
        # Counted down in importance order, a1 (priority 0) is the one that would break the budget; as the
        # kube-scheduler does, the pods that would break a budget are reprieved first, so a2 is the victim.
        assert report.preempted == (high,) and h.api.evictions == [a2]
        assert h.metric("sharegpu_preemptions_total", outcome=Outcome.BLOCKED.value) == 0

    run(body)


def test_preemptors_of_one_round_share_the_budgets() -> None:
    """Two preemptors in one round, each needing one victim under the same budget allowing one: the first uses it
    up, and the second is not started on a budget already spent (it would have got a 429)."""

    async def body(h: Harness) -> None:
        await h.nodes("n1", "n2")
        await h.placed("a1", "n1", labels=DB)
        await h.placed("a2", "n2", labels=DB)
        h.api.pdbs["default/db"] = budget(1)
        first = await h.waiting("high1", priority=2000)
        second = await h.waiting("high2", priority=1000)
        report = await h.ctrl.round()
        assert report.preempted == (first,) and len(h.api.evictions) == 1
        assert second in report.refused and "PodDisruptionBudgets allow now" in report.refused[second]
        assert not any("429" in c for c in h.api.calls)

    run(body)


def test_consolidation_moves_no_more_pods_under_a_budget_than_it_allows() -> None:
    """Two 20 GiB shares under a budget allowing one could make room on n1 together; the planner must not count on
    moving both (the second eviction would get a 429 after the first moved for nothing)."""

    async def body(h: Harness) -> None:
        await h.nodes("n1", "n2", gpus=1)
        batch = {"app": "batch"}
        await share(h, "a", "n1", memory="20Gi", labels=batch)
        await share(h, "b", "n1", memory="20Gi", labels=batch)
        await share(h, "c", "n2", memory="39Gi", movable=None)
        big = await h.waiting("big", priority=0, memory="70Gi")
        h.api.pdbs["default/batch"] = budget(1, "batch")
        report = await h.ctrl.round()
        assert big in report.refused and h.api.evictions == []
        assert not any(c.startswith("evict pod") for c in h.api.calls)
        assert events(h, "ConsolidationBlocked") == []
        assert h.metric("sharegpu_consolidation_plans_total", outcome=PlanOutcome.BLOCKED.value) == 0

    run(body, consolidation=ON)


def test_no_preemption_is_said_once_per_pod_at_info_and_repeated_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 28 item 9: a round every 2 s said "no preemption for X … fits on no node" at INFO each time."""

    async def body(h: Harness) -> None:
        h.ctrl.config = replace(h.ctrl.config, backoff_s=0.0)
        await h.nodes("n1")
        await h.placed("peer", "n1", priority=HIGH)  # nobody of lower priority to evict
        first = await h.waiting("first")
        with caplog.at_level(logging.DEBUG, logger="sharegpu.k8s.controllers.preemption"):
            for _ in range(3):
                await h.ctrl.round()
            second = await h.waiting("second")
            for _ in range(2):
                await h.ctrl.round()
        said = [(r.levelno, r.getMessage().split(":")[0]) for r in caplog.records if "no preemption" in r.getMessage()]
        assert said.count((logging.INFO, f"no preemption for {first}")) == 1
        assert said.count((logging.DEBUG, f"no preemption for {first}")) == 4
        assert said.count((logging.INFO, f"no preemption for {second}")) == 1
        assert said.count((logging.DEBUG, f"no preemption for {second}")) == 1

    run(body)
