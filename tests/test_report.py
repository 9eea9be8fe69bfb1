"""Reports of simulation runs (sim/report.py): JSON structure, the PNG plot, the summary and the table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from sharegpu.placement.reasons import ReasonKind
from sharegpu.sim.engine import RunResult
from sharegpu.sim.report import print_table, summarize, table, write_json, write_plot

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def curve(a100: float | None, a130: float | None, stop: int = 131) -> list[float | None]:
    """A plausible curve: linear up to 90 %, flat-ish to 130 %, with the given values at 100 and 130."""
    out: list[float | None] = [float(min(x, 90)) for x in range(131)]
    out[100] = a100
    out[130] = a130
    return [v if x < stop else None for x, v in enumerate(out)]


def result(
    policy: str,
    seed: int,
    a100: float | None,
    a130: float | None,
    wall: float = 1.0,
    failed: int = 10,
    frag: float | None = 5.0,
    p50: float = 0.1,
    p99: float = 0.9,
    stop: int = 131,
) -> RunResult:
    return RunResult(
        policy=policy,
        seed=seed,
        wall_s=wall,
        pods=100,
        placed=100 - failed,
        failed=failed,
        total_gpus=64,
        curve=curve(a100, a130, stop),
        failures={ReasonKind.CPU: failed // 2, ReasonKind.GPU_ROOM: failed - failed // 2},
        latency_p50_ms=p50,
        latency_p99_ms=p99,
        fragmentation_pct=frag,
        final_alloc_pct=a130 if a130 is not None else 0.0,
    )


RUNS = [
    result("fgd", 42, 95.0, 96.0, wall=2.0, failed=10, frag=4.0),
    result("fgd", 43, 94.0, 95.0, wall=4.0, failed=20, frag=6.0),
    result("bestfit", 42, 92.0, 93.0, wall=1.0, failed=30, frag=None),
    result("fgd", 44, 96.0, 97.0, wall=3.0, failed=30, frag=5.0),
    result("bestfit", 43, 91.0, 92.5, wall=1.5, failed=40, frag=None),
]


# ----- summarize ------------------------------------------------------------------------------------------------
def test_summarize_means_per_policy_in_first_seen_order() -> None:
    fgd, bestfit = summarize(RUNS)
    assert fgd.policy == "fgd" and bestfit.policy == "bestfit"
    assert fgd.seeds == 3 and bestfit.seeds == 2
    assert fgd.alloc_100 == pytest.approx(95.0)
    assert fgd.alloc_130 == pytest.approx(96.0)
    assert bestfit.alloc_100 == pytest.approx(91.5)
    assert bestfit.alloc_130 == pytest.approx(92.75)
    assert fgd.wall_s == 3.0  # median
    assert bestfit.wall_s == 1.25
    assert fgd.failed == pytest.approx(20.0)  # mean
    assert bestfit.failed == pytest.approx(35.0)
    assert fgd.fragmentation_pct == pytest.approx(5.0)
    assert bestfit.fragmentation_pct is None
    assert fgd.unalloc_100 == pytest.approx(5.0)
    assert fgd.p50_ms == pytest.approx(0.1) and fgd.p99_ms == pytest.approx(0.9)


def test_summarize_ignores_missing_values_and_keeps_none_when_all_are_missing() -> None:
    runs = [
        result("x", 1, 90.0, None, stop=120),
        result("x", 2, 80.0, None, stop=110),
        result("y", 1, None, None, stop=90),
    ]
    x, y = summarize(runs)
    assert x.alloc_100 == pytest.approx(85.0)
    assert x.alloc_130 is None
    assert y.alloc_100 is None and y.alloc_130 is None
    assert y.unalloc_100 is None
    # A run that has a value and one that has not: the mean is over those that have one.
    (z,) = summarize([result("z", 1, 90.0, 91.0), result("z", 2, None, None, stop=99)])
    assert z.alloc_100 == 90.0 and z.alloc_130 == 91.0


def test_summarize_nothing() -> None:
    assert summarize([]) == []


# ----- RunResult.to_dict / write_json ----------------------------------------------------------------------------
def test_write_json_structure(tmp_path: Path) -> None:
    out = tmp_path / "deep" / "dir" / "report.json"
    write_json(out, RUNS, {"trace": "default", "tune": 1.3})
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert doc["trace"] == "default" and doc["tune"] == 1.3  # meta at the top level
    assert isinstance(doc["runs"], list) and len(doc["runs"]) == len(RUNS)
    for r, d in zip(RUNS, doc["runs"], strict=True):
        assert d["policy"] == r.policy
        assert d["seed"] == r.seed
        assert d["wall_s"] == r.wall_s
        assert set(d["alloc_pct_at_arrived"]) == {"100", "130"}
        assert d["alloc_pct_at_arrived"]["100"] == r.curve[100]
        assert d["alloc_pct_at_arrived"]["130"] == r.curve[130]
        assert d["unallocated_gpu_pct_at_arrived"]["100"] == pytest.approx(100 - r.curve[100])  # type: ignore[operator]
        assert d["pods"] == 100 and d["placed"] + d["failed"] == 100
        assert d["total_gpus"] == 64
        assert len(d["curve_alloc_pct_by_arrived_pct"]) == 131
        assert sum(d["failures_by_reason"].values()) == r.failed
        assert set(d["decision_latency_ms"]) == {"p50", "p99"}
    summary = {s["policy"]: s for s in doc["summary"]}
    assert list(summary) == ["fgd", "bestfit"]
    assert summary["fgd"]["seeds"] == 3
    assert summary["fgd"]["mean_alloc_pct_at_arrived"]["100"] == pytest.approx(95.0)
    assert summary["bestfit"]["mean_alloc_pct_at_arrived"]["130"] == pytest.approx(92.75)
    assert summary["bestfit"]["median_wall_s"] == pytest.approx(1.25)
    assert out.read_text(encoding="utf-8").endswith("\n")


def test_to_dict_rounds_and_orders() -> None:
    r = RunResult(
        policy="p",
        seed=1,
        wall_s=1.23456,
        pods=10,
        placed=7,
        failed=3,
        total_gpus=8,
        curve=curve(93.456, None, stop=120),
        failures={ReasonKind.CPU: 1, ReasonKind.GPU_ROOM: 2},
        latency_p50_ms=0.12345,
        latency_p99_ms=1.98765,
        fragmentation_pct=3.14159,
        final_alloc_pct=87.5555,
    )
    d = r.to_dict()
    assert d["wall_s"] == 1.235
    assert d["alloc_pct_at_arrived"] == {"100": 93.456, "130": None}
    assert d["unallocated_gpu_pct_at_arrived"] == {"100": 6.54, "130": None}
    assert d["final_alloc_pct"] == 87.56
    assert d["fragmentation_pct"] == 3.14
    assert list(d["failures_by_reason"]) == ["gpu-busy", "cpu"]  # by machine name, most common first
    assert d["decision_latency_ms"] == {"p50": 0.123, "p99": 1.988}
    json.dumps(d)  # serialisable as it is


def test_alloc_at_out_of_range() -> None:
    r = result("p", 1, 90.0, 91.0)
    assert r.alloc_at(100) == 90.0
    assert r.alloc_at(-1) is None
    assert r.alloc_at(131) is None


def test_write_json_with_no_runs(tmp_path: Path) -> None:
    out = tmp_path / "empty.json"
    write_json(out, [], {})
    assert json.loads(out.read_text()) == {"runs": [], "summary": []}


# ----- write_plot ------------------------------------------------------------------------------------------------
def test_write_plot_writes_a_png(tmp_path: Path) -> None:
    out = tmp_path / "plots" / "alloc.png"
    write_plot(out, RUNS, "default trace")
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 5_000  # a real picture, not an empty canvas


def test_write_plot_handles_curves_that_stop_early(tmp_path: Path) -> None:
    out = tmp_path / "alloc.png"
    write_plot(out, [result("x", 1, None, None, stop=60), result("y", 1, 90.0, None, stop=110)], "short")
    assert out.read_bytes()[:8] == PNG_MAGIC


# ----- table ---------------------------------------------------------------------------------------------------
def test_table_has_a_row_per_policy_with_its_numbers() -> None:
    t = table(RUNS, "title", total_gpus=64)
    assert t.row_count == 2
    assert t.title == "title"
    cells = {c.header: list(c.cells) for c in t.columns}
    assert cells["policy"] == ["fgd", "bestfit"]
    assert cells["seeds"] == ["3", "2"]
    assert cells["alloc@100"] == ["95.00", "91.50"]
    assert cells["alloc@130"] == ["96.00", "92.75"]
    assert cells["unalloc"] == ["3.2", "5.4"]  # 5 % and 8.5 % of 64 GPUs
    assert cells["frag%"] == ["5.00", "—"]
    assert cells["failed"] == ["20", "35"]


def test_print_table() -> None:
    console = Console(record=True, width=200)
    print_table(console, RUNS, "my title", 64)
    text = console.export_text()
    assert "my title" in text and "fgd" in text and "bestfit" in text and "95.00" in text
