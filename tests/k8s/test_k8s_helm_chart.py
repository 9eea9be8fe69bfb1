"""The Helm chart, rendered by the real Helm engine (helm-python-sdk binds Helm's Go SDK; no helm binary, no
network) and every rendered object validated against the Kubernetes OpenAPI schemas (kubernetes-validate)."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (a dev dependency) renders the chart")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate checks the objects")

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "sharegpu"
KUBE_VERSIONS = ("1.30.0", "1.37.0")  # the oldest supported cluster and the newest schemas shipped


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    chart = helm.Chart.load(str(CHART))
    out = chart.render(values, name="sg", namespace="gpu-system", is_install=True)
    docs = []
    for path, text in sorted(out.items()):
        if not path.endswith((".yaml", ".yml")):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


@pytest.fixture(scope="module")
def default_docs() -> list[dict[str, Any]]:
    return render()


@pytest.mark.parametrize(
    "values",
    [
        None,
        {
            "nodeAgent": {"backend": "sim"},
            "webhook": {"existingSecret": "my-tls", "caBundle": "Zm9v", "protectAssignment": False},
        },
        {"scheduler": {"enabled": False}, "webhook": {"enabled": False}, "nodeAgent": {"enabled": False}},
    ],
)
def test_every_rendered_object_is_valid_kubernetes(values: dict[str, Any] | None) -> None:
    docs = render(values)
    assert docs
    for version in KUBE_VERSIONS:
        for d in docs:
            kubernetes_validate.validate(d, version, strict=True)


def test_chart_lints_clean() -> None:
    report = helm.lint(str(CHART), strict=True, kube_version="v1.30.0")
    assert report["errors"] == []
    assert all(m["severity"] < 2 for m in report["messages"]), report["messages"]


def test_the_chart_has_all_the_parts(default_docs: list[dict[str, Any]]) -> None:
    kinds = {(d["kind"], d["metadata"]["name"]) for d in default_docs}
    for part in (
        ("Deployment", "sg-scheduler"),
        ("Deployment", "sg-extender"),
        ("Deployment", "sg-webhook"),
        ("DaemonSet", "sg-node-agent"),
        ("Service", "sg-extender"),
        ("Service", "sg-webhook"),
        ("Secret", "sg-webhook-tls"),
        ("MutatingWebhookConfiguration", "sg-webhook"),
        ("ValidatingWebhookConfiguration", "sg-webhook"),
        ("ConfigMap", "sg-scheduler-config"),
    ):
        assert part in kinds


def test_scheduler_profile_calls_the_extender_with_the_managed_resources(default_docs: list[dict[str, Any]]) -> None:
    config = yaml.safe_load(by_kind(default_docs, "ConfigMap")["sg-scheduler-config"]["data"]["config.yaml"])
    assert config["apiVersion"] == "kubescheduler.config.k8s.io/v1" and config["kind"] == "KubeSchedulerConfiguration"
    assert [p["schedulerName"] for p in config["profiles"]] == ["sharegpu-scheduler"]
    (ext,) = config["extenders"]
    service = by_kind(default_docs, "Service")["sg-extender"]
    assert ext["urlPrefix"] == f"http://sg-extender.gpu-system.svc:{service['spec']['ports'][0]['port']}"
    assert (ext["filterVerb"], ext["prioritizeVerb"], ext["bindVerb"], ext["preemptVerb"]) == (
        "filter",
        "prioritize",
        "bind",
        "preempt",
    )
    assert ext["nodeCacheCapable"] is True and ext["ignorable"] is False
    assert {r["name"]: r["ignoredByScheduler"] for r in ext["managedResources"]} == {
        "sharegpu.io/gpu": False,
        "sharegpu.io/gpu-memory": True,
        "sharegpu.io/gpu-compute": True,
    }
    deploy = by_kind(default_docs, "Deployment")["sg-scheduler"]
    assert (
        "--config=/etc/sharegpu-scheduler/config.yaml" in deploy["spec"]["template"]["spec"]["containers"][0]["command"]
    )


def test_rbac_is_least_privilege(default_docs: list[dict[str, Any]]) -> None:
    roles = by_kind(default_docs, "ClusterRole")
    assert roles["sg-extender"]["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "patch"]},
        {"apiGroups": [""], "resources": ["pods/binding"], "verbs": ["create"]},
    ]
    for role in roles.values():
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"]
            assert not {"delete", "deletecollection", "escalate", "bind", "impersonate"} & set(rule["verbs"])
    webhook = by_kind(default_docs, "Deployment")["sg-webhook"]["spec"]["template"]["spec"]
    assert webhook["automountServiceAccountToken"] is False  # the webhook needs no API access
    # Two replicas elect a leader on a Lease they may only get and update by name.
    extender = by_kind(default_docs, "Deployment")["sg-extender"]["spec"]
    assert extender["replicas"] == 2 and extender["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    args = extender["template"]["spec"]["containers"][0]["args"]
    assert "--leader-elect" in args and "--lease-name=sg-extender" in args
    lease_rules = by_kind(default_docs, "Role")["sg-extender-leader-election"]["rules"]
    assert {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": ["sg-extender"],
            "verbs": ["get", "update"]} in lease_rules  # fmt: skip


def test_webhook_is_served_with_a_certificate_the_api_server_trusts(default_docs: list[dict[str, Any]]) -> None:
    secret = by_kind(default_docs, "Secret")["sg-webhook-tls"]
    cert_pem = base64.b64decode(secret["data"]["tls.crt"]).decode()
    assert cert_pem.startswith("-----BEGIN CERTIFICATE-----")
    assert base64.b64decode(secret["data"]["tls.key"]).decode().startswith("-----BEGIN RSA PRIVATE KEY-----")
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        (hook,) = by_kind(default_docs, kind)["sg-webhook"]["webhooks"]
        ca = base64.b64decode(hook["clientConfig"]["caBundle"]).decode()
        assert ca.startswith("-----BEGIN CERTIFICATE-----") and ca != cert_pem
        assert hook["clientConfig"]["service"] == {
            "name": "sg-webhook",
            "namespace": "gpu-system",
            "path": hook["clientConfig"]["service"]["path"],
            "port": 443,
        }
        assert hook["namespaceSelector"]["matchExpressions"][0]["values"] == ["gpu-system", "kube-system"]
    args = by_kind(default_docs, "Deployment")["sg-webhook"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--trusted-user=system:serviceaccount:gpu-system:sg-extender" in args
    assert "--scheduler-name=sharegpu-scheduler" in args


def test_node_agent_values_are_merged_into_values_yaml() -> None:
    assert not (CHART / "values-node-agent.yaml").exists()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["nodeAgent"]["enabled"] is True and values["nodeAgent"]["backend"] == "nvml"
    docs = render({"nodeAgent": {"backend": "sim"}})
    ds = by_kind(docs, "DaemonSet")["sg-node-agent"]
    assert "--backend=sim" in ds["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "sg-node-agent-sim" in by_kind(docs, "ConfigMap")


def test_sim_node_agent_runs_on_any_node_and_keeps_its_mig_layout_in_the_state_dir(
    default_docs: list[dict[str, Any]],
) -> None:
    real = by_kind(default_docs, "DaemonSet")["sg-node-agent"]["spec"]
    assert real["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert real["updateStrategy"]["type"] == "RollingUpdate"
    docs = render({"nodeAgent": {"backend": "sim", "updateStrategy": "OnDelete"}})
    sim = by_kind(docs, "DaemonSet")["sg-node-agent"]["spec"]
    assert "nodeSelector" not in sim["template"]["spec"]  # a simulated node needs no GPU
    assert sim["updateStrategy"] == {"type": "OnDelete"}
    config = yaml.safe_load(by_kind(docs, "ConfigMap")["sg-node-agent-sim"]["data"]["sim.yaml"])
    assert config["stateFile"] == "/var/lib/sharegpu/sim.json"  # under the host-path state dir: survives restarts
    mine = render({"nodeAgent": {"backend": "sim", "nodeSelector": {"pool": "demo"}, "simConfig": {"stateFile": "/s"}}})
    assert by_kind(mine, "DaemonSet")["sg-node-agent"]["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "demo"}
    assert yaml.safe_load(by_kind(mine, "ConfigMap")["sg-node-agent-sim"]["data"]["sim.yaml"])["stateFile"] == "/s"


def test_webhook_certificate_is_reused_on_upgrade_and_a_new_one_rolls_the_pods(
    default_docs: list[dict[str, Any]],
) -> None:
    template = (CHART / "templates" / "webhook.yaml").read_text()
    # On a live cluster the chart reads its Secret (and, for Secrets of older versions, the CA of the installed
    # webhook configuration) back instead of making a new pair; `helm template` looks nothing up.
    assert 'lookup "v1" "Secret"' in template and '"MutatingWebhookConfiguration"' in template
    secret = by_kind(default_docs, "Secret")["sg-webhook-tls"]
    (hook,) = by_kind(default_docs, "MutatingWebhookConfiguration")["sg-webhook"]["webhooks"]
    assert secret["data"]["ca.crt"] == hook["clientConfig"]["caBundle"]  # what the next upgrade reuses
    pod = by_kind(default_docs, "Deployment")["sg-webhook"]["spec"]["template"]["metadata"]
    checksum = pod["annotations"]["checksum/tls"]
    assert len(checksum) == 64
    again = by_kind(render(), "Deployment")["sg-webhook"]["spec"]["template"]["metadata"]["annotations"]
    assert again["checksum/tls"] != checksum  # a new certificate (template mode makes one each time) rolls the pods
    mine = {"webhook": {"existingSecret": "my-tls", "caBundle": "Zm9v"}}
    a, b = (by_kind(render(mine), "Deployment")["sg-webhook"]["spec"]["template"]["metadata"] for _ in range(2))
    assert a["annotations"]["checksum/tls"] == b["annotations"]["checksum/tls"]


def test_only_pods_naming_sharegpu_reach_the_webhook_and_it_survives_drains(
    default_docs: list[dict[str, Any]],
) -> None:
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        (hook,) = by_kind(default_docs, kind)["sg-webhook"]["webhooks"]
        (cond,) = hook["matchConditions"]
        expr = cond["expression"]
        for part in ("object.metadata.annotations", "object.spec.containers", "object.spec.initContainers"):
            assert part in expr
        assert "oldObject.metadata.annotations" in expr and "'sharegpu.io/'" in expr
        assert expr.count("(") == expr.count(")")
    (hook,) = by_kind(default_docs, "ValidatingWebhookConfiguration")["sg-webhook"]["webhooks"]
    assert ["pods/ephemeralcontainers"] in [r["resources"] for r in hook["rules"]]
    pdb = by_kind(default_docs, "PodDisruptionBudget")["sg-webhook"]
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] == "sharegpu-webhook"
    assert "PodDisruptionBudget" not in {
        d["kind"] for d in render({"webhook": {"podDisruptionBudget": {"enabled": False}}})
    }


def test_only_the_sharegpu_scheduler_may_reach_the_extender(default_docs: list[dict[str, Any]]) -> None:
    policy = by_kind(default_docs, "NetworkPolicy")["sg-extender"]["spec"]
    assert policy["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == "sharegpu-extender"
    assert policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    assert rule["from"] == [
        {
            "podSelector": {
                "matchLabels": {"app.kubernetes.io/name": "sharegpu-scheduler", "app.kubernetes.io/instance": "sg"}
            }
        }
    ]
    assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    scheduler = by_kind(default_docs, "Deployment")["sg-scheduler"]["spec"]["template"]["metadata"]["labels"]
    assert all(scheduler[k] == v for k, v in rule["from"][0]["podSelector"]["matchLabels"].items())
    args = by_kind(default_docs, "Deployment")["sg-extender"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--scheduler-name=sharegpu-scheduler" in args
    extra = {"extender": {"networkPolicy": {"extraFrom": [{"namespaceSelector": {"matchLabels": {"name": "mon"}}}]}}}
    docs = render(extra)
    assert len(by_kind(docs, "NetworkPolicy")["sg-extender"]["spec"]["ingress"][0]["from"]) == 2
    for version in KUBE_VERSIONS:
        for d in docs:
            kubernetes_validate.validate(d, version, strict=True)
    off = render({"extender": {"networkPolicy": {"enabled": False}}})
    assert "NetworkPolicy" not in {d["kind"] for d in off}
