"""kube.schema's Pod read from the JSON the API server writes (shapes as ``kubectl get pod -o json`` prints them):
every field sharegpu reads declared under its API name, defaulted as the API server defaults it, wrong types refused,
and the object passed through unchanged."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import ValidationError

from sharegpu.kube.schema import Container, Pod, ResourceRequirements

# A pending high-priority pod of a Deployment, made unschedulable by the scheduler, with a claim from a template,
# a debug container added with kubectl debug, and fields sharegpu never reads (kept as they came).
API_POD: dict[str, Any] = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {
        "name": "train-7d9f8b6c4-x2x9q",
        "generateName": "train-7d9f8b6c4-",
        "namespace": "ml",
        "uid": "0b0c5f7e-2f6a-4b8e-9d3c-6f1e2a7b9c01",
        "resourceVersion": "48213",
        "creationTimestamp": "2026-11-26T09:14:07Z",
        "labels": {"app": "train", "pod-template-hash": "7d9f8b6c4"},
        "annotations": {"sharegpu.io/movable": "true"},
        "ownerReferences": [
            {
                "apiVersion": "apps/v1",
                "kind": "ReplicaSet",
                "name": "train-7d9f8b6c4",
                "uid": "5a4e3d2c-1b0a-4f9e-8d7c-6b5a4e3d2c1b",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
    },
    "spec": {
        "containers": [
            {
                "name": "main",
                "image": "nvcr.io/nvidia/pytorch:24.05-py3",
                "envFrom": [{"configMapRef": {"name": "train-env"}}, {"prefix": "S_", "secretRef": {"name": "s"}}],
                "resources": {
                    "limits": {"sharegpu.io/gpu": "1", "sharegpu.io/gpu-memory": "10Gi"},
                    "requests": {"cpu": "2", "memory": "8Gi", "sharegpu.io/gpu": "1", "sharegpu.io/gpu-memory": "10Gi"},
                },
                "terminationMessagePath": "/dev/termination-log",
                "imagePullPolicy": "IfNotPresent",
            }
        ],
        "ephemeralContainers": [
            {
                "name": "debugger-4kq2z",
                "image": "busybox",
                "targetContainerName": "main",
                "env": [{"name": "DEBUG", "value": "1"}],
            }
        ],
        "priority": 1000000,
        "priorityClassName": "training-high",
        "preemptionPolicy": "PreemptLowerPriority",
        "resourceClaims": [
            {"name": "gpu", "resourceClaimTemplateName": "one-share"},
            {"name": "shared", "resourceClaimName": "team-gpu"},
        ],
        "resources": {"limits": {"cpu": "4", "memory": "16Gi"}, "requests": {"cpu": "3"}},
        "overhead": {"cpu": "250m", "memory": "120Mi"},
        "schedulerName": "sharegpu-scheduler",
        "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute"}],
    },
    "status": {
        "phase": "Pending",
        "nominatedNodeName": "gpu-node-3",
        "qosClass": "Burstable",
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/4 nodes are available: 4 Insufficient sharegpu.io/gpu.",
                "lastProbeTime": None,
                "lastTransitionTime": "2026-11-26T09:14:08Z",
            }
        ],
        "startTime": "2026-11-26T09:15:00Z",
        "resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "train-7d9f8b6c4-x2x9q-gpu-8tq5w"}],
    },
}


def test_every_field_sharegpu_reads_comes_from_its_api_name() -> None:
    pod = Pod.model_validate(API_POD)
    meta, spec, status = pod.metadata, pod.spec, pod.status
    assert meta.creation_timestamp == "2026-11-26T09:14:07Z"
    (owner,) = meta.owner_references
    assert (owner.kind, owner.name, owner.uid, owner.controller) == (
        "ReplicaSet",
        "train-7d9f8b6c4",
        "5a4e3d2c-1b0a-4f9e-8d7c-6b5a4e3d2c1b",
        True,
    )
    assert [(e.config_map_ref, e.secret_ref, e.prefix) for e in spec.containers[0].env_from] == [
        ({"name": "train-env"}, None, ""),
        (None, {"name": "s"}, "S_"),
    ]
    assert [(c.name, [e.name for e in c.env]) for c in spec.ephemeral_containers] == [("debugger-4kq2z", ["DEBUG"])]
    assert (spec.priority, spec.preemption_policy) == (1000000, "PreemptLowerPriority")
    assert [(c.name, c.resource_claim_name, c.resource_claim_template_name) for c in spec.resource_claims] == [
        ("gpu", None, "one-share"),
        ("shared", "team-gpu", None),
    ]
    assert spec.resources is not None and spec.resources.limits == {"cpu": "4", "memory": "16Gi"}
    assert spec.overhead == {"cpu": "250m", "memory": "120Mi"}
    assert status.nominated_node_name == "gpu-node-3"
    (cond,) = status.conditions
    assert (cond.type, cond.status, cond.reason, cond.last_transition_time) == (
        "PodScheduled",
        "False",
        "Unschedulable",
        "2026-11-26T09:14:08Z",
    )
    assert status.start_time == "2026-11-26T09:15:00Z"
    assert [(s.name, s.resource_claim_name) for s in status.resource_claim_statuses] == [
        ("gpu", "train-7d9f8b6c4-x2x9q-gpu-8tq5w")
    ]


def test_the_pods_own_readers() -> None:
    pod = Pod.model_validate(API_POD)
    assert pod.unschedulable
    assert pod.started_at == datetime(2026, 11, 26, 9, 15, tzinfo=UTC).timestamp()
    assert [pod.claim_name(c) for c in pod.spec.resource_claims] == ["train-7d9f8b6c4-x2x9q-gpu-8tq5w", "team-gpu"]


@pytest.mark.parametrize(
    ("conditions", "unschedulable"),
    [
        ([], False),  # not tried yet
        ([{"type": "PodScheduled", "status": "True", "lastTransitionTime": "2026-11-26T09:14:08Z"}], False),
        ([{"type": "PodScheduled", "status": "False", "reason": "SchedulingGated"}], False),
        ([{"type": "Ready", "status": "False", "reason": "Unschedulable"}], False),
        (
            [
                {"type": "Ready", "status": "False"},
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"},
            ],
            True,
        ),
    ],
)
def test_unschedulable_is_podscheduled_false_for_want_of_a_node(
    conditions: list[dict[str, Any]], unschedulable: bool
) -> None:
    assert Pod.model_validate({"status": {"conditions": conditions}}).unschedulable is unschedulable


def test_unset_fields_read_as_the_api_server_defaults_them() -> None:
    pod = Pod.model_validate({"metadata": {"name": "p", "ownerReferences": [{"kind": "Job", "name": "j", "uid": "u"}]}})
    assert (pod.spec.priority, pod.spec.preemption_policy) == (0, "PreemptLowerPriority")
    assert pod.metadata.owner_references[0].controller is None  # *bool: unset is not the controller
    assert (pod.status.nominated_node_name, pod.status.conditions, pod.status.start_time) == ("", [], None)
    assert pod.metadata.creation_timestamp == "" and pod.spec.resources is None and pod.spec.overhead == {}
    assert not pod.unschedulable and pod.started_at is None
    # A template's claim the claim controller has not made yet has no name.
    unmade = Pod.model_validate({"spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "t"}]}})
    assert unmade.claim_name(unmade.spec.resource_claims[0]) is None
    bad_time = Pod.model_validate({"status": {"startTime": "yesterday"}})
    assert bad_time.started_at is None


@pytest.mark.parametrize(
    ("path", "value", "loc"),
    [
        (("spec", "priority"), "high", "spec.priority"),
        (("spec", "ephemeralContainers"), {"dbg": {"name": "dbg"}}, "spec.ephemeralContainers"),
        (("spec", "resourceClaims"), ["gpu"], "spec.resourceClaims.0"),
        (("status", "conditions"), {"type": "PodScheduled"}, "status.conditions"),
        (("status", "startTime"), 1764148500, "status.startTime"),
        (("metadata", "ownerReferences"), {"kind": "ReplicaSet"}, "metadata.ownerReferences"),
        (("metadata", "creationTimestamp"), ["2026"], "metadata.creationTimestamp"),
    ],
)
def test_a_field_of_the_wrong_type_is_refused_at_its_path(path: tuple[str, str], value: Any, loc: str) -> None:
    # The API server would refuse such an object too (its JSON does not decode into the Go struct).
    raw = copy.deepcopy(API_POD)
    raw[path[0]][path[1]] = value
    with pytest.raises(ValidationError) as e:
        Pod.model_validate(raw)
    assert ".".join(str(x) for x in e.value.errors()[0]["loc"]) == loc


def test_a_pod_goes_back_exactly_as_it_came() -> None:
    # Unknown fields (tolerations, qosClass, targetContainerName, lastProbeTime: null) are kept, and no default is
    # added: what the extender or the webhook passes on is what the API server sent.
    raw = copy.deepcopy(API_POD)
    assert Pod.model_validate(raw).model_dump(mode="json", by_alias=True, exclude_unset=True) == API_POD
    bare = {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c"}]}}
    assert Pod.model_validate(bare).model_dump(mode="json", by_alias=True, exclude_unset=True) == bare


@pytest.mark.parametrize(
    ("resources", "amount"),
    [
        ({"limits": {"sharegpu.io/gpu": "2"}}, "2"),
        ({"requests": {"sharegpu.io/gpu": "2"}}, "2"),  # not yet defaulted: the request is what is asked
        ({"limits": {"sharegpu.io/gpu": 3}, "requests": {"sharegpu.io/gpu": "1"}}, 3),  # the limit wins
        ({"limits": {"cpu": "1"}, "requests": {"memory": "1Gi"}}, None),
    ],
)
def test_a_containers_amount_is_its_limit_then_its_request(resources: dict[str, Any], amount: object) -> None:
    c = Container.model_validate({"name": "c", "resources": resources})
    assert c.resources.amount("sharegpu.io/gpu") == amount
    assert ResourceRequirements().amount("sharegpu.io/gpu") is None
