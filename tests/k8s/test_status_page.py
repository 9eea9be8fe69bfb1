"""The live status page (``sharegpu status --serve``): its HTTP contract, and a known cluster state rendered in a real
headless Chromium (Debian's ``chromium`` package), whose script refreshes the page by itself.

The browser tests skip with the reason where no Chromium is installed. ``SHAREGPU_WRITE_SCREENSHOT=1`` also writes
the screenshot shown in docs/ (docs/status-page.png).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import pytest
from k8s_helpers import LoopbackServer, node_obj, node_spec, nodes, pod_obj, pods, with_assignment

from sharegpu.k8s.cache.view import ClusterView
from sharegpu.k8s.status.page import make_page_app
from sharegpu.k8s.status.report import StatusSnapshot, status_report
from sharegpu.model.assignment import Assignment, GpuShare, Mechanism, MigSlot
from sharegpu.model.inventory import GpuDevice, NodeSpec

DOCS = Path(__file__).resolve().parents[2] / "docs"


def demo_pods() -> list[dict]:
    def mps(name: str, node: str, gpu: int, milli: int, gib: int) -> dict:
        a = Assignment(f"ml/{name}", node, (GpuShare(gpu, f"GPU-{node}-{gpu}", Mechanism.MPS, milli, gib * 1024),))
        return with_assignment(pod_obj(name, "ml", memory=f"{gib}Gi"), a.to_json(), node)

    def mig(name: str, profile: str, start: int, gib: int, inner: Mechanism = Mechanism.EXCLUSIVE) -> dict:
        share = GpuShare(0, "GPU-a100-0", Mechanism.MIG, 1000, gib * 1024, MigSlot(profile, start), inner)
        a = Assignment(f"research/{name}", "gpu-a100", (share,))
        return with_assignment(pod_obj(name, "research", memory=f"{gib}Gi"), a.to_json(), "gpu-a100")

    ts = Assignment("lab/notebook-1", "gpu-t4", (GpuShare(0, "GPU-gpu-t4-0", Mechanism.TIME_SLICING, 200, 0),))
    whole = Assignment("train/resnet", "gpu-h100", (GpuShare(1, "GPU-gpu-h100-1", Mechanism.EXCLUSIVE, 1000, 81920),))
    return [
        mps("infer-llama", "gpu-h100", 0, 400, 30),
        mps("infer-bert", "gpu-h100", 0, 200, 10),
        with_assignment(pod_obj("resnet", "train", gpu=1), whole.to_json(), "gpu-h100"),
        mig("isolated-svc", "3g.40gb", 4, 40),
        mig("small-svc", "1g.10gb", 0, 10),
        mig("tiny-a", "1g.10gb", 1, 10),
        with_assignment(pod_obj("notebook-1", "lab", compute=20), ts.to_json(), "gpu-t4"),
        pod_obj("waits-for-room", "ml", gpu=2),
        pod_obj("wants-l4", "ml", memory="5Gi", annotations={"sharegpu.io/gpu-model": "L4"}),
    ]


def demo_view(extra: list[dict] | None = None) -> ClusterView:
    a100 = NodeSpec(
        "gpu-a100",
        64000,
        262144,
        (GpuDevice(0, "GPU-a100-0", "A100-80GB", mig_enabled=True, mig_instances=(MigSlot("2g.20gb", 2),)),),
    )
    node_list = [node_obj(node_spec("gpu-h100", gpus=2)), node_obj(a100), node_obj(node_spec("gpu-t4", "T4", 2))]
    view = ClusterView()
    view.reset(nodes(node_list), pods(demo_pods() + (extra or [])))
    view.synced = True
    return view


def snapshot(view: ClusterView) -> StatusSnapshot:
    return StatusSnapshot(status_report(view), view.synced, time.time())


class Changing:
    """A page source that shows one state for its first ``after`` reads and another afterwards (a pod arrives)."""

    def __init__(self, first: StatusSnapshot, then: StatusSnapshot, after: int) -> None:
        self.first, self.then, self.after, self.reads = first, then, after, 0

    def __call__(self) -> StatusSnapshot:
        self.reads += 1
        return self.first if self.reads <= self.after else self.then


@pytest.fixture
def page() -> Iterator[LoopbackServer]:
    snap = snapshot(demo_view())
    with LoopbackServer(make_page_app(lambda: snap, refresh_s=1)) as srv:
        yield srv


def test_page_lists_every_gpu_and_pod_and_is_read_only(page: LoopbackServer) -> None:
    status, body = page.get("/")
    assert status == 200
    for text in (
        "gpu-h100",
        "GPU-gpu-h100-0",
        "ml/infer-llama",
        "ml/infer-bert",
        "train/resnet",
        "research/isolated-svc",
        "lab/notebook-1",
        "ml/waits-for-room",
        "3g.40gb",
        "2g.20gb",
        "time-slicing",
    ):
        assert text in body, text
    # Each pending pod's reason by its machine name, with the sentence for people as its tooltip.
    assert '<td title="no node has a GPU of an allowed model">no-allowed-model</td>' in body
    assert '<td title="GPUs of an allowed model exist but none has room for the share now">gpu-busy</td>' in body
    assert 'data-refresh="1"' in body and '<script src="page.js">' in body
    status, text = page.get("/fragment")
    assert status == 200 and "ml/infer-llama" in text and "<html" not in text
    status, text = page.get("/status.json")
    data = json.loads(text)
    assert data["synced"] is True and data["summary"]["gpus_total"] == 5
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        for path in ("/", "/fragment", "/status.json"):
            assert request(page, method, path)[0] == 405, (method, path)
    assert page.get("/nothing")[0] == 404


def request(srv: LoopbackServer, method: str, path: str) -> tuple[int, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    try:
        conn.request(method, path, body=b"{}" if method != "GET" else None)
        resp = conn.getresponse()
        resp.read()
        return resp.status, resp
    finally:
        conn.close()


def test_security_headers_forbid_inline_code_and_framing(page: LoopbackServer) -> None:
    _, resp = request(page, "GET", "/")
    csp = resp.getheader("Content-Security-Policy") or ""
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "frame-ancestors 'none'" in csp
    assert resp.getheader("X-Content-Type-Options") == "nosniff"


def test_names_and_reasons_are_escaped() -> None:
    evil = pod_obj("evil", "ml", memory="1Gi", annotations={"sharegpu.io/gpu-model": "<img src=x onerror=alert(1)>"})
    snap = snapshot(demo_view([evil]))
    with LoopbackServer(make_page_app(lambda: snap)) as srv:
        _, body = srv.get("/")
    assert "<img src=x" not in body and "&lt;img src=x onerror=alert(1)&gt;" in body


def chromium() -> str | None:
    for name in (os.environ.get("SHAREGPU_CHROMIUM", ""), "chromium", "chromium-browser", "google-chrome"):
        if name and (path := shutil.which(name)):
            return path
    return None


CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
)

needs_chromium = pytest.mark.skipif(
    chromium() is None, reason="no Chromium: apt-get install chromium (Debian) to run the real-browser tests"
)


def run_chromium(tmp_path: Path, url: str, *args: str) -> str:
    browser = chromium()
    assert browser is not None
    profile = tmp_path / f"profile-{time.monotonic_ns()}"
    cmd = [browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args, url]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


class _Dom(HTMLParser):
    """The rendered DOM's GPU rows, MIG instances, pods and summary values."""

    def __init__(self) -> None:
        super().__init__()
        self.gpus: list[dict[str, str]] = []
        self.mig: list[tuple[str, str]] = []
        self.pods: list[str] = []
        self.ids: dict[str, str] = {}
        self._capture: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "tr" and "gpu" in a.get("class", "").split():
            self.gpus.append(a)
        if tag == "g" and "data-profile" in a:
            self.mig.append((a["data-profile"], a["data-start"]))
        if tag == "li" and a.get("class") == "pod":
            self._capture, self._text = "pod", []
        elif "id" in a and tag == "div":
            self._capture, self._text = a["id"], []

    def handle_data(self, data: str) -> None:
        if self._capture is not None:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if self._capture is None or tag not in ("li", "div"):
            return
        text = "".join(self._text).strip()
        if self._capture == "pod":
            self.pods.append(text)
        else:
            self.ids[self._capture] = text
        self._capture = None


@needs_chromium
def test_chromium_renders_the_cluster_and_the_page_refreshes_itself(tmp_path: Path) -> None:
    before = snapshot(demo_view())
    newcomer = Assignment("ml/late-arrival", "gpu-t4", (GpuShare(1, "GPU-gpu-t4-1", Mechanism.MPS, 500, 4096),))
    after = snapshot(
        demo_view([with_assignment(pod_obj("late-arrival", "ml", memory="4Gi"), newcomer.to_json(), "gpu-t4")])
    )
    source = Changing(before, after, after=1)  # the page itself is the first read; every refresh sees the newcomer
    with LoopbackServer(make_page_app(source, refresh_s=1)) as srv:
        # Virtual time lets the page's timer fire (and its fetch of the new state land) before the DOM is dumped.
        dom_text = run_chromium(tmp_path, f"http://127.0.0.1:{srv.port}/", "--dump-dom", "--virtual-time-budget=5000")
    assert source.reads >= 2, "the page never refreshed itself"
    dom = _Dom()
    dom.feed(dom_text)
    gpus = {(g["data-node"], g["data-gpu"]): g for g in dom.gpus}
    assert set(gpus) == {("gpu-h100", "0"), ("gpu-h100", "1"), ("gpu-a100", "0"), ("gpu-t4", "0"), ("gpu-t4", "1")}
    assert gpus[("gpu-h100", "0")]["data-mechanism"] == "mps"
    assert gpus[("gpu-h100", "1")]["data-mechanism"] == "exclusive"
    assert gpus[("gpu-a100", "0")]["data-mechanism"] == "mig"
    assert gpus[("gpu-t4", "0")]["data-mechanism"] == "time-slicing"
    assert gpus[("gpu-t4", "1")]["data-mechanism"] == "mps"  # the refreshed state
    assert sorted(dom.mig) == [("1g.10gb", "0"), ("1g.10gb", "1"), ("2g.20gb", "2"), ("3g.40gb", "4")]
    for pod in (
        "ml/infer-llama",
        "ml/infer-bert",
        "train/resnet",
        "research/isolated-svc",
        "research/small-svc",
        "research/tiny-a",
        "lab/notebook-1",
        "ml/late-arrival",
    ):
        assert pod in dom.pods, pod
    assert dom.ids["gpus-in-use"] == "5 / 5"
    assert dom.ids["pending-count"] == "2"
    assert re.fullmatch(r"\d+(\.\d+)?%", dom.ids["allocation"]) and re.fullmatch(
        r"\d+(\.\d+)?%", dom.ids["fragmentation"]
    )
    assert "ml/waits-for-room" in dom_text and "ml/wants-l4" in dom_text


@needs_chromium
def test_chromium_screenshot(tmp_path: Path) -> None:
    snap = snapshot(demo_view())
    shot = tmp_path / "status-page.png"
    with LoopbackServer(make_page_app(lambda: snap, refresh_s=60)) as srv:
        run_chromium(tmp_path, f"http://127.0.0.1:{srv.port}/", f"--screenshot={shot}", "--window-size=1400,1300")
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # a real rendering, not a blank page
    if os.environ.get("SHAREGPU_WRITE_SCREENSHOT") == "1":
        shutil.copyfile(shot, DOCS / "status-page.png")


def test_serve_page_follows_the_api_server_and_stops() -> None:
    import asyncio
    import socket

    from memory_api import MemoryClusterApi

    from sharegpu.k8s.status.page import serve_page
    from sharegpu.k8s.status.report import FollowedStatus

    api = MemoryClusterApi()
    api.put_node("gpu-h100", node_spec("gpu-h100", gpus=2))
    api.put_pod(pod_obj("waiting", "ml", memory="5Gi"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def get(path: str) -> tuple[int, str]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.read().decode()
        finally:
            conn.close()

    async def main() -> tuple[dict, str]:
        stop = asyncio.Event()
        followed = FollowedStatus(min_age_s=0)
        task = asyncio.ensure_future(serve_page(followed, api, "127.0.0.1", port, 1, stop))
        loop = asyncio.get_running_loop()
        for _ in range(200):
            await asyncio.sleep(0.02)
            if followed.view.synced:
                break
        _, text = await loop.run_in_executor(None, get, "/status.json")
        _, page = await loop.run_in_executor(None, get, "/")
        # The same port again: refused with an OSError the command turns into exit code 2.
        with pytest.raises(OSError):
            await serve_page(FollowedStatus(), api, "127.0.0.1", port, 1, asyncio.Event())
        stop.set()
        await asyncio.wait_for(task, 10)
        return json.loads(text), page

    data, page = asyncio.run(main())
    assert data["synced"] is True and data["summary"]["gpus_total"] == 2
    assert [p["pod"] for p in data["pending"]] == ["ml/waiting"] and "ml/waiting" in page
