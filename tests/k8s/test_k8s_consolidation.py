"""Consolidation in the running system (issue 19 item 2), against the in-memory API server: the preemption
controller's harness (tests/k8s/test_k8s_preemption.py) with a :class:`Consolidator` attached.

The shape throughout: nodes of one H100 (80 GiB), each about half taken by a 39 GiB share; a pod asking 70 GiB waits
with the same priority as the shares (so preemption may evict none of them). Moving one share onto the other node's
free half makes room; whether consolidation does so depends on what the test changes. The shares are MPS clients of
pods that declare no user, each a tenant of its own: each runs its own MPS daemon, which takes 66 MiB of its GPU, so
two shares of 39 GiB fit one GPU where two of 40 GiB no longer do.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from test_k8s_preemption import Harness, run, until

from sharegpu.k8s.controllers.consolidation import ConsolidationConfig, PlanOutcome, is_movable
from sharegpu.k8s.controllers.preemption import Outcome
from sharegpu.k8s.extender.server import run_extender
from sharegpu.kube.api import DisruptionBudget, PodEvent
from sharegpu.kube.schema import ExtenderBindingArgs, Pod
from sharegpu.model.contract import MOVABLE_ANNOTATION

ON = ConsolidationConfig()
OWNER = {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "rs", "uid": "rs-uid", "controller": True}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def share(
    h: Harness,
    name: str,
    node: str,
    memory: str = "39Gi",
    movable: str | None = "true",
    owner: dict[str, Any] | None = OWNER,
    labels: dict[str, str] | None = None,
    compute: int | None = None,
) -> str:
    """A running share of ``memory`` on ``node`` (filtered to that node and bound through the extender)."""
    key = h.pod(name, memory=memory, labels=labels, compute=compute)
    obj = h.api.pods[key]
    if movable is not None:
        obj["metadata"]["annotations"] = {**obj["metadata"].get("annotations", {}), MOVABLE_ANNOTATION: movable}
    if owner is not None:
        obj["metadata"]["ownerReferences"] = [owner]
    h.api.put_pod(obj)
    await until(lambda: h.view.pod(key) is not None and bool(h.view.request(key)), key)
    assert h.filter(key, [node]) == [node], f"{key} should fit on {node}"
    args = ExtenderBindingArgs(PodName=name, PodNamespace="default", PodUID=h.uid(key), Node=node)
    assert (await h.ext.bind(args)).Error == ""
    obj = h.api.pods[key]
    obj["status"].update(phase="Running", startTime="2026-01-01T00:00:00Z")
    h.api.put_pod(obj)
    await until(lambda: (p := h.view.pod(key)) is not None and p.spec.node_name == node, f"{key} bound")
    return key


async def fragmented(h: Harness, **kw: Any) -> tuple[str, str, str]:
    """n1 and n2 each half full with a 39 GiB share; a 70 GiB pod of the same priority waits."""
    await h.nodes("n1", "n2", gpus=1)
    a = await share(h, "a", "n1", **kw)
    b = await share(h, "b", "n2", **kw)
    waiting = await h.waiting("big", priority=0, memory="70Gi")
    return a, b, waiting


def events(h: Harness, reason: str) -> list[PodEvent]:
    return [e for e in h.api.events if e.reason == reason]


def test_off_by_default() -> None:
    assert inspect.signature(run_extender).parameters["consolidation"].default is None

    async def body(h: Harness) -> None:
        await fragmented(h)
        report = await h.ctrl.round()
        assert h.api.evictions == [] and report.evicted == ()
        assert h.registry.get_sample_value("sharegpu_consolidation_moves_total") is None  # not even registered

    run(body)  # no consolidation= given


def test_a_movable_share_moves_and_the_freed_room_goes_to_the_waiting_pod() -> None:
    async def body(h: Harness) -> None:
        a, _, big = await fragmented(h)
        report = await h.ctrl.round()
        assert report.preempted == (big,) and len(report.evicted) == 1
        moved = report.evicted[0]
        assert h.api.evictions == [moved]
        node = "n1" if moved == a else "n2"
        assert h.nominated(big) == node
        # The moved share terminates and keeps its room: the waiting pod does not fit yet, nor does anyone else.
        assert h.terminating(moved) and moved in h.view.ledger.assignments
        other = await h.waiting("other", priority=0, memory="70Gi")
        assert h.filter(other) == []
        await h.ctrl.round()  # no second plan while the first is under way
        assert h.api.evictions == [moved]

        # The moved pod's controller recreates it at once: the replica goes to the other node's free half, never
        # beside its terminating original (that half is held for the waiting pod already).
        again = h.pod("a2", memory="39Gi")
        await until(lambda: h.view.request(again) is not None, again)
        assert h.filter(again) == [{"n1": "n2", "n2": "n1"}[node]]

        h.api.terminate(moved)
        await until(lambda: h.view.held(big) is not None, "room held for the waiting pod")
        assert h.filter(other) == []  # the freed room is the waiting pod's
        assert h.filter(big) == [node]
        args = ExtenderBindingArgs(PodName="big", PodNamespace="default", PodUID=h.uid(big), Node=node)
        assert (await h.ext.bind(args)).Error == ""
        await until(lambda: (p := h.view.pod(big)) is not None and p.spec.node_name == node, "waiting pod bound")
        await h.ctrl.round()
        assert h.ctrl.reservations() == {}
        h.view.ledger.check_invariants()

        await h.ctrl.flush_events()
        (ev,) = events(h, "Consolidated")
        assert (ev.pod, ev.message) == (moved.partition("/")[2], f"moved off node {node} so that default/big fits")
        (ev,) = events(h, "Consolidating")
        assert ev.pod == "big" and ev.message.startswith(f"Moving 1 pod(s) so that this pod fits on node {node}")
        assert h.metric("sharegpu_consolidation_moves_total") == 1
        assert h.metric("sharegpu_consolidation_plans_total", outcome=PlanOutcome.MOVED.value) == 1
        assert h.metric("sharegpu_preemptions_total", outcome=Outcome.BOUND.value) == 1

    run(body, consolidation=ON)


@pytest.mark.parametrize(
    "kw",
    [
        {"movable": None},  # not opted in
        {"movable": "false"},
        {"owner": None},  # a bare pod: nobody would recreate it
        {"owner": {**OWNER, "controller": False}},  # owned, but not by a controller
    ],
    ids=["no-annotation", "annotation-false", "no-owner", "owner-not-controller"],
)
def test_only_annotated_controller_owned_pods_move(kw: dict[str, Any]) -> None:
    async def body(h: Harness) -> None:
        _, _, big = await fragmented(h, **kw)
        report = await h.ctrl.round()
        assert h.api.evictions == [] and big in report.refused
        assert h.nominated(big) == ""
        assert h.metric("sharegpu_consolidation_plans_total", outcome=PlanOutcome.NO_PLAN.value) == 1

    run(body, consolidation=ON)


def test_is_movable_reads_the_annotation_and_the_controller_reference() -> None:
    def pod(annotations: dict[str, str], owners: list[dict[str, Any]]) -> Pod:
        meta = {"name": "p", "namespace": "default", "annotations": annotations, "ownerReferences": owners}
        return Pod.model_validate({"metadata": meta, "spec": {"containers": []}})

    assert is_movable(pod({MOVABLE_ANNOTATION: "true"}, [OWNER]))
    assert not is_movable(pod({MOVABLE_ANNOTATION: "yes"}, [OWNER]))
    assert not is_movable(pod({}, [OWNER]))
    assert not is_movable(pod({MOVABLE_ANNOTATION: "true"}, [{**OWNER, "controller": None}]))


def test_a_budget_that_refuses_stops_the_plan() -> None:
    """Two moves are needed; the budget allows one when listed but refuses the second eviction (429): the plan
    stops there, nothing is reserved, the waiting pod is told why."""

    async def body(h: Harness) -> None:
        await h.nodes("n1", "n2", gpus=1)
        batch = {"app": "batch"}
        await share(h, "a", "n1", memory="20Gi", labels=batch)
        await share(h, "b", "n1", memory="20Gi", labels=batch)
        await share(h, "c", "n2", memory="39Gi", movable=None)
        big = await h.waiting("big", priority=0, memory="70Gi")
        listed = DisruptionBudget("default", "batch", (("app", "batch"),), (), 2)

        async def budgets() -> list[DisruptionBudget]:  # as listed; one disruption is used up before the second
            return [listed]

        h.api.list_disruption_budgets = budgets  # type: ignore[method-assign]
        h.api.pdbs["default/batch"] = DisruptionBudget("default", "batch", (("app", "batch"),), (), 1)
        report = await h.ctrl.round()
        assert big in report.refused and "PodDisruptionBudget" in report.refused[big]
        assert h.api.evictions == ["default/a"]  # the first; the second refused; no third try
        assert h.ctrl.reservations() == {} and h.nominated(big) == ""
        await h.ctrl.flush_events()
        (ev,) = events(h, "ConsolidationBlocked")
        assert ev.pod == "big" and "default/b" in ev.message and "already moved: default/a" in ev.message
        assert h.metric("sharegpu_consolidation_plans_total", outcome=PlanOutcome.BLOCKED.value) == 1
        assert h.metric("sharegpu_consolidation_moves_total") == 1
        # Backed off: the next round does not try again at once.
        await h.ctrl.round()
        assert h.api.evictions == ["default/a"]

    run(body, consolidation=ON)


def test_a_budget_with_no_disruption_left_keeps_its_pods_in_place() -> None:
    async def body(h: Harness) -> None:
        await h.nodes("n1", "n2", gpus=1)
        await share(h, "a", "n1", labels={"app": "db"})
        await share(h, "b", "n2", labels={"app": "db"})
        big = await h.waiting("big", priority=0, memory="70Gi")
        h.api.pdbs["default/db"] = DisruptionBudget("default", "db", (("app", "db"),), (), 0)
        report = await h.ctrl.round()
        assert h.api.evictions == [] and big in report.refused

    run(body, consolidation=ON)


def test_nothing_is_evicted_when_a_moved_pod_would_have_no_place() -> None:
    """Enough free room in total (40 + 30 GiB for 70), but the only movable share (40 GiB) fits nowhere else."""

    async def body(h: Harness) -> None:
        await h.nodes("n1", "n2", gpus=1)
        await share(h, "a", "n1", memory="40Gi")
        await share(h, "c", "n2", memory="50Gi", movable=None)
        big = await h.waiting("big", priority=0, memory="70Gi")
        report = await h.ctrl.round()
        assert h.api.evictions == [] and big in report.refused
        assert h.ctrl.reservations() == {}
        assert h.metric("sharegpu_consolidation_plans_total", outcome=PlanOutcome.NO_PLAN.value) == 1

    run(body, consolidation=ON)


def test_not_fragmented_when_too_little_room_in_total() -> None:
    """60% of each GPU's compute taken, 90% asked: 80% free in all, so no move can help (the planner's bound is
    on compute)."""

    async def body(h: Harness) -> None:
        await h.nodes("n1", "n2", gpus=1)
        await share(h, "a", "n1", memory="10Gi", compute=60)
        await share(h, "b", "n2", memory="10Gi", compute=60)
        await h.waiting("big", priority=0, memory="10Gi", compute=90)
        await h.ctrl.round()
        assert h.api.evictions == []
        assert h.metric("sharegpu_consolidation_plans_total", outcome=PlanOutcome.NOT_FRAGMENTED.value) == 1

    run(body, consolidation=ON)


def test_moves_are_rate_limited() -> None:
    clock = Clock()

    async def body(h: Harness) -> None:
        await h.nodes("n1", "n2", "n3", "n4", gpus=1)
        for name, node in (("a", "n1"), ("b", "n2"), ("c", "n3"), ("d", "n4")):
            await share(h, name, node)
        first = await h.waiting("big1", priority=0, memory="70Gi")
        second = await h.waiting("big2", priority=0, memory="70Gi")
        report = await h.ctrl.round()
        assert report.preempted == (first,) and len(h.api.evictions) == 1
        assert second in report.refused and "move(s) in the last minute" in report.refused[second]
        assert h.metric("sharegpu_consolidation_plans_total", outcome=PlanOutcome.RATE_LIMITED.value) == 1
        clock.now += 30
        await h.ctrl.round()
        assert len(h.api.evictions) == 1  # still within the minute (and backed off)
        clock.now += 31
        report = await h.ctrl.round()
        assert report.preempted == (second,) and len(h.api.evictions) == 2
        assert h.metric("sharegpu_consolidation_moves_total") == 2

    run(body, consolidation=ConsolidationConfig(max_moves_per_minute=1), clock=clock)
