"""The real kube-scheduler schedules through the extender over mutual TLS, with the chart's own scheduler
configuration and the chart's own certificates (issue 8, item 10). Needs the k8s rig (../shared/k8s-rig):

    SHAREGPU_TEST_KUBECONFIG=$K8S_REAL/kubeconfig SHAREGPU_TEST_K8S_REAL=$K8S_REAL uv run pytest tests/k8s/test_k8s_rig_extender_tls.py

SHAREGPU_TEST_K8S_REAL names the rig's directory: the test restarts its kube-scheduler (restart-scheduler.sh) with
the chart's KubeSchedulerConfiguration pointed at an extender process it starts on loopback, and restores the
scheduler's previous configuration afterwards. It makes a fake node with a sharegpu inventory and a namespace, and
deletes both.
"""

from __future__ import annotations

import base64
import contextlib
import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from k8s_helpers import node_spec, pod_obj

from proc_helpers import Proc, free_port

KUBECONFIG = os.environ.get("SHAREGPU_TEST_KUBECONFIG")
RIG = os.environ.get("SHAREGPU_TEST_K8S_REAL")
pytestmark = pytest.mark.skipif(
    not (KUBECONFIG and RIG),
    reason="needs the k8s rig: set SHAREGPU_TEST_KUBECONFIG to its kubeconfig and SHAREGPU_TEST_K8S_REAL to its "
    "directory (the test restarts its kube-scheduler)",
)
helm_chart = pytest.importorskip("test_k8s_helm_chart", reason="renders the chart (helm-python-sdk, a dev dependency)")

T = TypeVar("T")
SERVICE_NAME = "sg-extender.gpu-system.svc"  # what the chart's server certificate is for


def until(get: Callable[[], T | None], what: str, timeout: float = 60.0) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = get()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.25)


def _rig_env() -> dict[str, str]:
    """The rig scripts' environment: its directory and its port offset (read off the API server's port)."""
    from sharegpu.kube.kubeconfig import load_credentials

    assert KUBECONFIG and RIG
    port = int(load_credentials(Path(KUBECONFIG)).server.rsplit(":", 1)[1])
    return os.environ | {"K8S_REAL": RIG, "K8S_RIG_PORT_OFFSET": str(port - 6443)}


def _restart_scheduler(config: Path | None) -> None:
    script = Path(RIG or "") / "restart-scheduler.sh"
    result = subprocess.run(
        [str(script), *([str(config)] if config else [])], env=_rig_env(), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _scheduler_config(docs: list[dict[str, Any]], url: str, tls_dir: Path, with_client_cert: bool) -> dict[str, Any]:
    """The chart's KubeSchedulerConfiguration, pointed at ``url`` and at the chart's client pair in ``tls_dir``,
    beside a default-scheduler profile (so that the rig keeps scheduling plain pods meanwhile)."""
    config = yaml.safe_load(helm_chart.by_kind(docs, "ConfigMap")["sg-scheduler-config"]["data"]["config.yaml"])
    config["clientConnection"] = {"kubeconfig": str(Path(RIG or "") / "scheduler.kubeconfig")}
    config["leaderElection"] = {"leaderElect": False}
    config["profiles"] = [{"schedulerName": "default-scheduler"}, *config["profiles"]]
    (ext,) = config["extenders"]
    assert ext["enableHTTPS"] is True and set(ext["tlsConfig"]) == {"caFile", "certFile", "keyFile"}
    ext["urlPrefix"] = url
    ext["tlsConfig"] = {"caFile": str(tls_dir / "ca.crt"), "serverName": SERVICE_NAME}
    if with_client_cert:
        ext["tlsConfig"] |= {"certFile": str(tls_dir / "tls.crt"), "keyFile": str(tls_dir / "tls.key")}
    return config


def _new_pod(name: str, ns: str) -> Any:
    """A pod for the sharegpu scheduler, as a user creates it (no uid, resourceVersion or status)."""
    from lightkube.resources.core_v1 import Pod

    obj = pod_obj(name, ns, memory="10Gi")
    for key in ("uid", "resourceVersion"):
        del obj["metadata"][key]
    del obj["status"]
    return Pod.from_dict(obj)


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    from lightkube import Client, KubeConfig

    assert KUBECONFIG
    c = Client(config=KubeConfig.from_file(KUBECONFIG))
    yield c


def test_the_real_scheduler_binds_through_the_mutual_tls_extender(client: Any, tmp_path: Path) -> None:
    from lightkube.models.meta_v1 import ObjectMeta
    from lightkube.resources.core_v1 import Event, Namespace, Pod
    from lightkube.resources.core_v1 import Node as KNode

    from sharegpu.model.assignment import Assignment
    from sharegpu.model.contract import ASSIGNMENT_ANNOTATION, INVENTORY_ANNOTATION

    docs = helm_chart.render()
    secrets = helm_chart.by_kind(docs, "Secret")
    dirs = {}
    for name in ("sg-extender-tls", "sg-scheduler-extender-client"):
        dirs[name] = tmp_path / name
        dirs[name].mkdir()
        for key, value in secrets[name]["data"].items():
            (dirs[name] / key).write_bytes(base64.b64decode(value))
    server, client_pair = dirs["sg-extender-tls"], dirs["sg-scheduler-extender-client"]
    suffix = uuid.uuid4().hex[:6]
    node, ns = f"sharegpu-tls-{suffix}", f"sharegpu-tls-{suffix}"
    port = free_port()
    url = f"https://127.0.0.1:{port}"
    previous = Path(RIG or "") / "scheduler-config-in-use.yaml"
    previous_config = previous.read_text() if previous.exists() else None

    def bound(name: str) -> str | None:
        pod = client.get(Pod, name, namespace=ns)
        return pod.spec.nodeName if pod.metadata.annotations and pod.spec.nodeName else None

    def events(name: str) -> list[str]:
        return [
            f"{e.reason}: {e.message}"
            for e in client.list(Event, namespace=ns, fields={"involvedObject.name": name})
            if e.reason == "FailedScheduling"
        ]

    with Proc(
        "scheduler-extender", "--kubeconfig", str(KUBECONFIG), "--listen", f"127.0.0.1:{port}",
        "--tls-cert", str(server / "tls.crt"), "--tls-key", str(server / "tls.key"), "--client-ca", str(server / "ca.crt"),
        "--scheduler-name", "sharegpu-scheduler",
    ) as ext:  # fmt: skip
        try:
            ext.wait_for(lambda line: "cluster view in sync" in line)
            env = _rig_env() | {"GPU_RESOURCE": "sharegpu.io/gpu", "NODE_CPU": "16", "NODE_MEMORY": "64Gi"}
            made = subprocess.run(
                [str(Path(RIG or "") / "add-fake-node.sh"), node, "128"], env=env, capture_output=True, text=True
            )
            assert made.returncode == 0, made.stdout + made.stderr
            spec = node_spec(node, "H100-80GB", 2, cpu_milli=16000, memory_mib=65536)
            client.patch(KNode, node, {"metadata": {"annotations": {INVENTORY_ANNOTATION: spec.to_json()}}})
            client.create(Namespace(metadata=ObjectMeta(name=ns)))

            # A scheduler without the client certificate: the extender refuses it, the pod stays pending.
            refused_cfg = tmp_path / "refused.yaml"
            refused_cfg.write_text(yaml.safe_dump(_scheduler_config(docs, url, client_pair, with_client_cert=False)))
            _restart_scheduler(refused_cfg)
            client.create(_new_pod("a", ns), namespace=ns)
            # The scheduler's error is its TLS connection's ('Post "https://.../filter": EOF' on v1.36).
            failure = until(
                lambda: [e for e in events("a") if f'Post "{url}/filter"' in e], "the refused scheduler's event"
            )
            assert bound("a") is None, failure
            assert not any("bound " in line for line in ext.lines)

            # The chart's configuration, with the scheduler's certificate: bound through the TLS extender.
            cfg = tmp_path / "scheduler.yaml"
            cfg.write_text(yaml.safe_dump(_scheduler_config(docs, url, client_pair, with_client_cert=True)))
            _restart_scheduler(cfg)
            client.create(_new_pod("b", ns), namespace=ns)
            for name in ("b", "a"):  # a: the scheduler retries it after its back-off
                assert until(lambda n=name: bound(n), f"pod {name} bound", timeout=90) == node
                # Written by the extender's /bind, which the scheduler called over mutual TLS.
                annotation = client.get(Pod, name, namespace=ns).metadata.annotations[ASSIGNMENT_ANNOTATION]
                assert Assignment.from_json(annotation).node == node
        finally:
            if previous_config is not None:  # restart-scheduler.sh copies its argument over scheduler-config-in-use
                (tmp_path / "previous.yaml").write_text(previous_config)
                _restart_scheduler(tmp_path / "previous.yaml")
            else:
                _restart_scheduler(None)
            for pod_name in ("a", "b"):  # no kubelet ends them: delete them at once, or the namespace lingers
                with contextlib.suppress(Exception):
                    client.delete(Pod, pod_name, namespace=ns, grace_period=0)
            for res, name in ((Namespace, ns), (KNode, node)):
                with contextlib.suppress(Exception):  # best effort: it may not have been made
                    client.delete(res, name)
            assert ext.stop() == 0
