"""Issue 28 on the rig's real control plane: what the webhook refuses through a real AdmissionReview, names that are
no Kubernetes names against the real API server, a pod that asks for no GPU through the real kube-scheduler's bind,
and preemption under a real policy/v1 PodDisruptionBudget kept by the real disruption controller (with the real
Eviction API's 429).

Skipped unless SHAREGPU_TEST_KUBECONFIG names the rig's kubeconfig.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from k8s_helpers import pod_obj
from rig import KUBECONFIG, SKIP_REASON, Rig, audit, chart_webhooks, wait_for
from test_k8s_rig_preemption import HIGH_VALUE, Watchdog, _delete_priority_class, _priority_class
from test_k8s_rig_scheduling import webhooks_in_force

pytestmark = pytest.mark.skipif(not KUBECONFIG, reason=SKIP_REASON)


def rig_pod(name: str, **kw: Any) -> dict[str, Any]:
    obj = pod_obj(name, **kw)
    for k in ("uid", "resourceVersion", "namespace"):
        obj["metadata"].pop(k, None)
    obj.pop("status", None)
    return obj


# ----- the webhook through a real AdmissionReview (items 1-3) ------------------------------------------------------
def test_the_webhook_refuses_a_typo_zero_gpus_and_a_bad_movable_through_the_api_server(rig: Rig) -> None:
    from lightkube.core.exceptions import ApiError
    from lightkube.resources.core_v1 import Pod

    with chart_webhooks(rig, lambda ns: webhooks_in_force(rig, ns)) as ns:

        def refusal(obj: dict[str, Any]) -> str:
            with pytest.raises(ApiError) as e:
                rig.client.create(Pod.from_dict(obj), namespace=ns)
            assert "denied the request" in str(e.value), e.value
            return str(e.value)

        typo = rig_pod("typo", gpu=None, scheduler_name=None)
        typo["spec"]["containers"][0]["resources"]["limits"]["sharegpu.io/gpu-mem"] = "10Gi"
        message = refusal(typo)
        assert "unknown resource sharegpu.io/gpu-mem" in message and "did you mean sharegpu.io/gpu-memory?" in message
        zero = refusal(rig_pod("zero", gpu=0, scheduler_name=None))
        assert "sharegpu.io/gpu: 0" in zero and "1 or more" in zero
        movable = refusal(rig_pod("movable", memory="10Gi", annotations={"sharegpu.io/movable": "yes"}))
        assert "sharegpu.io/movable is 'yes'" in movable
        # The same pods written right are admitted.
        ok = rig_pod("ok", memory="10Gi", annotations={"sharegpu.io/movable": "true"}, scheduler_name=None)
        assert rig.client.create(Pod.from_dict(ok), namespace=ns).spec.schedulerName == "sharegpu-scheduler"


# ----- names and the zero-GPU bind (items 2 and 5) ------------------------------------------------------------------
def test_names_that_are_no_kubernetes_names_never_reach_the_api_server(rig: Rig) -> None:
    from lightkube.resources.core_v1 import Pod

    from sharegpu.k8s.cache.view import ClusterView
    from sharegpu.k8s.extender.binding import Binder
    from sharegpu.k8s.extender.schedulers import Schedulers
    from sharegpu.kube.api import LightkubeClusterApi
    from sharegpu.kube.names import InvalidName
    from sharegpu.kube.schema import ExtenderBindingArgs

    node = rig.add_node("n1", [{"model": "H100-80GB", "count": 1}])
    rig.wait_nodes_published()
    ns = rig.namespace()
    rig.client.create(Pod.from_dict(rig_pod("p", memory="10Gi")), namespace=ns)

    async def main() -> tuple[list[str], list[str]]:
        api = LightkubeClusterApi(rig.kubeconfig)
        view = ClusterView()
        nodes, _ = await api.list_nodes()
        pods, _ = await api.list_pods()
        view.reset(nodes, pods)
        view.synced = True
        binder = Binder(view, api, Schedulers(view, "bestfit"))
        errors = []
        for name, namespace, target in (
            (f"../../../nodes/{node}", ns, node),
            ("p", f"../{ns}", node),
            ("p", ns, f"../nodes/{node}"),
        ):
            args = ExtenderBindingArgs(PodName=name, PodNamespace=namespace, PodUID="", Node=target)
            errors.append((await binder.bind(args)).Error)
        raised = []
        for call in (
            lambda: api.get_pod(ns, f"../../../nodes/{node}"),
            lambda: api.evict_pod(f"../{ns}", "p"),
            lambda: api.bind_pod(ns, "p", "", f"{node}/../x"),
        ):
            try:
                await call()
            except InvalidName as e:
                raised.append(str(e))
        await api.close()
        return errors, raised

    errors, raised = asyncio.run(main())
    assert all(e.startswith("cannot bind: ") and "DNS-1123" in e for e in errors), errors
    assert len(raised) == 3 and all("DNS-1123" in r for r in raised), raised
    pod = rig.client.get(Pod, "p", namespace=ns)
    assert not pod.spec.nodeName and pod.metadata.deletionTimestamp is None


def test_a_pod_that_asks_for_zero_gpus_is_not_bound_by_the_extender(rig: Rig) -> None:
    rig.add_node("n1", [{"model": "H100-80GB", "count": 1}])
    rig.wait_nodes_published()
    _, url = rig.start_extender()
    rig.start_scheduler(url)
    ns = rig.namespace()
    rig.create_pods(ns, [rig_pod("zero", gpu=0), rig_pod("one", gpu=1)])

    def bind_refused() -> str:
        for e in rig.events(ns):
            if e["involvedObject"]["name"] == "zero" and "sharegpu.io/gpu: 0 (no GPU)" in (e.get("message") or ""):
                return str(e["message"])
        return ""

    wait_for(lambda: bool(bind_refused()), "the zero-GPU pod's bind to be refused", 90)
    pods = {p["metadata"]["name"]: p for p in rig.pods(ns)}
    assert not pods["zero"]["spec"].get("nodeName"), pods["zero"]["spec"]
    assert "sharegpu.io/assignment" not in (pods["zero"]["metadata"].get("annotations") or {})
    wait_for(lambda: any(p["spec"].get("nodeName") for p in rig.pods(ns) if p["metadata"]["name"] == "one"), "one", 60)


# ----- preemption under a real PodDisruptionBudget (item 6) ---------------------------------------------------------
def _ready(rig: Rig, ns: str, names: list[str]) -> None:
    """What a kubelet would report for running pods: Running and Ready (the disruption controller counts Ready pods
    as healthy), all started at the same time (so that no victim is more important than another)."""
    from lightkube.resources.core_v1 import Pod
    from lightkube.types import PatchType

    now = "2026-01-01T00:00:00Z"
    cond = [{"type": "Ready", "status": "True", "lastTransitionTime": now}]
    for n in names:
        status = {"status": {"phase": "Running", "startTime": now, "conditions": cond}}
        rig.client.patch(Pod.Status, n, status, namespace=ns, patch_type=PatchType.MERGE)


def _budget(rig: Rig, ns: str, app: str, min_available: int) -> None:
    from lightkube.generic_resource import create_namespaced_resource

    pdb = create_namespaced_resource("policy", "v1", "PodDisruptionBudget", "poddisruptionbudgets")
    obj = {
        "metadata": {"name": app},
        "spec": {"minAvailable": min_available, "selector": {"matchLabels": {"app": app}}},
    }
    rig.client.create(pdb.from_dict(obj), namespace=ns)

    def allowed() -> int:
        return int((rig.client.get(pdb, app, namespace=ns).to_dict().get("status") or {}).get("disruptionsAllowed", -1))

    wait_for(lambda: allowed() == 1, f"PodDisruptionBudget {app} to allow one disruption", 60)


def _on(name: str, node: str, app: str | None) -> dict[str, Any]:
    obj = rig_pod(name, memory="39Gi", cpu="100m")  # two a GPU, beside their MPS daemons' 66 MiB each
    obj["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node}
    if app:
        obj["metadata"]["labels"] = {"app": app}
    return obj


def test_preemption_prefers_the_node_whose_victims_break_no_real_budget(rig: Rig) -> None:
    """n1: two 39Gi shares under a PodDisruptionBudget that allows one disruption; n2: two such shares, no budget. A
    whole-GPU high-priority pod must take both shares of one node: n2's, and nothing under the budget is evicted."""
    n1 = rig.add_node("n1", [{"model": "H100-80GB", "count": 1}])
    n2 = rig.add_node("n2", [{"model": "H100-80GB", "count": 1}])
    rig.wait_nodes_published()
    _, url = rig.start_extender(0, "--preemption-interval", "0.5")
    rig.start_scheduler(url)
    ns = rig.namespace()
    high = _priority_class(rig, HIGH_VALUE)
    try:
        rig.create_pods(ns, [_on("db-0", n1, "db"), _on("db-1", n1, "db"), _on("w-0", n2, None), _on("w-1", n2, None)])
        wait_for(lambda: all(p["spec"].get("nodeName") for p in rig.pods(ns)), "the four shares bound", 90)
        _ready(rig, ns, ["db-0", "db-1", "w-0", "w-1"])
        _budget(rig, ns, "db", 1)
        with Watchdog(rig, ns) as dog:
            urgent = rig_pod("urgent", gpu=1, cpu="100m")
            urgent["spec"]["priorityClassName"] = high
            rig.create_pods(ns, [urgent])

            def bound() -> str:
                return next(
                    (p["spec"].get("nodeName") or "" for p in rig.pods(ns) if p["metadata"]["name"] == "urgent"), ""
                )

            wait_for(lambda: bool(bound()), "the high-priority pod bound", 120)
            # The preemptor is bound, so its reservation is over and nothing more is evicted for it: wait for the
            # watch to have seen its victims go, then nothing else may have gone.
            wait_for(lambda: {"w-0", "w-1"} <= set(dog.deleted), "the victims' deletions seen", 30)
        pods = {p["metadata"]["name"]: p for p in rig.pods(ns)}
        assert bound() == n2
        assert sorted(dog.deleted) == ["w-0", "w-1"], dog.deleted
        assert all(pods[n]["metadata"].get("deletionTimestamp") is None for n in ("db-0", "db-1"))
        assert dog.findings == [], dog.findings[:5]
        reasons = [e.get("reason") for e in rig.events(ns)]
        assert "PreemptionBlocked" not in reasons and reasons.count("Preempted") == 2
        assert audit([rig.node(n) for n in rig.nodes], list(pods.values())).findings == []
    finally:
        _delete_priority_class(rig, high)


def test_the_real_eviction_api_answers_429_and_it_is_eviction_blocked(rig: Rig) -> None:
    """Two pods under a budget allowing one disruption: the first eviction is accepted, the second refused by the
    API server with 429, which the client layer raises as EvictionBlocked (the pod is left running)."""
    from lightkube.resources.core_v1 import Pod

    from sharegpu.kube.api import LightkubeClusterApi
    from sharegpu.kube.errors import EvictionBlocked

    node = rig.add_node("n1", [{"model": "H100-80GB", "count": 1}], agent=False)
    ns = rig.namespace()
    for n in ("db-0", "db-1"):
        obj = rig_pod(n, gpu=None, cpu="100m", scheduler_name=None)
        obj["metadata"]["labels"] = {"app": "db"}
        obj["spec"]["nodeName"] = node
        rig.client.create(Pod.from_dict(obj), namespace=ns)
    _ready(rig, ns, ["db-0", "db-1"])
    _budget(rig, ns, "db", 1)

    async def main() -> tuple[str, int | None]:
        api = LightkubeClusterApi(rig.kubeconfig)
        try:
            await api.evict_pod(ns, "db-0")
            try:
                await api.evict_pod(ns, "db-1")
            except EvictionBlocked as e:
                return str(e), e.code
            return "", None
        finally:
            await api.close()

    message, code = asyncio.run(main())
    assert code == 429 and "PodDisruptionBudget allows no disruption now" in message, message
    assert rig.client.get(Pod, "db-0", namespace=ns).metadata.deletionTimestamp is not None
    assert rig.client.get(Pod, "db-1", namespace=ns).metadata.deletionTimestamp is None
