"""MPS pods of several Unix users, and pods that declare none, at once on one GPU of the real node, in a namespace
that enforces Pod Security "baseline" (issue 32).

One MPS server serves one Unix user at a time (measured on an H200, ../shared/gpu-evidence/h200-2026-11-26), and two
control daemons on one GPU serve two users at once. So the node runs a daemon per (unit, tenant): the pods of one
namespace and one declared UID share one; a pod that declares no user has one of its own. The five pods of the
issue's "Done when" (10Gi/15 % each: two of uid 1000, one of uid 0, two undeclared) run at the same time on one GPU
with four daemons, and each container reaches only its tenant's daemon: the host-side source of its pipe mount, as
containerd gave it to the container (its OCI spec) and as the container sees it (its /proc/self/mountinfo), is its
own tenant's pipe directory, where the simulated daemon's file names that tenant. Pods go through the real
kube-scheduler, ``sharegpu scheduler-extender`` and the real kubelet with ``sharegpu node-agent --backend sim``; each
container prints what it was given, read back from its log. The pods need no ``hostIPC``, which "baseline" forbids.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from rig import KUBECONFIG, SKIP_REASON, Rig
from test_k8s_real_node_device_plugin import PRINT, Verdict, check_pod, limits, logs_of, pod

from realnode import RealNode, busybox, env_lines, wait_until
from sharegpu.model.assignment import Assignment
from sharegpu.model.tenant import own_tenant, tenant_dir, user_tenant

pytestmark = pytest.mark.skipif(not KUBECONFIG, reason=SKIP_REASON)

BASELINE = {"pod-security.kubernetes.io/enforce": "baseline", "pod-security.kubernetes.io/enforce-version": "latest"}
ONE_GPU = [{"model": "H100-80GB", "count": 1}]
PIPE = "/run/sharegpu/mps"
MPS_ENV = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
# What each container prints about its MPS pipe before its environment: its mount as it sees it, the simulated daemon's
# file (whom the daemon serves), what the directory holds, and its own UID.
SHOW = (
    f"echo SHAREGPU_T_MOUNT=$(grep ' {PIPE} ' /proc/self/mountinfo); "
    f"echo SHAREGPU_T_DAEMON=$(cat {PIPE}/sim-mps-daemon.json); "
    f"echo SHAREGPU_T_FILES=$(ls -A {PIPE} | tr '\\n' ' '); "
    "echo SHAREGPU_T_UID=$(id -u)"
)


def mps_pod(name: str, node: str, uid: int | None, memory: str = "10Gi", compute: int = 15) -> dict[str, Any]:
    # The pods stay up: what is checked is that they run at once.
    p = pod(name, node, containers=[busybox("app", f"{SHOW}; {PRINT}; sleep 3600", limits(1, memory, compute))],
            annotations={"sharegpu.io/isolation": "memory", "sharegpu.io/gpu-model": "H100-80GB"})  # fmt: skip
    if uid is None:
        p["spec"].pop("securityContext", None)  # as the image says: the API shows no user
    else:
        p["spec"]["securityContext"] = {"runAsUser": uid}
    return p


def oci_pipe_source(real_node: RealNode, container_id: str) -> str:
    """The host-side source of ``PIPE`` in the container's OCI spec, as containerd holds it (``ctr containers info``)."""
    ctr = real_node.k8s_real / "bin" / "ctr"
    sock = real_node.k8s_real / "node" / "containerd" / "containerd.sock"
    out = subprocess.run(
        [str(ctr), "--address", str(sock), "-n", "k8s.io", "containers", "info", container_id.split("://", 1)[-1]],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    mounts = json.loads(out.stdout)["Spec"]["mounts"]
    (source,) = [m["source"] for m in mounts if m["destination"] == PIPE]
    return str(source)


def test_mps_pods_of_two_users_and_none_run_at_once_on_one_gpu_each_reaching_only_its_tenants_daemon(
    rig: Rig, real_node: RealNode
) -> None:
    node = rig.attach_real_node(real_node, ONE_GPU)
    rig.wait_nodes_published(90)
    _, url = rig.start_extender()
    rig.start_scheduler(url)
    state = rig.real_state[node]
    ns = rig.namespace(labels=BASELINE)
    # The namespace really enforces baseline: a pod that asks for hostIPC is refused by the API server.
    from lightkube import ApiError

    host_ipc = mps_pod("host-ipc", node, 1000)
    host_ipc["spec"]["hostIPC"] = True
    with pytest.raises(ApiError, match="hostIPC"):
        rig.create_pods(ns, [host_ipc])

    users = {"u1000-a": 1000, "u1000-b": 1000, "root": 0, "anon-1": None, "anon-2": None}
    rig.create_pods(ns, [mps_pod(name, node, uid) for name, uid in users.items()], parallel=len(users))

    def done() -> list[dict[str, Any]] | None:
        now = rig.pods(ns)
        if len(now) != len(users) or any(p["status"].get("phase") != "Running" for p in now):
            return None
        return now if all("SHAREGPU_DONE" in logs_of(rig, ns, p)["app"] for p in now) else None

    try:
        settled = wait_until(done, "the five MPS pods to run at once", 180, every=0.5)
    except AssertionError:
        states = [(p["metadata"]["name"], p["status"].get("phase"), p["status"].get("message")) for p in rig.pods(ns)]
        events = [(e["involvedObject"]["name"], e.get("reason"), e.get("message")) for e in rig.events(ns)][-20:]
        raise AssertionError(f"{states}\n{events}") from None

    verdict = Verdict()
    seen: dict[str, dict[str, Any]] = {}
    for p in settled:
        name = p["metadata"]["name"]
        assert "hostIPC" not in p["spec"] and "hostPID" not in p["spec"]
        logs = logs_of(rig, ns, p)
        check_pod(p, logs, verdict)
        a = Assignment.from_json(p["metadata"]["annotations"]["sharegpu.io/assignment"])
        (share,) = a.shares
        uid = users[name]
        tenant = user_tenant(ns, uid) if uid is not None else own_tenant(p["metadata"]["uid"])
        assert share.sharing.value == "mps" and a.tenant == tenant, (name, share, a.tenant)
        env = env_lines(logs["app"])
        mount = env["SHAREGPU_T_MOUNT"].split(" ")
        (status,) = p["status"]["containerStatuses"]
        seen[name] = {
            "gpu": share.gpu_uuid,
            "tenant": tenant,
            "oci": oci_pipe_source(real_node, status["containerID"]),  # what containerd mounted
            "mountinfo": mount[3],  # the mount's root as the container sees it: the same directory
            "daemon": json.loads(env["SHAREGPU_T_DAEMON"]),
            "files": env["SHAREGPU_T_FILES"].split(),
            "uid": int(env["SHAREGPU_T_UID"]),
            "env": {k: env.get(k) for k in MPS_ENV},
        }
    print("what each container saw:", json.dumps(seen, indent=1, sort_keys=True))
    assert verdict.wrong == [], verdict.wrong
    assert verdict.containers == len(users)
    # All five on the one GPU, at the same time (each is Running and printed before the others were checked).
    assert len({s["gpu"] for s in seen.values()}) == 1
    gpu = seen["root"]["gpu"]
    for name, s in seen.items():
        expected = state / "mps" / gpu / tenant_dir(s["tenant"]) / "pipe"
        assert Path(s["oci"]) == expected, (name, s["oci"], expected)  # only its own tenant's pipe directory
        assert s["mountinfo"].endswith(f"/mps/{gpu}/{tenant_dir(s['tenant'])}/pipe"), (name, s["mountinfo"])
        assert s["daemon"]["tenant"] == s["tenant"] and s["daemon"]["unit"] == gpu and not s["daemon"]["multiUser"]
        assert s["files"] == ["sim-mps-daemon.json"], s["files"]  # one daemon's directory, nothing of another's
        assert s["uid"] == (users[name] if users[name] is not None else 0)  # busybox's image runs as root
        assert s["env"]["CUDA_MPS_PIPE_DIRECTORY"] == PIPE
        assert s["env"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10240M"
    # Four daemons: uid 1000's two pods share one, root's pod and each undeclared pod have their own.
    sources = {s["oci"] for s in seen.values()}
    assert len(sources) == 4 and seen["u1000-a"]["oci"] == seen["u1000-b"]["oci"], sources
    running = sorted(d.parent.name for d in (state / "mps" / gpu).glob("*/tenant"))
    assert running == sorted({tenant_dir(s["tenant"]) for s in seen.values()}), running
    # Each cap is held against its own tenant's shares on the GPU when its container started: uid 1000's second
    # container saw both 15 % shares (half each; the first may have started before the second pod was bound); a
    # tenant's only share has its daemon's turn to itself.
    caps = {n: int(s["env"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]) for n, s in seen.items()}
    assert sorted((caps["u1000-a"], caps["u1000-b"]))[0] == 50 and {caps["u1000-a"], caps["u1000-b"]} <= {50, 100}
    assert (caps["root"], caps["anon-1"], caps["anon-2"]) == (100, 100, 100), caps
