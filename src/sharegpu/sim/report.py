"""Reports of simulation runs: a rich table, a JSON document and a PNG plot of allocation vs arrived."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from sharegpu.sim.engine import RunResult


@dataclass(frozen=True)
class PolicySummary:
    policy: str
    seeds: int
    alloc_100: float | None
    alloc_130: float | None
    wall_s: float
    p50_ms: float
    p99_ms: float
    failed: float
    fragmentation_pct: float | None

    @property
    def unalloc_100(self) -> float | None:
        return None if self.alloc_100 is None else 100 - self.alloc_100


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def summarize(runs: Sequence[RunResult]) -> list[PolicySummary]:
    order: list[str] = []
    for r in runs:
        if r.policy not in order:
            order.append(r.policy)
    out = []
    for p in order:
        rs = [r for r in runs if r.policy == p]
        out.append(
            PolicySummary(
                p,
                len(rs),
                _mean([r.alloc_at(100) for r in rs]),
                _mean([r.alloc_at(130) for r in rs]),
                statistics.median(r.wall_s for r in rs),
                statistics.median(r.latency_p50_ms for r in rs),
                statistics.median(r.latency_p99_ms for r in rs),
                statistics.fmean(r.failed for r in rs),
                _mean([r.fragmentation_pct for r in rs]),
            )
        )
    return out


def _fmt(v: float | None, digits: int = 2) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def table(runs: Sequence[RunResult], title: str, total_gpus: int) -> Table:
    t = Table(
        title=title,
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        caption="alloc: allocated GPU % of capacity when arrived demand is 100 % / 130 %; unalloc: GPUs left "
        "idle at 100 %; frag: GPU the typical workload cannot use, at the end; decision latency in ms",
    )
    for col in ("policy", "seeds", "alloc@100", "alloc@130", "unalloc", "frag%", "failed", "wall s", "p50", "p99"):
        t.add_column(col, justify="left" if col == "policy" else "right", no_wrap=True)
    for s in summarize(runs):
        unalloc = None if s.unalloc_100 is None else s.unalloc_100 * total_gpus / 100
        t.add_row(
            s.policy,
            str(s.seeds),
            _fmt(s.alloc_100),
            _fmt(s.alloc_130),
            _fmt(unalloc, 1),
            _fmt(s.fragmentation_pct),
            f"{s.failed:.0f}",
            f"{s.wall_s:.2f}",
            f"{s.p50_ms:.3f}",
            f"{s.p99_ms:.3f}",
        )
    return t


def write_json(path: Path, runs: Sequence[RunResult], meta: dict[str, object]) -> None:
    doc = {
        **meta,
        "runs": [r.to_dict() for r in runs],
        "summary": [
            {
                "policy": s.policy,
                "seeds": s.seeds,
                "mean_alloc_pct_at_arrived": {"100": s.alloc_100, "130": s.alloc_130},
                "median_wall_s": s.wall_s,
            }
            for s in summarize(runs)
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


def write_plot(path: Path, runs: Sequence[RunResult], title: str) -> None:
    """Mean allocation % against arrived % per policy (one line each), as in the FGD paper's Fig. 7."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    policies = [s.policy for s in summarize(runs)]
    for p in policies:
        rs = [r for r in runs if r.policy == p]
        xs, ys = [], []
        for x in range(len(rs[0].curve)):
            m = _mean([r.curve[x] for r in rs])
            if m is not None:
                xs.append(x)
                ys.append(m)
        ax.plot(xs, ys, label=p, linewidth=1.4)
    ax.plot([0, 100], [0, 100], color="grey", linestyle=":", linewidth=0.8, label="all placed")
    ax.set_xlabel("arrived GPU demand, % of cluster GPUs")
    ax.set_ylabel("allocated GPU, % of cluster GPUs")
    ax.set_title(title)
    ax.set_xlim(0, 130)
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    # Inset: the region where policies differ.
    inset = ax.inset_axes((0.07, 0.6, 0.34, 0.35))
    for p in policies:
        rs = [r for r in runs if r.policy == p]
        points = [(x, _mean([r.curve[x] for r in rs])) for x in range(80, len(rs[0].curve))]
        kept = [(x, y) for x, y in points if y is not None]
        inset.plot([x for x, _ in kept], [y for _, y in kept])
    inset.set_xlim(80, 130)
    inset.grid(alpha=0.3)
    inset.tick_params(labelsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def print_table(console: Console, runs: Sequence[RunResult], title: str, total_gpus: int) -> None:
    console.print(table(runs, title, total_gpus))
