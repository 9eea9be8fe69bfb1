"""``sharegpu status``: the report built from the API server's objects, its table, and its JSON contract."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

from k8s_helpers import node_obj, node_spec, nodes, pod_obj, pods, with_assignment
from memory_api import MemoryClusterApi
from rich.console import Console
from typer.testing import CliRunner

from sharegpu.cli import app
from sharegpu.k8s.cache.view import ClusterView
from sharegpu.k8s.status.report import FollowedStatus, print_status, status_report, summary_line, watch_status
from sharegpu.model.assignment import Assignment, GpuShare, Mechanism, MigSlot
from sharegpu.model.inventory import GpuDevice, NodeSpec


def build() -> ClusterView:
    """node-h: GPU 0 shared through MPS by a pod of uid 1000 and a pod that declares no user (two tenants, so two
    daemons); node-m: an A100 with a 3g.40gb instance."""
    mig = NodeSpec("node-m", 64000, 262144, (GpuDevice(0, "GPU-m-0", "A100-80GB", mig_enabled=True),))
    h100 = node_spec("node-h", gpus=2)
    a1 = Assignment(
        "ml/infer-a", "node-h", (GpuShare(0, "GPU-node-h-0", Mechanism.MPS, 300, 10240),), tenant="ml/uid-1000"
    )
    a2 = Assignment(
        "ml/infer-b", "node-h", (GpuShare(0, "GPU-node-h-0", Mechanism.MPS, 200, 20480),), tenant="pod/uid-ml-infer-b"
    )
    a3 = Assignment(
        "ml/iso",
        "node-m",
        (GpuShare(0, "GPU-m-0", Mechanism.MIG, 1000, 40960, MigSlot("3g.40gb", 4), Mechanism.EXCLUSIVE),),
    )
    pod_list = [
        with_assignment(pod_obj("infer-a", "ml", memory="10Gi", run_as_user=1000), a1.to_json(), "node-h"),
        with_assignment(pod_obj("infer-b", "ml", memory="20Gi"), a2.to_json(), "node-h"),
        with_assignment(pod_obj("iso", "ml", memory="40Gi"), a3.to_json(), "node-m"),
        with_assignment(pod_obj("broken", "ml", memory="1Gi"), "{oops", "node-h"),
    ]
    view = ClusterView()
    view.reset(nodes([node_obj(h100), node_obj(mig)]), pods(pod_list))
    return view


def test_report_has_the_json_contract_and_the_sharing_pods() -> None:
    report = status_report(build())
    by_name = {n["name"]: n for n in report["nodes"]}
    g0 = by_name["node-h"]["gpus"][0]
    for key in ("uuid", "model", "mechanism", "memory_mib_total", "memory_mib_used", "compute_pct_used", "pods"):
        assert key in g0
    assert g0["uuid"] == "GPU-node-h-0" and g0["model"] == "H100-80GB" and g0["mechanism"] == "mps"
    # Used: the two pods' 30Gi and the 66 MiB each of their two MPS daemons' servers takes.
    assert (g0["memory_mib_total"], g0["memory_mib_used"], g0["compute_pct_used"]) == (81920, 30720 + 2 * 66, 50.0)
    assert g0["memory_mib_daemons"] == 2 * 66
    assert g0["pods"] == ["ml/infer-a", "ml/infer-b"]
    assert g0["mps_daemons"] == [
        {"tenant": "ml/uid-1000", "who": "uid 1000 in ml", "clients": 1},
        {"tenant": "pod/uid-ml-infer-b", "who": "pod ml/infer-b alone", "clients": 1},  # by name, not UID
    ]
    g1 = by_name["node-h"]["gpus"][1]
    assert (g1["mechanism"], g1["memory_mib_used"], g1["pods"], g1["mps_daemons"]) == ("free", 0, [], [])
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
            "mps_daemons": [],
            "memory_mib_daemons": 0,
            "pods": ["ml/iso"],
        }
    ]
    s = report["summary"]
    assert (s["mps_daemons"], s["mps_daemons_per_gpu"], s["mps_daemon_memory_mib"]) == (2, 16, 66)
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
        "30.1Gi / 80Gi",  # with the daemons' memory
        "MPS daemons",
        "uid 1000 in ml: 1 client",
        "1 pod alone",  # infer-b, a tenant of its own (the pods column names it)
        "ml/infer-a",
        "3g.40gb@4 exclusive",
        "ml/broken",
    ):
        assert fragment in text
    h_head, m_head = [line for line in text.splitlines() if line.startswith("GPU ")]
    assert h_head.index("compute") < h_head.index("MPS daemons") < h_head.index("pods")
    assert "MPS daemons" not in m_head and "MIG layout" in m_head  # node-m runs no daemon: no such column


def test_status_command_reports_a_missing_kubeconfig_without_a_traceback(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["status", "--kubeconfig", str(tmp_path / "nope.yaml"), "--json"])
    assert result.exit_code == 2
    assert "cannot load Kubernetes credentials" in result.output
    assert "Traceback" not in result.output


def test_extender_command_rejects_a_bad_listen_address() -> None:
    result = CliRunner().invoke(app, ["scheduler-extender", "--listen", "nowhere"])
    assert result.exit_code == 2 and "HOST:PORT" in result.output


def test_report_has_a_summary_line_with_allocation_fragmentation_and_pending() -> None:
    report = status_report(build())
    s = report["summary"]
    assert (s["gpus_total"], s["gpus_in_use"], s["pods_placed"], s["pending"]) == (3, 2, 3, 0)
    # 300 + 200 milli of MPS and a 3g instance (3 of 7 slices) of 3 GPUs.
    assert s["allocation_pct"] == round(100 * (500 + 428) / 3000, 2)
    assert s["fragmentation_pct"] is not None
    line = summary_line(report)
    assert line.startswith("2/3 GPUs in use on 2 node(s) · allocation 30.93% · fragmentation ")
    assert line.endswith("· 3 pod(s) placed · 0 pending")


def test_watch_redraws_as_the_cluster_changes() -> None:
    api = MemoryClusterApi()
    api.put_node("node-h", node_spec("node-h", gpus=1))
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=160)

    async def main() -> None:
        stop = asyncio.Event()
        followed = FollowedStatus(min_age_s=0)
        task = asyncio.ensure_future(watch_status(followed, api, console, 0.05, stop))
        for _ in range(100):
            await asyncio.sleep(0.02)
            if "node node-h" in out.getvalue():
                break
        api.put_pod(pod_obj("newcomer", "ml", memory="5Gi"))
        for _ in range(100):
            await asyncio.sleep(0.02)
            if "ml/newcomer" in out.getvalue():
                break
        stop.set()
        await task

    asyncio.run(main())
    text = out.getvalue()
    assert "connecting to the API server" in text or "node node-h" in text
    first, newcomer = text.index("0/1 GPUs in use"), text.index("ml/newcomer")
    assert first < newcomer and "1 pending (1 fits)" in text[newcomer - 2000 :]


def test_status_flags_are_checked_before_connecting() -> None:
    for args, fragment in (
        (["--watch", "--serve", "127.0.0.1:8080"], "choose one of"),
        (["--watch", "--interval", "0"], "--interval 0 must be"),
        (["--serve", "nowhere"], "--serve 'nowhere' must be HOST:PORT"),
    ):
        result = CliRunner().invoke(app, ["status", *args])
        assert result.exit_code == 2 and fragment in result.output, result.output
        assert "Traceback" not in result.output
