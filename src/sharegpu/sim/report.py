"""Reports of simulation runs: a rich table, a JSON document and a PNG plot — of allocation against arrived demand
for the FGD protocol, of queueing figures and allocation and pending pods over time for a replay."""

from __future__ import annotations

import dataclasses
import json
import statistics
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console, RenderableType
from rich.measure import Measurement
from rich.table import Column, Table
from rich.text import Text

from sharegpu.sim.engine import RunResult
from sharegpu.sim.mps_rules import run_label


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
    seeds_100: int = 0  # runs whose arrivals reached 100 % of capacity (the others have no value there)
    seeds_130: int = 0
    # Spread over the seeds that reached the level: (min, max, standard deviation; 0 for one seed).
    spread_100: tuple[float, float, float] | None = None
    spread_130: tuple[float, float, float] | None = None

    @property
    def unalloc_100(self) -> float | None:
        return None if self.alloc_100 is None else 100 - self.alloc_100


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def _spread(values: Sequence[float | None]) -> tuple[float, float, float] | None:
    present = [v for v in values if v is not None]
    if not present:
        return None
    return min(present), max(present), statistics.stdev(present) if len(present) > 1 else 0.0


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
                sum(r.alloc_at(100) is not None for r in rs),
                sum(r.alloc_at(130) is not None for r in rs),
                _spread([r.alloc_at(100) for r in rs]),
                _spread([r.alloc_at(130) for r in rs]),
            )
        )
    return out


def _fmt(v: float | None, digits: int = 2) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def _level(mean: float | None, reached: int, seeds: int) -> str:
    """A level's mean, marked with how many seeds reached it when some did not."""
    return _fmt(mean) if reached == seeds or mean is None else f"{_fmt(mean)} ({reached}/{seeds})"


@dataclass(frozen=True)
class Paired:
    """One policy against another seed by seed at one arrived level: both saw the same arrivals for a seed, so the
    per-seed difference says more than two means whose spreads overlap."""

    policy: str
    rival: str
    level: int
    seeds: int
    ahead: int
    behind: int
    mean_diff_pp: float

    def __str__(self) -> str:
        return (
            f"{self.policy} against {self.rival} at {self.level} %, seed by seed (the same arrivals): ahead on "
            f"{self.ahead} of {self.seeds} seeds, behind on {self.behind}, mean {self.mean_diff_pp:+.2f} pp"
        )


DEFAULT_POLICY = "sharegpu"


def paired(runs: Sequence[RunResult], policy: str = DEFAULT_POLICY, level: int = 100) -> Paired | None:
    """``policy`` against the best other policy (highest mean at ``level``) over the seeds both reached it with;
    None when there is no such rival or fewer than two such seeds (one seed ranks nothing)."""
    mine = {r.seed: r.alloc_at(level) for r in runs if r.policy == policy}
    others = [s for s in summarize(runs) if s.policy != policy and s.alloc_100 is not None]
    if not mine or not others:
        return None
    rival = max(others, key=lambda s: s.alloc_100 or 0.0).policy
    theirs = {r.seed: r.alloc_at(level) for r in runs if r.policy == rival}
    diffs = [a - b for seed, a in mine.items() if a is not None and (b := theirs.get(seed)) is not None]
    if len(diffs) < 2:
        return None
    return Paired(
        policy,
        rival,
        level,
        len(diffs),
        sum(d > 0 for d in diffs),
        sum(d < 0 for d in diffs),
        statistics.fmean(diffs),
    )


def above_arrived(runs: Sequence[RunResult]) -> bool:
    """Whether some run allocated more GPU than had arrived at some level (beyond the curve's rounding)."""
    return any(v is not None and v > x + 1 for r in runs for x, v in enumerate(r.curve))


ABOVE_ARRIVED = (
    "allocation counts what placed pods hold: a MIG share holds its whole instance, and the GPU memory a pod asks "
    "for can need a larger MIG profile than the compute it asks for, so allocation can run above arrived demand"
)


def _last_level(runs: Sequence[RunResult]) -> int:
    return max((x for r in runs for x, v in enumerate(r.curve) if v is not None), default=0)


def _column(t: Table, header: str, summaries: Sequence[PolicySummary]) -> None:
    # Never wrapped and never cut: a table too wide for the terminal is split by columns (fit_tables).
    t.add_column(header, justify="left" if header == "policy" else "right", no_wrap=True)


def fit_tables(console: Console, t: Table) -> list[RenderableType]:
    """``t`` as it is when it fits ``console``'s width; otherwise split into tables of fewer columns, each repeating
    the first (the row's name), so that no name or number is cut to "…" or folded mid-number. The title goes on the
    first; the caption follows the last at the console's whole width."""
    if _natural_width(console, t) <= console.width or len(t.columns) < 3:
        return [t]
    first, rest = t.columns[0], t.columns[1:]
    groups: list[list[Column]] = [[]]
    for column in rest:
        trial = _part(t, first, [*groups[-1], column], None)
        if groups[-1] and _natural_width(console, trial) > console.width:
            groups.append([])
        groups[-1].append(column)
    parts: list[RenderableType] = [_part(t, first, g, t.title if i == 0 else None) for i, g in enumerate(groups)]
    if t.caption:
        parts.append(Text(str(t.caption), style="table.caption"))
    return parts


def _natural_width(console: Console, t: Table) -> int:
    """The width ``t`` takes with room to spare (a console's own measure stops at its width)."""
    return Measurement.get(console, console.options.update_width(100_000), t).maximum


def _part(t: Table, first: Column, columns: Sequence[Column], title: Any) -> Table:
    part = Table(title=title, box=t.box, pad_edge=t.pad_edge)
    for c in (first, *columns):
        part.add_column(c.header, justify=c.justify, no_wrap=c.no_wrap, overflow=c.overflow, min_width=c.min_width)
    for row in zip(*(list(c.cells) for c in (first, *columns)), strict=True):
        part.add_row(*row)
    return part


def table(runs: Sequence[RunResult], title: str, total_gpus: int) -> Table:
    if runs and all(r.replay is not None for r in runs):
        return replay_table(runs, title)
    summaries = summarize(runs)
    several = any(s.seeds > 1 for s in summaries)
    notes = [
        "alloc: allocated GPU % of capacity when arrived demand is 100 % / 130 % (mean over seeds)"
        + ("; range: lowest–highest seed at 100 %" if several else "")
        + "; unalloc: GPUs left idle at 100 %; frag: GPU the typical workload cannot use, at the end; failed: "
        "pods that found no node with room when they arrived, never retried (mean over seeds); wall s: seconds one run took (mean over "
        "seeds); p50, p99: decision latency in ms"
    ]
    partial = any(0 < s.seeds_130 < s.seeds or 0 < s.seeds_100 < s.seeds for s in summaries)
    if partial:
        notes.append(
            "(k/n): only k of the n seeds' workloads reached that level (the mean is theirs, so it is not "
            "comparable with the other column): each workload stops one pod short of --tune × capacity, so raise "
            "--tune a little"
        )
    if any(s.alloc_100 is None or s.alloc_130 is None for s in summaries):
        notes.append(
            f"—: no seed's workload reached that level (arrived demand stopped at {_last_level(runs)} % of "
            "capacity): raise --tune to at least the level"
        )
    if above_arrived(runs):
        notes.append(ABOVE_ARRIVED)
    vs = paired(runs)
    if vs is not None:
        notes.append(str(vs))
    t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, caption="; ".join(notes))
    columns = ["policy", "seeds", "alloc@100", *(["range@100"] if several else []), "alloc@130", "unalloc"]
    for col in (*columns, "frag%", "failed", "wall s", "p50", "p99"):
        _column(t, col, summaries)
    for s in summaries:
        unalloc = None if s.unalloc_100 is None else s.unalloc_100 * total_gpus / 100
        spread = [] if not several else ["—" if s.spread_100 is None else "{:.2f}–{:.2f}".format(*s.spread_100)]
        t.add_row(
            s.policy,
            str(s.seeds),
            _level(s.alloc_100, s.seeds_100, s.seeds),
            *spread,
            _level(s.alloc_130, s.seeds_130, s.seeds),
            _fmt(unalloc, 1),
            _fmt(s.fragmentation_pct),
            f"{s.failed:.0f}",
            f"{s.wall_s:.2f}",
            f"{s.p50_ms:.3f}",
            f"{s.p99_ms:.3f}",
        )
    return t


REPLAY_FIGURES = ("waited", "never_placed", "peak_pending", "mean_alloc_pct")
# A priority replay's own figures (sim.replay), and their columns.
PRIORITY_FIGURES = ("high_wait_p50_s", "high_wait_p95_s", "high_never_placed", "evictions", "moves")
PRIORITY_COLUMNS = ("hi p50 s", "hi p95 s", "hi never", "evicted", "moves")
PRIORITY_CAPTION = (
    "hi p50 s, hi p95 s: waiting time of the high-priority pods, seconds of trace time from creation to first start "
    "(a pod never placed counts until the end); hi never: high-priority pods never placed; evicted: preemption "
    "victims; moves: pods consolidation moved; decision latency left out"
)


def _replay_mean(rs: Sequence[RunResult], key: str) -> float:
    return statistics.fmean((r.replay or {}).get(key, 0.0) for r in rs)


def replay_table(runs: Sequence[RunResult], title: str) -> Table:
    """Replay's own figures, mean over seeds: pods that waited in the pending queue, pods never placed, the
    largest queue, and allocation averaged over the replay's events."""
    t = Table(
        title=title,
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        caption="replay of creation and deletion times, mean over seeds: waited: pods that found no room on arrival "
        "and queued; never placed: still pending at the end or dropped; peak pending: largest queue; mean alloc: "
        "allocated GPU % of capacity averaged over events; final alloc: at the end; wall s: seconds one run took; "
        "p50, p99: decision latency in ms",
    )
    prio = all("high_pods" in (r.replay or {}) for r in runs)
    if prio:
        t.caption = f"{t.caption}; {PRIORITY_CAPTION}"
    summaries = summarize(runs)
    for col in ("policy", "seeds", "waited", "never placed", "peak pending", "mean alloc", "final alloc", "wall s"):
        _column(t, col, summaries)
    for col in PRIORITY_COLUMNS if prio else ("p50", "p99"):
        _column(t, col, summaries)
    for s in summaries:
        rs = [r for r in runs if r.policy == s.policy]
        extra = [f"{_replay_mean(rs, k):,.0f}" for k in PRIORITY_FIGURES] if prio else []
        t.add_row(
            s.policy,
            str(s.seeds),
            f"{_replay_mean(rs, 'waited'):,.0f}",
            f"{statistics.fmean(r.failed for r in rs):,.0f}",
            f"{_replay_mean(rs, 'peak_pending'):,.0f}",
            _fmt(_replay_mean(rs, "mean_alloc_pct")),
            _fmt(statistics.fmean(r.final_alloc_pct for r in rs)),
            f"{s.wall_s:.2f}",
            *(extra if prio else [f"{s.p50_ms:.3f}", f"{s.p99_ms:.3f}"]),
        )
    return t


PLOT_SOFTWARE = "sharegpu sim"  # the plot's PNG Software text, by which a rerun tells the plot as its own
REPORT_KEYS = frozenset({"experiment", "runs", "summary"})


def is_report(path: Path) -> bool:
    """Whether ``path`` is a file ``sim`` wrote: a JSON report (an object with the keys of :func:`write_json`) or a
    plot (a PNG whose Software text is :data:`PLOT_SOFTWARE`); a rerun may replace it, any other file it refuses."""
    try:
        with path.open("rb") as f:
            head = f.read(4096)
            if head.startswith(b"\x89PNG\r\n\x1a\n"):
                return b"tEXtSoftware\x00" + PLOT_SOFTWARE.encode() in head
            if not head.lstrip().startswith(b"{"):
                return False
            doc = json.loads(head + f.read())
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and doc.keys() >= REPORT_KEYS


def write_json(path: Path, runs: Sequence[RunResult], meta: dict[str, object]) -> None:
    """The JSON report: ``meta``, every run and a summary per policy; with several MPS rules, a summary per rule and
    policy (each entry names its rule), the paired comparison per rule and the rules side by side."""
    rules = mps_rules_of(runs)
    groups = [(rule, [r for r in runs if r.mps_rule == rule]) for rule in rules] if len(rules) > 1 else [(None, runs)]
    doc: dict[str, object] = dict(meta)
    if len(rules) > 1:
        doc["paired_at_100_by_mps_rule"] = {
            rule: dataclasses.asdict(vs) for rule, rs in groups if rule and (vs := paired(rs)) is not None
        }
        doc["mps_rule_comparison"] = [dataclasses.asdict(row) for row in rule_comparison(runs)]
    elif (vs := paired(runs)) is not None:
        doc["paired_at_100"] = dataclasses.asdict(vs)
    doc["runs"] = [r.to_dict() for r in runs]
    doc["summary"] = [
        {
            **({"mps_rule": rule} if rule is not None else {}),
            "policy": s.policy,
            "seeds": s.seeds,
            "mean_alloc_pct_at_arrived": {"100": s.alloc_100, "130": s.alloc_130},
            # The means above are over the seeds whose workload reached the level.
            "seeds_reaching_arrived": {"100": s.seeds_100, "130": s.seeds_130},
            "alloc_pct_spread_at_arrived": {
                level: None if sp is None else {"min": sp[0], "max": sp[1], "stdev": round(sp[2], 3)}
                for level, sp in (("100", s.spread_100), ("130", s.spread_130))
            },
            "median_wall_s": s.wall_s,
            **_replay_summary([r for r in rs if r.policy == s.policy]),
        }
        for rule, rs in groups
        for s in summarize(rs)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


def mps_rules_of(runs: Sequence[RunResult]) -> list[str]:
    """The MPS rules the runs ran under, in run order (none where no run says)."""
    rules: list[str] = []
    for r in runs:
        if r.mps_rule is not None and r.mps_rule not in rules:
            rules.append(r.mps_rule)
    return rules


@dataclass(frozen=True)
class RuleRow:
    """One policy under one MPS rule, against the same policy under the reference rule seed by seed (the same
    arrivals and the same drawn users for a seed, so the per-seed difference is the rule's own)."""

    policy: str
    mps_rule: str
    figure: str  # what the values are: allocation at arrived 100 % (FGD protocol), or mean allocation (replay)
    seeds: int
    mean: float | None
    low: float | None
    high: float | None
    alloc_130: float | None
    failed: float
    wall_s: float
    reference: str
    diff_pp: float | None  # mean over the seeds of (this rule − the reference), percentage points
    behind: int  # seeds on which this rule allocated less than the reference
    compared: int  # seeds both have a value for
    worst_pp: float | None  # the most negative per-seed difference (or the least positive)


def _figure(r: RunResult) -> float | None:
    if r.replay is not None:
        return r.replay.get("mean_alloc_pct")
    return r.alloc_at(100)


def rule_comparison(runs: Sequence[RunResult]) -> list[RuleRow]:
    """Every policy under every MPS rule of ``runs``, policy by policy, against the rule ``none`` (or the first rule
    when ``none`` did not run)."""
    rules = mps_rules_of(runs)
    if not rules:
        return []
    reference = "none" if "none" in rules else rules[0]
    replay = any(r.replay is not None for r in runs)
    figure = "mean_alloc_pct" if replay else "alloc_pct_at_arrived_100"
    rows = []
    for policy in dict.fromkeys(r.policy for r in runs):
        ref = {r.seed: _figure(r) for r in runs if r.policy == policy and r.mps_rule == reference}
        for rule in rules:
            rs = [r for r in runs if r.policy == policy and r.mps_rule == rule]
            if not rs:
                continue
            values = [v for r in rs if (v := _figure(r)) is not None]
            diffs = [v - b for r in rs if (v := _figure(r)) is not None and (b := ref.get(r.seed)) is not None]
            rows.append(
                RuleRow(
                    policy,
                    rule,
                    figure,
                    len(rs),
                    statistics.fmean(values) if values else None,
                    min(values, default=None),
                    max(values, default=None),
                    _mean([r.alloc_at(130) for r in rs]),
                    statistics.fmean(r.failed for r in rs),
                    statistics.median(r.wall_s for r in rs),
                    reference,
                    statistics.fmean(diffs) if diffs else None,
                    sum(d < 0 for d in diffs),
                    len(diffs),
                    min(diffs, default=None),
                )
            )
    return rows


def rules_table(runs: Sequence[RunResult], title: str, described: dict[str, str] | None = None) -> Table:
    """The MPS rules side by side: a row per policy and rule, with the difference from the reference rule seed by
    seed. ``described``: a rule's words for the caption."""
    rows = rule_comparison(runs)
    replay = bool(rows) and rows[0].figure == "mean_alloc_pct"
    head = "mean alloc" if replay else "alloc@100"
    reference = rows[0].reference if rows else "none"
    notes = [
        f"{head}: "
        + (
            "allocated GPU % of capacity averaged over the replay (mean over seeds)"
            if replay
            else "allocated GPU % of capacity at arrived 100 % (mean over seeds)"
        )
        + f"; range: lowest–highest seed; vs {reference}: the same policy under rule {reference} on the same arrivals "
        "and drawn users, seed by seed (mean pp; behind: seeds with less allocated; worst: the worst seed's pp); "
        + (
            "never placed: pods still pending at the end or dropped"
            if replay
            else "failed: pods placed nowhere on arrival"
        )
        + " (mean)"
    ]
    if described:
        notes.append("rules: " + "; ".join(f"{rule}: {words}" for rule, words in described.items()))
    t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, caption="; ".join(notes))
    for col in ("policy", "MPS rule", "seeds", head, "range", *(() if replay else ("alloc@130",))):
        t.add_column(col, justify="left" if col in ("policy", "MPS rule") else "right", no_wrap=True)
    for col in (f"vs {reference}", "behind", "worst", "never placed" if replay else "failed", "wall s"):
        t.add_column(col, justify="right", no_wrap=True)
    for row in rows:
        own = row.mps_rule == row.reference
        spread = "—" if row.low is None or row.high is None else f"{row.low:.2f}–{row.high:.2f}"
        t.add_row(
            row.policy,
            row.mps_rule,
            str(row.seeds),
            _fmt(row.mean),
            spread,
            *(() if replay else (_fmt(row.alloc_130),)),
            "—" if own or row.diff_pp is None else f"{row.diff_pp:+.2f}",
            "—" if own else f"{row.behind} of {row.compared}",
            "—" if own or row.worst_pp is None else f"{row.worst_pp:+.2f}",
            f"{row.failed:.0f}",
            f"{row.wall_s:.2f}",
        )
    return t


def _replay_summary(rs: Sequence[RunResult]) -> dict[str, object]:
    if not rs or any(r.replay is None for r in rs):
        return {}
    keys = REPLAY_FIGURES + (PRIORITY_FIGURES if all("high_pods" in (r.replay or {}) for r in rs) else ())
    return {"mean_replay": {k: round(_replay_mean(rs, k), 2) for k in keys}}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    return plt


def _all_seeds_curve(rs: Sequence[RunResult], start: int = 0) -> tuple[list[int], list[float]]:
    """Mean allocation at each arrived level that every seed reached: a level some seeds never reached would
    average the others only, and the line would seem to fall as demand rises."""
    xs, ys = [], []
    for x in range(start, len(rs[0].curve)):
        values = [r.curve[x] for r in rs]
        if all(v is not None for v in values):
            xs.append(x)
            ys.append(statistics.fmean(v for v in values if v is not None))
    return xs, ys


def write_plot(path: Path, runs: Sequence[RunResult], title: str) -> None:
    """Mean allocation % against arrived % per policy (one line each), as in the FGD paper's Fig. 7; a replay
    gets :func:`write_replay_plot` instead. A line ends at the last level that all its seeds reached; with several
    MPS rules a line is a policy under a rule."""
    runs = plot_labels(runs)
    if runs and all(r.timeline is not None for r in runs):
        write_replay_plot(path, runs, title)
        return
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    summaries = summarize(runs)
    policies = [s.policy for s in summaries]
    for s in summaries:
        rs = [r for r in runs if r.policy == s.policy]
        xs, ys = _all_seeds_curve(rs)
        ended = max((i for i, v in enumerate(rs[0].curve) if v is not None), default=0)
        label = s.policy if not xs or xs[-1] >= ended else f"{s.policy} (all {s.seeds} seeds up to {xs[-1]} %)"
        ax.plot(xs, ys, label=label, linewidth=1.4)
    ax.plot([0, 100], [0, 100], color="grey", linestyle=":", linewidth=0.8, label="every pod placed as it asked")
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
        xs, ys = _all_seeds_curve([r for r in runs if r.policy == p], start=80)
        inset.plot(xs, ys)
    inset.set_xlim(80, 130)
    inset.grid(alpha=0.3)
    inset.tick_params(labelsize=7)
    notes = [f"lines: mean over {max(s.seeds for s in summaries)} seed(s)"] if summaries else []
    if above_arrived(runs):
        notes.append(f"above the dotted line: {ABOVE_ARRIVED}")
    if notes:
        # Below the axes, so that it reads as the plot's caption rather than a label of some line.
        fig.text(0.01, -0.02, "\n".join(textwrap.wrap("; ".join(notes), 110)), fontsize=7.5, va="top")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight", metadata={"Software": PLOT_SOFTWARE})
    plt.close(fig)


def _mean_timeline(rs: Sequence[RunResult]) -> tuple[Any, Any, Any]:
    """Seeds of one policy on one time axis (hours): step values at the union of their sample times, averaged."""
    import numpy as np

    lines = [r.timeline for r in rs if r.timeline is not None and r.timeline.time_s]
    if not lines:
        return np.zeros(0), np.zeros(0), np.zeros(0)
    grid = np.unique(np.concatenate([np.asarray(t.time_s) for t in lines]))
    alloc, pending = [], []
    for t in lines:
        idx = np.clip(np.searchsorted(np.asarray(t.time_s), grid, side="right") - 1, 0, None)
        alloc.append(np.asarray(t.alloc_pct)[idx])
        pending.append(np.asarray(t.pending)[idx])
    return (grid - grid[0]) / 3600, np.mean(alloc, axis=0), np.mean(pending, axis=0)


def write_replay_plot(path: Path, runs: Sequence[RunResult], title: str) -> None:
    """Allocated GPU % (top) and pods pending (bottom) against trace time, one line per policy (mean of seeds)."""
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), dpi=120, sharex=True, height_ratios=(3, 2))
    for s in summarize(runs):
        hours, alloc, pending = _mean_timeline([r for r in runs if r.policy == s.policy])
        top.step(hours, alloc, where="post", label=s.policy, linewidth=1.2)
        bottom.step(hours, pending, where="post", label=s.policy, linewidth=1.2)
    top.set_ylabel("allocated GPU, % of cluster GPUs")
    top.set_ylim(bottom=0)  # not 0-100: a lightly loaded replay would be a flat line at the bottom
    top.set_title(title)
    top.grid(alpha=0.3)
    top.legend(loc="lower right")
    bottom.set_ylabel("pods pending")
    bottom.set_xlabel("trace time, hours from the first event")
    bottom.set_ylim(bottom=0)
    bottom.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight", metadata={"Software": PLOT_SOFTWARE})
    plt.close(fig)


def print_table(
    console: Console, runs: Sequence[RunResult], title: str, total_gpus: int, described: dict[str, str] | None = None
) -> None:
    """The runs' table; with several MPS rules, one table per rule and then the rules side by side."""
    rules = mps_rules_of(runs)
    if len(rules) <= 1:
        for part in fit_tables(console, table(runs, title, total_gpus)):
            console.print(part)
        return
    for rule in rules:
        words = (described or {}).get(rule, rule)
        subset = [r for r in runs if r.mps_rule == rule]
        for part in fit_tables(console, table(subset, f"{title}; MPS rule {rule}: {words}", total_gpus)):
            console.print(part)
    for part in fit_tables(console, rules_table(runs, f"{title}: MPS rules side by side", described)):
        console.print(part)


def plot_labels(runs: Sequence[RunResult]) -> list[RunResult]:
    """``runs`` named for a plot: with several MPS rules each line is a policy under a rule."""
    if len(mps_rules_of(runs)) <= 1:
        return list(runs)
    return [dataclasses.replace(r, policy=run_label(r.policy, r.mps_rule)) for r in runs]
