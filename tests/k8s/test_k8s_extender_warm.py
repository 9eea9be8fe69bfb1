"""The extender's warm-up (issue 34): warming every pod shape changes no decision, and the running extender warms
each scheduler the decisions build (after the first list and after a relist) without building one on its own."""

from __future__ import annotations

import asyncio
import gc
import random
from collections.abc import Iterator

import pytest
from k8s_helpers import node_obj, node_spec, nodes

from sharegpu.k8s.cache.view import ClusterView
from sharegpu.k8s.extender.schedulers import Schedulers
from sharegpu.k8s.extender.warm import POLL_S, keep_warm, warm_all
from sharegpu.ledger import Ledger
from sharegpu.model.request import GpuRequest
from sharegpu.placement.fragmentation import Workload
from sharegpu.placement.framework import Decision, Scheduler
from sharegpu.placement.policies import PolicyContext, make_policy
from test_fast_paths import random_cluster, random_request


def _replay(sched: Scheduler, reqs: list[GpuRequest], warm_every: int, chunk: int) -> list[object]:
    """Every decision of ``reqs`` in order, placed where one is made; the scheduler warmed for every shape of
    ``reqs`` first and again every ``warm_every`` requests (0: never)."""
    shapes = list({r.shape_key(): r for r in reqs}.values())
    out: list[object] = []
    for i, r in enumerate(reqs):
        if warm_every and i % warm_every == 0:
            for s in shapes:
                for _ in sched.warm(s, chunk):
                    pass
        d = sched.decide(r)
        if isinstance(d, Decision):
            sched.ledger.place(d.assignment)
            out.append((r.name, d.node_index, d.score, d.feasible, d.assignment))
        else:
            out.append((r.name, repr(d)))
    return out


@pytest.mark.parametrize("policy", ["sharegpu", "fgd", "bestfit", "random", "packing"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_warmed_and_unwarmed_schedulers_decide_alike(policy: str, seed: int) -> None:
    """A recorded sequence (random cluster, random requests of every kind, tenants included) replayed through a
    scheduler warmed for every shape (in slices of a few nodes, again every 20 pods, so cached rows are also read
    after nodes changed) and through one never warmed: every decision is the same, the random policy's too (the
    warm-up draws from no generator of the scheduler)."""
    rnd = random.Random(seed)
    specs = random_cluster(rnd, 30)
    reqs = [random_request(rnd, f"p{i}") for i in range(160)]
    workload = Workload.from_requests(reqs)

    def run(warm_every: int) -> list[object]:
        sched = Scheduler(Ledger(specs), make_policy(policy, PolicyContext(workload)), seed=seed)
        return _replay(sched, reqs, warm_every, chunk=7)

    unwarmed = run(0)
    assert sum(1 for d in unwarmed if len(d) == 5) > 20  # the trace places pods, not only refusals
    assert run(20) == unwarmed
    assert run(1) == unwarmed


def test_warm_all_fills_each_shape_so_the_first_cycle_computes_nothing() -> None:
    rnd = random.Random(7)
    specs = random_cluster(rnd, 20)
    reqs = [random_request(rnd, f"p{i}") for i in range(40)]
    sched = Scheduler(Ledger(specs), make_policy("sharegpu", PolicyContext(Workload.from_requests(reqs))))
    shapes = list({r.shape_key(): r for r in reqs}.values())
    for s in shapes:
        for _ in sched.warm(s, 3):
            pass
    calls = 0
    policy = sched.policy
    for plugin, _ in policy.scorers:
        original = type(plugin)._parts if hasattr(type(plugin), "_parts") else None
        if original is None:
            continue

        def counting(self: object, *a: object, _o=original) -> object:  # type: ignore[no-untyped-def]
            nonlocal calls
            calls += 1
            return _o(self, *a)

        with pytest.MonkeyPatch.context() as m:
            m.setattr(type(plugin), "_parts", counting)
            for s in shapes:
                sched.decide(s)
    assert calls == 0


def test_keep_warm_builds_at_the_list_warms_and_warms_again_after_a_relist() -> None:
    specs = [node_spec(f"n{i}", gpus=2) for i in range(12)]
    view = ClusterView()
    objs = [node_obj(s) for s in specs]
    reqs = [GpuRequest(f"default/p{i}", 1, compute_milli=100 * (1 + i % 3), cpu_milli=1000) for i in range(9)]
    view.requests = lambda: list(reqs)  # type: ignore[method-assign]
    view.request_count = lambda: len(reqs)  # type: ignore[method-assign]
    schedulers = Schedulers(view, "sharegpu")

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.ensure_future(keep_warm(schedulers, stop, chunk=5))
        await asyncio.sleep(0.05)
        assert schedulers.current() is None  # not listed yet: nothing built
        view.reset(nodes(objs), [])
        view.synced = True
        for _ in range(200):
            await asyncio.sleep(0.01)
            if schedulers.current() is not None and len(schedulers.current().memo._entries) > 0:
                break
        first = schedulers.current()
        assert first is not None and first.ledger is view.ledger
        await asyncio.sleep(0.1)
        assert set(first._feasible) == {r.shape_key() for r in reqs}
        assert schedulers.placement() is first  # the decisions find the warmed scheduler
        # A relist that finds a node more: the view builds a new ledger (an unchanged list keeps it).
        view.reset(nodes([*objs, node_obj(node_spec("n-new", gpus=4))]), [])
        assert view.ledger is not first.ledger
        for _ in range(200):
            await asyncio.sleep(0.01)
            s = schedulers.current()
            if s is not None and s is not first and set(s._feasible) == {r.shape_key() for r in reqs}:
                break
        second = schedulers.current()
        assert second is not None and second is not first and second.ledger is view.ledger
        await asyncio.sleep(0.1)
        assert set(second._feasible) == {r.shape_key() for r in reqs}
        stop.set()
        await asyncio.wait_for(task, 2)

    asyncio.run(main())


def _listed_schedulers() -> Schedulers:
    """The decisions' schedulers over a listed view of four nodes whose pods have one shape."""
    view = ClusterView()
    view.reset(nodes([node_obj(node_spec(f"n{i}", gpus=2)) for i in range(4)]), [])
    view.synced = True
    reqs = [GpuRequest("default/p", 1, compute_milli=100, cpu_milli=1000)]
    view.requests = lambda: list(reqs)  # type: ignore[method-assign]
    view.request_count = lambda: len(reqs)  # type: ignore[method-assign]
    return Schedulers(view, "sharegpu")


@pytest.mark.parametrize("freeze", [False, True])
def test_the_serving_process_freezes_the_warmed_heap_and_only_it(freeze: bool) -> None:
    schedulers = _listed_schedulers()
    gc.unfreeze()

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.ensure_future(keep_warm(schedulers, stop, chunk=5, freeze=freeze))
        for _ in range(200):
            await asyncio.sleep(0.01)
            s = schedulers.current()
            if s is not None and s._feasible:
                break
        await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(task, 2)

    try:
        asyncio.run(main())
        # Frozen: the view's and the warmed scheduler's objects no longer in the collector's generations.
        assert (gc.get_freeze_count() > 0) is freeze
    finally:
        gc.unfreeze()


def test_a_failing_warm_up_is_logged_once_and_the_task_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    schedulers = _listed_schedulers()

    def broken(self: Scheduler, req: GpuRequest, chunk: int) -> Iterator[None]:
        raise RuntimeError("boom")
        yield

    async def main() -> bool:
        stop = asyncio.Event()
        task = asyncio.ensure_future(keep_warm(schedulers, stop, chunk=5))
        await asyncio.sleep(POLL_S * 3)
        alive = not task.done()
        stop.set()
        await asyncio.wait_for(task, 2)
        return alive

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Scheduler, "warm", broken)
        assert asyncio.run(main())  # still watching for the next scheduler
    failures = [r for r in caplog.records if "warming pod shapes failed" in r.getMessage()]
    assert len(failures) == 1 and "boom" in (failures[0].exc_text or "")


def test_warm_requests_one_per_shape_most_common_first() -> None:
    view = ClusterView()
    view.reset(nodes([node_obj(node_spec("n0", gpus=1))]), [])
    a = GpuRequest("default/a", 1, compute_milli=100)
    b = GpuRequest("default/b", 1, compute_milli=200)
    reqs = [a, b, GpuRequest("default/b2", 1, compute_milli=200, tenant="ns/uid-1")]
    view.requests = lambda: list(reqs)  # type: ignore[method-assign]
    schedulers = Schedulers(view, "sharegpu")
    assert [r.name for r in schedulers.warm_requests()] == ["default/b", "default/a"]
    assert warm_all(schedulers.placement(), schedulers) == 2


def test_prioritize_keeps_filters_name_lookup() -> None:
    """Filter's cached name → index array survives a prioritize of fewer names (issue 34): the next filter of the
    same list finds it instead of looking every name up again."""
    from k8s_helpers import pod_obj

    from sharegpu.k8s.extender.decisions import Decisions
    from sharegpu.kube.schema import ExtenderArgs

    specs = [node_spec(f"n{i}", gpus=2) for i in range(6)]
    view = ClusterView()
    view.reset(nodes([node_obj(s) for s in specs]), [])
    view.synced = True
    decisions = Decisions(view, policy="bestfit", may_hold=lambda: False)
    names = [s.name for s in specs]
    pod = pod_obj("p", compute=10)
    f = decisions.filter(ExtenderArgs.model_validate({"Pod": pod, "NodeNames": names}))
    assert f.NodeNames
    filters = decisions._names
    assert filters is not None and filters[1] == names
    prio = decisions.prioritize(ExtenderArgs.model_validate({"Pod": pod, "NodeNames": names[:1]}))
    assert [h for h, _ in prio] == names[:1]
    assert decisions._names is filters  # not replaced by prioritize's list
    decisions.filter(ExtenderArgs.model_validate({"Pod": pod, "NodeNames": names}))
    assert decisions._names is filters  # found, not looked up again
