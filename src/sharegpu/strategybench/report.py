"""The benchmark's outputs: the terminal table, the JSON file and the PNG plot, all from the same rows."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from sharegpu.strategybench.recommend import Recommendation
from sharegpu.strategybench.results import STRATEGY_TITLES, UNITS, Row, Spread

SCHEMA_VERSION = 1


def cell(s: Spread | None, fmt: str = "{:.2f}") -> str:
    """``1.57`` for one repetition or equal ones, ``1.57 (1.49–1.81)`` with the min–max spread."""
    if s is None:
        return "-"
    v = fmt.format(s.value)
    lo, hi = fmt.format(s.lo), fmt.format(s.hi)
    return v if lo == hi else f"{v} ({lo}–{hi})"


def _mem(r: Row) -> str:
    lo, hi = r.get("mem_min_mib"), r.get("mem_max_mib")
    if lo is None or hi is None:
        return "-"
    a, b = lo.value / 1024, hi.value / 1024
    return f"{a:.0f}" if round(a) == round(b) else f"{a:.0f}–{b:.0f}"


def table(rows: Sequence[Row], title: str) -> Table:
    t = Table(title=title, title_justify="left", header_style="bold", pad_edge=False)
    for h, just in (
        ("workload", "left"),
        ("strategy", "left"),
        ("clients", "right"),
        ("p50 ms", "right"),
        ("p99 ms", "right"),
        ("throughput", "right"),
        ("unit", "left"),
        ("completion s", "right"),
        ("GPU busy %", "right"),
        ("GiB/client", "right"),
    ):
        t.add_column(h, justify=just, no_wrap=True)  # type: ignore[arg-type]
    for kind in ("light", "heavy", "batch", "memory"):
        kind_rows = [r for r in rows if r.kind == kind]
        for r in kind_rows:
            if r.errors and not r.metrics:
                err = r.errors[0]
                t.add_row(kind, STRATEGY_TITLES[r.strategy], str(r.clients), f"[red]failed: {escape(err[:90])}[/]")
                continue
            tp = r.get("throughput")
            t.add_row(
                kind,
                STRATEGY_TITLES[r.strategy],
                str(r.clients),
                cell(r.get("p50_ms")),
                cell(r.get("p99_ms")),
                cell(tp, "{:.0f}" if kind != "batch" else "{:.2f}"),
                UNITS[kind] if tp else "",
                cell(r.get("completion_s")),
                cell(r.get("busy_pct"), "{:.1f}"),
                _mem(r),
            )
        if kind_rows:
            t.add_section()
    return t


def print_report(
    console: Console, rows: Sequence[Row], recs: Sequence[Recommendation], title: str, notes: Sequence[str]
) -> None:
    console.print(table(rows, title))
    for n in notes:
        console.print(n, markup=False)
    if not recs:  # a heading with nothing under it said nothing: say why there is none
        console.print(
            "no recommendation: one is made from sharing strategies measured with 2 or more clients, and none was "
            "(--clients, --strategies)",
            markup=False,
        )
        return
    console.print("[bold]recommendation[/] (measured here):")
    for r in recs:
        console.print(f"  {r.line()}", markup=False)


def to_json(
    rows: Sequence[Row],
    recs: Sequence[Recommendation],
    meta: dict[str, Any],
    measurements: Sequence[dict[str, Any]],
) -> dict[str, Any]:
    return {
        "version": SCHEMA_VERSION,
        **meta,
        "rows": [r.to_json() for r in rows],
        "recommendations": [r.to_json() for r in recs],
        "measurements": list(measurements),
    }


def write_json(path: Path, doc: dict[str, Any]) -> None:
    path.write_text(json.dumps(doc, indent=1) + "\n")


def load_rows(doc: dict[str, Any]) -> list[Row]:
    return [Row.from_json(r) for r in doc["rows"]]


PANELS = (  # workload, metric, title, scale of the metric's value
    ("light", "p99_ms", "light: p99 latency (ms)", 1.0),
    ("light", "busy_pct", "light: GPU busy (%)", 1.0),
    ("heavy", "throughput", "heavy: throughput (TFLOP/s, summed)", 1.0),
    ("batch", "completion_s", "batch: completion of the last job (s)", 1.0),
    ("memory", "mem_max_mib", "memory: most one client got (GiB)", 1 / 1024),
)


def write_plot(path: Path, rows: Sequence[Row], title: str) -> list[str]:
    """One panel per figure that decides a recommendation and was measured (a workload not run, or whose every run
    failed, has none): bars per strategy, grouped by client count, with the min–max spread as error bars. Returns
    the panels' titles; with none, no file is written (and an earlier run's plot at ``path`` is removed, as it
    would be replaced)."""
    panels = [p for p in PANELS if any(r.kind == p[0] and r.get(p[1]) is not None for r in rows)]
    if not panels:
        path.unlink(missing_ok=True)
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    strategies = [s for s in STRATEGY_TITLES if any(r.strategy == s for r in rows)]
    width = 0.8 / max(1, len(strategies))
    for ax, (kind, metric, label, scale) in zip(axes[0], panels, strict=True):
        counts = sorted({r.clients for r in rows if r.kind == kind and r.get(metric) is not None})
        for i, s in enumerate(strategies):
            xs, ys, lo, hi = [], [], [], []
            for j, n in enumerate(counts):
                r = next((r for r in rows if (r.strategy, r.clients, r.kind) == (s, n, kind)), None)
                v = r.get(metric) if r else None
                if v is None:
                    continue
                xs.append(j + (i - (len(strategies) - 1) / 2) * width)
                ys.append(v.value * scale)
                lo.append((v.value - v.lo) * scale)
                hi.append((v.hi - v.value) * scale)
            if xs:
                ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=STRATEGY_TITLES[s])
        ax.set_xticks(range(len(counts)), [f"×{n}" for n in counts])
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("clients", fontsize=8)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [label for _, _, label, _ in panels]
