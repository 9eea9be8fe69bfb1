"""DRA steering through the real kube-scheduler (../shared/k8s-rig, v1.36 with DRA on): pods whose GPU comes from a
``gpu.sharegpu.io`` claim are scheduled by the chart's profile with ``scheduler.draSteering.enabled``; the extender's
``/dra/filter`` leaves the node sharegpu picks, the scheduler's DRA plugin allocates the claim there (first fit) and
the default binder binds. The harness publishes the DRA nodes' ResourceSlices as the driver would (same builder).
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import Any

import pytest
from rig import KUBECONFIG, SKIP_REASON, Rig, wait_for

from sharegpu.k8s.dra_view import DEVICE_PATH_DRA, DEVICE_PATH_LABEL
from sharegpu.node.backends.base import DeviceInfo
from sharegpu.node.dra.classes import device_classes
from sharegpu.node.dra.slices import build_slices, resource_slice

pytestmark = pytest.mark.skipif(not KUBECONFIG, reason=SKIP_REASON)

STEERING = {"scheduler": {"draSteering": {"enabled": True}}}
GIB = 1024


@pytest.fixture
def rig() -> Iterator[Rig]:
    with Rig.open() as r:
        try:
            yield r
        finally:
            print(r.dump())


def _dra_node(rig: Rig, suffix: str, gpus: int = 2) -> str:
    """A kubelet-less DRA node with ``gpus`` A100-80GB published as the driver publishes them."""
    from lightkube import codecs

    name = rig.add_node(suffix, [], agent=False, labels={DEVICE_PATH_LABEL: DEVICE_PATH_DRA})
    uid = rig.node(name)["metadata"]["uid"]
    devices = [
        DeviceInfo(i, f"GPU-{name}-{i}", "NVIDIA A100-SXM4-80GB", "A100-80GB", 80 * GIB, 108, False)
        for i in range(gpus)
    ]
    specs = build_slices(name, devices)
    for s in specs:
        rig.client.create(codecs.from_dict(resource_slice(s, name, 1, len(specs), {"name": name, "uid": uid})))
    return name


def _classes(rig: Rig) -> None:
    from lightkube import codecs
    from lightkube.core.exceptions import ApiError

    for cls in device_classes():
        try:
            rig.client.create(codecs.from_dict(cls))
        except ApiError as e:
            if e.status.code != 409:
                raise


def _claim_and_pod(
    rig: Rig, ns: str, name: str, memory: str, compute: int, scheduler: str = "sharegpu-scheduler"
) -> None:
    from lightkube import codecs

    rig.client.create(
        codecs.from_dict(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": name, "namespace": ns},
                "spec": {
                    "devices": {
                        "requests": [
                            {
                                "name": "gpu",
                                "exactly": {
                                    "deviceClassName": "gpu.sharegpu.io",
                                    "capacity": {"requests": {"memory": memory, "compute": str(compute)}},
                                },
                            }
                        ]
                    }
                },
            }
        )
    )
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "schedulerName": scheduler,
            "containers": [
                {
                    "name": "main",
                    "image": "cuda",
                    "resources": {"claims": [{"name": "gpu"}], "requests": {"cpu": "1", "memory": "1Gi"}},
                }
            ],
            "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
        },
    }
    rig.create_pods(ns, [pod])


def _claims(rig: Rig, ns: str) -> dict[str, dict[str, Any]]:
    from lightkube.resources.resource_v1 import ResourceClaim

    return {c.metadata.name: c.to_dict() for c in rig.client.list(ResourceClaim, namespace=ns)}


def _placed(rig: Rig, ns: str) -> dict[str, tuple[str, str]]:
    """pod → (node, device) of its claim's allocation, for the bound pods."""
    claims = _claims(rig, ns)
    out = {}
    for p in rig.pods(ns):
        node = p["spec"].get("nodeName")
        if not node:
            continue
        (r,) = claims[p["metadata"]["name"]]["status"]["allocation"]["devices"]["results"]
        assert r["pool"] == node, f"{p['metadata']['name']}: claim allocated on {r['pool']}, pod bound to {node}"
        out[p["metadata"]["name"]] = (node, r["device"])
    return out


def _assert_not_over_allocated(rig: Rig, ns: str) -> None:
    used: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for c in _claims(rig, ns).values():
        alloc = (c.get("status") or {}).get("allocation")
        if not alloc:
            continue
        for r in alloc["devices"]["results"]:
            cc = r["consumedCapacity"]
            mem = float(cc["memory"].removesuffix("Gi")) if cc["memory"].endswith("Gi") else 0.0
            used[(r["pool"], r["device"])][0] += mem
            used[(r["pool"], r["device"])][1] += float(cc["compute"])
    for dev, (mem, compute) in used.items():
        assert mem <= 80 and compute <= 100, f"{dev} over-allocated: {mem}Gi, compute {compute}"


def test_dra_pods_are_packed_where_sharegpu_says_not_spread(rig: Rig) -> None:
    _classes(rig)
    nodes = [_dra_node(rig, s) for s in ("a", "b", "c")]
    _, url = rig.start_extender(0, "--dra-steering")
    rig.start_scheduler(url, values=STEERING)
    ns = rig.namespace()
    # Wait until the extender follows the slices: its log says so once it listed them.
    ext = next(p for p in rig.procs if p.name == "extender")
    wait_for(lambda: "DRA steering: following 3 DRA node(s)" in ext.text(), "the extender to follow the DRA nodes", 30)

    # One at a time: six quarter-GPU shares. LeastAllocated (cpu and memory only) would put each on the emptiest
    # node; sharegpu fills one GPU, then the node's next one.
    for i in range(6):
        _claim_and_pod(rig, ns, f"p{i}", "10Gi", 25)
        wait_for(lambda i=i: f"p{i}" in _placed(rig, ns), f"pod p{i} bound", 60)
    placed = _placed(rig, ns)
    (node,) = {n for n, _ in placed.values()}
    assert Counter(d for _, d in placed.values()) == {"gpu-0": 4, "gpu-1": 2}, placed
    first = node
    assert "steered DRA pod" in ext.text()

    # A burst of six more at once: the extender holds each choice until its claim is seen allocated, so the
    # pods still pack (first node's gpu-1 fills, then one GPU of a second node) and nothing is over-allocated.
    for i in range(6, 12):
        _claim_and_pod(rig, ns, f"p{i}", "10Gi", 25)
    wait_for(lambda: len(_placed(rig, ns)) == 12, "the burst bound", 90)
    placed = _placed(rig, ns)
    _assert_not_over_allocated(rig, ns)
    per_node = Counter(n for n, _ in placed.values())
    assert per_node[first] == 8, per_node  # the first node is full before another is opened
    assert len(per_node) == 2, per_node  # 12 quarter shares on 3 GPUs of two nodes, the third node untouched
    assert len({(n, d) for n, d in placed.values()}) == 3, placed

    # The binding extender entry (it has managedResources) is never called for them: the default binder binds,
    # with no sharegpu assignment; the extender's bind would have refused ("asks for no sharegpu.io resource").
    assert "cannot bind" not in ext.text()
    assert not any("sharegpu.io/assignment" in (p["metadata"].get("annotations") or {}) for p in rig.pods(ns))

    # Control: the rig's own default scheduler (no extender) places the same claim by cpu and memory alone and
    # opens the untouched node.
    _claim_and_pod(rig, ns, "control", "10Gi", 25, scheduler="default-scheduler")
    wait_for(lambda: "control" in _placed(rig, ns), "the control pod bound", 60)
    (untouched,) = set(nodes) - set(per_node)
    assert _placed(rig, ns)["control"][0] == untouched
    _assert_not_over_allocated(rig, ns)


def test_a_pod_steering_cannot_judge_is_placed_as_the_stock_scheduler_would(rig: Rig) -> None:
    """A pod of the profile without claims and a claim of a class steering does not know pass every node."""
    _classes(rig)
    _dra_node(rig, "a")
    _, url = rig.start_extender(0, "--dra-steering")
    rig.start_scheduler(url, values=STEERING)
    ns = rig.namespace()
    rig.create_pods(
        ns,
        [
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "plain"},
                "spec": {"schedulerName": "sharegpu-scheduler", "containers": [{"name": "m", "image": "x"}]},
            }
        ],
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        pods = rig.pods(ns)
        if pods and pods[0]["spec"].get("nodeName"):
            break
        time.sleep(0.5)
    assert rig.pods(ns)[0]["spec"].get("nodeName"), "a pod without claims must still be scheduled"
