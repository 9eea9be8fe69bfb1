from __future__ import annotations

import json
import re

import pytest
from k8s_helpers import pod_obj

from sharegpu.k8s.pod_request import InvalidPodRequest, asks_for_sharegpu, containers_missing_gpu_count, pod_request
from sharegpu.kube.schema import Pod
from sharegpu.model.request import InvalidRequest, Isolation, Sharing


def parse(obj: dict) -> object:
    return pod_request(Pod.model_validate(obj))


def test_full_request_is_read_from_resources_and_annotations() -> None:
    obj = pod_obj(
        "infer",
        memory="10Gi",
        compute=30,
        annotations={
            "sharegpu.io/isolation": "memory",
            "sharegpu.io/sharing": "mps",
            "sharegpu.io/gpu-model": "H100-80GB, a100-80gb",
        },
        cpu="1500m",
    )
    req = parse(obj)
    assert req is not None
    assert req.name == "default/infer"
    assert (req.gpu_count, req.memory_mib, req.compute_milli) == (1, 10240, 300)
    assert req.isolation is Isolation.MEMORY and req.sharing is Sharing.MPS
    assert req.allowed_models == frozenset({"H100-80GB", "A100-80GB"})
    assert (req.cpu_milli, req.host_memory_mib) == (1500, 1024)


def test_decimal_memory_is_rounded_up_to_whole_mib() -> None:
    req = parse(pod_obj("p", memory="10G"))
    assert req is not None and req.memory_mib == 9537  # 10e9 B = 9536.74 MiB: never less than asked


def test_pod_without_sharegpu_resources_is_none() -> None:
    obj = pod_obj("web", gpu=None, annotations={"sharegpu.io/isolation": "memory"})
    assert not asks_for_sharegpu(Pod.model_validate(obj))
    assert parse(obj) is None


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"compute": 150}, "outside 1–100%"),  # the core's message, passed on
        ({"memory": "200Gi"}, "above the largest allowed GPU"),
        ({"memory": "-5Gi"}, "must be positive"),
        ({"memory": "ten"}, "is not a Kubernetes quantity"),
        ({"gpu": "1.5"}, "whole number of GPUs"),
        ({"gpu": "-1"}, "is negative; ask for a number of GPUs"),
        ({"compute": "30.5"}, "whole percent"),
        ({"annotations": {"sharegpu.io/isolation": "strong"}}, "isolation 'strong' is not one of"),
        ({"annotations": {"sharegpu.io/gpu-model": "H900"}}, "unknown GPU model 'H900'"),
        ({"annotations": {"sharegpu.io/mig-profile": "9g.99gb"}}, "MIG profile '9g.99gb' exists on no allowed model"),
        (
            {"annotations": {"sharegpu.io/isolation": "hardware", "sharegpu.io/sharing": "time-slicing"}},
            "isolation 'hardware' cannot be met",
        ),
    ],
)
def test_invalid_requests_say_what_to_change(kwargs: dict, fragment: str) -> None:
    with pytest.raises(InvalidRequest, match=fragment):
        parse(pod_obj("bad", **kwargs))


def test_memory_without_gpu_count_is_reported_and_listed_for_the_webhook() -> None:
    obj = pod_obj("p", gpu=None, memory="4Gi")
    pod = Pod.model_validate(obj)
    assert containers_missing_gpu_count(pod) == [("containers", 0)]
    with pytest.raises(InvalidPodRequest, match=re.escape("add sharegpu.io/gpu: 1")):
        pod_request(pod)


def test_containers_sum_gpus_and_must_agree_on_the_share() -> None:
    obj = pod_obj("multi", gpu=1, memory="8Gi")
    second = {"name": "side", "resources": {"limits": {"sharegpu.io/gpu": "2", "sharegpu.io/gpu-memory": "8Gi"}}}
    init = {"name": "init", "resources": {"limits": {"cpu": "4"}}}
    obj["spec"]["containers"].append(second)
    obj["spec"]["initContainers"] = [init]
    req = parse(obj)
    assert req is not None and req.gpu_count == 3 and req.memory_mib == 8192
    assert req.cpu_milli == 4000  # the init container's 4 CPUs exceed the app containers' 1
    obj["spec"]["containers"][1]["resources"]["limits"]["sharegpu.io/gpu-memory"] = "16Gi"
    with pytest.raises(InvalidPodRequest, match=re.escape("same sharegpu.io/gpu-memory")):
        parse(obj)


def _with_users(obj: dict, pod_uid: int | None, **container_uids: int | None) -> dict:
    if pod_uid is not None:
        obj["spec"]["securityContext"] = {"runAsUser": pod_uid}
    for c in obj["spec"]["containers"]:
        if c["name"] in container_uids and container_uids[c["name"]] is not None:
            c["securityContext"] = {"runAsUser": container_uids[c["name"]]}
    return obj


def tenant(obj: dict) -> str | None:
    req = pod_request(Pod.model_validate(obj))
    assert req is not None
    return req.tenant


def _two_gpu_containers(obj: dict) -> dict:
    second = json.loads(json.dumps(obj["spec"]["containers"][0]))
    second["name"] = "side"
    obj["spec"]["containers"].append(second)
    return obj


def test_the_tenant_is_the_namespace_and_run_as_user_else_the_pod_alone() -> None:
    """sharegpu.model.tenant: pods of one namespace that declare one runAsUser share an MPS daemon; a pod that
    declares none (the image's USER decides, which the API never shows) is a tenant of its own."""
    assert tenant(pod_obj("infer", memory="10Gi")) == "pod/uid-default-infer"
    assert tenant(_with_users(pod_obj("infer", memory="10Gi"), 1000)) == "default/uid-1000"
    assert tenant(_with_users(pod_obj("infer", memory="10Gi", namespace="team-b"), 1000)) == "team-b/uid-1000"
    own = _with_users(pod_obj("infer", memory="10Gi"), 1000, main=0)
    assert tenant(own) == "default/uid-0"  # a container's own securityContext wins over the pod's
    # hostUsers: false maps the declared UID to another one on the host: the pod is a tenant of its own.
    apart = _with_users(pod_obj("infer", memory="10Gi"), 1000)
    apart["spec"]["hostUsers"] = False
    assert tenant(apart) == "pod/uid-default-infer"
    apart["spec"]["hostUsers"] = True
    assert tenant(apart) == "default/uid-1000"
    nameless = pod_obj("infer", memory="10Gi")
    del nameless["metadata"]["uid"]  # not created yet (the webhook's view): the pod's name stands in
    assert tenant(nameless) == "pod/default/infer"


def test_gpu_containers_of_different_users_are_refused_with_what_to_do() -> None:
    obj = _two_gpu_containers(pod_obj("two", memory="10Gi"))
    obj["spec"]["containers"][0]["securityContext"] = {"runAsUser": 1000}
    obj["spec"]["containers"][1]["securityContext"] = {"runAsUser": 0}
    with pytest.raises(InvalidPodRequest, match=r"different Unix users \('main': 1000, 'side': 0\).*runAsUser"):
        parse(obj)
    obj["spec"]["containers"][1]["securityContext"] = {"runAsUser": 1000}
    assert tenant(obj) == "default/uid-1000"


def test_a_pod_with_one_declared_and_one_undeclared_gpu_container_is_a_tenant_of_its_own() -> None:
    """The undeclared container runs as its image's user, who may be anyone: the pod is not the declared user's
    tenant (issue 33 names this mutation), and it is not refused either (one UID is declared)."""
    obj = _two_gpu_containers(pod_obj("half", memory="10Gi"))
    obj["spec"]["containers"][0]["securityContext"] = {"runAsUser": 1000}
    assert tenant(obj) == "pod/uid-default-half"
    obj["spec"]["containers"][1]["securityContext"] = {"runAsUser": 1000}
    assert tenant(obj) == "default/uid-1000"


def test_only_the_containers_that_hold_a_gpu_decide_the_tenant() -> None:
    """A sidecar without a GPU runs no MPS client: its user (declared or not) decides nothing; an init container that
    holds a GPU does."""
    obj = pod_obj("sc", memory="10Gi")
    obj["spec"]["containers"][0]["securityContext"] = {"runAsUser": 1000}
    obj["spec"]["containers"].append({"name": "log", "image": "busybox", "securityContext": {"runAsUser": 0}})
    assert tenant(obj) == "default/uid-1000"
    obj["spec"]["containers"][1] = {"name": "log", "image": "busybox"}
    assert tenant(obj) == "default/uid-1000"
    init = json.loads(json.dumps(obj["spec"]["containers"][0]))
    init["name"] = "warm"
    init["securityContext"] = {"runAsUser": 0}
    obj["spec"]["initContainers"] = [init]
    with pytest.raises(InvalidPodRequest, match=r"different Unix users \('warm': 0, 'main': 1000\)"):
        parse(obj)
