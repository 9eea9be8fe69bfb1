"""The chart's observability parts (metrics Service and NetworkPolicy, ServiceMonitor/PodMonitor, the Grafana
dashboard ConfigMap, the status page), rendered by the real Helm engine, and the dashboard's PromQL checked against
the metric names the extender and the node agent really export."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_cluster_metrics import cluster_view

from sharegpu.k8s.extender.metrics import ClusterMetrics
from sharegpu.node.metrics import GpuSample, MetricsSnapshot, MigSample, PodUsage, ShareSample, new_registry
from sharegpu.node.mps import MpsDaemonStatus

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (a dev dependency) renders the chart")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate checks the objects")

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "sharegpu"
DASHBOARD = CHART / "dashboards" / "sharegpu.json"
OPERATOR_KINDS = {"ServiceMonitor", "PodMonitor"}  # CRDs: no schema in kubernetes-validate
# assumeCrds: an offline rendering cannot see the cluster's APIs (Helm's .Capabilities lacks monitoring.coreos.com/v1).
ALL_ON = {
    "metrics": {
        "serviceMonitor": {"enabled": True, "assumeCrds": True, "labels": {"release": "kps"}},
        "dashboard": {"enabled": True},
    },
    "statusPage": {"enabled": True},
}


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    import yaml

    out = helm.Chart.load(str(CHART)).render(values, name="sg", namespace="gpu-system", is_install=True)
    return [d for path, text in sorted(out.items()) if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def test_everything_on_renders_valid_objects() -> None:
    docs = render(ALL_ON)
    for d in docs:
        if d["kind"] not in OPERATOR_KINDS:
            kubernetes_validate.validate(d, "1.30.0", strict=True)
    for kind in OPERATOR_KINDS:
        (mon,) = by_kind(docs, kind).values()
        assert mon["apiVersion"] == "monitoring.coreos.com/v1" and mon["metadata"]["labels"]["release"] == "kps"


def test_chart_lints_clean_with_everything_on() -> None:
    report = helm.lint(str(CHART), ALL_ON, strict=True, kube_version="v1.30.0")
    assert report["errors"] == []
    assert all(m["severity"] < 2 for m in report["messages"]), report["messages"]


def test_servicemonitor_scrapes_the_extenders_metrics_port_and_not_its_api() -> None:
    docs = render(ALL_ON)
    ext = by_kind(docs, "Deployment")["sg-extender"]["spec"]["template"]["spec"]["containers"][0]
    assert "--metrics-listen=0.0.0.0:9403" in ext["args"]
    assert {p["name"]: p["containerPort"] for p in ext["ports"]} == {"https": 8888, "health": 8889, "metrics": 9403}
    svc = by_kind(docs, "Service")["sg-extender-metrics"]
    assert svc["spec"]["ports"] == [{"name": "metrics", "port": 9403, "targetPort": "metrics", "protocol": "TCP"}]
    mon = by_kind(docs, "ServiceMonitor")["sg-extender"]
    assert mon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert mon["spec"]["endpoints"][0]["port"] == "metrics"
    # The extender's API stays the scheduler's alone; the extra policy opens the metrics port only.
    policies = by_kind(docs, "NetworkPolicy")
    assert [p["port"] for r in policies["sg-extender-metrics"]["spec"]["ingress"] for p in r["ports"]] == ["metrics"]
    assert "from" not in policies["sg-extender-metrics"]["spec"]["ingress"][0]  # any scraper, by default
    api_rule = policies["sg-extender"]["spec"]["ingress"][0]
    assert [p["port"] for p in api_rule["ports"]] == ["https"] and api_rule["from"]
    pod_mon = by_kind(docs, "PodMonitor")["sg-node-agent"]
    assert pod_mon["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    ds = by_kind(docs, "DaemonSet")["sg-node-agent"]["spec"]["template"]
    assert pod_mon["spec"]["selector"]["matchLabels"].items() <= ds["metadata"]["labels"].items()


def test_monitors_are_left_out_with_a_note_where_the_operator_api_is_not_served() -> None:
    # The cluster of issue 21 had no Prometheus Operator: the API server refused the whole release for its PodMonitor.
    out = helm.Chart.load(str(CHART)).render(
        {"metrics": {"serviceMonitor": {"enabled": True}}}, name="sg", namespace="gpu-system", is_install=True
    )
    kinds = {d["kind"] for path, text in out.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d}
    assert not kinds & OPERATOR_KINDS and "Service" in kinds
    notes = next(text for path, text in out.items() if path.endswith("NOTES.txt"))
    assert "does not serve monitoring.coreos.com/v1" in notes and "metrics.serviceMonitor.assumeCrds=true" in notes
    quiet = helm.Chart.load(str(CHART)).render(ALL_ON, name="sg", namespace="gpu-system", is_install=True)
    assert "WARNING" not in next(text for path, text in quiet.items() if path.endswith("NOTES.txt"))


def test_defaults_export_metrics_but_install_no_operator_objects_dashboard_or_page() -> None:
    docs = render()
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("Service", "sg-extender-metrics") in kinds and ("NetworkPolicy", "sg-extender-metrics") in kinds
    assert not {k for k, _ in kinds} & OPERATOR_KINDS
    assert ("ConfigMap", "sg-dashboard") not in kinds and ("Deployment", "sg-status-page") not in kinds
    off = render({"metrics": {"enabled": False}})
    ext = by_kind(off, "Deployment")["sg-extender"]["spec"]["template"]["spec"]["containers"][0]
    assert not any(a.startswith("--metrics-listen") for a in ext["args"])
    assert "sg-extender-metrics" not in by_kind(off, "Service")


def test_dashboard_configmap_carries_the_dashboard_for_the_sidecar() -> None:
    docs = render({"metrics": {"dashboard": {"enabled": True, "namespace": "monitoring"}}})
    cm = by_kind(docs, "ConfigMap")["sg-dashboard"]
    assert cm["metadata"]["namespace"] == "monitoring" and cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["sharegpu.json"]) == json.loads(DASHBOARD.read_text())


def test_status_page_is_read_only_and_unreachable_by_default() -> None:
    docs = render({"statusPage": {"enabled": True}})
    role = by_kind(docs, "ClusterRole")["sg-status-page"]
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["nodes", "pods"], "verbs": ["get", "list", "watch"]},
        # status shows the DRA GPUs too (issue 28: without these it lost them to a 403)
        {
            "apiGroups": ["resource.k8s.io"],
            "resources": ["resourceslices", "resourceclaims"],
            "verbs": ["get", "list", "watch"],
        },
    ]
    pod = by_kind(docs, "Deployment")["sg-status-page"]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["command"] == ["sharegpu", "status"] and "--serve=0.0.0.0:8080" in c["args"]
    assert pod["securityContext"]["runAsNonRoot"] is True and c["securityContext"]["readOnlyRootFilesystem"] is True
    policy = by_kind(docs, "NetworkPolicy")["sg-status-page"]["spec"]
    assert policy["ingress"] == [] and policy["policyTypes"] == ["Ingress"]  # no one over the pod network
    peers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}}}]
    opened = render({"statusPage": {"enabled": True, "networkPolicy": {"allowedFrom": peers}}})
    assert by_kind(opened, "NetworkPolicy")["sg-status-page"]["spec"]["ingress"][0]["from"] == peers


# ----- the dashboard's PromQL against what is exported ------------------------------------------------------------
PROMQL_WORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (not functions, keywords, labels, durations or numbers)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings (label values)
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors, e.g. [$__rate_interval]
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)  # label lists
    names = set()
    for m in re.finditer(r"(?<![\w$.])([A-Za-z_:][\w:]*)(\s*\()?", expr):
        word, call = m.group(1), m.group(2)
        if call or word in PROMQL_WORDS or word.lower() in ("inf", "nan"):
            continue
        names.add(word)
    return names


def test_metric_name_extraction() -> None:
    expr = 'histogram_quantile(0.99, sum by (le, verb) (rate(a_bucket{verb="x"}[$__rate_interval]))) / b or vector(0)'
    assert metric_names(expr) == {"a_bucket", "b"}
    assert metric_names("count(c == 0) or vector(0)") == {"c"}


def exported_names() -> set[str]:
    """Every sample name the extender's registry and a node agent's registry expose (with _total, _bucket …)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = ClusterMetrics(cluster_view()).render().decode()
    snapshot = MetricsSnapshot(
        node="n",
        gpus=(GpuSample(0, "GPU-0", "A100-80GB", True, True, 81920, 1024, 50, 10),),
        pod_usage=(PodUsage("ns", "p", 0, "GPU-0", 512, 20),),
        shares=(ShareSample("ns", "p", 0, "GPU-0", "gpu", "mps", 1024, 300, True, True),),
        mig=(MigSample(0, "GPU-0", "1g.10gb", 0, True),),
        mps=(MpsDaemonStatus("GPU-0", True, 0),),
    )
    from prometheus_client import generate_latest

    text += generate_latest(new_registry(lambda: snapshot)).decode()
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            out.append((panel["title"], t["expr"]))
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            out.append((f"variable {var['name']}", str(var["query"])))
    return out


def test_every_metric_the_dashboard_queries_is_exported() -> None:
    exported = exported_names()
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    missing = [(title, name) for title, expr in exprs for name in sorted(metric_names(expr)) if name not in exported]
    assert not missing, f"dashboard panels query metrics nobody exports: {missing}"
    used = {n for _, e in exprs for n in metric_names(e)}
    # The dashboard covers what the issue asks: allocation, fragmentation, per-GPU sharing, pending reasons, latency.
    for name in (
        "sharegpu_cluster_allocation_ratio",
        "sharegpu_cluster_fragmentation_ratio",
        "sharegpu_cluster_pending_pods",
        "sharegpu_extender_request_duration_seconds_bucket",
        "sharegpu_extender_binds_total",
        "sharegpu_pod_gpu_compute_promised_ratio",
        "sharegpu_gpu_shares",
    ):
        assert name in used, name


def test_a_panel_naming_a_metric_that_does_not_exist_is_caught() -> None:
    exported = exported_names()
    assert metric_names("sum(sharegpu_cluster_gpus_typo)") - exported == {"sharegpu_cluster_gpus_typo"}
