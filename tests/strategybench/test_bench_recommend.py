"""The recommendation per workload kind, on recorded results: the H200 evidence of 2026-11-26 and the bench's own
full run on that GPU, and the edge cases (noise, latency that does not hold, memory nobody enforced)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sharegpu.strategybench.recommend import Recommendation, recommend
from sharegpu.strategybench.report import load_rows
from sharegpu.strategybench.results import Row, Spread

FIXTURES = Path(__file__).parent / "fixtures"


def _load(name: str) -> tuple[list[Row], int]:
    doc = json.loads((FIXTURES / name).read_text())
    return load_rows(doc), int(doc["unit"]["memory_mib"])


def _by_kind(recs: list[Recommendation]) -> dict[str, Recommendation]:
    return {r.kind: r for r in recs}


def test_the_h200_evidence_recommends_mps_for_every_kind_with_the_measured_margin() -> None:
    recs = _by_kind(recommend(*_load("h200-evidence-2026-11-26.json")))
    assert set(recs) == {"light", "heavy", "batch"}  # no memory probe in the evidence
    b = recs["batch"]
    assert (b.clients, b.strategy, b.versus, b.margin_pct, b.noise) == (4, "mps", "time-slicing", 9.1, False)
    assert b.line() == "batch ×4: MPS, 9 % faster than time-slicing here (4.75 s vs 5.18 s; one alone 1.18 s)"
    h = recs["heavy"]
    assert (h.clients, h.strategy, h.versus, h.margin_pct) == (2, "mps", "time-slicing", 4.5)
    assert "669 TFLOP/s vs 640 TFLOP/s; one alone 656 TFLOP/s" in h.line()
    li = recs["light"]
    # every strategy kept p99 within 25 % of the dedicated GPU's 2.41 ms; MPS kept the GPU least busy
    assert (li.clients, li.strategy, li.versus) == (4, "mps", "time-slicing")
    assert li.margin_pct == pytest.approx(100 * (1 - 11.0 / 34.4), abs=0.1)
    assert "GPU busy 11 % vs 34 % under time-slicing" in li.line()


def test_the_recorded_full_run_on_the_h200_recommends_as_it_printed() -> None:
    rows, mem = _load("h200-bench-full-2026-11-26.json")
    lines = [r.line() for r in recommend(rows, mem)]
    assert lines == [
        "light ×4: MPS, p99 0.74 ms (0.67 ms alone); GPU busy 6 % vs 21 % under time-slicing (p99 1.38 ms)",
        "heavy ×4: MPS, 5.9 % more throughput than time-slicing here (643 TFLOP/s vs 607 TFLOP/s; one alone "
        "637 TFLOP/s)",
        "batch ×4: MPS, 10 % faster than time-slicing here (4.74 s vs 5.21 s; one alone 1.19 s)",
        "memory ×4: MPS + limits, each client held to its share: 34–34 GiB of 35 GiB; under time-slicing one "
        "client took 37 GiB",
    ]


def _row(strategy: str, clients: int, kind: str, **metrics: tuple[float, float, float]) -> Row:
    return Row(strategy, clients, kind, 3, {k: Spread(*v) for k, v in metrics.items()})


def test_a_margin_inside_the_spread_is_called_noise() -> None:
    rows = [
        _row("time-slicing", 4, "batch", completion_s=(5.0, 4.6, 5.4)),
        _row("mps", 4, "batch", completion_s=(4.9, 4.5, 5.3)),
    ]
    (b,) = recommend(rows, 80000)
    assert b.strategy == "mps" and b.noise and "within the spread" in b.line()


def test_time_slicing_wins_where_it_measured_best() -> None:
    rows = [
        _row("time-slicing", 2, "heavy", throughput=(700, 699, 701)),
        _row("mps", 2, "heavy", throughput=(600, 599, 601)),
        _row("mps-limits", 2, "heavy", throughput=(650, 649, 651)),
    ]
    (h,) = recommend(rows, 80000)
    assert (h.strategy, h.versus) == ("time-slicing", "mps-limits")  # the runner-up
    assert h.margin_pct == pytest.approx(7.7, abs=0.05)


def test_light_picks_the_lowest_p99_when_none_holds_latency() -> None:
    rows = [
        _row("dedicated", 1, "light", p99_ms=(1.0, 1.0, 1.0), busy_pct=(2, 2, 2)),
        _row("time-slicing", 4, "light", p99_ms=(3.0, 2.9, 3.1), busy_pct=(30, 30, 30)),
        _row("mps", 4, "light", p99_ms=(2.0, 1.9, 2.1), busy_pct=(10, 10, 10)),
    ]
    (li,) = recommend(rows, 80000)
    assert li.strategy == "mps" and li.margin_pct is None
    assert "none kept p99 within 25% of 1.00 ms alone" in li.line()


def test_light_prefers_the_least_busy_among_those_that_hold_latency() -> None:
    rows = [
        _row("dedicated", 1, "light", p99_ms=(1.0, 1.0, 1.0)),
        _row("time-slicing", 2, "light", p99_ms=(1.1, 1.1, 1.1), busy_pct=(5, 5, 5)),
        _row("mps", 2, "light", p99_ms=(2.0, 2.0, 2.0), busy_pct=(1, 1, 1)),  # least busy, but latency did not hold
    ]
    (li,) = recommend(rows, 80000)
    assert (li.strategy, li.versus) == ("time-slicing", "mps")


def test_memory_is_recommended_only_where_a_limit_held_each_client() -> None:
    gib = 1024
    even = {"mem_min_mib": (40 * gib,) * 3, "mem_max_mib": (40 * gib,) * 3}
    rows = [
        _row("time-slicing", 2, "memory", **even),  # equal by chance: nothing enforced it
        _row("mps-limits", 2, "memory", mem_min_mib=(39 * gib,) * 3, mem_max_mib=(39 * gib,) * 3),
    ]
    (m,) = recommend(rows, 80 * gib)
    assert m.strategy == "mps-limits" and "39–39 GiB of 40 GiB" in m.line()
    over = [
        _row("time-slicing", 2, "memory", mem_min_mib=(20 * gib,) * 3, mem_max_mib=(60 * gib,) * 3),
        _row("mps-limits", 2, "memory", mem_min_mib=(20 * gib,) * 3, mem_max_mib=(60 * gib,) * 3),  # not enforced
    ]
    (m,) = recommend(over, 80 * gib)
    assert m.strategy is None and "no strategy held each client to its share (40 GiB)" in m.line()
    assert "one client took 60 GiB" in m.line()


def test_a_failed_strategy_is_never_recommended() -> None:
    rows = [
        _row("time-slicing", 2, "batch", completion_s=(3.0, 3.0, 3.0)),
        Row("mps", 2, "batch", 1, {"completion_s": Spread(1.0, 1.0, 1.0)}, ("client 1: CUDA error",)),
    ]
    (b,) = recommend(rows, 80000)
    assert b.strategy == "time-slicing"
