"""Pods a new user's run found admitted without a word (issue 21): each is refused with what to change, through the
admission function both webhooks call (/mutate and /validate), in the AdmissionReview shapes the API server sends."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from k8s_helpers import pod_obj

from sharegpu.k8s.webhook.admission import WebhookConfig, admit_pod

EXTENDER = "system:serviceaccount:sharegpu:sharegpu-extender"
CFG = WebhookConfig(trusted_users=(EXTENDER,))


def refused(pod: dict[str, Any], mutate: bool = True) -> str:
    v = admit_pod(pod, "CREATE", None, "alice", mutate, CFG)
    assert v.allowed is False and not v.patch, v
    return v.message


@pytest.mark.parametrize(("text", "meant"), [("10", "10Gi"), ("1", "1Gi"), ("255Mi", "10Gi"), ("100M", "10Gi")])
@pytest.mark.parametrize("mutate", [True, False])
def test_gpu_memory_without_a_unit_is_refused_with_the_unit_to_write(text: str, meant: str, mutate: bool) -> None:
    message = refused(pod_obj("p", memory=text), mutate)
    assert f"sharegpu.io/gpu-memory {text!r} is " in message
    assert "a number without a unit is bytes" in message and f"sharegpu.io/gpu-memory: {meant}" in message
    if text.isdigit():
        assert f"only {text} bytes" in message


@pytest.mark.parametrize("text", ["256Mi", "1Gi", "0.5Gi", "10Gi"])
def test_gpu_memory_of_256mi_and_more_is_admitted(text: str) -> None:
    assert admit_pod(pod_obj("p", memory=text), "CREATE", None, "alice", True, CFG).allowed


@pytest.mark.parametrize(
    ("key", "hint"),
    [
        ("sharegpu.io/isolaton", "did you mean sharegpu.io/isolation?"),
        ("sharegpu.io/shareing", "did you mean sharegpu.io/sharing?"),
        ("sharegpu.io/gpu-models", "did you mean sharegpu.io/gpu-model?"),
        ("sharegpu.io/migprofile", "did you mean sharegpu.io/mig-profile?"),
        ("sharegpu.io/priority", "the annotations a pod may set are sharegpu.io/isolation, sharegpu.io/sharing"),
    ],
)
def test_an_unknown_sharegpu_annotation_is_refused_with_the_closest_known_one(key: str, hint: str) -> None:
    pod = pod_obj("p", memory="10Gi", annotations={key: "hardware"})
    message = refused(pod)
    assert f"unknown annotation {key}: " in message and hint in message
    # On a pod that asks for no sharegpu resource too: the annotation shows the user meant one.
    assert f"unknown annotation {key}" in refused(pod_obj("q", gpu=None, annotations={key: "x"}))


def test_the_movable_annotation_is_admitted() -> None:
    pod = pod_obj("p", memory="10Gi", annotations={"sharegpu.io/movable": "true"})
    assert admit_pod(pod, "CREATE", None, "alice", True, CFG).allowed  # consolidation's opt-in (issue 19 item 2)
    assert "did you mean sharegpu.io/movable?" in refused(
        pod_obj("q", memory="10Gi", annotations={"sharegpu.io/moveable": "true"})
    )


def test_a_resource_given_as_an_annotation_is_named_a_resource() -> None:
    message = refused(pod_obj("p", gpu=None, annotations={"sharegpu.io/gpu-memory": "10Gi"}))
    assert "sharegpu.io/gpu-memory is a container resource, not an annotation" in message
    assert "resources.limits (e.g. sharegpu.io/gpu-memory: 10Gi)" in message


@pytest.mark.parametrize("where", ["same", "other", "init"])
def test_nvidia_gpus_beside_sharegpu_are_refused(where: str) -> None:
    pod = pod_obj("p", memory="10Gi")
    extra = {"name": "side", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
    if where == "same":
        pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "1"
    elif where == "other":
        pod["spec"]["containers"].append(extra)
    else:
        pod["spec"]["initContainers"] = [extra]
    name = "main" if where == "same" else "side"
    message = refused(pod)
    assert f"container {name!r} asks for nvidia.com/gpu in a pod that asks for sharegpu.io/gpu" in message
    assert "ask for sharegpu.io/gpu alone" in message


def test_another_schedulers_name_is_refused_and_only_default_scheduler_replaced() -> None:
    pod = pod_obj("p", memory="10Gi", scheduler_name="volcano")
    message = refused(pod)
    assert "spec.schedulerName is volcano" in message and "set it to sharegpu-scheduler" in message
    # The API server writes default-scheduler into a pod that sets none, before admission: replaced, as unset is.
    for name in ("default-scheduler", None):
        v = admit_pod(pod_obj("p", memory="10Gi", scheduler_name=name), "CREATE", None, "alice", True, CFG)
        assert v.allowed and v.patch[-1]["path"] == "/spec/schedulerName"
        assert v.patch[-1]["value"] == "sharegpu-scheduler"


def test_a_user_set_bind_fence_is_refused_as_an_assignment_is() -> None:
    for gpu in (1, None):
        message = refused(pod_obj("p", gpu=gpu, annotations={"sharegpu.io/bind-fence": "41"}))
        assert "remove the sharegpu.io/bind-fence annotation: only the sharegpu scheduler sets it" in message


def _bound(annotations: dict[str, str]) -> dict[str, Any]:
    return pod_obj(
        "p",
        memory="10Gi",
        node_name="node-a",
        phase="Running",
        annotations={"sharegpu.io/assignment": '{"node": "node-a"}', **annotations},
    )


@pytest.mark.parametrize(
    ("before", "after", "shown"),
    [
        ({"sharegpu.io/isolation": "none"}, {"sharegpu.io/isolation": "hardware"}, "('none' → 'hardware')"),
        ({}, {"sharegpu.io/isolation": "hardware"}, "(unset → 'hardware')"),
        ({"sharegpu.io/sharing": "mps"}, {}, "('mps' → unset)"),
        ({}, {"sharegpu.io/gpu-model": "A100-80GB"}, "sharegpu.io/gpu-model"),
        ({}, {"sharegpu.io/mig-profile": "1g.10gb"}, "sharegpu.io/mig-profile"),
    ],
)
def test_request_annotations_cannot_change_on_update(before: dict[str, str], after: dict[str, str], shown: str) -> None:
    old, new = _bound(before), _bound(after)
    for user in ("alice", EXTENDER):
        v = admit_pod(new, "UPDATE", old, user, False, CFG)
        assert v.allowed is False and shown in v.message and "cannot change after it is created" in v.message
    unbound_old, unbound_new = pod_obj("p", memory="10Gi", annotations=before), pod_obj("p", memory="10Gi")
    unbound_new["metadata"]["annotations"] = dict(after)
    assert not admit_pod(unbound_new, "UPDATE", unbound_old, "alice", False, CFG).allowed


def test_other_updates_of_a_bound_pod_pass() -> None:
    old = _bound({"sharegpu.io/isolation": "memory", "legacy": "x"})
    new = copy.deepcopy(old)
    new["metadata"]["annotations"]["team"] = "ml"
    new["metadata"].setdefault("labels", {})["app"] = "a"
    assert admit_pod(new, "UPDATE", old, "alice", False, CFG).allowed
    # A pod that asks for nothing of sharegpu's may gain and change a request annotation (it has no effect).
    plain_old = pod_obj("q", gpu=None)
    plain_new = pod_obj("q", gpu=None, annotations={"sharegpu.io/isolation": "hardware"})
    assert admit_pod(plain_new, "UPDATE", plain_old, "alice", False, CFG).allowed


def test_the_bind_fence_is_the_extenders_on_update() -> None:
    old = pod_obj("p", memory="10Gi")
    new = pod_obj("p", memory="10Gi", annotations={"sharegpu.io/bind-fence": "17"})
    v = admit_pod(new, "UPDATE", old, "mallory", False, CFG)
    assert not v.allowed and "sharegpu.io/bind-fence is written by the sharegpu scheduler only" in v.message
    assert admit_pod(new, "UPDATE", old, EXTENDER, False, CFG).allowed


def test_an_unknown_annotation_added_on_update_is_refused_and_an_old_one_kept() -> None:
    old = _bound({})
    new = _bound({"sharegpu.io/isolaton": "hardware"})
    v = admit_pod(new, "UPDATE", old, "alice", False, CFG)
    assert not v.allowed and "did you mean sharegpu.io/isolation?" in v.message
    # Already there before the rule (admitted by an older webhook): the pod stays editable.
    newer = copy.deepcopy(new)
    newer["metadata"]["annotations"]["team"] = "ml"
    assert admit_pod(newer, "UPDATE", new, "alice", False, CFG).allowed
