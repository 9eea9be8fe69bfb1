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
    assert ext["urlPrefix"] == f"https://sg-extender.gpu-system.svc:{service['spec']['ports'][0]['port']}"
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
        # Preemption (on by default): evictions through the Eviction API only (no pod delete), the nomination, its
        # Events, and the budgets it must respect.
        {"apiGroups": [""], "resources": ["pods/eviction"], "verbs": ["create"]},
        {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
        {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"], "verbs": ["list", "watch"]},
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
    assert "--preemption" in args and "--preemption-interval=2" in args
    assert not [a for a in args if a.startswith("--consolidation")]  # off by default (issue 19 item 2)
    lease_rules = by_kind(default_docs, "Role")["sg-extender-leader-election"]["rules"]
    assert {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": ["sg-extender"],
            "verbs": ["get", "update"]} in lease_rules  # fmt: skip


def test_consolidation_is_turned_on_with_its_rate() -> None:
    values = {"extender": {"consolidation": {"enabled": True, "movesPerMinute": 2}}}
    extender = by_kind(render(values), "Deployment")["sg-extender"]["spec"]
    args = extender["template"]["spec"]["containers"][0]["args"]
    assert "--consolidation" in args and "--consolidation-moves-per-minute=2" in args


def test_the_mps_daemon_cap_and_memory_go_to_the_extender_and_the_status_page_alike() -> None:
    """Issue 32: both build a ledger that counts MPS daemons per GPU; a status page that counted with another cap
    than the extender's would say why pods wait wrongly."""
    from sharegpu.ledger import DEFAULT_DAEMONS_PER_UNIT, MPS_DAEMON_MEMORY_MIB

    def args(values: dict[str, Any]) -> tuple[list[str], list[str]]:
        deployments = by_kind(render(values | {"statusPage": {"enabled": True}}), "Deployment")
        extender, page = (deployments[n]["spec"]["template"]["spec"]["containers"][0]["args"] for n in
                          ("sg-extender", "sg-status-page"))  # fmt: skip
        return extender, page

    assert all(f"--mps-daemons-per-gpu={DEFAULT_DAEMONS_PER_UNIT}" in a for a in args({}))
    assert all("--mps-daemons-per-gpu=4" in a for a in args({"extender": {"mpsDaemonsPerGpu": 4}}))
    # So does each daemon's server memory (measured per GPU and driver; the default is the H200's).
    assert all(f"--mps-daemon-memory={MPS_DAEMON_MEMORY_MIB}" in a for a in args({}))
    assert all("--mps-daemon-memory=80" in a for a in args({"extender": {"mpsDaemonMemoryMiB": 80}}))


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
    assert rule["ports"] == [{"port": "https", "protocol": "TCP"}]
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


def _container(docs: list[dict[str, Any]], deployment: str) -> dict[str, Any]:
    return by_kind(docs, "Deployment")[deployment]["spec"]["template"]["spec"]["containers"][0]


def _mounted_secret(docs: list[dict[str, Any]], deployment: str, path: str) -> tuple[str, str]:
    """(Secret name, file) of the file at ``path`` in the Deployment's container."""
    pod = by_kind(docs, "Deployment")[deployment]["spec"]["template"]["spec"]
    for m in _container(docs, deployment)["volumeMounts"]:
        if path.startswith(m["mountPath"] + "/"):
            (volume,) = [v for v in pod["volumes"] if v["name"] == m["name"]]
            return volume["secret"]["secretName"], path[len(m["mountPath"]) + 1 :]
    raise AssertionError(f"{path} is not mounted in {deployment}")


def test_the_scheduler_calls_the_extender_over_mutual_tls(default_docs: list[dict[str, Any]]) -> None:
    (ext,) = yaml.safe_load(by_kind(default_docs, "ConfigMap")["sg-scheduler-config"]["data"]["config.yaml"])[
        "extenders"
    ]
    assert ext["enableHTTPS"] is True
    secrets = by_kind(default_docs, "Secret")
    client = {
        k: _mounted_secret(default_docs, "sg-scheduler", ext["tlsConfig"][k]) for k in ("caFile", "certFile", "keyFile")
    }
    assert client == {
        "caFile": ("sg-scheduler-extender-client", "ca.crt"),
        "certFile": ("sg-scheduler-extender-client", "tls.crt"),
        "keyFile": ("sg-scheduler-extender-client", "tls.key"),
    }
    args = _container(default_docs, "sg-extender")["args"]
    flags = dict(a.removeprefix("--").split("=", 1) for a in args if "=" in a)
    server = {f: _mounted_secret(default_docs, "sg-extender", flags[f]) for f in ("tls-cert", "tls-key", "client-ca")}
    assert server == {
        "tls-cert": ("sg-extender-tls", "tls.crt"),
        "tls-key": ("sg-extender-tls", "tls.key"),
        "client-ca": ("sg-extender-tls", "ca.crt"),
    }
    assert "plain-http" not in flags
    # One CA signs both sides; the scheduler alone holds the client key.
    assert secrets["sg-extender-tls"]["data"]["ca.crt"] == secrets["sg-scheduler-extender-client"]["data"]["ca.crt"]
    for d in default_docs:
        if d["kind"] == "Deployment" and d["metadata"]["name"] != "sg-scheduler":
            for v in d["spec"]["template"]["spec"].get("volumes", []):
                assert v.get("secret", {}).get("secretName") != "sg-scheduler-extender-client"
    # The kubelet probes a plain-HTTP port that serves nothing but the probes; the Service exposes only HTTPS.
    container = _container(default_docs, "sg-extender")
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert flags["health-listen"] == f"0.0.0.0:{ports['health']}" and flags["listen"] == f"0.0.0.0:{ports['https']}"
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert [p["targetPort"] for p in by_kind(default_docs, "Service")["sg-extender"]["spec"]["ports"]] == ["https"]


def test_extender_certificates_are_reused_on_upgrade_and_new_ones_roll_both_sides(
    default_docs: list[dict[str, Any]],
) -> None:
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    assert 'lookup "v1" "Secret" $ns (printf "%s-tls" $ext)' in helpers
    assert 'lookup "v1" "Secret" $ns (include "sharegpu.extenderClientSecret" .)' in helpers
    again = render()  # template mode looks nothing up: a fresh set, which must roll both Deployments
    for name in ("sg-extender", "sg-scheduler"):
        a, b = (
            by_kind(d, "Deployment")[name]["spec"]["template"]["metadata"]["annotations"] for d in (default_docs, again)
        )
        assert len(a["checksum/tls"]) == 64 and a["checksum/tls"] != b["checksum/tls"]


def test_the_charts_certificates_make_a_working_mutual_tls_pair(
    default_docs: list[dict[str, Any]], tmp_path: Path
) -> None:
    """The chart's own PEMs in a real extender process: the scheduler's pair is served (the server checked under
    the Service name, as the kube-scheduler checks it), a client without a certificate is refused."""
    import socket
    import ssl

    from proc_helpers import Proc, free_port, kubeconfig

    secrets = by_kind(default_docs, "Secret")
    for secret in ("sg-extender-tls", "sg-scheduler-extender-client"):
        (tmp_path / secret).mkdir()
        for key, value in secrets[secret]["data"].items():
            (tmp_path / secret / key).write_bytes(base64.b64decode(value))
    server, client = tmp_path / "sg-extender-tls", tmp_path / "sg-scheduler-extender-client"
    port = free_port()

    def get(with_cert: bool) -> bytes:
        ctx = ssl.create_default_context(cafile=str(client / "ca.crt"))
        if with_cert:
            ctx.load_cert_chain(str(client / "tls.crt"), str(client / "tls.key"))
        raw = socket.create_connection(("127.0.0.1", port), timeout=10)
        with ctx.wrap_socket(raw, server_hostname="sg-extender.gpu-system.svc") as tls:
            tls.sendall(b"GET /healthz HTTP/1.1\r\nHost: sg-extender\r\nConnection: close\r\n\r\n")
            data = b""
            while chunk := tls.recv(4096):
                data += chunk
            return data

    with Proc(
        "scheduler-extender", "--kubeconfig", str(kubeconfig(tmp_path / "kc", f"https://127.0.0.1:{free_port()}")),
        "--listen", f"127.0.0.1:{port}", "--tls-cert", str(server / "tls.crt"), "--tls-key", str(server / "tls.key"),
        "--client-ca", str(server / "ca.crt"),
    ) as proc:  # fmt: skip
        proc.wait_for(lambda line: "listening on https://" in line)
        assert get(with_cert=True).startswith(b"HTTP/1.1 200")
        with pytest.raises((ssl.SSLError, ConnectionError)):
            if not get(with_cert=False):
                raise ConnectionError("closed without an answer")
        assert proc.stop() == 0


def test_the_bench_job_is_off_by_default_and_runs_sharegpu_bench_on_the_named_node(
    default_docs: list[dict[str, Any]],
) -> None:
    assert not by_kind(default_docs, "Job")
    docs = render({"bench": {"enabled": True, "nodeName": "gpu-7", "quick": True, "clients": "1,2"}})
    for version in KUBE_VERSIONS:
        for d in docs:
            kubernetes_validate.validate(d, version, strict=True)
    job = by_kind(docs, "Job")["sg-bench"]["spec"]
    pod = job["template"]["spec"]
    assert job["backoffLimit"] == 0 and pod["restartPolicy"] == "Never" and pod["nodeName"] == "gpu-7"
    c = pod["containers"][0]
    assert c["command"] == ["sharegpu", "bench"]
    assert c["args"] == ["--gpu=0", "--out=/tmp/sharegpu-bench", "--quick", "--clients=1,2", "--publish",
                         "--node=$(NODE_NAME)"]  # fmt: skip
    assert c["securityContext"]["runAsUser"] == 0  # the MPS control daemon
    # --publish may patch that one Node and nothing else
    assert by_kind(docs, "ClusterRole")["sg-bench"]["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "resourceNames": ["gpu-7"], "verbs": ["get", "patch"]}
    ]
    private = render({"bench": {"enabled": True, "nodeName": "gpu-7", "publish": False}})
    pod = by_kind(private, "Job")["sg-bench"]["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False and "--publish" not in pod["containers"][0]["args"]
    assert "sg-bench" not in by_kind(private, "ClusterRole")


def test_the_bench_job_needs_its_node() -> None:
    with pytest.raises(Exception, match=r"bench.nodeName: name the GPU node to benchmark"):
        render({"bench": {"enabled": True}})
