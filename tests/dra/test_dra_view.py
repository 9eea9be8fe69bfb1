"""DRA nodes in the control plane: out of the extender's ledger, in `sharegpu status` from slices and claims."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from sharegpu.k8s.cache.view import ClusterView
from sharegpu.k8s.status.dra import dra_status
from sharegpu.k8s.status.report import print_status, status_report
from sharegpu.kube.schema import Node, ResourceClaim, ResourceSlice
from sharegpu.model.contract import INVENTORY_ANNOTATION
from sharegpu.model.inventory import NodeSpec, sim_gpus
from sharegpu.node.backends.base import DeviceInfo
from sharegpu.node.dra.slices import build_slices, resource_slice

A100 = DeviceInfo(0, "GPU-a100", "NVIDIA A100-SXM4-80GB", "A100-80GB", 81920, 108, False)


def node(name: str, labels: dict[str, str]) -> Node:
    spec = NodeSpec(name, 64000, 262144, sim_gpus(name, "H100-80GB", 2))
    return Node.model_validate(
        {"metadata": {"name": name, "labels": labels, "annotations": {INVENTORY_ANNOTATION: spec.to_json()}}}
    )


def test_dra_nodes_are_left_out_of_the_ledger() -> None:
    view = ClusterView()
    view.reset([node("plugin-node", {}), node("dra-node", {"sharegpu.io/device-path": "dra"})], [])
    assert [n.name for n in view.ledger.nodes] == ["plugin-node"]


def claim(name: str, device: str, consumed: dict[str, str] | None = None) -> dict[str, Any]:
    result: dict[str, Any] = {"driver": "gpu.sharegpu.io", "pool": "n1", "device": device, "request": "gpu"}
    if consumed:
        result["consumedCapacity"] = consumed
    return {
        "metadata": {"namespace": "ml", "name": name},
        "status": {"allocation": {"devices": {"results": [result]}}},
    }


def rows_of(slices: list[dict[str, Any]], claims: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return dra_status(
        [ResourceSlice.model_validate(s) for s in slices], [ResourceClaim.model_validate(c) for c in claims]
    )


def test_status_shows_dra_gpus_from_slices_and_claims() -> None:
    slices = [resource_slice(s, "n1", 3, 2, {"name": "n1", "uid": "u"}) for s in build_slices("n1", (A100,))]
    claims = [
        claim("a", "gpu-0", {"memory": "10Gi", "compute": "30"}),
        claim("b", "gpu-0", {"memory": "20Gi", "compute": "50"}),
        claim("other-driver", "gpu-0") | {"status": {"allocation": {"devices": {"results": [{"driver": "x"}]}}}},
    ]
    rows = rows_of(slices, claims)
    assert rows[0]["name"] == "n1"
    g = rows[0]["gpus"][0]
    assert (g["model"], g["mechanism"], g["memory_mib_used"], g["compute_pct_used"]) == (
        "A100-80GB",
        "shared",
        30720,
        80,
    )
    assert g["claims"] == ["ml/a", "ml/b"]
    mig = rows_of(slices, [claim("m", "gpu-0-mig-3g40gb-4")])[0]["gpus"][0]
    assert (mig["mechanism"], mig["mig"]) == ("mig", [{"profile": "3g.40gb", "start": 4, "claim": "ml/m"}])
    # The report takes them from the view, which follows the slices and claims with everything else.
    view = ClusterView(follow_dra=True)
    view.relisted(
        [], [], [ResourceSlice.model_validate(s) for s in slices], [ResourceClaim.model_validate(c) for c in claims]
    )
    report = status_report(view)
    assert report["dra_nodes"] == rows
    console = Console(record=True, width=200)
    print_status(console, report)
    text = console.export_text()
    assert "node n1 (DRA)" in text and "ml/a" in text
