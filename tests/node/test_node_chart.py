"""The node agent's part of the Helm chart, rendered by the real Helm engine (as tests/k8s/test_k8s_helm_chart.py
does): the agent may evict pods only where eviction is on (issue 33: it held cluster-wide pods/eviction whatever
the option, and the chart could not turn the option on at all)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (a dev dependency) renders the chart")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate checks the objects")

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "sharegpu"


def _agent(values: dict[str, Any] | None) -> tuple[dict[str, Any], list[str]]:
    """The node agent's ClusterRole and its container's arguments, each rendered object checked against the schema."""
    out = helm.Chart.load(str(CHART)).render(values, name="sg", namespace="gpu-system", is_install=True)
    docs = [d for path, text in sorted(out.items()) if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]
    for d in docs:
        if d["kind"] != "DeviceClass":
            kubernetes_validate.validate(d, "1.37.0", strict=True)
    role = next(d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "sg-node-agent")
    ds = next(d for d in docs if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "sg-node-agent")
    return role, ds["spec"]["template"]["spec"]["containers"][0]["args"]


def _grants(role: dict[str, Any]) -> set[tuple[str, str]]:
    return {(res, verb) for r in role["rules"] for res in r["resources"] for verb in r["verbs"]}


def test_the_agent_holds_no_eviction_permission_unless_eviction_is_on() -> None:
    role, args = _agent(None)
    assert ("pods/eviction", "create") not in _grants(role)
    assert ("events", "create") in _grants(role)  # the audit's and the fault watch's Warning Events stay
    assert "--evict-on-audit" not in args


def test_eviction_on_passes_the_flag_and_grants_eviction_alone() -> None:
    off, _ = _agent(None)
    role, args = _agent({"nodeAgent": {"evictOnAudit": True}})
    assert "--evict-on-audit" in args
    assert _grants(role) - _grants(off) == {("pods/eviction", "create")}


def test_the_agent_knows_its_namespace_where_the_bench_job_runs_with_the_labels_it_recognises() -> None:
    """The agent recognises the bench Job's pod by BENCH_POD_LABELS in its own namespace ($POD_NAMESPACE): the chart
    must give both the same (sharegpu.node.audit.bench_pods)."""
    from sharegpu.node.audit import BENCH_POD_LABELS

    values = {"bench": {"enabled": True, "nodeName": "gpu-1"}}
    out = helm.Chart.load(str(CHART)).render(values, name="sg", namespace="gpu-system", is_install=True)
    docs = [d for path, text in sorted(out.items()) if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]
    job = next(d for d in docs if d["kind"] == "Job")
    ds = next(d for d in docs if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "sg-node-agent")
    env = {e["name"]: e for e in ds["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert job["metadata"]["namespace"] == ds["metadata"]["namespace"] == "gpu-system"
    assert BENCH_POD_LABELS.items() <= job["spec"]["template"]["metadata"]["labels"].items()


def test_the_dra_driver_knows_its_namespace_too() -> None:
    """The DRA driver runs the same audit (sharegpu.node.watch) and recognises the bench Job's pod the same way: its
    container gets POD_NAMESPACE as the agent's does, or the exemption matches no pod."""
    values = {"dra": {"enabled": True}, "bench": {"enabled": True, "nodeName": "gpu-1"}}
    out = helm.Chart.load(str(CHART)).render(values, name="sg", namespace="gpu-system", is_install=True)
    docs = [d for path, text in sorted(out.items()) if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]
    ds = next(d for d in docs if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "sg-dra-driver")
    env = {e["name"]: e for e in ds["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
