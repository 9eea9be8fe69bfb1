"""The extender's filter and prioritize answers, joined from cached JSON pieces, equal answers computed from
scratch the plain way (a cache-less scheduler over the same ledger, reasons classified and made readable node by
node, dicts encoded by pydantic), over random clusters, pods and node lists (unknown names, names given twice), while
the ledger changes between cycles (prioritize holds what it chose, holds lapse, pods leave)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from k8s_helpers import node_obj, nodes, pod_obj
from memory_api import MemoryClusterApi

from sharegpu.k8s.cache.view import ClusterView
from sharegpu.k8s.extender import answers
from sharegpu.k8s.extender.answers import event_safe
from sharegpu.k8s.extender.server import Extender
from sharegpu.k8s.pod_request import pod_request
from sharegpu.kube.schema import MAX_EXTENDER_PRIORITY, ExtenderArgs, Pod
from sharegpu.model.request import InvalidRequest
from sharegpu.placement.framework import CycleState, Policy, Scheduler
from test_fast_paths import random_cluster


def random_pod(rnd: random.Random, i: int) -> dict:
    models = ["A100-40GB", "H100-80GB", "T4", "V100-16GB", "P100", "G2"]
    annotations = {"sharegpu.io/gpu-model": ",".join(rnd.sample(models, 2))} if rnd.random() < 0.25 else {}
    return pod_obj(
        f"p{i}",
        gpu=rnd.choice([None, 1, 1, 1, 2, 4, 8]),
        memory=rnd.choice([None, None, "2Gi", "10Gi", "30Gi", "90Gi"]),
        compute=rnd.choice([None, None, 5, 30, 50, 100]),
        annotations=annotations,
        cpu=rnd.choice(["1", "8", "32", "100"]),
    )


def reference_filter(view: ClusterView, policy: Policy, pod: Pod, names: list[str]) -> dict:
    """Filter's answer from scratch, node by node (the synced path; the pod asks for sharegpu)."""
    req = pod_request(pod, view.catalog)
    assert req is not None
    sched = Scheduler(view.ledger, policy)  # nothing remembered
    ok, usable = sched.feasible(req)
    passed, failed, unresolvable = [], {}, {}
    for name in names:
        n = view.ledger.index.get(name)
        if n is None:
            unresolvable[name] = event_safe(view.node_problem(name))
        elif ok[n]:
            passed.append(name)
        else:
            reason = sched.explain_nodes(req, usable, np.array([n]))[0]
            (unresolvable if reason.unresolvable else failed)[name] = event_safe(reason.text)
    return {
        "Nodes": None,
        "NodeNames": passed,
        "FailedNodes": failed,
        "FailedAndUnresolvableNodes": unresolvable,
        "Error": "",
    }


def reference_priorities(view: ClusterView, policy: Policy, pod: Pod, names: list[str]) -> list[dict]:
    req = pod_request(pod, view.catalog)
    assert req is not None
    led = view.ledger
    sched = Scheduler(led, policy)
    ok, usable = sched.feasible(req)
    cand = np.array(sorted({led.index[n] for n in names if n in led.index and ok[led.index[n]]}), dtype=np.int64)
    by_node: dict[int, int] = {}
    if len(cand):
        state = CycleState(req, usable, np.random.default_rng(0))
        scores = sum(w * p.score(led, state, cand) for p, w in sched.policy.scorers)
        best = sched.pick(cand, scores)
        lo, hi = int(scores.min()), int(scores.max())
        for n, s in zip(cand.tolist(), scores.tolist(), strict=True):
            top = MAX_EXTENDER_PRIORITY - 1
            by_node[n] = MAX_EXTENDER_PRIORITY if n == best else top if hi == lo else (s - lo) * top // (hi - lo)
    return [{"Host": n, "Score": by_node.get(led.index.get(n, -1), 0)} for n in names]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1), st.sampled_from(["bestfit", "sharegpu", "fgd"]), st.booleans())
def test_answers_equal_answers_from_scratch(seed: int, policy: str, tiny_caches: bool) -> None:
    rnd = random.Random(seed)
    specs = random_cluster(rnd, rnd.randint(1, 9))
    view = ClusterView()
    view.reset(nodes([node_obj(s) for s in specs] + [node_obj(None, "cpu-only")]), [])
    view.synced = True
    # With an API prioritize holds its choice, so the ledger moves; not narrowed: every passed node is answered.
    ext = Extender(view, MemoryClusterApi(), narrow=False, policy=policy)
    everyone = [s.name for s in specs] + ["cpu-only", "gone-node"]
    with pytest.MonkeyPatch.context() as mp:
        if tiny_caches:  # reasons forgotten and shapes evicted all the time: answers must not change
            mp.setattr(answers, "MAX_REASONS", 3)
            mp.setattr(answers, "MAX_SHAPES", 2)
        for i in range(30):
            obj = random_pod(rnd, rnd.randrange(12))  # names come back: holds of earlier cycles are dropped
            obj["metadata"]["resourceVersion"] = str(2 + i)  # a pod's content changes only with its version
            pod = Pod.model_validate(obj)
            try:
                asks = pod_request(pod, view.catalog) is not None
            except InvalidRequest:
                asks = False
            if rnd.random() < 0.7:
                names = everyone  # the same list every cycle, as the kube-scheduler sends it
            else:
                names = rnd.sample(everyone, rnd.randint(0, len(everyone)))
                names += rnd.sample(names, min(len(names), rnd.randint(0, 2)))  # a name given twice
            args = ExtenderArgs.model_validate({"Pod": pod.model_dump(by_alias=True), "NodeNames": names})
            answer = ext.filter_answer(args)
            got = json.loads(answer.body)
            assert ext.filter(args).model_dump() == got
            if not asks:
                continue
            expected = reference_filter(view, ext.decisions.schedulers.placement().policy, pod, names)
            assert got == expected
            assert answer.passed == len(expected["NodeNames"]) and not answer.not_synced
            # Prioritize is sent the passed names (or, now and then, another list: the cached lookup must miss).
            prio_names = got["NodeNames"] if rnd.random() < 0.8 else rnd.sample(everyone, len(everyone))
            prio_args = ExtenderArgs.model_validate({"Pod": pod.model_dump(by_alias=True), "NodeNames": prio_names})
            expected_prio = reference_priorities(view, ext.decisions.schedulers.placement().policy, pod, prio_names)
            assert json.loads(ext.prioritize_answer(prio_args)) == expected_prio
            if rnd.random() < 0.3:
                view.drop_holds()
            elif rnd.random() < 0.2:
                view.expire_holds(float("inf"))
    view.ledger.check_invariants()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1), st.sampled_from(["bestfit", "sharegpu", "fgd"]))
def test_a_narrowed_filter_leaves_the_node_prioritize_would_rank_first(seed: int, policy: str) -> None:
    """Narrowed (the default): filter leaves only the policy's pick and holds its share — the node the full path
    (filter passes all that fit, prioritize gives 10 to one) would bind to, with the same share held."""
    rnd = random.Random(seed)
    specs = random_cluster(rnd, rnd.randint(1, 9))
    views = [ClusterView() for _ in range(2)]
    for v in views:
        v.reset(nodes([node_obj(s) for s in specs] + [node_obj(None, "cpu-only")]), [])
        v.synced = True
    narrow, full = (
        Extender(views[0], MemoryClusterApi(), policy=policy),
        Extender(views[1], MemoryClusterApi(), narrow=False, policy=policy),
    )
    everyone = [s.name for s in specs] + ["cpu-only", "gone-node"]
    for i in range(30):
        obj = random_pod(rnd, rnd.randrange(12))
        obj["metadata"]["resourceVersion"] = str(2 + i)
        names = rnd.sample(everyone, rnd.randint(0, len(everyone)))
        args = ExtenderArgs.model_validate({"Pod": obj, "NodeNames": names})
        got, expected = narrow.filter(args), full.filter(args)
        try:
            asks = pod_request(args.Pod, views[0].catalog) is not None
        except InvalidRequest:
            asks = False
        if asks and expected.NodeNames:
            prio = full.prioritize(ExtenderArgs.model_validate({"Pod": obj, "NodeNames": expected.NodeNames}))
            assert got.NodeNames == [host for host, score in prio if score == MAX_EXTENDER_PRIORITY]
            assert got.FailedNodes == {} and got.FailedAndUnresolvableNodes == {}
        else:
            assert got == expected  # nothing fits (every node explained) or no sharegpu request: as before
        assert views[0].ledger.state() == views[1].ledger.state()  # the same share held (or none)
        if rnd.random() < 0.3:
            for v in views:
                v.drop_holds()


def test_nodes_mode_answers_equal_node_name_mode_answers() -> None:
    rnd = random.Random(7)
    specs = random_cluster(rnd, 8)
    view = ClusterView()
    objs = [node_obj(s) for s in specs] + [node_obj(None, "cpu-only")]
    view.reset(nodes(objs), [])
    view.synced = True
    ext = Extender(view, None, policy="bestfit")
    for i in range(40):
        pod = random_pod(rnd, i)
        by_names = json.loads(
            ext.filter_answer(
                ExtenderArgs.model_validate({"Pod": pod, "NodeNames": [o["metadata"]["name"] for o in objs]})
            ).body
        )
        by_nodes = json.loads(
            ext.filter_answer(ExtenderArgs.model_validate({"Pod": pod, "Nodes": {"items": objs}})).body
        )
        assert [n["metadata"]["name"] for n in by_nodes["Nodes"]["items"]] == by_names["NodeNames"]
        assert by_nodes["FailedNodes"] == by_names["FailedNodes"]
        assert by_nodes["FailedAndUnresolvableNodes"] == by_names["FailedAndUnresolvableNodes"]


def test_reasons_with_a_percent_are_event_safe() -> None:
    assert event_safe("most free compute 0% < 10% asked") == "most free compute 0 percent < 10 percent asked"
