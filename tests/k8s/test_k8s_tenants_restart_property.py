"""No MPS unit's daemons are ever counted for other tenants than its pods', and never more than the cap, across
restarts of the extender (issue 32, item 7, the control plane's half): pods of several users and pods that declare
none are filtered, bound and deleted in any order, and at any point the extender is replaced by a fresh one that
lists the same API server, as a restart or a new leader does. The node's half is
tests/node/test_node_mps_tenancy.py and tests/dra/test_dra_tenants_property.py."""

from __future__ import annotations

import asyncio
from collections import defaultdict

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from k8s_helpers import node_spec, pod_obj
from memory_api import MemoryClusterApi
from test_k8s_preemption import until

from sharegpu.k8s.cache.view import ClusterView
from sharegpu.k8s.extender.server import Extender
from sharegpu.kube.schema import ExtenderArgs, ExtenderBindingArgs, Pod
from sharegpu.ledger import MpsTenancy
from sharegpu.model.assignment import Assignment, Mechanism
from sharegpu.model.contract import ASSIGNMENT_ANNOTATION

CAP = 2  # daemons per unit: small, so that the cap binds often
NODES = ("n1", "n2")

op = st.one_of(
    st.tuples(st.just("pod"), st.sampled_from([None, 1000, 2000]), st.sampled_from(["4Gi", "20Gi"])),
    st.tuples(st.just("delete"), st.integers(min_value=0, max_value=30)),
    st.tuples(st.just("restart")),
)


def _expected(api: MemoryClusterApi) -> dict[tuple[str, int], set[str]]:
    """The tenants of the MPS shares bound on each (node, GPU), from the API server's pods alone."""
    out: dict[tuple[str, int], set[str]] = defaultdict(set)
    for obj in api.pods.values():
        text = obj["metadata"].get("annotations", {}).get(ASSIGNMENT_ANNOTATION)
        if not text or not obj["spec"].get("nodeName"):
            continue
        a = Assignment.from_json(text)
        for s in a.shares:
            if s.sharing is Mechanism.MPS and s.mig is None:
                assert a.tenant is not None
                out[(a.node, s.gpu_index)].add(a.tenant)
    return dict(out)


def _bound(view: ClusterView, key: str) -> bool:
    pod = view.pod(key)
    return pod is not None and bool(pod.spec.node_name)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(op, min_size=1, max_size=16))
@example(  # both GPUs at the cap with tenants of their own, a restart, a tenant gone, a restart
    steps=[("pod", None, "20Gi"), ("pod", None, "20Gi"), ("pod", 1000, "20Gi"), ("pod", 1000, "4Gi"),
           ("pod", 2000, "4Gi"), ("pod", None, "4Gi"), ("restart",), ("delete", 0), ("pod", 2000, "4Gi"), ("restart",)]
)  # fmt: skip
def test_daemons_are_counted_per_tenant_and_capped_across_extender_restarts(steps: list[tuple[object, ...]]) -> None:
    async def main() -> None:
        api = MemoryClusterApi()
        for n in NODES:
            api.put_node(n, node_spec(n, gpus=1))
        tenancy = MpsTenancy(daemons_per_unit=CAP)

        async def start() -> tuple[ClusterView, Extender, asyncio.Event, asyncio.Task[None]]:
            view = ClusterView(tenancy=tenancy)
            stop = asyncio.Event()
            task = asyncio.ensure_future(view.follow(api, stop, max_backoff_s=0.05))
            await until(lambda: view.synced and all(view.node_spec(n) for n in NODES), "the nodes")
            return view, Extender(view, api, is_leader=lambda: True, policy="bestfit"), stop, task

        view, ext, stop, task = await start()
        names: list[str] = []
        try:
            for i, step in enumerate(steps):
                if step[0] == "pod":
                    user, memory = step[1], step[2]
                    assert user is None or isinstance(user, int)
                    assert isinstance(memory, str)
                    name = f"p{i}"
                    api.put_pod(pod_obj(name, memory=memory, compute=10, run_as_user=user))
                    key = f"default/{name}"
                    await until(lambda v=view, k=key: v.pod(k) is not None, key)
                    pod = Pod.model_validate(api.pods[key])
                    fits = ext.filter(ExtenderArgs(Pod=pod, NodeNames=list(NODES))).NodeNames or []
                    if fits:
                        uid = str(api.pods[key]["metadata"]["uid"])
                        args = ExtenderBindingArgs(PodName=name, PodNamespace="default", PodUID=uid, Node=fits[0])
                        assert (await ext.bind(args)).Error == ""
                        await until(lambda v=view, k=key: _bound(v, k), key)
                    names.append(key)
                elif step[0] == "delete":
                    live = [k for k in names if k in api.pods]
                    if live:
                        assert isinstance(step[1], int)
                        key = live[step[1] % len(live)]
                        api.delete_pod(key)
                        await until(lambda v=view, k=key: v.pod(k) is None, f"{key} gone")
                else:
                    before = {u: dict(t) for u, t in view.ledger.unit_tenants.items()}
                    stop.set()
                    await asyncio.wait_for(task, 5)
                    view, ext, stop, task = await start()
                    assert {u: dict(t) for u, t in view.ledger.unit_tenants.items()} == before
                led = view.ledger
                led.check_invariants()
                counted = {
                    (led.nodes[n].name, g): set(tenants) for (n, g, start), tenants in led.unit_tenants.items()
                    if start is None and tenants
                }  # fmt: skip
                assert counted == _expected(api)
                assert all(len(t) <= CAP for t in counted.values()), counted
        finally:
            stop.set()
            await asyncio.wait_for(task, 5)

    asyncio.run(main())
