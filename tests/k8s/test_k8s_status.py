"""``sharegpu status``: the report built from the API server's objects, its table, and its JSON contract."""

from __future__ import annotations

import json
from pathlib import Path

from k8s_helpers import node_obj, node_spec, nodes, pod_obj, pods, with_assignment
from rich.console import Console
from typer.testing import CliRunner

from sharegpu.cli import app
from sharegpu.k8s.status import print_status, status_report
from sharegpu.k8s.view import ClusterView
from sharegpu.model.assignment import Assignment, GpuShare, Mechanism, MigSlot
from sharegpu.model.inventory import GpuDevice, NodeSpec


def build() -> ClusterView:
    mig = NodeSpec("node-m", 64000, 262144, (GpuDevice(0, "GPU-m-0", "A100-80GB", mig_enabled=True),))
    h100 = node_spec("node-h", gpus=2)
    a1 = Assignment("ml/infer-a", "node-h", (GpuShare(0, "GPU-node-h-0", Mechanism.MPS, 300, 10240),))
    a2 = Assignment("ml/infer-b", "node-h", (GpuShare(0, "GPU-node-h-0", Mechanism.MPS, 200, 20480),))
    a3 = Assignment(
        "ml/iso",
        "node-m",
        (GpuShare(0, "GPU-m-0", Mechanism.MIG, 1000, 40960, MigSlot("3g.40gb", 4), Mechanism.EXCLUSIVE),),
    )
    pod_list = [
        with_assignment(pod_obj("infer-a", "ml", memory="10Gi"), a1.to_json(), "node-h"),
        with_assignment(pod_obj("infer-b", "ml", memory="20Gi"), a2.to_json(), "node-h"),
        with_assignment(pod_obj("iso", "ml", memory="40Gi"), a3.to_json(), "node-m"),
        with_assignment(pod_obj("broken", "ml", memory="1Gi"), "{oops", "node-h"),
    ]
    view = ClusterView(policy="bestfit")
    view.reset(nodes([node_obj(h100), node_obj(mig)]), pods(pod_list))
    return view


def test_report_has_the_json_contract_and_the_sharing_pods() -> None:
    report = status_report(build())
    by_name = {n["name"]: n for n in report["nodes"]}
    g0 = by_name["node-h"]["gpus"][0]
    for key in ("uuid", "model", "mechanism", "memory_mib_total", "memory_mib_used", "compute_pct_used", "pods"):
        assert key in g0
    assert g0["uuid"] == "GPU-node-h-0" and g0["model"] == "H100-80GB" and g0["mechanism"] == "mps"
    assert (g0["memory_mib_total"], g0["memory_mib_used"], g0["compute_pct_used"]) == (81920, 30720, 50.0)
    assert g0["pods"] == ["ml/infer-a", "ml/infer-b"]
    g1 = by_name["node-h"]["gpus"][1]
    assert (g1["mechanism"], g1["memory_mib_used"], g1["pods"]) == ("free", 0, [])
    m = by_name["node-m"]["gpus"][0]
    assert m["mechanism"] == "mig" and m["pods"] == ["ml/iso"]
    assert m["mig"] == [
        {
            "profile": "3g.40gb",
            "start": 4,
            "slots": 4,
            "inner": "exclusive",
            "memory_mib_total": 40960,
            "memory_mib_used": 40960,
            "compute_pct_used": 100.0,
            "static": False,
            "pods": ["ml/iso"],
        }
    ]
    assert [p["name"] for p in report["problems"]] == ["ml/broken"]
    json.dumps(report)  # serialisable as is


def test_table_shows_models_mechanisms_mig_layout_and_pods() -> None:
    console = Console(record=True, width=200)
    print_status(console, status_report(build()))
    text = console.export_text()
    for fragment in (
        "node node-h",
        "H100-80GB",
        "mps",
        "30Gi / 80Gi",
        "ml/infer-a",
        "3g.40gb@4 exclusive",
        "ml/broken",
    ):
        assert fragment in text


def test_status_command_reports_a_missing_kubeconfig_without_a_traceback(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["status", "--kubeconfig", str(tmp_path / "nope.yaml"), "--json"])
    assert result.exit_code == 2
    assert "cannot load Kubernetes credentials" in result.output
    assert "Traceback" not in result.output


def test_extender_command_rejects_a_bad_listen_address() -> None:
    result = CliRunner().invoke(app, ["scheduler-extender", "--listen", "nowhere"])
    assert result.exit_code == 2 and "HOST:PORT" in result.output
