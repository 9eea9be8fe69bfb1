"""Cost of DRA steering's filter (``DraSteering.steer`` over the cluster view's DRA ledger) against the number of DRA nodes.

Builds the extender's DRA state from ResourceSlices (the driver's builder) of N nodes with 8 A100-80GB each, fills
about 60 % of the GPUs with allocated claims (quarter shares, whole GPUs), then times steering decisions for
quarter-share pods over every node as candidates: the first (it builds the ledger from the parsed objects, as after
a relist or a change of a DRA node's slices), then one per pod after the previous pod's claim was seen allocated
(the ledger follows that incrementally), and the same pod again with nothing changed.

    uv run python bench/dra_steer_bench.py --nodes 1213 --decisions 200
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from sharegpu.k8s.cache.view import ClusterView
from sharegpu.k8s.extender.dra_steer import DraSteering
from sharegpu.kube.schema import Node, Pod, ResourceClaim, ResourceSlice
from sharegpu.node.backends.base import DeviceInfo
from sharegpu.node.dra.slices import build_slices, resource_slice


def claim(name: str, compute: int | None, node: str | None = None, gpu: int = 0) -> dict[str, Any]:
    exact: dict[str, Any] = {"deviceClassName": "gpu.sharegpu.io"}
    asked = {"memory": f"{compute * 80 // 100 if compute else 80}Gi", "compute": str(compute)} if compute else {}
    if asked:
        exact["capacity"] = {"requests": asked}
    obj: dict[str, Any] = {
        "metadata": {"namespace": "b", "name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exact}]}},
    }
    if node is not None:
        r: dict[str, Any] = {"driver": "gpu.sharegpu.io", "pool": node, "device": f"gpu-{gpu}", "request": "gpu"}
        if asked:
            r["consumedCapacity"] = asked
        obj["status"] = {"allocation": {"devices": {"results": [r]}}}
    return obj


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=1213)
    ap.add_argument("--decisions", type=int, default=50)
    args = ap.parse_args()
    rng = random.Random(1)
    view = ClusterView(follow_dra=True)
    assert view.dra is not None
    s = DraSteering(view.dra)
    names = [f"n{i:04d}" for i in range(args.nodes)]
    nodes, slices, claims = [], [], []
    for n in names:
        nodes.append({"metadata": {"name": n, "labels": {"sharegpu.io/device-path": "dra"}},
                      "status": {"allocatable": {"cpu": "96", "memory": "512Gi"}}})  # fmt: skip
        devs = [
            DeviceInfo(i, f"GPU-{n}-{i}", "NVIDIA A100-SXM4-80GB", "A100-80GB", 81920, 108, False) for i in range(8)
        ]
        specs = build_slices(n, devs)
        slices.extend(resource_slice(x, n, 1, len(specs), {"name": n, "uid": "u"}) for x in specs)
        for g in range(8):
            u = rng.random()
            if u < 0.2:
                claims.append(claim(f"{n}-{g}-w", None, n, g))
            elif u < 0.6:
                for k in range(rng.choice((1, 2, 3))):
                    claims.append(claim(f"{n}-{g}-{k}", 25, n, g))
    view.relisted(
        [Node.model_validate(n) for n in nodes],
        [],
        [ResourceSlice.model_validate(x) for x in slices],
        [ResourceClaim.model_validate(c) for c in claims],
    )
    rebuilt, cached = [], []
    for i in range(args.decisions):
        c = claim(f"p{i}", 25)
        view.apply_claim("ADDED", ResourceClaim.model_validate(c))
        pod = Pod.model_validate({"metadata": {"namespace": "b", "name": f"p{i}", "uid": f"p{i}"},
                                  "spec": {"containers": [{"name": "m"}],
                                           "resourceClaims": [{"name": "gpu", "resourceClaimName": f"p{i}"}]}})  # fmt: skip
        t0 = time.perf_counter()
        got = s.steer(pod, names)
        rebuilt.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        s.steer(pod, names)
        cached.append(time.perf_counter() - t0)
        assert len(got.keep) == 1, got.why
        node = got.keep[0]
        gpu = got.assignment.shares[0].gpu_index if got.assignment else 0
        view.apply_claim("MODIFIED", ResourceClaim.model_validate(claim(f"p{i}", 25, node, gpu)))

    def q(xs: list[float], p: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(p * len(xs)))] * 1000

    print(f"{args.nodes} DRA nodes, {args.nodes * 8} GPUs, {len(claims)} allocated claims, {args.decisions} decisions")
    print(f"first decision (builds the ledger): {rebuilt[0] * 1000:.1f} ms")
    rest = rebuilt[1:]
    print(f"after a claim allocated: p50 {statistics.median(rest) * 1000:.2f} ms, p99 {q(rest, 0.99):.2f} ms")
    print(f"nothing changed:         p50 {statistics.median(cached) * 1000:.2f} ms, p99 {q(cached, 0.99):.2f} ms")


if __name__ == "__main__":
    main()
