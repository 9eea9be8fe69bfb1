"""The `sharegpu sim` command end to end: the embedded default, a small trace, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from sharegpu.cli import app

runner = CliRunner()

NODES = "sn,cpu_milli,memory_mib,gpu,model\nn0,32000,131072,2,V100M16\nn1,32000,131072,4,T4\n"
PODS = (
    "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n"
    "p0,4000,8192,1,500,\n"
    "p1,4000,8192,1,1000,\n"
    "p2,8000,8192,2,1000,\n"
    "p3,1000,1024,0,0,\n"
    "p4,2000,4096,1,250,T4\n"
)


def _trace(tmp_path: Path, pods: str = PODS, nodes: str = NODES) -> tuple[Path, Path]:
    n = tmp_path / "nodes.csv"
    p = tmp_path / "pods.csv"
    n.write_text(nodes)
    p.write_text(pods)
    return n, p


def test_trace_run_writes_json_with_required_fields(tmp_path: Path) -> None:
    n, p = _trace(tmp_path)
    out = tmp_path / "report.json"
    r = runner.invoke(
        app,
        [
            *("sim", "--nodes", str(n), "--pods", str(p), "--policy", "fgd,bestfit", "--seeds", "1-2"),
            "--out",
            str(tmp_path),
            "--jobs",
            "1",
        ],
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert [(run["policy"], run["seed"]) for run in doc["runs"]] == [
        ("fgd", 1),
        ("fgd", 2),
        ("bestfit", 1),
        ("bestfit", 2),
    ]
    for run in doc["runs"]:
        assert set(run["alloc_pct_at_arrived"]) == {"100", "130"}
        assert run["wall_s"] >= 0
        assert 0 < run["alloc_pct_at_arrived"]["100"] <= 100
    assert (tmp_path / "allocation.png").stat().st_size > 1000


def test_bad_csv_names_file_and_line_and_exits_2(tmp_path: Path) -> None:
    n, p = _trace(tmp_path, pods=PODS.replace("p3,1000,1024,0,0,", "p3,-5,1024,0,0,"))
    r = runner.invoke(app, ["sim", "--nodes", str(n), "--pods", str(p)])
    assert r.exit_code == 2
    assert f"{p}:5" in r.output and "negative" in r.output
    assert "Traceback" not in r.output


def test_unknown_column_and_policy_are_usage_errors(tmp_path: Path) -> None:
    n, p = _trace(
        tmp_path, pods=PODS.replace("gpu_spec", "gpu_spec,color").replace("\n", ",x\n").replace("color,x", "color")
    )
    r = runner.invoke(app, ["sim", "--nodes", str(n), "--pods", str(p)])
    assert r.exit_code == 2 and "unknown column" in r.output
    n, p = _trace(tmp_path)
    r = runner.invoke(app, ["sim", "--nodes", str(n), "--pods", str(p), "--policy", "magic"])
    assert r.exit_code == 2 and "unknown policy 'magic'" in r.output
    r = runner.invoke(app, ["sim", "--nodes", str(n)])
    assert r.exit_code == 2 and "--pods" in r.output
