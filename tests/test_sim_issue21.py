"""A new user's report on the simulator and trace commands (issue 21), one test per case; each fails on the code
before the fix (fbfe64c), which is why names new since then are looked up inside the tests."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sharegpu.cli import app
from sharegpu.sim import scenario
from sharegpu.sim.engine import RunResult
from sharegpu.sim.openb import TraceError, TraceTask, load_nodes, load_pods, read_pod_table
from sharegpu.sim.protocol import fgd_arrivals
from sharegpu.sim.report import table, write_json
from sharegpu.sim.scenario import scenario_nodes, scenario_tasks

runner = CliRunner()
NODES = "sn,cpu_milli,memory_mib,gpu,model\nn0,32000,131072,2,V100M16\nn1,32000,131072,4,T4\n"
POD_HEADER = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time"


def pods_text(n: int = 12, deletion: bool = True) -> str:
    rows = [
        f"p{i:03d},2000,4096,1,{300 + 50 * (i % 10)},,LS,Running,{10 * i},{10 * i + 95 if deletion else ''}"
        for i in range(n)
    ]
    return "\n".join([POD_HEADER, *rows]) + "\n"


def trace(tmp_path: Path, pods: str | None = None, nodes: str = NODES) -> tuple[Path, Path]:
    n, p = tmp_path / "nodes.csv", tmp_path / "pods.csv"
    n.write_text(nodes, encoding="utf-8")
    p.write_text(pods if pods is not None else pods_text(), encoding="utf-8")
    return n, p


def sim(tmp_path: Path, *args: str, pods: str | None = None, nodes: str = NODES):  # type: ignore[no-untyped-def]
    n, p = trace(tmp_path, pods, nodes)
    return runner.invoke(app, ["sim", "--nodes", str(n), "--pods", str(p), "--jobs", "1", *args])


class RunsStarted(Exception):
    pass


@pytest.fixture
def no_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runs must not start: what is checked here is checked before them."""

    def refuse(*a: object, **k: object) -> list[RunResult]:
        raise RunsStarted

    monkeypatch.setattr("sharegpu.sim.cli.run_experiment", refuse)


def refused(r, *fragments: str) -> None:  # type: ignore[no-untyped-def]
    """Exit 2, the message on stderr, no traceback, nothing on stdout."""
    assert r.exit_code == 2, r.output
    assert not isinstance(r.exception, RunsStarted)
    err = " ".join(r.stderr.split())
    assert err.startswith("error: "), err
    for f in fragments:
        assert f in err, (f, err)
    assert "Traceback" not in r.output and r.stdout == ""


# ----- data loss: the report never goes over an input ---------------------------------------------------------
@pytest.mark.usefixtures("no_runs")
def test_the_report_never_overwrites_an_input(tmp_path: Path) -> None:
    n, p = trace(tmp_path)
    before = {f: f.read_bytes() for f in (n, p)}
    (tmp_path / "d").mkdir()
    in_folder = tmp_path / "d" / "report.json"  # --out d would write d/report.json
    in_folder.write_text(pods_text(), encoding="utf-8")
    plot_named = tmp_path / "r.png"  # --json r.json puts the plot at r.png
    plot_named.write_text(NODES, encoding="utf-8")
    link = tmp_path / "link.json"
    os.link(p, link)  # another name for the pods file
    cases = [
        (n, p, ["--json", str(p)], "--pods input"),
        (n, p, ["--json", str(n)], "--nodes input"),
        (n, p, ["--json", str(tmp_path / "." / "pods.csv")], "--pods input"),
        (n, in_folder, ["--out", str(tmp_path / "d")], "--pods input"),
        (plot_named, p, ["--json", str(tmp_path / "r.json")], "--nodes input"),
        (n, p, ["--json", str(link)], "--pods input"),
    ]
    for nodes, pods, args, fragment in cases:
        r = runner.invoke(app, ["sim", "--nodes", str(nodes), "--pods", str(pods), *args])
        refused(r, fragment, "overwrite")
    assert {f: f.read_bytes() for f in (n, p)} == before
    assert in_folder.read_text(encoding="utf-8") == pods_text()
    assert plot_named.read_text(encoding="utf-8") == NODES


def test_trace_vary_never_overwrites_its_spec_source(tmp_path: Path) -> None:
    _, p = trace(tmp_path)
    src = tmp_path / "src.csv"
    src.write_text(pods_text().replace(",,LS", ",T4,LS"), encoding="utf-8")
    before = src.read_bytes()
    r = runner.invoke(
        app, ["trace", "vary", str(p), "-o", str(src), "--gpu-spec", "50", "--spec-source", str(src), "--force"]
    )
    refused(r, "--spec-source itself")
    assert src.read_bytes() == before


# ----- the size of a run, said up front; absurd ones refused ------------------------------------------------------
@pytest.mark.usefixtures("no_runs")
def test_absurd_seed_ranges_are_refused_at_once(tmp_path: Path) -> None:
    refused(runner.invoke(app, ["sim", "--seeds", "0-100000"]), "100,001 seeds", "at most 10,000")
    refused(runner.invoke(app, ["sim", "--seeds", "0-99999999999999"]), "at most 10,000")  # never built
    r = runner.invoke(app, ["sim", "--seeds", "0-5000"])
    refused(r, "25,005 runs (5 policies × 5,001 seeds)", "placement decisions", "--large")
    r = runner.invoke(app, ["sim", "--seeds", "0-5000", "--large"])
    assert isinstance(r.exception, RunsStarted)  # --large lets it through


def test_the_size_of_the_run_is_said_before_it_starts(tmp_path: Path) -> None:
    r = sim(tmp_path, "--policy", "fgd,bestfit", "--seeds", "1-3", "--out", str(tmp_path / "o"))
    assert r.exit_code == 0, r.output
    said = re.search(r"simulating 6 runs \(2 policies × 3 seeds\) of about (\d+) pods each", r.stderr)
    assert said is not None, r.stderr
    pods = [run["pods"] for run in json.loads((tmp_path / "o" / "report.json").read_text())["runs"]]
    assert all(abs(int(said[1]) - p) <= 2 for p in pods), (said[1], pods)  # the estimate, to within a pod or two


# ----- input accepted without a word ------------------------------------------------------------------------------
def test_a_gpu_node_without_cpu_and_memory_is_refused_and_one_without_either_warned(tmp_path: Path) -> None:
    n = tmp_path / "n.csv"
    n.write_text("sn,cpu_milli,memory_mib,gpu,model\na,0,0,2,T4\n", encoding="utf-8")
    with pytest.raises(TraceError, match=r"n.csv:2: node 'a' has 2 GPUs but 0 CPU and 0 memory"):
        load_nodes(n)
    n.write_text("sn,cpu_milli,memory_mib,gpu,model\na,0,1024,2,T4\nb,0,0,0,\nc,1000,0,1,T4\n", encoding="utf-8")
    got: list[object] = []
    load_nodes(n, warn=got.append)
    text = " | ".join(map(str, got))
    assert "n.csv:2: 1 node(s) with GPUs have 0 CPU" in text and "cpu_milli" in text
    assert "n.csv:4: 1 node(s) with GPUs have 0 memory" in text and "memory_mib" in text


@pytest.mark.parametrize("value", ["1e1", "1E1", "1_0", "inf", "nan", "+1", "0x1", "١"])
def test_numbers_are_plain_digits(tmp_path: Path, value: str) -> None:
    n = tmp_path / "n.csv"
    n.write_text(f"sn,cpu_milli,memory_mib,gpu,model\na,1000,1024,{value},T4\n", encoding="utf-8")
    with pytest.raises(TraceError, match=r"n.csv:2: gpu is .*not a number: write a whole number in plain digits"):
        load_nodes(n)


def test_whole_numbers_with_a_zero_fraction_still_load(tmp_path: Path) -> None:
    n = tmp_path / "n.csv"
    n.write_text("sn,cpu_milli,memory_mib,gpu,model\na,1000.0,1024.,2.00,T4\n", encoding="utf-8")
    (node,) = load_nodes(n)
    assert (node.cpu_milli, node.memory_mib, len(node.gpus)) == (1000, 1024, 2)


@pytest.mark.parametrize("spec", ["T4||", "|T4", "T4| |V100M16", "|"])
def test_a_gpu_spec_with_an_empty_model_name_is_refused(tmp_path: Path, spec: str) -> None:
    p = tmp_path / "p.csv"
    p.write_text(f"name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\np0,1,1,1,500,{spec}\n", encoding="utf-8")
    with pytest.raises(TraceError, match=r"p.csv:2: gpu_spec .* has an empty model name"):
        load_pods(p)


def test_replay_says_which_pods_lack_times_and_refuses_a_trace_without_any(tmp_path: Path) -> None:
    pods = pods_text(6) + pods_text(4, deletion=False).split("\n", 1)[1].replace("p00", "q00")
    r = sim(tmp_path, "--replay", "--policy", "bestfit", "--out", str(tmp_path / "o"), pods=pods)
    assert r.exit_code == 0, r.output
    assert "4 pod(s) have no deletion_time; --replay keeps them to the end (they never leave)" in " ".join(
        r.stderr.split()
    )
    r = sim(tmp_path, "--replay", pods=pods_text(5, deletion=False))
    refused(r, "no pod has a deletion_time", "without --replay")
    no_times = "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1,1,1,500\n"
    refused(sim(tmp_path, "--replay", pods=no_times), "no pod has a creation_time")


@pytest.mark.usefixtures("no_runs")
@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--seeds", ""], ["--seeds ''", "no seed given"]),
        (["--seeds", "1,,2"], ["'1,,2'", "empty"]),
        (["--seeds", "1,"], ["empty"]),
        (["--seeds", "1_0"], ["'1_0' is not a seed"]),
        (["--policy", ""], ["--policy ''", "names no policy", "sharegpu"]),
        (["--policy", "fgd,,bestfit"], ["empty"]),
        (["--json", "r.json", "--out", "d"], ["--json r.json and --out d", "not both"]),
        (["--out", ""], ["--out is empty"]),
        (["--json", ""], ["--json is empty"]),
        (["--nodes", ""], ["--nodes is empty"]),
        (["--tune", "100.0001"], ["--tune 100.0001", "multiple of the cluster's GPU capacity", "at most 100"]),
        (["--tune", "nan"], ["--tune nan"]),
    ],
)
def test_bad_options_say_what_is_wrong(tmp_path: Path, args: list[str], fragments: list[str]) -> None:
    refused(sim(tmp_path, *args), *fragments)


@pytest.mark.usefixtures("no_runs")
def test_replay_of_the_embedded_scenario_is_refused() -> None:
    refused(runner.invoke(app, ["sim", "--replay"]), "embedded scenario has none")


@pytest.mark.usefixtures("no_runs")
def test_a_trace_with_nothing_to_measure_says_what_is_wrong(tmp_path: Path) -> None:
    cpu_only = "name,cpu_milli,memory_mib,num_gpu,gpu_milli\n" + "".join(f"p{i},1000,1024,0,0\n" for i in range(5))
    refused(sim(tmp_path, pods=cpu_only), "none of its 5 pods asks for a GPU")
    too_big = "name,cpu_milli,memory_mib,num_gpu,gpu_milli\n" + "".join(f"p{i},99000,1,1,500\n" for i in range(5))
    refused(sim(tmp_path, pods=too_big), "none of its GPU pods fits on any node", "even with the cluster empty", "CPU")


def test_pods_that_fit_nowhere_are_warned_about(tmp_path: Path) -> None:
    pods = pods_text(8) + "big,99000,1,1,500,,LS,Running,1,2\n"
    r = sim(tmp_path, "--policy", "bestfit", "--out", str(tmp_path / "o"), pods=pods)
    assert r.exit_code == 0, r.output
    assert "1 of 9 pods fit on no node even with the cluster empty" in " ".join(r.stderr.split())


def test_trace_vary_without_a_share_refuses_to_copy_the_base(tmp_path: Path) -> None:
    _, p = trace(tmp_path)
    out = tmp_path / "copy.csv"
    refused(runner.invoke(app, ["trace", "vary", str(p), "-o", str(out)]), "give at least one share")
    refused(runner.invoke(app, ["trace", "vary", str(p), "-o", "", "--sharing", "10"]), "--out is empty")
    assert not out.exists()


# ----- unclear errors ---------------------------------------------------------------------------------------------
def test_a_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    n, p = tmp_path / "n.csv", tmp_path / "p.csv"
    n.write_bytes(b"\xef\xbb\xbf" + NODES.encode())
    p.write_bytes(b"\xef\xbb\xbf" + pods_text(3).encode())
    assert [x.name for x in load_nodes(n)] == ["n0", "n1"]
    assert [t.name for t in load_pods(p)] == ["p000", "p001", "p002"]
    assert read_pod_table(p).header[0] == "name"


# ----- the first thing `sharegpu sim` shows -----------------------------------------------------------------------
def test_every_default_seed_of_the_scenario_reaches_130() -> None:
    assert len(scenario.DEFAULT_SEEDS) >= 20
    tasks = [TraceTask(r) for r in scenario_tasks()]
    capacity = sum(len(n.gpus) for n in scenario_nodes()) * 1000
    for seed in scenario.DEFAULT_SEEDS:
        arrived = sum(r.total_milli for r in fgd_arrivals(tasks, capacity, seed, scenario.DEFAULT_TUNE))  # type: ignore[attr-defined]
        assert arrived >= 1.305 * capacity, seed  # past the level, not just near it


def result(policy: str, seed: int, a100: float, above: bool = False) -> RunResult:
    curve: list[float | None] = [float(min(x, 90)) for x in range(131)]
    curve[100] = a100
    if above:
        curve[40] = 44.0
    return RunResult(policy, seed, 1.0, 100, 90, 10, 64, curve, {}, 0.1, 0.9, 5.0, 90.0)


def test_table_shows_the_spread_and_the_default_policy_seed_by_seed(tmp_path: Path) -> None:
    runs = [
        result("fgd", 1, 95.0),
        result("fgd", 2, 97.0),
        result("fgd", 3, 96.0),
        result("sharegpu", 1, 96.0),
        result("sharegpu", 2, 96.5),
        result("sharegpu", 3, 97.0),
    ]
    t = table(runs, "t", 64)
    cells = {c.header: list(c.cells) for c in t.columns}
    assert cells["range@100"] == ["95.00–97.00", "96.00–97.00"]
    caption = " ".join(str(t.caption).split())
    assert (
        "sharegpu against fgd at 100 %, seed by seed (the same arrivals): ahead on 2 of 3 seeds, behind on 1" in caption
    )
    assert "mean +0.50 pp" in caption
    assert "MIG" not in caption  # no curve above arrived demand, so no word about it
    out = tmp_path / "r.json"
    write_json(out, runs, {})
    doc = json.loads(out.read_text())
    assert doc["paired_at_100"]["ahead"] == 2 and doc["paired_at_100"]["rival"] == "fgd"
    spread = {s["policy"]: s["alloc_pct_spread_at_arrived"]["100"] for s in doc["summary"]}
    assert spread["fgd"] == {"min": 95.0, "max": 97.0, "stdev": 1.0}


def test_allocation_above_arrived_demand_is_explained() -> None:
    runs = [result("fgd", 1, 95.0, above=True), result("fgd", 2, 95.0)]
    caption = " ".join(str(table(runs, "t", 64).caption).split())
    assert "allocation can run above arrived demand" in caption and "MIG" in caption


def test_the_embedded_default_shows_every_level_for_every_seed_and_ranks_the_default_policy(tmp_path: Path) -> None:
    # The default scenario and seeds, two of its policies (the five take ~25 s on 2 cores).
    r = runner.invoke(
        app, ["sim", "--policy", "fgd,sharegpu", "--out", str(tmp_path)], env={"COLUMNS": "200"}, terminal_width=200
    )
    assert r.exit_code == 0, r.output
    assert not re.search(r"\(\d+/\d+\)", r.stdout)  # no level reached by only some seeds
    assert "range@100" in r.stdout and "sharegpu against fgd" in " ".join(r.stdout.split())
    doc = json.loads((tmp_path / "report.json").read_text())
    summary = {s["policy"]: s for s in doc["summary"]}
    assert all(s["seeds_reaching_arrived"] == {"100": 20, "130": 20} for s in summary.values())
    # What the scenario is there to show: the default policy ahead of FGD over the seeds, on more of them than not.
    mean = {p: s["mean_alloc_pct_at_arrived"]["100"] for p, s in summary.items()}
    assert mean["sharegpu"] > mean["fgd"]
    assert doc["paired_at_100"]["ahead"] > doc["paired_at_100"]["behind"]
