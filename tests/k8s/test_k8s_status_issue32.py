"""``sharegpu status`` shows the MPS daemons per GPU (issue 32): one per tenant on each GPU or MIG instance shared
through MPS, who the tenant is in words and how many clients it serves, the cap where a unit is at it — in the
report (``--json``), the table, ``--watch`` and the ``--serve`` page — and counts with ``--mps-daemons-per-gpu``."""

from __future__ import annotations

import asyncio
import io
import json
import time
from pathlib import Path
from typing import Any

import pytest
from k8s_helpers import LoopbackServer, node_obj, node_spec, nodes, pod_obj, pods, with_assignment
from memory_api import MemoryClusterApi
from rich.console import Console
from test_k8s_kubeconfig_issue21 import FakeApiServer, write
from typer.testing import CliRunner

from sharegpu.cli import app
from sharegpu.k8s.cache.view import ClusterView
from sharegpu.k8s.status.page import make_page_app, render_fragment
from sharegpu.k8s.status.report import FollowedStatus, StatusSnapshot, print_status, status_report, watch_status
from sharegpu.ledger import DEFAULT_DAEMONS_PER_UNIT, MPS_DAEMON_MEMORY_MIB, MpsTenancy
from sharegpu.model.assignment import Assignment, GpuShare, Mechanism, MigSlot
from sharegpu.model.inventory import GpuDevice, NodeSpec
from sharegpu.model.tenant import MULTI_USER_TENANT

DAEMON = MPS_DAEMON_MEMORY_MIB


def mps_pod(name: str, ns: str, node: str, gpu: int, gib: int, run_as_user: int | None = None) -> dict[str, Any]:
    """A running MPS pod with the assignment the extender writes (its tenant as pod_request computes it)."""
    tenant = f"{ns}/uid-{run_as_user}" if run_as_user is not None else f"pod/uid-{ns}-{name}"
    share = GpuShare(gpu, f"GPU-{node}-{gpu}", Mechanism.MPS, 100, gib * 1024)
    a = Assignment(f"{ns}/{name}", node, (share,), tenant=tenant)
    return with_assignment(pod_obj(name, ns, memory=f"{gib}Gi", run_as_user=run_as_user), a.to_json(), node)


def mig_mps_pod(name: str, ns: str, start: int, gib: int, run_as_user: int | None = None) -> dict[str, Any]:
    tenant = f"{ns}/uid-{run_as_user}" if run_as_user is not None else f"pod/uid-{ns}-{name}"
    share = GpuShare(0, "GPU-a100-0", Mechanism.MIG, 500, gib * 1024, MigSlot("2g.20gb", start), Mechanism.MPS)
    a = Assignment(f"{ns}/{name}", "gpu-a100", (share,), tenant=tenant)
    return with_assignment(pod_obj(name, ns, memory=f"{gib}Gi", run_as_user=run_as_user), a.to_json(), "gpu-a100")


def cluster(daemons_per_gpu: int = 2) -> ClusterView:
    """gpu-h100 GPU 0: two pods of uid 1000 in ml and one undeclared pod (two daemons: at a cap of 2); GPU 1: one
    undeclared pod. gpu-a100: a 2g.20gb instance shared through MPS by two tenants. gpu-multi: a node in multi-user
    mode, where two tenants' pods are clients of its one daemon."""
    a100 = NodeSpec("gpu-a100", 64000, 262144, (GpuDevice(0, "GPU-a100-0", "A100-80GB", mig_enabled=True),))
    multi = NodeSpec("gpu-multi", 64000, 262144, node_spec("gpu-multi", gpus=1).gpus, mps_multi_user=True)
    objs = [
        mps_pod("llama-1", "ml", "gpu-h100", 0, 20, run_as_user=1000),
        mps_pod("llama-2", "ml", "gpu-h100", 0, 20, run_as_user=1000),
        mps_pod("notebook", "lab", "gpu-h100", 0, 10),
        mps_pod("bert", "ml", "gpu-h100", 1, 10),
        mig_mps_pod("small-a", "research", 0, 4, run_as_user=0),
        mig_mps_pod("small-b", "research", 0, 4),
        mps_pod("m-1", "ml", "gpu-multi", 0, 10, run_as_user=1000),
        mps_pod("m-2", "lab", "gpu-multi", 0, 10),
    ]
    view = ClusterView(tenancy=MpsTenancy(daemons_per_unit=daemons_per_gpu))
    node_list = [node_obj(node_spec("gpu-h100", gpus=2)), node_obj(a100), node_obj(multi)]
    view.reset(nodes(node_list), pods(objs))
    view.synced = True
    assert view.problems == []
    return view


def test_the_report_lists_each_units_daemons_by_tenant_with_their_clients() -> None:
    report = status_report(cluster())
    by_node = {n["name"]: n for n in report["nodes"]}
    h0, h1 = by_node["gpu-h100"]["gpus"]
    assert h0["mps_daemons"] == [
        {"tenant": "ml/uid-1000", "who": "uid 1000 in ml", "clients": 2},  # two pods, one daemon
        {"tenant": "pod/uid-lab-notebook", "who": "pod lab/notebook alone", "clients": 1},
    ]
    assert h0["memory_mib_used"] == 50 * 1024 + 2 * DAEMON and h0["memory_mib_daemons"] == 2 * DAEMON
    assert h1["mps_daemons"] == [{"tenant": "pod/uid-ml-bert", "who": "pod ml/bert alone", "clients": 1}]
    (a100,) = by_node["gpu-a100"]["gpus"]
    assert a100["mps_daemons"] == []  # in MIG mode: its daemons are its instances'
    (inst,) = a100["mig"]
    assert (inst["profile"], inst["inner"]) == ("2g.20gb", "mps")
    assert [(d["who"], d["clients"]) for d in inst["mps_daemons"]] == [
        ("pod research/small-b alone", 1),
        ("uid 0 in research", 1),
    ]
    assert inst["memory_mib_daemons"] == 2 * DAEMON and inst["memory_mib_used"] == 8 * 1024 + 2 * DAEMON
    (multi,) = by_node["gpu-multi"]["gpus"]
    assert multi["mps_daemons"] == [
        {"tenant": MULTI_USER_TENANT, "who": "every user (multi-user daemon)", "clients": 2}
    ]
    s = report["summary"]
    assert (s["mps_daemons"], s["mps_daemons_per_gpu"], s["mps_daemon_memory_mib"]) == (6, 2, DAEMON)
    json.dumps(report)


def test_the_table_words_each_daemon_and_the_cap() -> None:
    console = Console(record=True, width=160, file=io.StringIO())
    print_status(console, status_report(cluster()))
    text = console.export_text()
    for fragment in (
        "MPS daemons",
        "uid 1000 in ml: 2 clients",
        "1 pod alone",  # the pods column names it
        "at the cap of 2 daemons",  # GPU 0: a tenant that runs none there cannot join
        "2g.20gb@0 uid 0 in research: 1 client",
        "2g.20gb@0 1 pod alone",
        "2g.20gb@0 at the cap of 2 daemons",
        "every user (multi-user daemon): 2 clients",
    ):
        assert fragment in text, fragment
    assert text.count("at the cap of") == 2  # not GPU 1 (one daemon), not the multi-user node (one daemon)
    roomy = Console(record=True, width=160, file=io.StringIO())
    print_status(roomy, status_report(cluster(DEFAULT_DAEMONS_PER_UNIT)))
    assert "at the cap" not in roomy.export_text()


def test_an_80_column_terminal_wraps_the_daemons_and_keeps_pod_names_whole() -> None:
    console = Console(record=True, width=80, file=io.StringIO())
    print_status(console, status_report(cluster()))
    text = console.export_text()
    assert max(len(line.rstrip()) for line in text.splitlines()) <= 80
    # Whole on one line: the daemons' column wraps (and folds) before a name does. (Not on gpu-a100, whose table has
    # the MIG layout and the daemons of its instances besides: 80 columns cannot hold both and its pods' names.)
    for name in ("ml/llama-1", "ml/llama-2", "lab/notebook", "ml/bert", "H100-80GB", "mps", "uid 1000 in ml:"):
        assert name in text, name


def test_the_page_shows_each_daemon_its_clients_and_the_cap() -> None:
    view = cluster()
    snap = StatusSnapshot(status_report(view), True, time.time())
    body = render_fragment(snap)
    assert "<th>MPS daemons</th>" in body
    assert '<li class="daemon" data-tenant="ml/uid-1000" data-clients="2">uid 1000 in ml: 2 clients</li>' in body
    assert 'data-tenant="pod/uid-lab-notebook" data-clients="1">pod lab/notebook alone: 1 client</li>' in body
    assert '<li class="cap">at the cap of 2 daemons</li>' in body
    assert "2g.20gb@0 uid 0 in research: 1 client" in body
    assert '<div class="v" id="mps-daemons">6</div><div class="sub">at most 2 a GPU, one per tenant</div>' in body
    with LoopbackServer(make_page_app(lambda: snap, refresh_s=1)) as srv:
        status, text = srv.get("/status.json")
        assert status == 200 and json.loads(text)["summary"]["mps_daemons"] == 6
        status, page = srv.get("/")
        assert status == 200 and "uid 1000 in ml: 2 clients" in page


def test_watch_shows_a_daemon_as_its_first_client_arrives_and_its_clients_as_more_join() -> None:
    api = MemoryClusterApi()
    api.put_node("gpu-h100", node_spec("gpu-h100", gpus=2))
    out = io.StringIO()
    console = Console(file=out, width=160)  # a pipe: every refresh printed after the last

    async def main() -> None:
        stop = asyncio.Event()
        followed = FollowedStatus(ClusterView(follow_dra=True), min_age_s=0)
        task = asyncio.ensure_future(watch_status(followed, api, console, 0.05, stop))

        async def shown(fragment: str) -> None:
            for _ in range(200):
                if fragment in out.getvalue():
                    return
                await asyncio.sleep(0.02)
            raise AssertionError(f"never shown: {fragment}")

        await shown("node gpu-h100")
        api.put_pod(mps_pod("llama-1", "ml", "gpu-h100", 0, 20, run_as_user=1000))
        await shown("uid 1000 in ml: 1 client")
        api.put_pod(mps_pod("llama-2", "ml", "gpu-h100", 0, 20, run_as_user=1000))
        api.put_pod(mps_pod("notebook", "lab", "gpu-h100", 0, 10))
        await shown("uid 1000 in ml: 2 clients")
        await shown("1 pod alone")
        stop.set()
        await task

    asyncio.run(main())


@pytest.mark.parametrize(
    ("flag", "given", "key", "default", "bad", "range_words"),
    [
        ("--mps-daemons-per-gpu", 3, "mps_daemons_per_gpu", DEFAULT_DAEMONS_PER_UNIT, ("0", "49"), "1 to 48"),
        ("--mps-daemon-memory", 80, "mps_daemon_memory_mib", MPS_DAEMON_MEMORY_MIB, ("-1", "4097"), "0 to 4,096 MiB"),
    ],
)
def test_status_counts_with_the_tenancy_it_is_given_and_refuses_a_figure_out_of_range(
    tmp_path: Path, flag: str, given: int, key: str, default: int, bad: tuple[str, ...], range_words: str
) -> None:
    """The MPS daemon cap and each daemon's memory: what status counts with, as the extender does."""
    server = FakeApiServer()
    try:
        kc = write(tmp_path / "kc", server.url)
        result = CliRunner().invoke(app, ["status", "--kubeconfig", str(kc), "--json", flag, str(given)])
        assert result.exit_code == 0, result.output
        assert json.loads(result.output)["summary"][key] == given
        result = CliRunner().invoke(app, ["status", "--kubeconfig", str(kc), "--json"])
        assert json.loads(result.output)["summary"][key] == default
    finally:
        server.close()
    for command in (["status"], ["scheduler-extender", "--plain-http"]):
        for value in bad:
            result = CliRunner().invoke(app, [*command, flag, value])
            assert result.exit_code == 2 and f"{flag} {value} is out of range: {range_words}" in " ".join(
                result.output.split()
            ), result.output
            assert "Traceback" not in result.output
