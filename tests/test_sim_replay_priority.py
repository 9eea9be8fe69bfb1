"""`sharegpu sim --replay` with priorities, preemption and consolidation (issue 19): bad input refused with a message
and exit 2 before any run, the figures of a small replay, and the loaded openb replay (skipped without the trace)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sharegpu.cli import app
from sharegpu.model.inventory import NodeSpec, sim_gpus
from sharegpu.model.request import GpuRequest
from sharegpu.placement.policies import PolicyContext, make_policy
from sharegpu.sim.openb import TraceTask, load_nodes, load_pods
from sharegpu.sim.replay import HIGH, PriorityOptions, mark_high, overloaded, replay_trace

runner = CliRunner()
NODES = "sn,cpu_milli,memory_mib,gpu,model\nn0,32000,131072,2,V100M16\nn1,32000,131072,4,T4\n"
POD_HEADER = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time"
DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "openb"


def pods_text(n: int = 40) -> str:
    rows = [f"p{i:03d},2000,4096,1,{300 + 70 * (i % 10)},,LS,Running,{10 * i},{10 * i + 400}" for i in range(n)]
    return "\n".join([POD_HEADER, *rows]) + "\n"


def sim(tmp_path: Path, *args: str):  # type: ignore[no-untyped-def]
    n, p = tmp_path / "nodes.csv", tmp_path / "pods.csv"
    n.write_text(NODES, encoding="utf-8")
    p.write_text(pods_text(), encoding="utf-8")
    return runner.invoke(
        app, ["sim", "--nodes", str(n), "--pods", str(p), "--jobs", "1", "--out", str(tmp_path / "r"), *args]
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--high-priority-share", "0.2"], "only with --replay"),
        (["--replay", "--high-priority-share", "1.5"], "out of range"),
        (["--replay", "--high-priority-share", "nan"], "out of range"),
        (["--replay", "--preemption"], "--preemption needs --high-priority-share above 0"),
        (["--replay", "--max-moves", "3"], "give --consolidation too"),
        (["--replay", "--consolidation", "--max-moves", "0"], "--max-moves 0 is out of range"),
        (["--replay", "--arrivals", "100"], "give --load too"),
        (["--replay", "--load", "0"], "--load 0.0 is out of range"),
        (["--replay", "--load", "2", "--arrivals", "0"], "--arrivals 0 is out of range"),
    ],
)
def test_bad_options_are_refused_with_a_message(tmp_path: Path, args: list[str], message: str) -> None:
    r = sim(tmp_path, *args)
    assert r.exit_code == 2, r.output
    assert message in " ".join(r.output.split())
    assert "Traceback" not in r.output
    assert not (tmp_path / "r").exists()


def test_priority_replay_reports_its_figures(tmp_path: Path) -> None:
    r = sim(
        tmp_path,
        "--replay",
        "--high-priority-share",
        "0.3",
        "--preemption",
        "--consolidation",
        "--load",
        "3",
        "--arrivals",
        "300",
        "--policy",
        "bestfit",
    )
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "r" / "report.json").read_text())
    assert doc["priority"] == {"high_share": 0.3, "preemption": True, "consolidation": True, "max_moves": 2}
    assert doc["load"] == 3 and doc["arrivals"] == 300
    stats = doc["runs"][0]["replay"]
    assert stats["high_pods"] == 90
    for key in ("high_wait_p50_s", "high_wait_p95_s", "high_never_placed", "evictions", "moves"):
        assert key in stats
    assert "hi p95 s" in " ".join(r.output.split())


def cluster() -> list[NodeSpec]:
    return [NodeSpec(f"n{i}", 64_000, 262_144, sim_gpus(f"n{i}", "A100-40GB", 2)) for i in range(3)]


def loaded_tasks(n: int = 400, seed: int = 7) -> tuple[TraceTask, ...]:
    shapes = [GpuRequest(f"t{i}", compute_milli=[300, 500, 1000, 700][i % 4], cpu_milli=1000) for i in range(40)]
    base = tuple(TraceTask(r, 10 * i, 10 * i + 500 + 37 * i) for i, r in enumerate(shapes))
    return overloaded(base, 6000, n, seed, 2.0)


def test_without_features_the_replay_equals_the_plain_one() -> None:
    """No pod marked and no feature: the same placements, waits and allocation as the plain replay, which reports
    no priority figures (and the indexed pending queue places as retrying the whole queue does)."""
    tasks = loaded_tasks()
    policy = make_policy("bestfit", PolicyContext())
    plain = replay_trace(cluster(), tasks, policy, None, 0).run
    prio = replay_trace(cluster(), tasks, policy, PriorityOptions(), 0).run
    whole = replay_trace(cluster(), tasks, policy, PriorityOptions(), 0, retry_all=True).run
    assert prio.placed == plain.placed == whole.placed and prio.failed == plain.failed
    assert prio.curve == plain.curve == whole.curve
    assert plain.replay is not None and prio.replay is not None
    for key in ("waited", "never_placed", "peak_pending", "mean_alloc_pct"):
        assert prio.replay[key] == plain.replay[key]
    assert "high_pods" not in plain.replay and prio.replay["high_pods"] == 0


def test_preemption_cuts_high_priority_waits() -> None:
    tasks = loaded_tasks(600)
    policy = make_policy("bestfit", PolicyContext())
    base = replay_trace(cluster(), tasks, policy, PriorityOptions(0.2), 0).run.replay
    pre = replay_trace(cluster(), tasks, policy, PriorityOptions(0.2, preemption=True), 0).run.replay
    assert base is not None and pre is not None
    assert base["high_wait_mean_s"] > 0, "the scenario must make high-priority pods wait"
    assert pre["high_wait_mean_s"] < base["high_wait_mean_s"] / 2
    assert pre["evictions"] > 0
    assert base["evictions"] == 0 and base["moves"] == 0


def test_marking_is_seeded() -> None:
    tasks = loaded_tasks()
    assert mark_high(tasks, 0.25, 1) == mark_high(tasks, 0.25, 1)
    assert mark_high(tasks, 0.25, 1) != mark_high(tasks, 0.25, 2)
    assert len(mark_high(tasks, 0.25, 1)) == 100
    assert mark_high(tasks, 0.0, 1) == frozenset()
    assert HIGH > 0


@pytest.mark.skipif(not (DATA / "openb_pod_list_default.csv").exists(), reason=f"the openb trace is not at {DATA}")
def test_loaded_openb_replay_with_preemption() -> None:
    nodes = tuple(load_nodes(DATA / "openb_node_list_gpu_node.csv"))
    base = tuple(load_pods(DATA / "openb_pod_list_default.csv"))
    tasks = overloaded(base, 1000 * sum(len(n.gpus) for n in nodes), 3000, 42, 2.0)
    policy = make_policy("bestfit", PolicyContext())
    r = replay_trace(nodes, tasks, policy, PriorityOptions(0.2, preemption=True), 42).run
    assert r.replay is not None and r.replay["high_never_placed"] == 0


def test_event_times_never_run_backwards() -> None:
    """A pod that waited past its deletion time ends when it is placed, not in the past: B waits for A until 100 and
    was to be deleted at 50. Before, its end at 50 came after A's at 100 and the timeline ended at 50."""
    one = [NodeSpec("n0", 64_000, 262_144, sim_gpus("n0", "A100-40GB", 1))]
    tasks = (TraceTask(GpuRequest("a"), 0, 100), TraceTask(GpuRequest("b"), 10, 50))
    policy = make_policy("bestfit", PolicyContext())
    for run in (
        replay_trace(one, tasks, policy, None, 0).run,
        replay_trace(one, tasks, policy, PriorityOptions(0.5), 0).run,
    ):
        assert run.timeline is not None
        assert run.timeline.time_s[0] == 0 and run.timeline.time_s[-1] == 100
        assert run.placed == 2


def test_loaded_window_allocation() -> None:
    tasks = loaded_tasks(600)
    r = replay_trace(cluster(), tasks, make_policy("bestfit", PolicyContext()), PriorityOptions(0.2), 0).run
    assert r.replay is not None
    # Over the loaded part the small cluster is nearly full; over all events the drain pulls the mean down.
    assert r.replay["arrival_alloc_pct"] > r.replay["mean_alloc_pct"]
    assert 0 < r.replay["arrival_alloc_pct"] <= 100
