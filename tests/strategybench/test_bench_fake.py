"""``sharegpu bench`` end to end on the fake backend: real client processes with modelled timings, the node
agent's MPS manager driving the simulated daemon, the table, the JSON, the plot, the recommendation and the
clean-up (also on SIGTERM)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from proc_helpers import MAIN, free_port, kubeconfig
from sharegpu.cli import app
from sharegpu.k8s.status.bench_note import parse_note
from sharegpu.model.contract import BENCH_ANNOTATION
from sharegpu.node.backends.sim import SimBackend
from sharegpu.node.backends.sim_config import parse_sim_config
from sharegpu.strategybench.runner import BenchError, plan

FAST = ["--backend", "fake", "--seconds", "0.3", "--repeat", "2", "--batch-seconds", "0.05"]


def _bench(tmp_path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-c", MAIN, "bench", *FAST, "--out", str(tmp_path / "out")]
    cmd += ["--mps-root", str(tmp_path / "mps"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=os.environ | {"COLUMNS": "200"})


def _clients_alive(tmp_path: Path) -> list[str]:
    ps = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if "strategybench.client" in line and "--backend=fake" in line]


def test_fake_run_prints_the_table_writes_json_and_plot_and_recommends_mps(tmp_path: Path) -> None:
    r = _bench(tmp_path, "--clients", "1,2", "--fake-ts-overhead", "0.3", "--batch-seconds", "0.2")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    for head in ("p50 ms", "p99 ms", "throughput", "completion s", "GPU busy %", "GiB/client"):
        assert head in out
    assert "skipped mig ×2: GPU 0 is not in MIG mode; sharegpu bench never changes a GPU's MIG mode" in out
    doc = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert (tmp_path / "out" / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = {(r["strategy"], r["clients"], r["kind"]): r for r in doc["rows"]}
    expected = {(s, 2) for s in ("time-slicing", "mps", "mps-limits")} | {("dedicated", 1)}
    assert {(s, n) for s, n, _ in rows} == expected
    assert all(r["reps"] == 2 and not r["errors"] for r in doc["rows"])
    # the fake's model: 2 clients time-sliced run 2 × 1.3 slower than one alone, under MPS 2 ×
    alone = rows[("dedicated", 1, "batch")]["metrics"]["completion_s"]["value"]
    ts = rows[("time-slicing", 2, "batch")]["metrics"]["completion_s"]["value"]
    mps = rows[("mps", 2, "batch")]["metrics"]["completion_s"]["value"]
    assert ts / alone == pytest.approx(2.6, rel=0.25) and mps / alone == pytest.approx(2.0, rel=0.25)
    assert ts > mps
    # the MPS + limits clients got the agent's environment for half the unit: the fake reports what it was held to
    mem = rows[("mps-limits", 2, "memory")]["metrics"]
    assert mem["mem_max_mib"]["value"] == 40960 and mem["mem_min_mib"]["value"] == 40960
    assert rows[("time-slicing", 2, "memory")]["metrics"]["mem_max_mib"]["value"] == 61440
    recs = {r["kind"]: r for r in doc["recommendations"]}
    assert (recs["batch"]["strategy"], recs["batch"]["versus"]) == ("mps", "time-slicing")
    assert recs["batch"]["margin_pct"] > 10
    assert recs["memory"]["strategy"] == "mps-limits"
    assert "batch ×2: MPS, " in out and "% faster than time-slicing here" in out
    # one common start per window, given after every client had warmed up: the clients were there before it
    for m in doc["measurements"]:
        assert len({c["start_at"] for c in m["results"]}) == 1
    late = sorted(c["late_s"] for m in doc["measurements"] for c in m["results"])
    assert late[len(late) // 2] == 0.0
    # every daemon stopped, every client gone
    assert not any((tmp_path / "mps").iterdir())
    assert not _clients_alive(tmp_path)


def test_sigterm_stops_the_clients_and_the_mps_daemon(tmp_path: Path) -> None:
    cmd = [sys.executable, "-c", MAIN, "bench", "--backend", "fake", "--seconds", "20", "--clients", "2"]
    cmd += ["--strategies", "mps", "--workloads", "heavy", "--out", str(tmp_path / "out")]
    cmd += ["--mps-root", str(tmp_path / "mps")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(_clients_alive(tmp_path)) < 2 and proc.poll() is None:
            time.sleep(0.2)
        assert len(_clients_alive(tmp_path)) == 2, proc.poll() is None or proc.communicate()[0]
        marker = next((tmp_path / "mps").rglob("pipe/sim-mps-daemon.json"))  # <root>/<unit>/<tenant dir>/pipe
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 130, out
    assert "interrupted; the clients and MPS daemons were stopped" in out
    assert not marker.exists() and not any((tmp_path / "mps").iterdir())
    time.sleep(0.5)
    assert not _clients_alive(tmp_path)


def test_mig_runs_each_client_on_its_own_existing_instance_and_skips_what_it_lacks(tmp_path: Path) -> None:
    cfg = parse_sim_config(
        "gpus: [{model: A100-80GB, mig: true, migInstances: [{profile: 3g.40gb, start: 0}, {profile: 3g.40gb, start: 4}]}]"
    )
    p = plan(SimBackend(cfg, seed="t"), "0", None, ["dedicated", "time-slicing", "mig"], [1, 2, 4])
    assert p.unit.mig and p.unit.memory_mib == 40960
    assert "is in MIG mode: the strategies share its MIG instance" in p.notes[0]
    mig2 = next(g for g in p.groups if g.strategy == "mig")
    assert mig2.clients == 2 and len({u.uuid for u in mig2.units}) == 2
    assert [(s.strategy, s.clients) for s in p.skipped] == [("mig", 4)]
    assert "needs 4 MIG instances on GPU 0, it has 2" in p.skipped[0].why
    assert p.groups[0].strategy == "dedicated"


def test_a_gpu_in_mig_mode_without_instances_is_refused_with_what_to_do() -> None:
    cfg = parse_sim_config("gpus: [{model: A100-80GB, mig: true}]")
    with pytest.raises(BenchError, match="never changes a GPU's MIG mode or layout"):
        plan(SimBackend(cfg, seed="t"), "0", None, ["dedicated"], [1])
    with pytest.raises(BenchError, match="no GPU '3'"):
        plan(SimBackend(cfg, seed="t"), "3", None, ["dedicated"], [1])


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed here")
def test_without_cupy_it_says_what_to_install_and_exits_2(tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["bench", "--out", str(tmp_path)])
    assert r.exit_code == 2
    text = " ".join(r.output.split())
    assert "pip install 'sharegpu[bench]'" in text and "cupy-cuda" in text


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--clients", "0,2"], "each count must be 1..48"),
        (["--clients", "two"], "give client counts separated by commas"),
        (["--strategies", "mps,fast"], "fast is not one of dedicated, time-slicing, mps, mps-limits, mig"),
        (["--workloads", "video"], "video is not one of light, heavy, batch, memory"),
        (["--seconds", "0"], "--seconds must be 0.2..60"),
        (["--publish"], "--publish needs the Node's name"),
    ],
)
def test_bad_input_exits_2_with_what_to_do(args: list[str], words: str, tmp_path: Path) -> None:
    r = CliRunner().invoke(app, ["bench", "--backend", "fake", "--out", str(tmp_path), *args], env={"NODE_NAME": ""})
    assert r.exit_code == 2, r.output
    assert words in " ".join(r.output.split())


class _ApiServer:
    """An API server that takes one thing: a merge patch of a Node (what --publish sends), of the ``nodes`` it has;
    ``refuse`` answers the patch with that HTTP status (its dry run too where ``refuse_dry_run``)."""

    def __init__(
        self, nodes: tuple[str, ...] = ("gpu-7",), refuse: int | None = None, refuse_dry_run: bool = False
    ) -> None:
        import http.server
        import threading

        self.patches: list[tuple[str, str, dict[str, object]]] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_PATCH(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.patches.append((self.path, self.headers.get("Content-Type", ""), body))
                name = self.path.split("?")[0].rsplit("/", 1)[-1]
                code = 404 if name not in nodes else 200
                if code == 200 and refuse is not None and (refuse_dry_run or "dryRun=All" not in self.path):
                    code = refuse
                if code == 200:
                    out = json.dumps({"kind": "Node", "apiVersion": "v1", "metadata": {"name": name}}).encode()
                else:
                    status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code}
                    status["message"] = f'nodes "{name}" not found' if code == 404 else f"refused with {code}"
                    out = json.dumps(status).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


def _dry(url: str) -> tuple[str, bool]:
    """A request's path and whether it was a dry run."""
    from urllib.parse import parse_qs, urlsplit

    parts = urlsplit(url)
    return parts.path, parse_qs(parts.query).get("dryRun") == ["All"]


def test_publish_annotates_the_node_with_what_status_reads(tmp_path: Path) -> None:
    api = _ApiServer()
    try:
        cfg = kubeconfig(tmp_path / "kubeconfig", api.url)
        r = _bench(
            tmp_path,
            "--clients",
            "1,2",
            "--workloads",
            "batch",
            "--strategies",
            "dedicated,time-slicing,mps",
            "--fake-ts-overhead",
            "0.3",
            "--publish",
            "--node",
            "gpu-7",
            "--kubeconfig",
            str(cfg),
        )
    finally:
        api.httpd.shutdown()
    assert r.returncode == 0, r.stdout + r.stderr
    (dry, (path, ctype, body)) = api.patches  # a dry run of the same patch before measuring, then the patch
    assert _dry(dry[0]) == ("/api/v1/nodes/gpu-7", True) and dry[1] == "application/merge-patch+json"
    assert parse_note(dry[2]["metadata"]["annotations"][BENCH_ANNOTATION]).picks == ()  # type: ignore[index]
    assert _dry(path) == ("/api/v1/nodes/gpu-7", False) and ctype == "application/merge-patch+json"
    note = parse_note(body["metadata"]["annotations"][BENCH_ANNOTATION])  # type: ignore[index]
    assert note.unit.startswith("GPU-") and note.gpu == "Simulated H100-80GB"
    (pick,) = note.picks
    assert (pick.kind, pick.clients, pick.strategy, pick.versus) == ("batch", 2, "mps", "time-slicing")
    assert f"published on node gpu-7 ({BENCH_ANNOTATION}): batch×2: mps +" in r.stdout


def test_publish_to_an_unreachable_api_server_says_so_before_measuring_and_exits_2(tmp_path: Path) -> None:
    cfg = kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{free_port()}")
    r = _bench(tmp_path, "--clients", "1", "--workloads", "batch", "--publish", "--node", "n", "--kubeconfig", str(cfg))
    assert r.returncode == 2
    assert "--publish: cannot check node n before measuring" in " ".join(r.stderr.split())
    assert "Traceback" not in r.stderr and "sharegpu bench" not in r.stdout  # nothing was measured
    assert not (tmp_path / "out" / "bench.json").exists()


def test_publish_to_an_unknown_node_fails_before_measuring_and_exits_2(tmp_path: Path) -> None:
    """Issue 33: --node ghost measured for minutes on the GPU, then failed on the unknown node."""
    api = _ApiServer()
    try:
        cfg = kubeconfig(tmp_path / "kubeconfig", api.url)
        args = ["--clients", "1", "--workloads", "batch", "--publish", "--node", "ghost", "--kubeconfig", str(cfg)]
        r = _bench(tmp_path, *args)
    finally:
        api.httpd.shutdown()
    assert r.returncode == 2, r.stdout + r.stderr
    err = " ".join(r.stderr.split())
    assert "--node ghost: the cluster has no Node of that name" in err and "kubectl get nodes" in err, err
    assert "Nothing was measured" in err and "Traceback" not in r.stderr
    assert "sharegpu bench" not in r.stdout and not (tmp_path / "out" / "bench.json").exists()
    assert [_dry(p[0]) for p in api.patches] == [("/api/v1/nodes/ghost", True)]  # the dry run only


def test_credentials_that_may_not_patch_the_node_fail_before_measuring(tmp_path: Path) -> None:
    api = _ApiServer(refuse=403, refuse_dry_run=True)  # a dry run is authorised as the patch is
    try:
        cfg = kubeconfig(tmp_path / "kubeconfig", api.url)
        args = ["--clients", "1", "--workloads", "batch", "--publish", "--node", "gpu-7", "--kubeconfig", str(cfg)]
        r = _bench(tmp_path, *args)
    finally:
        api.httpd.shutdown()
    assert r.returncode == 2, r.stdout + r.stderr
    err = " ".join(r.stderr.split())
    assert "--publish: the credentials may not annotate node gpu-7" in err and "grant it" in err, err
    assert "sharegpu bench" not in r.stdout and not (tmp_path / "out" / "bench.json").exists()


def test_a_publish_that_fails_after_measuring_keeps_the_measurement(tmp_path: Path) -> None:
    api = _ApiServer(refuse=500)  # the dry run passes; the server fails the patch itself
    try:
        cfg = kubeconfig(tmp_path / "kubeconfig", api.url)
        args = ["--clients", "1", "--workloads", "batch", "--publish", "--node", "gpu-7", "--kubeconfig", str(cfg)]
        r = _bench(tmp_path, *args)
    finally:
        api.httpd.shutdown()
    assert r.returncode == 2, r.stdout + r.stderr
    assert "cannot publish the result on node gpu-7" in " ".join(r.stderr.split())
    assert "Traceback" not in r.stderr
    assert (tmp_path / "out" / "bench.json").is_file()  # the measurement is kept


def test_the_memory_workload_alone_with_one_client_count_prints_and_plots_only_what_it_has(tmp_path: Path) -> None:
    """Issue 33: `--workloads memory` drew four empty panels, and one client count printed an empty heading."""
    r = _bench(tmp_path, "--clients", "1", "--workloads", "memory")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "recommendation (measured here)" not in r.stdout
    assert "no recommendation: one is made from sharing strategies measured with 2 or more clients" in r.stdout
    assert "no plot" not in r.stdout  # its one panel, the memory each client got
    assert (tmp_path / "out" / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
