"""What the simulator predicts is what the cluster does: the same pods through the extender's filter → prioritize →
bind (choosing the host as the kube-scheduler does, by the highest score) land exactly where the core's
Scheduler.decide puts them on a ledger of its own."""

from __future__ import annotations

import asyncio
import random

from k8s_helpers import node_spec, nodes, pod_obj
from memory_api import MemoryClusterApi

from sharegpu.k8s.cache.view import ClusterView
from sharegpu.k8s.extender.server import Extender
from sharegpu.k8s.pod_request import pod_request
from sharegpu.kube.schema import ExtenderArgs, ExtenderBindingArgs, Pod
from sharegpu.ledger import Ledger
from sharegpu.model.assignment import Assignment
from sharegpu.model.contract import ASSIGNMENT_ANNOTATION
from sharegpu.placement.fragmentation import Workload
from sharegpu.placement.framework import Decision, Scheduler
from sharegpu.placement.policies import PolicyContext, make_policy

SHAPES = [
    {"memory": "10Gi", "compute": 20, "annotations": {"sharegpu.io/isolation": "memory"}},
    {"memory": "4Gi"},
    {"compute": 50, "annotations": {"sharegpu.io/sharing": "time-slicing"}},
    {"gpu": 2},
    {"gpu": 1},
    {"memory": "20Gi", "annotations": {"sharegpu.io/isolation": "hardware"}},
    {"memory": "8Gi", "annotations": {"sharegpu.io/gpu-model": "V100-16GB"}},
]


def test_extender_places_like_the_simulator() -> None:
    rnd = random.Random(7)
    specs = [node_spec(f"h{i}", "H100-80GB", 4) for i in range(3)]
    specs += [node_spec(f"a{i}", "A100-80GB", 2) for i in range(2)]
    specs += [node_spec(f"v{i}", "V100-16GB", 4) for i in range(3)]
    objs = [pod_obj(f"p{i:02d}", **rnd.choice(SHAPES)) for i in range(60)]
    reqs = [pod_request(Pod.model_validate(o)) for o in objs]
    workload = Workload.from_requests(r for r in reqs if r is not None)

    sim = Scheduler(Ledger(specs), make_policy("sharegpu", PolicyContext(workload)))
    expected: dict[str, Assignment | None] = {}
    for r in reqs:
        assert r is not None
        d = sim.decide(r)
        expected[r.name] = d.assignment if isinstance(d, Decision) else None
        if isinstance(d, Decision):
            sim.ledger.place(d.assignment)
    assert sum(a is not None for a in expected.values()) > 30

    async def cluster() -> dict[str, Assignment | None]:
        api = MemoryClusterApi()
        for s in specs:
            api.put_node(s.name, s)
        view = ClusterView()
        view.reset(nodes(list(api.nodes.values())), [])
        view.synced = True
        ext = Extender(view, api, policy="sharegpu", workload=workload)
        names = [s.name for s in specs]
        got: dict[str, Assignment | None] = {}
        for o in objs:
            stored = api.put_pod(o)
            key = f"default/{o['metadata']['name']}"
            args = ExtenderArgs.model_validate({"Pod": stored, "NodeNames": names})
            passed = ext.filter(args).NodeNames or []
            got[key] = None
            if not passed:
                continue
            prio = ext.prioritize(ExtenderArgs.model_validate({"Pod": stored, "NodeNames": passed}))
            host = max(prio, key=lambda h: h[1])[0]
            meta = stored["metadata"]
            res = await ext.bind(
                ExtenderBindingArgs(PodName=meta["name"], PodNamespace="default", PodUID=meta["uid"], Node=host)
            )
            assert res.Error == ""
            got[key] = Assignment.from_json(api.pods[key]["metadata"]["annotations"][ASSIGNMENT_ANNOTATION])
        view.ledger.check_invariants()
        assert view.ledger.state() == sim.ledger.state()
        return got

    assert asyncio.run(cluster()) == expected
