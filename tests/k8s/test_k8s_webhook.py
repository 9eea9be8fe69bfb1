"""AdmissionReview v1 round trips over HTTP: valid and invalid pods, mutation, and pods that are not ours."""

from __future__ import annotations

import base64
import http.client
import json
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from k8s_helpers import LoopbackServer, pod_obj

from sharegpu.k8s.webhook.admission import WebhookConfig, make_app

EXTENDER = "system:serviceaccount:sharegpu:sharegpu-extender"


@pytest.fixture(scope="module")
def srv() -> Iterator[LoopbackServer]:
    with LoopbackServer(make_app(WebhookConfig(trusted_users=(EXTENDER,)))) as s:
        yield s


def review(
    pod: dict[str, Any], operation: str = "CREATE", old: dict[str, Any] | None = None, user: str = "alice"
) -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "namespace": "default",
            "operation": operation,
            "userInfo": {"username": user, "groups": ["system:authenticated"]},
            "object": pod,
            "oldObject": old,
            "dryRun": False,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    }


def admit(srv: LoopbackServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    status, out = srv.post(path, body)
    assert status == 200
    assert out["apiVersion"] == "admission.k8s.io/v1" and out["kind"] == "AdmissionReview"
    assert out["response"]["uid"] == body["request"]["uid"]
    return out["response"]  # type: ignore[no-any-return]


def apply_patch(pod: dict[str, Any], resp: dict[str, Any]) -> list[dict[str, Any]]:
    assert resp["patchType"] == "JSONPatch"
    return json.loads(base64.b64decode(resp["patch"]))  # type: ignore[no-any-return]


def test_valid_pod_is_admitted_and_sent_to_the_sharegpu_scheduler(srv: LoopbackServer) -> None:
    pod = pod_obj("ok", memory="10Gi", compute=30, annotations={"sharegpu.io/isolation": "memory"}, scheduler_name=None)
    resp = admit(srv, "/mutate", review(pod))
    assert resp["allowed"] is True
    assert apply_patch(pod, resp) == [{"op": "add", "path": "/spec/schedulerName", "value": "sharegpu-scheduler"}]
    pod["spec"]["schedulerName"] = "default-scheduler"
    assert apply_patch(pod, admit(srv, "/mutate", review(pod)))[0]["op"] == "replace"
    # The validating webhook sees the pod after mutation and re-checks without changing it.
    pod["spec"]["schedulerName"] = "sharegpu-scheduler"
    resp = admit(srv, "/validate", review(pod))
    assert resp["allowed"] is True and "patch" not in resp


def test_gpu_count_is_added_where_only_memory_was_asked(srv: LoopbackServer) -> None:
    pod = pod_obj("mem-only", gpu=None, memory="4Gi")
    resp = admit(srv, "/mutate", review(pod))
    assert resp["allowed"] is True
    assert {"op": "add", "path": "/spec/containers/0/resources/limits/sharegpu.io~1gpu", "value": "1"} in apply_patch(
        pod, resp
    )
    # Without mutation (validate) the same pod is refused with what to change.
    resp = admit(srv, "/validate", review(pod))
    assert resp["allowed"] is False and "add sharegpu.io/gpu: 1" in resp["status"]["message"]


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"compute": 150}, "GPU compute 150% is outside 1–100%"),
        ({"memory": "500Gi"}, "above the largest allowed GPU"),
        ({"annotations": {"sharegpu.io/gpu-model": "H900"}}, "unknown GPU model 'H900'"),
        ({"annotations": {"sharegpu.io/mig-profile": "1g.5gb", "sharegpu.io/gpu-model": "T4"}}, "no allowed GPU model"),
        ({"env": {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"}}, "sets CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
        ({"env": {"NVIDIA_VISIBLE_DEVICES": "all"}}, "sets NVIDIA_VISIBLE_DEVICES"),
        ({"env": {"CUDA_VISIBLE_DEVICES": "0"}}, "sets CUDA_VISIBLE_DEVICES"),
        ({"annotations": {"sharegpu.io/assignment": "{}"}}, "only the sharegpu scheduler sets it"),
        ({"node_name": "node-1"}, "remove spec.nodeName"),
    ],
)
def test_invalid_pods_are_refused_with_what_to_change(
    srv: LoopbackServer, kwargs: dict[str, Any], fragment: str
) -> None:
    pod = pod_obj("bad", memory="10Gi", **{k: v for k, v in kwargs.items() if k != "memory"})
    if "memory" in kwargs:
        pod = pod_obj("bad", **kwargs)
    for path in ("/mutate", "/validate"):
        resp = admit(srv, path, review(pod))
        assert resp["allowed"] is False
        assert resp["status"]["code"] == 403
        assert fragment in resp["status"]["message"] and resp["status"]["message"].startswith("sharegpu: ")
        assert "patch" not in resp


def test_pods_that_ask_for_nothing_of_ours_pass_untouched(srv: LoopbackServer) -> None:
    pod = pod_obj("web", gpu=None, scheduler_name=None, env={"CUDA_VISIBLE_DEVICES": "0"})
    for path in ("/mutate", "/validate"):
        resp = admit(srv, path, review(pod))
        assert resp == {"uid": "705ab4f5-6393-11e8-b7cc-42010a800002", "allowed": True}
    stray = pod_obj("web", gpu=None, annotations={"sharegpu.io/isolation": "hardware"})
    resp = admit(srv, "/mutate", review(stray))
    assert resp["allowed"] is True and "no effect" in resp["warnings"][0] and "patch" not in resp


def test_only_the_extender_may_change_an_assignment(srv: LoopbackServer) -> None:
    old = pod_obj("p", memory="1Gi", annotations={"sharegpu.io/assignment": '{"a":1}'})
    new = pod_obj("p", memory="1Gi", annotations={"sharegpu.io/assignment": '{"a":2}'})
    resp = admit(srv, "/validate", review(new, "UPDATE", old, user="mallory"))
    assert resp["allowed"] is False and "mallory may not change it" in resp["status"]["message"]
    assert admit(srv, "/validate", review(new, "UPDATE", old, user=EXTENDER))["allowed"] is True
    other = pod_obj("p", memory="1Gi", annotations={"sharegpu.io/assignment": '{"a":1}', "team": "x"})
    assert admit(srv, "/validate", review(other, "UPDATE", old, user="mallory"))["allowed"] is True


def test_malformed_reviews_get_400(srv: LoopbackServer) -> None:
    for raw in (b"not json", b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}', b'{"request": {}}'):
        status, body = srv.post("/mutate", None, raw=raw)
        assert status == 400 and "malformed AdmissionReview" in body["error"]
    pod = pod_obj("ok", memory="1Gi")
    assert admit(srv, "/mutate", review(pod))["allowed"] is True


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a test certificate")
def test_the_webhook_command_serves_https(tmp_path: Path) -> None:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from sharegpu.k8s.webhook.admission import serve_webhook

    thread = threading.Thread(
        target=serve_webhook, args=("127.0.0.1", port, str(cert), str(key), WebhookConfig()), daemon=True
    )
    thread.start()
    ctx = ssl.create_default_context(cafile=str(cert))
    body = json.dumps(review(pod_obj("tls", memory="1Gi", scheduler_name=None))).encode()
    for _ in range(200):
        try:
            conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=5)
            conn.request("POST", "/mutate", body, {"Content-Type": "application/json"})
            out = json.loads(conn.getresponse().read())
            break
        except (ConnectionRefusedError, ssl.SSLError, OSError):
            time.sleep(0.05)
    else:
        raise AssertionError("the webhook did not come up")
    assert out["response"]["allowed"] is True and out["response"]["patchType"] == "JSONPatch"


def test_an_mps_pod_is_admitted_without_a_warning_whoever_it_runs_as(srv: LoopbackServer) -> None:
    """Issue 32: a pod that declares no user is an MPS tenant of its own and shares MPS units with any other (a
    daemon each), so there is nothing to warn about; the warning that asked for runAsUser is gone."""
    pod = pod_obj("mps", memory="10Gi", compute=30, annotations={"sharegpu.io/isolation": "memory"})
    resp = admit(srv, "/mutate", review(pod))
    assert resp["allowed"] is True and "warnings" not in resp
    pod["spec"]["securityContext"] = {"runAsUser": 1000}
    assert "warnings" not in admit(srv, "/mutate", review(pod))
    pod["spec"]["hostUsers"] = False
    assert "warnings" not in admit(srv, "/mutate", review(pod))


def test_gpu_containers_of_different_users_are_refused_at_admission_with_what_to_do(srv: LoopbackServer) -> None:
    pod = pod_obj("two", memory="10Gi", annotations={"sharegpu.io/isolation": "memory"})
    side = json.loads(json.dumps(pod["spec"]["containers"][0]))
    side["name"] = "side"
    pod["spec"]["containers"].append(side)
    pod["spec"]["containers"][0]["securityContext"] = {"runAsUser": 1000}
    pod["spec"]["containers"][1]["securityContext"] = {"runAsUser": 0}
    resp = admit(srv, "/mutate", review(pod))
    assert resp["allowed"] is False
    message = resp["status"]["message"]
    assert "different Unix users ('main': 1000, 'side': 0)" in message and "securityContext.runAsUser" in message
    # One declared and one left to its image: admitted, the pod a tenant of its own (not uid 1000's).
    del pod["spec"]["containers"][1]["securityContext"]
    assert admit(srv, "/mutate", review(pod))["allowed"] is True
