"""The webhook refuses every way a sharegpu pod could set the variables sharegpu owns: env, valueFrom, envFrom."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from k8s_helpers import pod_obj

from sharegpu.k8s.webhook.admission import WebhookConfig, admit_pod

EXTENDER = "system:serviceaccount:gpu-system:sg-extender"
CFG = WebhookConfig(trusted_users=(EXTENDER,))


def with_env_from(pod: dict[str, Any], field: str, env_from: list[dict[str, Any]]) -> dict[str, Any]:
    pod = copy.deepcopy(pod)
    c = {"name": "extra", "image": "busybox", "envFrom": env_from}
    if field == "containers":
        pod["spec"]["containers"][0]["envFrom"] = env_from
    else:
        pod["spec"].setdefault(field, []).append(c)
    return pod


@pytest.mark.parametrize("field", ["containers", "initContainers", "ephemeralContainers"])
@pytest.mark.parametrize(
    "env_from",
    [
        [{"configMapRef": {"name": "cuda-overrides"}}],
        [{"secretRef": {"name": "s"}}],
        [{"prefix": "CUDA_MPS_", "configMapRef": {"name": "limits"}}],
        [{"prefix": "CUDA_VISIBLE_DEVICES", "configMapRef": {"name": "x"}}],
    ],
)
@pytest.mark.parametrize("mutate", [True, False])
def test_env_from_is_refused_in_pods_that_ask_for_sharegpu(
    field: str, env_from: list[dict[str, Any]], mutate: bool
) -> None:
    pod = with_env_from(pod_obj("a", gpu=1, memory="10Gi"), field, env_from)
    v = admit_pod(pod, "CREATE", None, "alice", mutate, CFG)
    assert not v.allowed
    assert "envFrom" in v.message and "set its variables with env instead" in v.message


def test_env_from_is_fine_in_pods_that_ask_for_nothing_of_sharegpus() -> None:
    pod = with_env_from(pod_obj("a", gpu=None), "containers", [{"configMapRef": {"name": "app"}}])
    assert admit_pod(pod, "CREATE", None, "alice", True, CFG).allowed


def test_env_value_from_of_a_forbidden_name_is_refused() -> None:
    pod = pod_obj("c", gpu=1, memory="10Gi")
    pod["spec"]["containers"][0]["env"] = [
        {"name": "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "valueFrom": {"configMapKeyRef": {"name": "x", "key": "y"}}}
    ]
    v = admit_pod(pod, "CREATE", None, "alice", True, CFG)
    assert not v.allowed and "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" in v.message


def test_an_ephemeral_container_added_by_update_may_not_use_env_from_or_forbidden_env() -> None:
    old = pod_obj("a", gpu=1, memory="10Gi", node_name="node-a")
    new = with_env_from(old, "ephemeralContainers", [{"configMapRef": {"name": "x"}}])
    v = admit_pod(new, "UPDATE", old, "alice", False, CFG)
    assert not v.allowed and "envFrom" in v.message
    new = copy.deepcopy(old)
    new["spec"]["ephemeralContainers"] = [
        {"name": "debug", "image": "busybox", "env": [{"name": "CUDA_VISIBLE_DEVICES", "value": "0,1"}]}
    ]
    assert not admit_pod(new, "UPDATE", old, "alice", False, CFG).allowed
    # One already there (admitted before this rule) does not block other updates, e.g. the extender's annotation.
    annotated = copy.deepcopy(new)
    annotated["metadata"]["annotations"]["sharegpu.io/assignment"] = "{}"
    assert admit_pod(annotated, "UPDATE", new, EXTENDER, False, CFG).allowed
