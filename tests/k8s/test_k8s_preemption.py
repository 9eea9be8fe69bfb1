"""Preemption for GPU shortfalls in the running system (issue 19): the controller beside the extender, against the
in-memory API server.

Each test builds nodes whose GPUs are taken by low-priority pods (bound through the extender, as the scheduler
would), marks a high-priority pod unschedulable (what the kube-scheduler writes after the filter refused it) and
runs preemption rounds: who is evicted, what is nominated, and who may take the freed room.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from k8s_helpers import node_spec, pod_obj
from memory_api import MemoryClusterApi
from prometheus_client import CollectorRegistry

from sharegpu.k8s.cache.view import ClusterView
from sharegpu.k8s.controllers.consolidation import ConsolidationConfig, ConsolidationMetrics, Consolidator
from sharegpu.k8s.controllers.preemption import (
    Outcome,
    PreemptionConfig,
    PreemptionController,
    PreemptionMetrics,
)
from sharegpu.k8s.extender.server import Extender
from sharegpu.kube.api import DisruptionBudget
from sharegpu.kube.schema import ExtenderArgs, ExtenderBindingArgs, Pod
from sharegpu.ledger import MpsTenancy

HIGH = 1000


async def until(cond: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


class Harness:
    def __init__(
        self,
        api: MemoryClusterApi,
        view: ClusterView,
        leader: bool = True,
        clock: Callable[[], float] = time.monotonic,
        consolidation: ConsolidationConfig | None = None,
    ) -> None:
        self.api, self.view = api, view
        self.leader = leader
        self.ext = Extender(view, api, is_leader=lambda: self.leader, policy="bestfit")
        self.registry = CollectorRegistry()
        self.ctrl = PreemptionController(
            view,
            self.ext.decisions.schedulers,
            api,
            PreemptionMetrics(self.registry),
            is_leader=lambda: self.leader,
            config=PreemptionConfig(interval_s=0.01, backoff_s=60.0),
            clock=clock,
        )
        self.ctrl.attach()
        if consolidation is not None:  # tests/k8s/test_k8s_consolidation.py
            Consolidator(self.ctrl, ConsolidationMetrics(self.registry), consolidation, clock).attach()
        self.ext.on_filter.append(self.ctrl.saw_filter)

    def metric(self, name: str, **labels: str) -> float:
        value = self.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    async def nodes(self, *names: str, gpus: int = 1) -> None:
        for n in names:
            self.api.put_node(n, node_spec(n, gpus=gpus))
        await until(lambda: self.view.synced and all(self.view.node_spec(n) for n in names), "nodes")

    def pod(
        self, name: str, priority: int = 0, never: bool = False, labels: dict[str, str] | None = None, **kw: Any
    ) -> str:
        obj = pod_obj(name, **kw)
        obj["spec"]["priority"] = priority
        if never:
            obj["spec"]["preemptionPolicy"] = "Never"
        obj["metadata"]["labels"] = dict(labels or {})
        self.api.put_pod(obj)
        return f"default/{name}"

    async def placed(self, name: str, node: str, priority: int = 0, **kw: Any) -> str:
        """A pod bound through the extender (filter, then bind), running since a given time."""
        key = self.pod(name, priority, **kw)
        await until(lambda: self.view.pod(key) is not None, key)
        assert self.filter(key) == [node], f"{key} should fit on {node}"
        err = (
            await self.ext.bind(
                ExtenderBindingArgs(PodName=name, PodNamespace="default", PodUID=self.uid(key), Node=node)
            )
        ).Error
        assert err == "", err
        obj = self.api.pods[key]
        obj["status"].update(phase="Running", startTime="2026-01-01T00:00:00Z")
        self.api.put_pod(obj)
        await until(lambda: (p := self.view.pod(key)) is not None and p.spec.node_name == node, f"{key} bound")
        return key

    async def waiting(self, name: str, priority: int = HIGH, nodes: list[str] | None = None, **kw: Any) -> str:
        """A pod the scheduler found no node for (PodScheduled=False, Unschedulable)."""
        key = self.pod(name, priority, **kw)
        obj = self.api.pods[key]
        obj["status"]["conditions"] = [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/1 nodes"}
        ]
        self.api.put_pod(obj)
        await until(lambda: (p := self.view.pod(key)) is not None and bool(p.status.conditions), f"{key} seen")
        assert self.filter(key, nodes) == [], f"{key} should fit nowhere"
        return key

    def uid(self, key: str) -> str:
        return str(self.api.pods[key]["metadata"]["uid"])

    def filter(self, key: str, nodes: list[str] | None = None) -> list[str]:
        """The nodes the extender's filter passes for pod ``key`` of ``nodes`` (default: all; those the
        kube-scheduler's own filters passed)."""
        pod = Pod.model_validate(self.api.pods[key])
        names = sorted(self.api.nodes) if nodes is None else nodes
        return list(self.ext.filter(ExtenderArgs(Pod=pod, NodeNames=names)).NodeNames or [])

    def nominated(self, key: str) -> str:
        return str(self.api.pods[key].get("status", {}).get("nominatedNodeName", ""))

    def terminating(self, key: str) -> bool:
        return bool(self.api.pods[key]["metadata"].get("deletionTimestamp"))


def run(
    body: Callable[[Harness], Awaitable[None]], leader: bool = True, tenancy: MpsTenancy | None = None, **harness: Any
) -> None:
    async def main() -> None:
        api = MemoryClusterApi()
        view = ClusterView(tenancy=tenancy)
        stop = asyncio.Event()
        task = asyncio.ensure_future(view.follow(api, stop, max_backoff_s=0.05))
        h = Harness(api, view, leader, **harness)
        try:
            await body(h)
            await h.ctrl.flush_events()
        finally:
            stop.set()
            await asyncio.wait_for(task, 5)

    asyncio.run(main())


def test_lower_priority_pod_is_evicted_and_its_room_is_held_for_the_preemptor_only() -> None:
    async def body(h: Harness) -> None:
        await h.nodes("n1")
        low = await h.placed("low", "n1", priority=0)  # the whole GPU
        high = await h.waiting("high")
        assert h.filter(high) == []

        report = await h.ctrl.round()
        assert report.preempted == (high,) and report.evicted == (low,)
        assert h.api.evictions == [low]
        assert h.nominated(high) == "n1"
        # The victim terminates: it keeps its share, so nobody (not even the preemptor) fits yet.
        assert h.terminating(low) and low in h.view.ledger.assignments
        other = await h.waiting("other", priority=0)
        assert h.filter(other) == [] and h.filter(high) == []
        # A second round neither evicts again nor plans for the preemptor again.
        await h.ctrl.round()
        assert h.api.evictions == [low]

        h.api.terminate(low)
        await until(lambda: h.view.held(high) is not None, "room held for the preemptor")
        # The freed room is the preemptor's: a lower-priority pod's filter finds none, the preemptor's finds it.
        assert h.filter(other) == []
        assert h.filter(high) == ["n1"]
        err = (
            await h.ext.bind(ExtenderBindingArgs(PodName="high", PodNamespace="default", PodUID=h.uid(high), Node="n1"))
        ).Error
        assert err == ""
        await until(lambda: (p := h.view.pod(high)) is not None and p.spec.node_name == "n1", "preemptor bound")
        await h.ctrl.round()
        assert h.ctrl.reservations() == {}
        assert h.filter(other) == []  # the GPU is the preemptor's now
        h.view.ledger.check_invariants()

        await h.ctrl.flush_events()
        by_pod = {(e.pod, e.reason): e for e in h.api.events}
        assert (
            by_pod[("low", "Preempted")].message == "preempted by default/high (priority 1000) for GPU room on node n1"
        )
        assert by_pod[("high", "Preempting")].message.startswith("Preempting 1 pod(s) on node n1")
        assert h.metric("sharegpu_preemptions_total", outcome=Outcome.PREEMPTED.value) == 1
        assert h.metric("sharegpu_preemptions_total", outcome=Outcome.BOUND.value) == 1
        assert h.metric("sharegpu_preemption_victims_total") == 1

    run(body)


def test_never_a_victim_of_equal_or_higher_priority() -> None:
    async def body(h: Harness) -> None:
        await h.nodes("n1", "n2", "n3")
        await h.placed("equal", "n1", priority=HIGH)
        await h.placed("higher", "n2", priority=HIGH + 1)
        low = await h.placed("low", "n3", priority=HIGH - 1)
        high = await h.waiting("high")
        report = await h.ctrl.round()
        assert report.evicted == (low,), report
        assert h.nominated(high) == "n3"
        # A second preemptor of the same priority finds nothing it may evict (low is already leaving for high).
        second = await h.waiting("second")
        report = await h.ctrl.round()
        assert second in report.refused and h.api.evictions == [low]
        assert h.metric("sharegpu_preemptions_total", outcome=Outcome.NO_ROOM.value) == 1

    run(body)


def test_two_preemptors_never_count_on_the_same_freed_room() -> None:
    async def body(h: Harness) -> None:
        await h.nodes("n1", "n2")
        a = await h.placed("low-a", "n1")
        b = await h.placed("low-b", "n2")
        h1 = await h.waiting("high-1")
        h2 = await h.waiting("high-2", priority=HIGH + 5)
        report = await h.ctrl.round()
        assert report.preempted == (h2, h1)  # the higher priority first
        assert sorted(h.api.evictions) == [a, b]
        assert {h.nominated(h1), h.nominated(h2)} == {"n1", "n2"}

    run(body)


def test_preemption_policy_never_waits() -> None:
    async def body(h: Harness) -> None:
        await h.nodes("n1")
        await h.placed("low", "n1")
        await h.waiting("polite", never=True)
        report = await h.ctrl.round()
        assert report.candidates == 0 and h.api.evictions == []
        assert h.metric("sharegpu_preemptions_total", outcome=Outcome.NEVER.value) == 1

    run(body)


def test_a_budget_that_refuses_the_eviction_ends_the_plan() -> None:
    async def body(h: Harness) -> None:
        await h.nodes("n1")
        low = await h.placed("low", "n1", labels={"app": "db"})
        h.api.pdbs["default/db"] = DisruptionBudget("default", "db", (("app", "db"),), (), 0)
        listed = DisruptionBudget("default", "db", (("app", "db"),), (), 1)

        async def budgets() -> list[DisruptionBudget]:  # listed before its last disruption was used up elsewhere
            return [listed]

        h.api.list_disruption_budgets = budgets  # type: ignore[method-assign]
        high = await h.waiting("high")
        report = await h.ctrl.round()
        assert high in report.refused and "refused by its PodDisruptionBudget" in report.refused[high]
        assert h.api.evictions == [] and not h.terminating(low)
        assert h.nominated(high) == "" and h.ctrl.reservations() == {}
        await h.ctrl.flush_events()
        assert [e.reason for e in h.api.events] == ["PreemptionBlocked"]
        assert h.metric("sharegpu_preemptions_total", outcome=Outcome.BLOCKED.value) == 1
        # Backed off: the next round does not ask again at once.
        await h.ctrl.round()
        assert h.api.calls.count(f"evict pod {low}") == 1

    run(body)


def test_the_node_whose_victims_no_budget_protects_is_chosen() -> None:
    async def body(h: Harness) -> None:
        await h.nodes("n1", "n2")
        await h.placed("guarded", "n1", labels={"app": "db"})  # lower priority, but protected
        free = await h.placed("free", "n2", priority=10)
        h.api.pdbs["default/db"] = DisruptionBudget("default", "db", (("app", "db"),), (), 0)
        await h.waiting("high")
        report = await h.ctrl.round()
        assert report.evicted == (free,)

    run(body)


def test_only_the_leader_preempts() -> None:
    async def body(h: Harness) -> None:
        await h.nodes("n1")
        low = await h.placed("low", "n1")
        h.leader = False
        high = await h.waiting("high")
        stop = asyncio.Event()
        task = asyncio.ensure_future(h.ctrl.run(stop))
        try:
            await asyncio.sleep(0.2)  # 20 intervals
            assert h.api.evictions == [] and h.nominated(high) == ""
            h.leader = True
            await until(lambda: h.api.evictions == [low], "the new leader preempts")
            h.leader = False  # stepping down forgets the reservations
            await until(lambda: h.ctrl.reservations() == {}, "reservations dropped")
        finally:
            stop.set()
            await asyncio.wait_for(task, 5)

    run(body)


def test_a_new_leader_adopts_a_preemption_in_progress_without_evicting_again() -> None:
    async def body(h: Harness) -> None:
        await h.nodes("n1")
        low = await h.placed("low", "n1")
        high = await h.waiting("high")
        await h.ctrl.round()
        assert h.api.evictions == [low]
        await until(lambda: bool((p := h.view.pod(low)) and p.metadata.deletion_timestamp), "victim terminating")
        h.ctrl.drop_all()  # as a new leader starts: nothing remembered
        report = await h.ctrl.round()
        assert report.preempted == (high,) and report.evicted == () and h.api.evictions == [low]
        assert h.metric("sharegpu_preemptions_total", outcome=Outcome.ADOPTED.value) == 1
        h.api.terminate(low)
        await until(lambda: h.view.held(high) is not None, "room held for the preemptor")
        other = await h.waiting("other", priority=0)
        assert h.filter(other) == []

    run(body)


def test_room_freed_by_the_first_victim_is_kept_while_the_others_terminate() -> None:
    """Found on the rig: two 40Gi victims share the GPU the preemptor needs whole; the first one gone left 40Gi that
    a low-priority 40Gi pod took, and the preemptor never fitted. (39Gi here: each victim's MPS daemon takes 66 MiB
    of the GPU too, as each declares no user.)"""

    async def body(h: Harness) -> None:
        await h.nodes("n1")
        a = await h.placed("low-a", "n1", memory="39Gi")
        b = await h.placed("low-b", "n1", memory="39Gi")
        high = await h.waiting("high")
        await h.ctrl.round()
        assert sorted(h.api.evictions) == [a, b]
        late = await h.waiting("late", priority=0, memory="39Gi")
        h.api.terminate(a)
        await until(lambda: h.view.pod(a) is None, "first victim gone")
        assert h.filter(late) == [] and h.filter(high) == []
        kept = h.view.kept_room(high, a)  # the gone victim's share, kept for the preemptor as a typed entry
        assert kept is not None and kept.assignment.node == "n1" and kept.ledger_name in h.view.ledger.assignments
        h.api.terminate(b)
        await until(lambda: h.view.held(high) is not None, "room held for the preemptor")
        assert h.filter(late) == []
        assert h.filter(high) == ["n1"]
        assert (
            h.view.room_for(high) == [] and [k for k in h.view.ledger.assignments if "#" in k] == []
        )  # the kept room went to the preemptor
        h.view.ledger.check_invariants()

    run(body)


def test_the_free_part_of_the_preemptors_room_is_held_while_its_victim_terminates() -> None:
    """The preemptor needs 60Gi where 40Gi are free and a low-priority 40Gi pod runs: one victim, and while it
    terminates (its controller recreating it at once) the 40Gi free already must not go to a lower-priority pod, or
    the room never comes together. Before, only consolidation held that part."""

    async def body(h: Harness) -> None:
        await h.nodes("n1")
        low = await h.placed("low", "n1", memory="40Gi")
        high = await h.waiting("high", memory="60Gi")
        await h.ctrl.round()
        assert h.api.evictions == [low]
        replica = await h.waiting("low-replica", priority=0, memory="30Gi")  # would fit in the free 40Gi
        assert h.filter(replica) == []
        kept = h.view.kept_room(high, None)  # the free part of its room, a typed entry of the assume cache
        assert kept is not None and kept.ledger_name in h.view.ledger.assignments
        h.view.ledger.check_invariants()
        h.api.terminate(low)
        await until(lambda: h.view.held(high) is not None, "room held for the preemptor")
        assert h.filter(replica) == [] and h.filter(high) == ["n1"]
        assert (
            h.view.room_for(high) == [] and [k for k in h.view.ledger.assignments if "#" in k] == []
        )  # placeholders gave way to the hold

    run(body)


def test_a_refused_eviction_releases_the_room_reserved_before_it() -> None:
    async def body(h: Harness) -> None:
        await h.nodes("n1")
        await h.placed("low", "n1", memory="40Gi", labels={"app": "db"})
        h.api.pdbs["default/db"] = DisruptionBudget("default", "db", (("app", "db"),), (), 0)
        high = await h.waiting("high", memory="60Gi")
        report = await h.ctrl.round()
        assert high in report.refused and h.api.evictions == []
        assert (
            h.ctrl.reservations() == {}
            and h.view.room_for(high) == []
            and [k for k in h.view.ledger.assignments if "#" in k] == []
        )
        other = h.pod("other", 0, memory="30Gi")
        await until(lambda: h.view.pod(other) is not None, other)
        assert h.filter(other) == ["n1"]  # the free 40Gi is anyone's again
        assert h.filter(high) == []

    run(body)


def test_victims_only_on_nodes_the_scheduler_passed_for_the_pod() -> None:
    async def body(h: Harness) -> None:
        await h.nodes("n1", "n2")
        await h.placed("cheap", "n1", priority=0)
        dear = await h.placed("dear", "n2", priority=500)
        await h.waiting("high", nodes=["n2"])  # its affinity (or taints) leave it n2 only
        report = await h.ctrl.round()
        assert report.evicted == (dear,)

    run(body)
