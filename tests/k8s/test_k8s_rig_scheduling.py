"""The whole extender path on a real control plane (../shared/k8s-rig): node agents publish inventories, the real
kube-scheduler runs the chart's profile and calls ``sharegpu scheduler-extender`` to filter, prioritize and bind.

Skipped unless SHAREGPU_TEST_KUBECONFIG names the rig's kubeconfig (.ci/run starts the rig and sets it).
"""

from __future__ import annotations

from typing import Any

import pytest
from k8s_helpers import pod_obj
from rig import (
    KUBECONFIG,
    SKIP_REASON,
    Rig,
    audit,
    chart_webhooks,
    status_json,
    wait_for,
)

pytestmark = pytest.mark.skipif(not KUBECONFIG, reason=SKIP_REASON)


def rig_pod(name: str, **kw: Any) -> dict[str, Any]:
    obj = pod_obj(name, **kw)
    for k in ("uid", "resourceVersion", "namespace"):
        obj["metadata"].pop(k, None)
    obj.pop("status", None)
    return obj


def test_pods_are_bound_through_the_real_scheduler_with_their_assignments(rig: Rig) -> None:
    rig.add_node("h100", [{"model": "H100-80GB", "count": 2}, {"model": "H100-80GB", "count": 1, "mig": True}])
    rig.add_node("a30", [{"model": "A30-24GB", "count": 1}])
    rig.wait_nodes_published()
    _, url = rig.start_extender()
    rig.start_scheduler(url)
    ns = rig.namespace()
    pods = [
        rig_pod("mps", memory="10Gi", compute=30, annotations={"sharegpu.io/isolation": "memory"}),
        # On the H100 node, where a GPU an administrator keeps in MIG mode waits for it. Left free to choose, the
        # policy may open the A30 for it instead (the pinned GPU is preferred within a node, not across nodes), and
        # then the whole-GPU pod finds no idle GPU: the pinned one never takes it.
        rig_pod(
            "mig",
            memory="10Gi",
            annotations={"sharegpu.io/isolation": "hardware", "sharegpu.io/gpu-model": "H100-80GB"},
        ),
        rig_pod("whole", gpu=1),
        rig_pod("ts", memory="4Gi", annotations={"sharegpu.io/sharing": "time-slicing"}),
    ]
    rig.create_pods(ns, pods)
    settled = rig.wait_settled(ns)
    assert all(p["spec"].get("nodeName") for p in settled), [p["metadata"]["name"] for p in settled]
    result = audit([rig.node(n) for n in rig.nodes], settled)
    assert result.findings == [] and result.bound == 4
    # sharegpu status, from the API server, shows the same pods on the same GPUs.
    report = status_json(rig)
    shown = {pod for node in report["nodes"] if node["name"] in rig.nodes for g in node["gpus"] for pod in g["pods"]}
    assert shown == {f"{ns}/{p['metadata']['name']}" for p in pods}
    # No bind was reported failed.
    failed = [e["message"] for e in rig.events(ns) if e.get("reason") == "FailedScheduling"]
    assert failed == []


def test_a_pod_that_does_not_fit_gets_a_readable_failed_scheduling_event(rig: Rig) -> None:
    rig.add_node("h100", [{"model": "H100-80GB", "count": 1}])
    rig.wait_nodes_published()
    _, url = rig.start_extender()
    rig.start_scheduler(url)
    ns = rig.namespace()
    mps = {"sharegpu.io/isolation": "memory", "sharegpu.io/sharing": "mps"}
    rig.create_pods(ns, [rig_pod("first", memory="10Gi", compute=60, annotations=mps)])
    rig.wait_settled(ns)
    rig.create_pods(ns, [rig_pod("second", memory="10Gi", compute=60, annotations=mps)])

    def event() -> str:
        for e in rig.events(ns):
            if e.get("reason") == "FailedScheduling" and e["involvedObject"]["name"] == "second":
                return str(e["message"])
        return ""

    wait_for(lambda: bool(event()), "the FailedScheduling event", 60)
    message = event()
    # The kube-scheduler formats extender reasons as a Go format string: a bare % would come out as %!<(MISSING).
    assert "MISSING" not in message and "%!" not in message, message
    assert "most free compute 40 percent < 60 percent asked" in message, message


def test_preemption_through_the_real_scheduler_and_the_extenders_preempt_verb(rig: Rig) -> None:
    """The kube-scheduler chooses victims by its own accounting (here CPU: the node has 2 cores) and asks the extender
    which of those nodes really have room for the pod's GPU share once the victims are gone (the preempt verb).

    Known limit: a GPU shortfall alone does not trigger preemption, because the scheduler counts sharegpu.io/gpu in
    tokens (64 per GPU) and sees room where the extender sees none, so it finds no victims to propose."""
    from lightkube.resources.core_v1 import Pod
    from lightkube.resources.scheduling_v1 import PriorityClass

    rig.add_node("a30", [{"model": "A30-24GB", "count": 1}], cpu="2")
    rig.wait_nodes_published()
    _, url = rig.start_extender()
    rig.start_scheduler(url)
    ns = rig.namespace()
    high = f"{rig.prefix}-high"
    rig.client.create(PriorityClass.from_dict({"metadata": {"name": high}, "value": 1000000}))
    try:
        rig.create_pods(ns, [rig_pod("low", gpu=1, cpu="1500m")])
        rig.wait_settled(ns)
        urgent = rig_pod("urgent", gpu=1, cpu="1500m")
        urgent["spec"]["priorityClassName"] = high
        rig.create_pods(ns, [urgent])

        def victim_marked() -> bool:
            low = rig.client.get(Pod, "low", namespace=ns)
            if low.metadata.deletionTimestamp is not None:
                # As the kubelet would once the container stopped: the pod goes, its GPU is free.
                rig.client.delete(Pod, "low", namespace=ns, grace_period=0)
                return True
            return False

        wait_for(victim_marked, "the low-priority pod to be preempted", 90)
        wait_for(
            lambda: bool(rig.client.get(Pod, "urgent", namespace=ns).spec.nodeName), "the urgent pod to be bound", 90
        )
        result = audit([rig.node(n) for n in rig.nodes], rig.pods(ns))
        assert result.findings == [] and result.bound == 1
        assert "preempt" in next(p for p in rig.procs if p.name == "kube-scheduler").text().lower()
    finally:
        rig.client.delete(PriorityClass, high)


def webhooks_in_force(rig: Rig, ns: str) -> bool:
    """A dry run shows the mutating webhook rewriting a pod and the validating one refusing another."""
    from lightkube.core.exceptions import ApiError
    from lightkube.resources.core_v1 import Pod

    def create(obj: dict[str, Any]) -> dict[str, Any]:
        return dict(rig.client.create(Pod.from_dict(obj), namespace=ns, dry_run=True).to_dict())

    mutated = create(rig_pod("probe", memory="10Gi", compute=30, scheduler_name=None))
    try:
        create(rig_pod("probe-bad", memory="10Gi", compute=150))
    except ApiError as e:
        return mutated["spec"]["schedulerName"] == "sharegpu-scheduler" and "denied the request" in str(e)
    return False


def test_the_webhook_admits_and_refuses_through_a_real_admission_review(rig: Rig) -> None:
    from lightkube.core.exceptions import ApiError
    from lightkube.resources.core_v1 import Pod

    with chart_webhooks(rig, lambda ns: webhooks_in_force(rig, ns)) as ns:

        def create(obj: dict[str, Any]) -> dict[str, Any]:
            return dict(rig.client.create(Pod.from_dict(obj), namespace=ns).to_dict())

        share = rig_pod("share", memory="10Gi", compute=30, scheduler_name=None)
        created = create(share)
        assert created["spec"]["schedulerName"] == "sharegpu-scheduler"  # mutated: the sharegpu scheduler places it
        plain = create(rig_pod("plain", gpu=None, scheduler_name=None))
        assert plain["spec"]["schedulerName"] == "default-scheduler"  # not sent to the webhook at all
        with pytest.raises(ApiError) as bad:
            create(rig_pod("too-much", memory="10Gi", compute=150))
        assert "denied the request" in str(bad.value) and "150" in str(bad.value) and "1–100" in str(bad.value)
        with pytest.raises(ApiError) as env:
            create(rig_pod("sneaky", memory="10Gi", compute=30, env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"}))
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" in str(env.value)


def test_resource_quota_on_sharegpu_resources_refuses_a_pod_over_quota_at_creation(rig: Rig) -> None:
    from lightkube.core.exceptions import ApiError
    from lightkube.resources.core_v1 import Pod, ResourceQuota

    ns = rig.namespace()
    quota = {"requests.sharegpu.io/gpu": "4", "requests.sharegpu.io/gpu-memory": "20Gi",
             "requests.sharegpu.io/gpu-compute": "60"}  # fmt: skip
    rig.client.create(
        ResourceQuota.from_dict({"metadata": {"name": "team-gpus"}, "spec": {"hard": quota}}), namespace=ns
    )
    wait_for(lambda: bool(rig.client.get(ResourceQuota, "team-gpus", namespace=ns).status.hard), "the quota", 30)
    for name in ("a", "b"):
        rig.client.create(Pod.from_dict(rig_pod(name, memory="10Gi", compute=30)), namespace=ns)
    with pytest.raises(ApiError) as over:
        rig.client.create(Pod.from_dict(rig_pod("c", memory="10Gi", compute=30)), namespace=ns)
    message = str(over.value)
    assert "exceeded quota: team-gpus" in message and "sharegpu.io/gpu-memory" in message, message
    used = rig.client.get(ResourceQuota, "team-gpus", namespace=ns).status.used
    assert used["requests.sharegpu.io/gpu-memory"] == "20Gi" and used["requests.sharegpu.io/gpu-compute"] == "60"
