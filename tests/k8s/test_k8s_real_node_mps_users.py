"""MPS pods of several Unix users on the real node, in a namespace that enforces Pod Security "baseline".

One MPS server serves one Unix UID at a time: a client of another UID waits in CUDA initialisation until every client
of the running server has exited (measured on an H200, ../shared/gpu-evidence/h200-2026-11-26). The extender keeps
MPS shares of different (or undeclared) users on different units, and the pods need no ``hostIPC``, which "baseline"
forbids. Pods go through the real kube-scheduler, ``sharegpu scheduler-extender`` and the real kubelet with
``sharegpu node-agent --backend sim``; each container prints its environment, read back from its log.
"""

from __future__ import annotations

from typing import Any

import pytest
from rig import KUBECONFIG, SKIP_REASON, Rig
from test_k8s_real_node_device_plugin import PRINT, Verdict, check_pod, limits, logs_of, pod, start

from realnode import RealNode, busybox, env_lines, wait_until
from sharegpu.model.assignment import Assignment

pytestmark = pytest.mark.skipif(not KUBECONFIG, reason=SKIP_REASON)

BASELINE = {"pod-security.kubernetes.io/enforce": "baseline", "pod-security.kubernetes.io/enforce-version": "latest"}


def mps_pod(name: str, node: str, uid: int | None, memory: str, compute: int) -> dict[str, Any]:
    # The pods stay up: the rule is about pods that run at once (a finished pod's unit is free for anyone).
    p = pod(name, node, containers=[busybox("app", f"{PRINT}; sleep 3600", limits(1, memory, compute))],
            annotations={"sharegpu.io/isolation": "memory", "sharegpu.io/gpu-model": "H100-80GB"})  # fmt: skip
    if uid is None:
        p["spec"].pop("securityContext", None)  # as the image says: the API shows no user
    else:
        p["spec"]["securityContext"] = {"runAsUser": uid}
    return p


def test_mps_pods_run_under_pod_security_baseline_and_each_unit_serves_one_user(rig: Rig, real_node: RealNode) -> None:
    node = start(rig, real_node)
    ns = rig.namespace(labels=BASELINE)
    # The namespace really enforces baseline: a pod that asks for hostIPC is refused by the API server.
    from lightkube import ApiError

    host_ipc = mps_pod("host-ipc", node, 1000, "1000Mi", 5)
    host_ipc["spec"]["hostIPC"] = True
    with pytest.raises(ApiError, match="hostIPC"):
        rig.create_pods(ns, [host_ipc])

    # Five small MPS shares that one H100 could hold: two users, and one pod whose user only its image knows.
    pods = [
        mps_pod("u1000-a", node, 1000, "1100Mi", 5),
        mps_pod("root-a", node, 0, "1200Mi", 6),
        mps_pod("u1000-b", node, 1000, "1300Mi", 7),
        mps_pod("root-b", node, 0, "1400Mi", 8),
        mps_pod("anon", node, None, "1500Mi", 9),
    ]
    rig.create_pods(ns, pods, parallel=len(pods))

    def done() -> list[dict[str, Any]] | None:
        now = rig.pods(ns)
        if len(now) != len(pods) or any(p["status"].get("phase") != "Running" for p in now):
            return None
        return now if all("SHAREGPU_DONE" in logs_of(rig, ns, p)["app"] for p in now) else None

    try:
        settled = wait_until(done, "the MPS pods of two users to run", 180, every=0.5)
    except AssertionError:
        states = [(p["metadata"]["name"], p["status"].get("phase"), p["status"].get("message")) for p in rig.pods(ns)]
        events = [(e["involvedObject"]["name"], e.get("reason"), e.get("message")) for e in rig.events(ns)][-20:]
        raise AssertionError(f"{states}\n{events}") from None

    verdict = Verdict()
    unit_of: dict[str, str] = {}
    for p in settled:
        name = p["metadata"]["name"]
        assert "hostIPC" not in p["spec"] and "hostPID" not in p["spec"]
        check_pod(p, logs_of(rig, ns, p), verdict)
        a = Assignment.from_json(p["metadata"]["annotations"]["sharegpu.io/assignment"])
        (share,) = a.shares
        assert share.sharing.value == "mps", (name, share)
        assert a.user == p["spec"].get("securityContext", {}).get("runAsUser"), (name, a.user)
        unit_of[name] = share.gpu_uuid
        env = env_lines(logs_of(rig, ns, p)["app"])
        assert env.get("CUDA_MPS_PIPE_DIRECTORY"), (name, env)  # reached its daemon through the mounted pipe directory
    assert verdict.wrong == [], verdict.wrong
    assert verdict.containers == len(pods)
    # All five run at once: no unit serves two users, and the pod whose user is undeclared is alone on its unit.
    by_user = {uid: {unit_of[n] for n in names} for uid, names in (("1000", ("u1000-a", "u1000-b")),
                                                                    ("0", ("root-a", "root-b")))}  # fmt: skip
    assert not by_user["1000"] & by_user["0"], unit_of
    assert unit_of["anon"] not in by_user["1000"] | by_user["0"], unit_of
