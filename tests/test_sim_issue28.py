"""Issue 28, the simulator: no input or option may grow memory without bound (a cap, exit 2 with a message)."""

from __future__ import annotations

import io
import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from sharegpu.cli import app
from sharegpu.placement.policies import POLICIES
from sharegpu.sim import openb, variants
from sharegpu.sim.engine import RunResult
from sharegpu.sim.openb import load_pods
from sharegpu.sim.replay import arrivals_to_load
from sharegpu.sim.report import print_table

runner = CliRunner()
NODES = "sn,cpu_milli,memory_mib,gpu,model\nn0,32000,131072,2,V100M16\nn1,32000,131072,4,T4\n"
HEADER = "name,cpu_milli,memory_mib,num_gpu,gpu_milli"


def write(tmp_path: Path, name: str, text: str | bytes) -> Path:
    p = tmp_path / name
    if isinstance(text, bytes):
        p.write_bytes(text)
    else:
        p.write_text(text)
    return p


def run(*args: str) -> tuple[int, str]:
    r = runner.invoke(app, list(args))
    assert "Traceback" not in r.output
    return r.exit_code, " ".join(r.output.split())


def _cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, 3 * 2**30))


def test_sim_refuses_dev_zero_at_once(tmp_path: Path) -> None:
    # Read whole, /dev/zero grew the process to 5.6 GB in 15 s; under a 3 GB cap the old code dies or times out.
    nodes = write(tmp_path, "n.csv", NODES)
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "from sharegpu.cli import main; main()",
            "sim",
            "--nodes",
            str(nodes),
            "--pods",
            "/dev/zero",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_cap_memory,
    )
    assert r.returncode == 2, r.stderr[-500:]
    assert "/dev/zero:1: not a CSV text file: it holds a NUL byte" in " ".join(r.stderr.split())


def test_a_nul_byte_is_named_with_its_line(tmp_path: Path) -> None:
    pods = write(tmp_path, "p.csv", f"{HEADER}\np0,1,1,1,500\np1,1,1\x00,1,500\n".encode())
    code, out = run("trace", "describe", str(pods))
    assert code == 2 and f"{pods}:3: not a CSV text file: it holds a NUL byte" in out


def test_a_file_above_the_size_cap_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(openb, "MAX_FILE_BYTES", 4 * 2**20)
    rows = "".join(f"p{i},1000,1024,1,500\n" for i in range(300_000))  # about 6 MB, every row valid
    pods = write(tmp_path, "p.csv", f"{HEADER}\n{rows}")
    code, out = run("trace", "describe", str(pods))
    assert code == 2 and f"{pods}: is larger than 4 MiB" in out


def test_a_line_above_the_length_cap_is_refused(tmp_path: Path) -> None:
    pods = write(tmp_path, "p.csv", f"{HEADER}\np0,1,1,1,500\np1,{'1' * 100_000},1,1,500\n")
    code, out = run("trace", "describe", str(pods))
    assert code == 2 and f"{pods}:3: a line is longer than 64 KiB" in out


def test_rows_above_the_row_cap_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(openb, "MAX_ROWS", 5)
    pods = write(tmp_path, "p.csv", HEADER + "\n" + "".join(f"p{i},1,1,1,500\n" for i in range(6)))
    code, out = run("trace", "describe", str(pods))
    assert code == 2 and f"{pods}:7: has more than 5 rows, the most a trace may have" in out
    pods.write_text(HEADER + "\n" + "".join(f"p{i},1,1,1,500\n" for i in range(5)))
    assert run("trace", "describe", str(pods))[0] == 0


def test_vary_refuses_a_cpu_only_share_that_would_outgrow_the_cap(tmp_path: Path) -> None:
    # 100 GPU pods at 99.99 % CPU-only is 999,900 CPU-only rows: the old code made them all (3.6 GB, no output).
    base = write(tmp_path, "b.csv", HEADER + "\nc0,1,1,0,0\n" + "".join(f"p{i},1,1,1,500\n" for i in range(100)))
    out_file = tmp_path / "v.csv"
    code, out = run("trace", "vary", str(base), "--cpu-only", "99.99", "-o", str(out_file))
    assert code == 2
    assert "--cpu-only 99.99 would make 999,900 CPU-only pods beside the variant's 100 GPU pods" in out
    assert f"more than the {variants.MAX_VARIANT_ROWS:,} a trace may have; give --cpu-only 99.98 or less" in out
    assert not out_file.exists()
    assert run("trace", "vary", str(base), "--cpu-only", "99.98", "-o", str(out_file))[0] == 0


def test_vary_refuses_a_gpu_share_that_would_outgrow_the_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # One tiny sharing pod asked to carry all the demand of 100 whole GPUs: 100,000 copies of it.
    monkeypatch.setattr(variants, "MAX_VARIANT_ROWS", 50_000)
    base = write(tmp_path, "b.csv", HEADER + "\ns0,1,1,1,1\n" + "".join(f"w{i},1,1,1,1000\n" for i in range(100)))
    code, out = run("trace", "vary", str(base), "--sharing", "100", "-o", str(tmp_path / "v.csv"))
    assert code == 2
    assert "the variant would need more than 50,000 rows" in out and "give a smaller --sharing" in out


# ----- tables never cut a name, and say what each column is ----------------------------------------------------
def _runs() -> list[RunResult]:
    def result(policy: str, seed: int) -> RunResult:
        curve: list[float | None] = [float(min(x, 90)) for x in range(131)]
        return RunResult(policy, seed, 1.0, 100, 90, 10, 64, curve, {}, 0.1, 0.9, 5.0, 91.0)

    return [result(p, s) for p in POLICIES for s in (1, 2)]


@pytest.mark.parametrize("width", [60, 80, 100])
def test_the_sim_table_keeps_every_name_and_number_whole_at_any_width(width: int) -> None:
    console = Console(width=width, record=True, file=io.StringIO())
    print_table(console, _runs(), "openb_pod_list_default: 6212 GPUs on 1213 nodes, 8152 tasks, tune 1.3", 6212)
    text = console.export_text()
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= width
    names = [line.split()[0] for line in text.splitlines() if line.split() and line.split()[0] in POLICIES]
    assert set(names) == set(POLICIES)
    for header in ("alloc@100", "range@100", "alloc@130", "unalloc", "frag%", "failed", "wall s", "p50", "p99"):
        assert header in text
    flat = " ".join(text.split())
    assert "failed: pods that found no node with room when they arrived" in flat
    assert "wall s: seconds one run took" in flat


def test_a_priority_replay_table_in_a_pipe_is_whole(tmp_path: Path) -> None:
    nodes = write(tmp_path, "n.csv", NODES)
    rows = "".join(f"p{i:03d},2000,4096,1,{300 + 50 * (i % 10)},{10 * i},{10 * i + 95}\n" for i in range(12))
    pods = write(tmp_path, "p.csv", f"{HEADER},creation_time,deletion_time\n{rows}")
    args = ["sim", "--nodes", str(nodes), "--pods", str(pods), "--replay", "--high-priority-share", "0.3"]
    args += ["--preemption", "--consolidation", "--policy", "dra-steered,clustering", "--out", str(tmp_path / "o")]
    r = runner.invoke(app, [*args, "--jobs", "1"])
    assert r.exit_code == 0, r.output
    assert "…" not in r.stdout
    for header in ("never placed", "peak pending", "hi p50 s", "hi never", "evicted", "moves", "wall s"):
        assert header in r.stdout
    assert "dra-steered" in r.stdout and "clustering" in r.stdout
    assert "wall s: seconds one run took" in " ".join(r.stdout.split())


def test_load_defaults_to_arrivals_that_fill_the_cluster_and_warns_below(tmp_path: Path) -> None:
    nodes = write(tmp_path, "n.csv", NODES)
    rows = "".join(f"p{i:03d},2000,4096,1,500,{10 * i},{10 * i + 10_000 * (1 + i % 3)}\n" for i in range(12))
    pods = write(tmp_path, "p.csv", f"{HEADER},creation_time,deletion_time\n{rows}")
    args = ["sim", "--nodes", str(nodes), "--pods", str(pods), "--replay", "--load", "2", "--jobs", "1"]
    r = runner.invoke(app, [*args, "--policy", "bestfit", "--out", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "o" / "report.json").read_text())
    tasks = load_pods(pods)
    needed = arrivals_to_load(tasks, 6 * 1000, 2.0)
    assert doc["arrivals"] == max(20_000, needed)
    assert "warning" not in r.output
    few = runner.invoke(app, [*args, "--arrivals", "50", "--policy", "bestfit", "--out", str(tmp_path / "o2")])
    assert few.exit_code == 0
    assert "--load 2 with 50 arrivals: the redraw starts with an empty cluster" in " ".join(few.output.split())
