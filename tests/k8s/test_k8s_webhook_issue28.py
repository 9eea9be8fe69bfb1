"""Pods admitted that could never run, and input echoed whole (issue 28): each refused at admission with what to
write instead, through the function both webhooks call and through the webhook's HTTP API as the API server calls it."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from k8s_helpers import LoopbackServer, pod_obj

from sharegpu.k8s.webhook.admission import WebhookConfig, admit_pod, make_app
from sharegpu.kube.echo import echo

CFG = WebhookConfig()


def refused(pod: dict[str, Any], mutate: bool = True, operation: str = "CREATE", old: Any = None) -> str:
    v = admit_pod(pod, operation, old, "alice", mutate, CFG)
    assert v.allowed is False and not v.patch, v
    return v.message


def with_limit(pod: dict[str, Any], name: str, value: Any, field: str = "limits") -> dict[str, Any]:
    pod["spec"]["containers"][0]["resources"].setdefault(field, {})[name] = value
    return pod


@pytest.mark.parametrize(
    ("name", "field", "hint"),
    [
        ("sharegpu.io/gpu-mem", "limits", "did you mean sharegpu.io/gpu-memory?"),
        ("sharegpu.io/gpus", "requests", "did you mean sharegpu.io/gpu?"),
        ("sharegpu.io/compute", "limits", "did you mean sharegpu.io/gpu-compute?"),
        ("sharegpu.io/tpu-cores", "limits", "the sharegpu resources are sharegpu.io/gpu, sharegpu.io/gpu-memory"),
    ],
)
@pytest.mark.parametrize("mutate", [True, False])
def test_an_unknown_sharegpu_resource_is_refused_with_the_known_names(
    name: str, field: str, hint: str, mutate: bool
) -> None:
    # Alone (the pod then names no known sharegpu resource) and beside a valid share.
    for pod in (pod_obj("p", gpu=None), pod_obj("q", memory="10Gi")):
        message = refused(with_limit(pod, name, "10Gi", field), mutate)
        assert f"container 'main' asks for unknown resource {name} in its {field}: " in message, message
        assert hint in message and "sharegpu.io/gpu, sharegpu.io/gpu-memory, sharegpu.io/gpu-compute" in message
        assert "Pending for ever" in message


def test_an_unknown_sharegpu_resource_of_an_init_container_is_refused() -> None:
    pod = pod_obj("p", gpu=None)
    pod["spec"]["initContainers"] = [{"name": "warm", "resources": {"limits": {"sharegpu.io/gpu-memroy": "1Gi"}}}]
    assert "container 'warm' asks for unknown resource sharegpu.io/gpu-memroy" in refused(pod)


@pytest.mark.parametrize("mutate", [True, False])
def test_zero_gpus_is_refused(mutate: bool) -> None:
    message = refused(pod_obj("p", gpu=0), mutate)
    assert "sharegpu.io/gpu: 0" in message and "ask for sharegpu.io/gpu: 1 or more, or drop" in message
    # An init container with no GPU beside an app container with one asks for one GPU: admitted.
    pod = pod_obj("q", gpu=1)
    pod["spec"]["initContainers"] = [{"name": "setup", "resources": {"limits": {"sharegpu.io/gpu": "0"}}}]
    assert admit_pod(pod, "CREATE", None, "alice", mutate, CFG).allowed


@pytest.mark.parametrize("value", ["yes", "True", "1", "", "on"])
def test_movable_takes_only_true_or_false(value: str) -> None:
    message = refused(pod_obj("p", memory="10Gi", annotations={"sharegpu.io/movable": value}))
    assert f"sharegpu.io/movable is {value!r}" in message and 'write "true"' in message and '"false"' in message
    for ok in ("true", "false"):
        assert admit_pod(
            pod_obj("q", memory="10Gi", annotations={"sharegpu.io/movable": ok}), "CREATE", None, "a", True, CFG
        ).allowed


def test_movable_set_on_update_takes_only_true_or_false() -> None:
    old = pod_obj("p", memory="10Gi")
    new = pod_obj("p", memory="10Gi", annotations={"sharegpu.io/movable": "yes"})
    assert "sharegpu.io/movable is 'yes'" in refused(new, operation="UPDATE", old=old)
    new["metadata"]["annotations"]["sharegpu.io/movable"] = "true"
    assert admit_pod(new, "UPDATE", old, "alice", False, CFG).allowed


def test_half_a_byte_of_gpu_memory_says_what_milli_means() -> None:
    message = refused(pod_obj("p", memory="500m"))
    assert "sharegpu.io/gpu-memory '500m' is 0.5 bytes" in message
    assert "m is milli" in message and "sharegpu.io/gpu-memory: 500Mi" in message


def test_a_huge_annotation_value_is_echoed_cut_short_in_the_denial_and_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    value = "x" * 200_000
    for key in ("sharegpu.io/gpu-model", "sharegpu.io/isolation", "sharegpu.io/sharing", "sharegpu.io/mig-profile"):
        message = refused(pod_obj("p", memory="10Gi", annotations={key: value}))
        assert len(message) < 400, (key, len(message))
        assert "… (200000 bytes)" in message and "x" * 80 in message and "x" * 81 not in message
    # Through the HTTP API, where the denial is logged.
    with LoopbackServer(make_app(CFG)) as srv, caplog.at_level(logging.INFO, logger="sharegpu.k8s.webhook.admission"):
        status, body = srv.post(
            "/validate", review(pod_obj("p", memory="10Gi", annotations={"sharegpu.io/gpu-model": value}))
        )
    assert status == 200 and body["response"]["allowed"] is False
    assert len(body["response"]["status"]["message"]) < 400
    denied = [r.getMessage() for r in caplog.records if "denied" in r.getMessage()]
    assert denied and all(len(m) < 500 for m in denied)
    # Other echoes go through the same helper: an old value shown on a refused UPDATE.
    old = pod_obj("p", memory="10Gi", annotations={"sharegpu.io/isolation": value})
    new = pod_obj("p", memory="10Gi", annotations={"sharegpu.io/isolation": "memory"})
    assert len(refused(new, operation="UPDATE", old=old)) < 600


def test_echo_cuts_long_values_and_names_their_size() -> None:
    assert echo("short") == "'short'"
    assert echo("é" * 100) == repr("é" * 80) + "… (200 bytes)"
    assert echo(["H100"]) == '["H100"]'


def review(pod: Any, operation: str = "CREATE", old: Any = None) -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u-1",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "operation": operation,
            "userInfo": {"username": "alice"},
            "object": pod,
            "oldObject": old,
        },
    }


@pytest.fixture(scope="module")
def srv() -> Iterator[LoopbackServer]:
    with LoopbackServer(make_app(CFG)) as s:
        yield s


def _denied(srv: LoopbackServer, body: dict[str, Any] | None = None, raw: bytes | None = None) -> str:
    status, out = srv.post("/mutate", body, raw=raw)
    assert status == 200, out
    assert out["response"]["allowed"] is False and "patch" not in out["response"], out
    return str(out["response"]["status"]["message"])


def test_containers_as_an_object_is_refused_with_the_field_named(srv: LoopbackServer) -> None:
    pod = pod_obj("p", memory="10Gi")
    pod["spec"]["containers"] = {"main": pod["spec"]["containers"][0]}
    message = _denied(srv, review(pod))
    assert "spec.containers: Input should be a valid list" in message and '{"main": ' in message


def test_ephemeral_containers_as_an_object_are_refused(srv: LoopbackServer) -> None:
    # Read item by item, an object here was skipped: its CUDA_VISIBLE_DEVICES went unchecked.
    old = pod_obj("p", memory="10Gi")
    pod = pod_obj("p", memory="10Gi")
    pod["spec"]["ephemeralContainers"] = {
        "dbg": {"name": "dbg", "env": [{"name": "CUDA_VISIBLE_DEVICES", "value": "0"}]}
    }
    message = _denied(srv, review(pod, "UPDATE", old))
    assert "spec.ephemeralContainers: Input should be a valid list" in message and '{"dbg": ' in message


@pytest.mark.parametrize(
    ("literal", "says"),
    [
        ("1e30", "is far beyond any GPU"),
        ('"1e30"', "is far beyond any GPU"),
        ("NaN", "is not a number"),
        ('"NaN"', "is not a number"),
        ("Infinity", "is not a number"),
    ],
)
@pytest.mark.parametrize("resource", ["sharegpu.io/gpu", "sharegpu.io/gpu-memory", "sharegpu.io/gpu-compute"])
def test_huge_and_not_a_number_limits_are_refused(srv: LoopbackServer, literal: str, says: str, resource: str) -> None:
    pod = pod_obj("p", memory="10Gi", compute=30)
    pod["spec"]["containers"][0]["resources"]["limits"][resource] = "PLACEHOLDER"
    raw = json.dumps(review(pod)).replace('"PLACEHOLDER"', literal).encode()
    message = _denied(srv, raw=raw)
    assert f"container 'main': {resource} " in message and says in message and "10Gi (memory)" in message


def test_an_annotation_whose_value_is_a_list_is_refused(srv: LoopbackServer) -> None:
    pod = pod_obj("p", memory="10Gi", annotations={"sharegpu.io/gpu-model": ["H100-80GB"]})  # type: ignore[dict-item]
    message = _denied(srv, review(pod))
    assert "metadata.annotations.sharegpu.io/gpu-model: Input should be a valid string" in message
    assert '["H100-80GB"]' in message


def test_a_review_that_is_not_an_admission_review_gets_400(srv: LoopbackServer) -> None:
    status, out = srv.post("/mutate", {"request": {"uid": 3, "kind": "Pod", "object": []}})
    assert status == 400 and out["error"].startswith("malformed AdmissionReview: ")
