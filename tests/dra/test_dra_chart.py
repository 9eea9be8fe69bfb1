"""The chart's DRA mode, rendered by the real Helm engine: the driver DaemonSet, RBAC, DeviceClasses and the
node agent kept off DRA nodes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from sharegpu.node.dra.classes import device_classes

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (a dev dependency) renders the chart")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate checks the objects")

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "sharegpu"


def render(values: dict[str, Any] | None) -> list[dict[str, Any]]:
    out = helm.Chart.load(str(CHART)).render(values, name="sg", namespace="gpu-system", is_install=True)
    return [d for path, text in sorted(out.items()) if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]


def test_dra_mode_renders_valid_objects_and_the_classes_of_the_code() -> None:
    docs = render({"dra": {"enabled": True, "backend": "sim"}})
    for d in docs:
        if d["kind"] != "DeviceClass":  # resource.k8s.io/v1 schemas are checked by the API server (tests/dra rig)
            kubernetes_validate.validate(d, "1.37.0", strict=True)
    classes = [d for d in docs if d["kind"] == "DeviceClass"]
    assert classes == device_classes()
    ds = next(d for d in docs if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "sg-dra-driver")
    pod = ds["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"sharegpu.io/device-path": "dra"}
    assert pod["containers"][0]["command"] == ["sharegpu", "dra-driver"]
    mounts = {m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert {"/var/lib/kubelet/plugins_registry", "/var/lib/kubelet/plugins", "/var/run/cdi"} <= mounts
    role = next(d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "sg-dra-driver")
    verbs = {(r["resources"][0], v) for r in role["rules"] for v in r["verbs"]}
    assert {
        ("resourceclaims", "get"),
        ("pods", "get"),  # the claim's reservedFor pods: their containers' users decide the claim's MPS tenant
        ("pods", "list"),  # the node's pods, for the audit
        ("events", "create"),  # what the audit and the fault watch tell
        ("nodes", "get"),
        ("resourceslices", "create"),
        ("resourceslices", "delete"),
    } <= verbs
    assert "pods/eviction" not in {r["resources"][0] for r in role["rules"]}  # only where eviction is on
    args = pod["containers"][0]["args"]
    assert "--mps-multi-user" not in args and "--evict-on-audit" not in args
    agent = next(d for d in docs if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "sg-node-agent")
    term = agent["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert term["nodeSelectorTerms"][0]["matchExpressions"] == [
        {"key": "sharegpu.io/device-path", "operator": "NotIn", "values": ["dra"]}
    ]


def test_dra_is_off_by_default() -> None:
    docs = render(None)
    assert not [d for d in docs if d["kind"] == "DeviceClass" or d["metadata"]["name"] == "sg-dra-driver"]
    agent = next(d for d in docs if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "sg-node-agent")
    assert "affinity" not in agent["spec"]["template"]["spec"]


def test_dra_steering_adds_a_filter_only_extender_entry_its_flag_and_rbac() -> None:
    off = render({})
    docs = render({"scheduler": {"draSteering": {"enabled": True}}})
    for d in docs:
        if d["kind"] != "DeviceClass":
            kubernetes_validate.validate(d, "1.37.0", strict=True)

    def config(ds: list[dict[str, Any]]) -> dict[str, Any]:
        cm = next(d for d in ds if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "sg-scheduler-config")
        out: dict[str, Any] = yaml.safe_load(cm["data"]["config.yaml"])
        return out

    assert len(config(off)["extenders"]) == 1
    main, steer = config(docs)["extenders"]
    assert main["bindVerb"] == "bind" and main["managedResources"]
    # called for every pod of the profile (no managedResources), filter only, never the binder, ignorable
    assert steer["urlPrefix"] == main["urlPrefix"] + "/dra"
    assert steer["filterVerb"] == "filter" and steer["ignorable"] is True
    assert not {"managedResources", "bindVerb", "prioritizeVerb", "preemptVerb"} & set(steer)
    assert steer["tlsConfig"] == main["tlsConfig"]
    deploy = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "sg-extender")
    assert "--dra-steering" in deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    role = next(d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "sg-extender")
    assert {"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices", "resourceclaims"],
            "verbs": ["get", "list", "watch"]} in role["rules"]  # fmt: skip


def test_dra_multi_user_mode_and_eviction_are_flags_and_eviction_brings_its_permission() -> None:
    docs = render({"dra": {"enabled": True, "backend": "sim", "mpsMultiUser": True, "evictOnAudit": True}})
    ds = next(d for d in docs if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "sg-dra-driver")
    args = ds["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--mps-multi-user" in args and "--evict-on-audit" in args
    role = next(d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "sg-dra-driver")
    assert {"apiGroups": [""], "resources": ["pods/eviction"], "verbs": ["create"]} in role["rules"]
    for d in docs:
        if d["kind"] != "DeviceClass":
            kubernetes_validate.validate(d, "1.37.0", strict=True)
