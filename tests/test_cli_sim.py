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


# ----- MPS tenancy (issue 32): the rule, its cap, and whom the pods run as ----------------------------------------
MPS_PODS = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n" + "".join(
    f"m{i},1000,1024,1,{(i % 3 + 1) * 100},\n" for i in range(30)
)


def test_mps_options_are_checked_before_anything_runs(tmp_path: Path) -> None:
    n, p = _trace(tmp_path, pods=MPS_PODS)
    bad = [
        (["--undeclared", "1.5"], "--undeclared 1.5 is out of range"),
        (["--undeclared", "-0.1"], "from 0 to 1"),
        (["--undeclared", "nan"], "out of range"),
        (["--users", "0"], "--users 0 is out of range"),
        (["--mps-rule", "tenant"], "'tenant' is not a rule"),
        (["--mps-rule", ""], "names no rule"),
        (["--mps-rule", "none,,per-tenant"], "empty"),
        (["--mps-rule", "none,none"], "more than once"),
        (["--mps-daemons-per-gpu", "0"], "1 to 48"),
        (["--mps-daemons-per-gpu", "49"], "1 to 48"),
        (["--mps-rule", "one-user", "--mps-daemons-per-gpu", "4"], "add per-tenant to --mps-rule"),
        (["--mps-rule", "none", "--users", "3"], "changes nothing under --mps-rule none"),
        (["--mps-rule", "multi-user,none", "--undeclared", "0.5"], "add one-user or per-tenant"),
        (["--mps-daemon-memory", "-1"], "--mps-daemon-memory -1 is out of range"),
        (["--mps-daemon-memory", "5000"], "0 to 4,096 MiB"),
    ]
    for args, words in bad:
        r = runner.invoke(app, ["sim", "--nodes", str(n), "--pods", str(p), "--out", str(tmp_path / "o"), *args])
        assert r.exit_code == 2, (args, r.output)
        assert words in " ".join(r.output.split()), (args, r.output)
        assert "Traceback" not in r.output
    assert not (tmp_path / "o").exists()  # nothing ran


def test_the_default_rule_is_a_daemon_per_tenant_with_the_common_case_drawn(tmp_path: Path) -> None:
    n, p = _trace(tmp_path, pods=MPS_PODS)
    r = runner.invoke(app, ["sim", "--nodes", str(n), "--pods", str(p), "--out", str(tmp_path), "--jobs", "1"])
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "report.json").read_text())
    assert (doc["mps_rules"], doc["mps_daemons_per_gpu"], doc["users"], doc["undeclared"]) == (
        ["per-tenant"],
        16,
        1,
        0.8,
    )
    assert {run["mps_rule"] for run in doc["runs"]} == {"per-tenant"}
    assert "a daemon per tenant" in " ".join(r.output.split())
    r = runner.invoke(app, ["sim", "--nodes", str(n), "--pods", str(p), "--out", str(tmp_path), "--mps-rule", "none"])
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["mps_rules"] == ["none"] and "users" not in doc and "mps_daemons_per_gpu" not in doc


def test_several_rules_run_side_by_side(tmp_path: Path) -> None:
    n, p = _trace(tmp_path, pods=MPS_PODS)
    out = tmp_path / "rules.json"
    args = ["sim", "--nodes", str(n), "--pods", str(p), "--policy", "fgd,bestfit", "--seeds", "1-2", "--json", str(out)]
    r = runner.invoke(app, [*args, "--mps-rule", "all", "--users", "2", "--undeclared", "0.5", "--jobs", "1"])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "simulating 16 runs (4 MPS rules × 2 policies × 2 seeds)" in text
    assert "MPS rules side by side" in text and "vs none" in text
    doc = json.loads(out.read_text())
    rules = ["none", "one-user", "per-tenant", "multi-user"]
    assert [(run["mps_rule"], run["policy"], run["seed"]) for run in doc["runs"]] == [
        (rule, policy, seed) for rule in rules for policy in ("fgd", "bestfit") for seed in (1, 2)
    ]
    assert [(s["mps_rule"], s["policy"]) for s in doc["summary"]] == [
        (rule, policy) for rule in rules for policy in ("fgd", "bestfit")
    ]
    rows = doc["mps_rule_comparison"]
    assert [(row["policy"], row["mps_rule"]) for row in rows] == [
        (policy, rule) for policy in ("fgd", "bestfit") for rule in rules
    ]
    for row in rows:
        assert row["reference"] == "none" and row["compared"] == 2
        assert (row["diff_pp"] == 0) if row["mps_rule"] == "none" else row["diff_pp"] is not None
    assert out.with_suffix(".png").stat().st_size > 1000


def test_a_replay_compares_rules_by_mean_allocation(tmp_path: Path) -> None:
    timed = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,creation_time,deletion_time\n" + "".join(
        f"m{i},1000,1024,1,{(i % 3 + 1) * 150},,{i * 10},{i * 10 + 200}\n" for i in range(40)
    )
    n, p = _trace(tmp_path, pods=timed)
    out = tmp_path / "replay.json"
    args = ["sim", "--nodes", str(n), "--pods", str(p), "--replay", "--policy", "fgd", "--seeds", "1-2"]
    r = runner.invoke(app, [*args, "--mps-rule", "one-user,per-tenant", "--json", str(out), "--jobs", "1"])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "vs one-user" in text and "never placed" in text and "mean alloc" in text
    rows = json.loads(out.read_text())["mps_rule_comparison"]
    assert [(row["mps_rule"], row["figure"], row["reference"]) for row in rows] == [
        ("one-user", "mean_alloc_pct", "one-user"),
        ("per-tenant", "mean_alloc_pct", "one-user"),
    ]
    assert rows[1]["diff_pp"] > 0  # undeclared pods share GPUs again
