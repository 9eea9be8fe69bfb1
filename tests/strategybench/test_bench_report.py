"""The bench's report (issue 33): the plot draws only the panels that have data, and the recommendation heading is
printed only over recommendations."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from sharegpu.strategybench.recommend import recommend
from sharegpu.strategybench.report import PANELS, load_rows, print_report, write_plot
from sharegpu.strategybench.results import Row

FIXTURES = Path(__file__).parent / "fixtures"
PNG = b"\x89PNG\r\n\x1a\n"


def _rows(*kinds: str) -> list[Row]:
    doc = json.loads((FIXTURES / "h200-bench-full-2026-11-26.json").read_text())
    return [r for r in load_rows(doc) if r.kind in kinds]


def _title(kind: str) -> list[str]:
    return [label for k, _, label, _ in PANELS if k == kind]


def test_the_plot_of_the_memory_workload_alone_has_its_one_panel(tmp_path: Path) -> None:
    out = tmp_path / "bench.png"
    assert write_plot(out, _rows("memory"), "memory only") == ["memory: most one client got (GiB)"]
    assert out.read_bytes()[:8] == PNG


def test_the_plot_draws_the_panels_of_the_workloads_run_and_no_empty_one(tmp_path: Path) -> None:
    out = tmp_path / "bench.png"
    assert write_plot(out, _rows("light", "batch"), "light and batch") == [*_title("light"), *_title("batch")]
    every = write_plot(out, _rows("light", "heavy", "batch", "memory"), "all")
    assert every == [label for _, _, label, _ in PANELS] and len(every) == 5


def test_without_any_figure_no_plot_is_written_and_an_earlier_one_goes(tmp_path: Path) -> None:
    out = tmp_path / "bench.png"
    out.write_bytes(PNG + b"from an earlier run")
    failed = [Row("mps", 2, "batch", 2, {}, ("client 0 exited 1",))]
    assert write_plot(out, failed, "failed") == []
    assert not out.exists()


def _report(rows: list[Row]) -> str:
    console = Console(record=True, width=200, highlight=False)
    print_report(console, rows, recommend(rows, 144_000), "t", [])
    return console.export_text()


def test_one_client_count_prints_no_empty_recommendation_heading() -> None:
    alone = [r for r in _rows("light", "heavy", "batch", "memory") if r.clients == 1]
    assert alone and not recommend(alone, 144_000)
    text = _report(alone)
    assert "recommendation (measured here)" not in text
    assert "no recommendation: one is made from sharing strategies measured with 2 or more clients" in text
    # with recommendations the heading stands over them
    text = _report(_rows("batch"))
    assert "recommendation (measured here):\n  batch ×4: MPS, 10 % faster than time-slicing" in text
    assert "no recommendation" not in text
