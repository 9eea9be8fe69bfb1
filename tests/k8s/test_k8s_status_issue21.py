"""``sharegpu status`` output that misled a new user (issue 21): an 80-column terminal, the summary of DRA nodes and
MIG claims, ``--watch`` into a pipe, ``--serve``'s address, and the HTTP client's per-request log lines."""

from __future__ import annotations

import asyncio
import io
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from k8s_helpers import node_spec, nodes, pod_obj, pods, with_assignment
from memory_api import MemoryClusterApi
from rich.console import Console
from test_k8s_kubeconfig_issue21 import FakeApiServer, write
from typer.testing import CliRunner

from proc_helpers import Proc, free_port, kubeconfig
from sharegpu.cli import app
from sharegpu.k8s.cache.view import ClusterView
from sharegpu.k8s.status.report import FollowedStatus, print_status, status_report, summary_line, watch_status
from sharegpu.kube.errors import Forbidden
from sharegpu.kube.schema import ResourceClaim, ResourceSlice
from sharegpu.model.assignment import Assignment, GpuShare, Mechanism
from sharegpu.model.catalog import DEFAULT_CATALOG
from sharegpu.node.backends.base import DeviceInfo
from sharegpu.node.dra.slices import build_slices, resource_slice

LONG = "machine-learning/inference-server-7d9f8b6c5-abcde"


def shared_view() -> ClusterView:
    spec = node_spec("gpu-node-1", gpus=1)
    uuid = spec.gpus[0].uuid
    a = Assignment(LONG, "gpu-node-1", (GpuShare(0, uuid, Mechanism.TIME_SLICING, 300, 10240),))
    b = Assignment("ml/b", "gpu-node-1", (GpuShare(0, uuid, Mechanism.TIME_SLICING, 200, 10240),))
    ns, name = LONG.split("/")
    objs = [
        with_assignment(pod_obj(name, ns, memory="10Gi"), a.to_json(), "gpu-node-1"),
        with_assignment(pod_obj("b", "ml", memory="10Gi"), b.to_json(), "gpu-node-1"),
    ]
    view = ClusterView()
    from k8s_helpers import node_obj

    view.reset(nodes([node_obj(spec)]), pods(objs))
    return view


def column(text: str, header: str) -> str:
    """The cells of the last column (from its header's offset on), joined: a folded name comes out whole."""
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.rstrip().endswith(header))
    at = lines[head].rindex(header)
    return "".join(line[at:].strip() for line in lines[head + 1 :] if len(line) > at)


def test_an_80_column_terminal_keeps_model_mechanism_and_pod_names_whole() -> None:
    view = shared_view()
    uuid = view.ledger.nodes[0].gpus[0].uuid
    console = Console(record=True, width=80, file=io.StringIO())
    print_status(console, status_report(view))
    text = console.export_text()
    assert max(len(line.rstrip()) for line in text.splitlines()) <= 80
    assert "H100-80GB" in text and "time-slicing" in text and "…" not in column(text, "pods")
    assert LONG in column(text, "pods") and "ml/b" in column(text, "pods")
    assert uuid not in text and uuid.removeprefix("GPU-")[:6] + "…" in text  # short, and still tells GPUs apart


A100 = DeviceInfo(0, "GPU-a100", "NVIDIA A100-SXM4-80GB", "A100-80GB", 81920, 108, False)


def claim(name: str, device: str) -> dict[str, Any]:
    result = {"driver": "gpu.sharegpu.io", "pool": "n1", "device": device, "request": "gpu"}
    return {"metadata": {"namespace": "ml", "name": name}, "status": {"allocation": {"devices": {"results": [result]}}}}


def test_a_mig_claim_counts_its_memory_and_compute_and_the_summary_names_dra() -> None:
    slices = [resource_slice(s, "n1", 3, 2, {"name": "n1", "uid": "u"}) for s in build_slices("n1", (A100,))]
    view = ClusterView(follow_dra=True)
    view.relisted(
        [],
        [],
        [ResourceSlice.model_validate(s) for s in slices],
        [ResourceClaim.model_validate(claim("m", "gpu-0-mig-3g40gb-4"))],
    )
    report = status_report(view)
    g = report["dra_nodes"][0]["gpus"][0]
    profile = DEFAULT_CATALOG.strict("A100-80GB").profile("3g.40gb")
    assert g["memory_mib_used"] == profile.memory_mib and g["compute_pct_used"] == round(300 / 7, 1)
    s = report["summary"]
    assert (s["dra_nodes"], s["dra_gpus_total"], s["dra_gpus_in_use"], s["dra_claims"]) == (1, 1, 1, 1)
    assert summary_line(report).endswith("· DRA: 1/1 GPUs claimed on 1 node(s), 1 claim(s)")
    console = Console(record=True, width=120, file=io.StringIO())
    print_status(console, report)
    text = console.export_text()
    assert "40Gi / 80Gi" in text and "42.9%" in text


def test_watch_into_a_pipe_prints_every_refresh() -> None:
    api = MemoryClusterApi()
    api.put_node("node-h", node_spec("node-h", gpus=1))
    out = io.StringIO()
    console = Console(file=out, width=100)  # not a terminal: what `status --watch | tee log` gets
    assert not console.is_terminal

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.ensure_future(watch_status(FollowedStatus(min_age_s=0), api, console, 0.05, stop))
        for _ in range(200):
            await asyncio.sleep(0.02)
            if out.getvalue().count("as of ") >= 3:
                break
        stop.set()
        await task

    asyncio.run(main())
    assert out.getvalue().count("as of ") >= 3 and out.getvalue().count("node node-h") >= 3


def test_serve_logs_the_address_it_serves(tmp_path: Path) -> None:
    port = free_port()
    kc = kubeconfig(tmp_path / "kc", f"https://127.0.0.1:{free_port()}")
    with Proc("status", "--kubeconfig", str(kc), "--serve", f"127.0.0.1:{port}") as proc:
        proc.wait_for(lambda line: f"status page listening on http://127.0.0.1:{port}" in line)


@pytest.fixture
def server() -> Any:
    s = FakeApiServer()
    yield s
    s.close()


def test_no_command_logs_each_http_request(
    tmp_path: Path, server: FakeApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    for name in ("httpx", "httpx2"):
        logging.getLogger(name).setLevel(logging.NOTSET)
    with caplog.at_level(logging.INFO):
        result = CliRunner().invoke(app, ["status", "--kubeconfig", str(write(tmp_path / "kc", server.url))])
    assert result.exit_code == 0, result.output
    assert server.auth  # requests were made
    assert not [r for r in caplog.records if r.name.startswith("httpx")], [r.getMessage() for r in caplog.records]


def test_watch_and_serve_follow_dra_nodes_too() -> None:
    """`status --watch` and `--serve` follow the DRA nodes with everything else: the view's one informer watches the
    driver's slices and the claims (they once showed only the ledger, then listed the DRA objects apart)."""
    a100 = DeviceInfo(0, "GPU-a100", "NVIDIA A100-SXM4-80GB", "A100-80GB", 81920, 108, False)

    def claim(name: str, device: str, consumed: dict[str, str]) -> dict[str, Any]:
        result = {
            "driver": "gpu.sharegpu.io",
            "pool": "n1",
            "device": device,
            "request": "gpu",
            "consumedCapacity": consumed,
        }
        return {
            "metadata": {"namespace": "ml", "name": name},
            "status": {"allocation": {"devices": {"results": [result]}}},
        }

    api = MemoryClusterApi()
    for s in build_slices("n1", (a100,)):
        api.put_slice(resource_slice(s, "n1", 3, 2, {"name": "n1", "uid": "u"}))

    async def main() -> None:
        followed = FollowedStatus(min_age_s=0)
        stop = asyncio.Event()
        task = asyncio.ensure_future(followed.run(api, stop))

        async def until(cond: Callable[[], bool], what: str) -> None:
            # Polls the snapshot rather than sleeping a fixed time: on a loaded machine a refresh may come late.
            for _ in range(500):
                if cond():
                    return
                assert not task.done(), f"the follower stopped before {what}"
                await asyncio.sleep(0.01)
            raise AssertionError(f"timed out after 5s waiting for {what}: {followed.snapshot().report}")

        await until(lambda: followed.snapshot().report["summary"].get("dra_nodes") == 1, "the DRA node listed")
        lists = api.calls.count("list ResourceClaims")
        api.put_claim(claim("a", "gpu-0", {"memory": "10Gi", "compute": "30"}))
        # The claim comes through the watch, not another listing.
        await until(lambda: bool(followed.snapshot().report["dra_nodes"][0]["gpus"][0]["claims"]), "the claim shown")
        assert followed.snapshot().report["dra_nodes"][0]["gpus"][0]["claims"] == ["ml/a"]
        assert api.calls.count("list ResourceClaims") == lists
        stop.set()
        await asyncio.wait_for(task, 2)

    asyncio.run(main())


def test_status_follows_without_dra_when_the_credentials_may_not_read_it() -> None:
    """A Forbidden on the DRA objects leaves the rest of the status live, and the report says why DRA is missing."""
    api = MemoryClusterApi()
    api.put_node("node-h", node_spec("node-h", gpus=1))
    api.dra_refused = Forbidden("resourceclaims.resource.k8s.io is forbidden: User cannot list resource", 403)

    async def main() -> None:
        followed = FollowedStatus(min_age_s=0)
        stop = asyncio.Event()
        task = asyncio.ensure_future(followed.run(api, stop))
        for _ in range(500):
            if followed.view.synced:
                break
            await asyncio.sleep(0.01)
        report = followed.snapshot().report
        assert followed.view.synced and [n["name"] for n in report["nodes"]] == ["node-h"]
        (problem,) = [p for p in report["problems"] if p["kind"] == "dra"]
        assert "grant list on resourceslices and resourceclaims" in problem["reason"]
        stop.set()
        await asyncio.wait_for(task, 2)

    asyncio.run(main())
