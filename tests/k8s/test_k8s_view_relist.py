"""A relist that keeps the ledger (the nodes unchanged, nothing left out) accounts exactly what a ledger rebuilt from
the same list holds: pods added, bound, finished, deleted, replaced and corrupted between relists, holds of this
process in flight, and node changes (which rebuild)."""

from __future__ import annotations

import contextlib
import dataclasses
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from k8s_helpers import pod_obj, with_assignment
from memory_api import MemoryClusterApi

from sharegpu.k8s.cache.view import ClusterView
from sharegpu.k8s.extender.schedulers import Schedulers
from sharegpu.k8s.pod_request import pod_request
from sharegpu.kube.schema import Node, Pod
from sharegpu.ledger import Ledger, LedgerError
from sharegpu.model.request import InvalidRequest
from sharegpu.placement.framework import Decision
from test_fast_paths import random_cluster

ARRAYS = ("cpu_free", "mem_free", "free_milli", "free_mem", "mode", "clients", "mig_slots_used", "mig_slices_used")


def state(led: Ledger) -> tuple[object, ...]:
    return (
        dict(led.assignments),
        tuple(led.__dict__[a].tolist() for a in ARRAYS),
        {k: dict(v) for k, v in led.instances.items() if v},
        [sorted(p) for p in led.node_pods],
    )


def relist(api: MemoryClusterApi, view: ClusterView) -> None:
    view.reset([Node.model_validate(n) for n in api.nodes.values()], [Pod.model_validate(p) for p in api.pods.values()])


def random_pod(rnd: random.Random, name: str) -> dict:
    return pod_obj(
        name,
        gpu=rnd.choice([1, 1, 2]),
        memory=rnd.choice([None, "2Gi", "10Gi"]),
        compute=rnd.choice([None, 10, 30, 50]),
        cpu=rnd.choice(["1", "4"]),
    )


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1))
def test_a_relist_that_keeps_the_ledger_equals_a_rebuild(seed: int) -> None:
    rnd = random.Random(seed)
    specs = random_cluster(rnd, rnd.randint(1, 6))
    api = MemoryClusterApi()
    for s in specs:
        api.put_node(s.name, s)
    view = ClusterView()
    schedulers = Schedulers(view, "bestfit")
    relist(api, view)
    serial = 0
    for _ in range(15):
        nodes_changed = corrupted = False
        for _ in range(rnd.randint(1, 5)):
            roll = rnd.random()
            keys = sorted(api.pods)
            if roll < 0.45 or not keys:  # a new pod, bound where the view's policy would put it
                serial += 1
                obj = random_pod(rnd, f"p{serial}")
                try:
                    req = pod_request(Pod.model_validate(obj), view.catalog)
                except InvalidRequest:
                    continue
                assert req is not None
                d = schedulers.placement().decide(req)
                if isinstance(d, Decision):
                    obj = with_assignment(obj, d.assignment.to_json(), d.assignment.node)
                api.put_pod(obj)
            elif roll < 0.6:
                api.delete_pod(rnd.choice(keys))
            elif roll < 0.7:
                api.set_phase(rnd.choice(keys), "Succeeded")
            elif roll < 0.78:  # replaced: same name, another UID, nothing held
                key = rnd.choice(keys)
                obj = api.pods[key]
                obj["metadata"]["uid"] = f"uid-{serial}-again"
                obj["spec"].pop("nodeName", None)
                obj["metadata"]["annotations"].pop("sharegpu.io/assignment", None)
                api.put_pod(obj)
            elif roll < 0.84:  # an assignment that cannot be accounted: reported, and the ledger is rebuilt
                key = rnd.choice(keys)
                obj = with_assignment(api.pods[key], "{not json", specs[0].name)
                api.put_pod(obj)
                corrupted = True
            elif roll < 0.9:  # a node changes: the ledger is rebuilt
                s = rnd.choice(specs)
                api.put_node(s.name, dataclasses.replace(s, cpu_milli=s.cpu_milli + 1000))
                specs[specs.index(s)] = dataclasses.replace(s, cpu_milli=s.cpu_milli + 1000)
                nodes_changed = True
            else:  # this process holds a placement for a pending pod: in flight across the relist
                pending = [k for k in keys if not api.pods[k]["spec"].get("nodeName")]
                if pending:
                    try:
                        req = pod_request(Pod.model_validate(api.pods[pending[0]]), view.catalog)
                    except InvalidRequest:
                        req = None
                    d = schedulers.placement().decide(req) if req is not None else None
                    if isinstance(d, Decision):
                        with contextlib.suppress(LedgerError):  # the pod already holds one
                            view.hold(d.assignment, api.pods[pending[0]]["metadata"]["uid"], float("inf"))
        before = view.ledger
        had_problems = bool(view.problems)
        relist(api, view)
        if not (nodes_changed or corrupted or had_problems or view.problems):
            assert view.ledger is before  # kept: the relist accounted only what changed
        got, problems = state(view.ledger), view.problems
        view._ledger = None  # rebuilt from the same list (and the same holds in flight)
        assert state(view.ledger) == got
        assert view.problems == problems
        view.ledger.check_invariants()
