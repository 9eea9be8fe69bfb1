"""Which strategy to use per workload kind, from what was measured, with the measured reason.

Rules (docs/bench.md): for each kind, at the largest client count where two or more sharing strategies were
measured —
- batch: the shortest completion of the last job; the margin is how much longer the runner-up took;
- heavy: the highest summed throughput; the margin is its gain over the runner-up;
- light: latency must hold — among the strategies whose p99 is within ``LIGHT_P99_SLACK`` of the dedicated GPU's
  (or the best p99, without a dedicated run), the one that keeps the GPU least busy (room left for more clients);
- memory: a strategy that enforces a share (MPS with limits, MIG) and held every client to it (none got more than ``1 + MEMORY_SLACK`` times the
  unit's memory divided by the client count, none less than ``MEMORY_FLOOR`` of it) isolates memory; among
  those, the one whose clients got the most. Without one, nothing isolated memory here.
A margin smaller than the spread of the two (their min–max ranges overlap) is said to be within the noise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from sharegpu.strategybench.results import STRATEGY_TITLES, Row, Spread, find

LIGHT_P99_SLACK = 0.25
MEMORY_SLACK = 0.05
MEMORY_FLOOR = 0.5  # a client's context and the probe's 1 GiB chunks take some of its share
SHARING = ("time-slicing", "mps", "mps-limits", "mig")
ENFORCING = ("mps-limits", "mig")  # the strategies that hold a client to a memory share; the others may by chance


@dataclass(frozen=True, slots=True)
class Recommendation:
    kind: str
    clients: int
    strategy: str | None  # None: nothing measured qualifies (the reason says why)
    margin_pct: float | None  # how much better than ``versus`` (positive: better)
    versus: str | None
    noise: bool  # the margin is within the repetitions' spread
    reason: str

    def line(self) -> str:
        """``batch ×4: MPS, 9 % faster than time-slicing here (4.75 s vs 5.18 s)``."""
        head = f"{self.kind} ×{self.clients}: "
        return head + (STRATEGY_TITLES[self.strategy] + ", " if self.strategy else "") + self.reason

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _v(row: Row, metric: str) -> Spread | None:
    return row.get(metric)


def _fmt(x: float, unit: str) -> str:
    if unit == "ms":
        return f"{x:.2f} ms"
    if unit == "s":
        return f"{x:.2f} s"
    if unit == "%":
        return f"{x:.0f} %"
    return f"{x:.0f} {unit}"


def _count(rows: Sequence[Row], kind: str) -> int | None:
    counts: dict[int, set[str]] = {}
    for r in rows:
        if r.kind == kind and r.strategy in SHARING and r.clients > 1 and r.metrics:
            counts.setdefault(r.clients, set()).add(r.strategy)
    multi = [n for n, s in counts.items() if len(s) >= 2]
    return max(multi) if multi else (max(counts) if counts else None)


def recommend(rows: Sequence[Row], unit_memory_mib: int) -> list[Recommendation]:
    out = []
    for kind in ("light", "heavy", "batch", "memory"):
        n = _count(rows, kind)
        if n is None:
            continue
        cands = [r for r in rows if r.kind == kind and r.clients == n and r.strategy in SHARING and not r.errors]
        alone = find(rows, "dedicated", 1, kind)
        if kind == "batch":
            out.append(_best(kind, n, cands, "completion_s", lower=True, alone=alone, unit="s"))
        elif kind == "heavy":
            out.append(_best(kind, n, cands, "throughput", lower=False, alone=alone, unit="TFLOP/s"))
        elif kind == "light":
            out.append(_light(n, cands, alone))
        else:
            out.append(_memory(n, cands, unit_memory_mib))
    return out


def _best(
    kind: str, n: int, cands: list[Row], metric: str, lower: bool, alone: Row | None, unit: str
) -> Recommendation:
    have = [(r, s) for r in cands if (s := _v(r, metric)) is not None]
    if not have:
        return Recommendation(kind, n, None, None, None, False, f"no strategy completed {kind} ×{n}")
    have.sort(key=lambda rs: rs[1].value if lower else -rs[1].value)
    best, bs = have[0]
    base = ""
    a = _v(alone, metric) if alone else None
    if a is not None:
        base = f"; one alone {_fmt(a.value, unit)}"
    if len(have) == 1:
        return Recommendation(kind, n, best.strategy, None, None, False, f"{_fmt(bs.value, unit)}{base}")
    # Compared with time-slicing (what a cluster shares with when nothing else is set up) where it was measured and
    # lost, else with the runner-up.
    other, os_ = next(((r, s) for r, s in have[1:] if r.strategy == "time-slicing"), have[1])
    title = STRATEGY_TITLES[other.strategy]
    noise = bs.overlaps(os_)
    if lower:
        margin = 100.0 * (os_.value / bs.value - 1.0)
        what = f"{margin:.0f} % faster than {title}"
    else:
        margin = 100.0 * (bs.value / os_.value - 1.0)
        what = f"{margin:.1f} % more throughput than {title}"
    reason = f"{what} here ({_fmt(bs.value, unit)} vs {_fmt(os_.value, unit)}{base})" + (
        " — within the spread of the repetitions" if noise else ""
    )
    return Recommendation(kind, n, best.strategy, round(margin, 1), other.strategy, noise, reason)


def _light(n: int, cands: list[Row], alone: Row | None) -> Recommendation:
    have = [r for r in cands if _v(r, "p99_ms") is not None]
    if not have:
        return Recommendation("light", n, None, None, None, False, f"no strategy completed light ×{n}")
    ref = _v(alone, "p99_ms") if alone else None
    limit = (ref.value if ref else min(r.metrics["p99_ms"].value for r in have)) * (1 + LIGHT_P99_SLACK)
    held = [r for r in have if r.metrics["p99_ms"].value <= limit]
    ref_txt = f"{ref.value:.2f} ms alone" if ref else "the best measured"
    if not held:
        best = min(have, key=lambda r: r.metrics["p99_ms"].value)
        return Recommendation(
            "light",
            n,
            best.strategy,
            None,
            None,
            False,
            f"lowest p99 ({best.metrics['p99_ms'].value:.2f} ms), but none kept p99 within "
            f"{LIGHT_P99_SLACK:.0%} of {ref_txt}",
        )

    def busy(r: Row) -> float:
        b = _v(r, "busy_pct")
        return b.value if b is not None else float("inf")

    held.sort(key=busy)
    best = held[0]
    reason = f"p99 {best.metrics['p99_ms'].value:.2f} ms ({ref_txt})"
    bb = _v(best, "busy_pct")
    # Compared with time-slicing where it was measured (whether its latency held or not), else the busiest other.
    others = [r for r in have if r is not best]
    ts = next((r for r in others if r.strategy == "time-slicing"), None)
    other = ts or (max(others, key=busy) if others else None)
    ob = _v(other, "busy_pct") if other else None
    if other is None or bb is None or ob is None:
        return Recommendation("light", n, best.strategy, None, None, False, reason)
    saved = 100.0 * (1.0 - bb.value / ob.value) if ob.value > 0 else 0.0
    reason += (
        f"; GPU busy {bb.value:.0f} % vs {ob.value:.0f} % under {STRATEGY_TITLES[other.strategy]} "
        f"(p99 {other.metrics['p99_ms'].value:.2f} ms)"
    )
    noise = bb.overlaps(ob)
    if noise:
        reason += " — within the spread of the repetitions"
    return Recommendation("light", n, best.strategy, round(saved, 1), other.strategy, noise, reason)


def _memory(n: int, cands: list[Row], unit_memory_mib: int) -> Recommendation:
    share = unit_memory_mib / n
    have = [r for r in cands if _v(r, "mem_max_mib") is not None and _v(r, "mem_min_mib") is not None]
    if not have:
        return Recommendation("memory", n, None, None, None, False, f"no strategy completed memory ×{n}")
    held = [
        r
        for r in have
        if r.strategy in ENFORCING
        and r.metrics["mem_max_mib"].hi <= share * (1 + MEMORY_SLACK)
        and r.metrics["mem_min_mib"].lo >= share * MEMORY_FLOOR
    ]
    worst = max(have, key=lambda r: r.metrics["mem_max_mib"].hi)
    took = f"under {STRATEGY_TITLES[worst.strategy]} one client took {worst.metrics['mem_max_mib'].hi / 1024:.0f} GiB"
    if not held:
        return Recommendation(
            "memory",
            n,
            None,
            None,
            None,
            False,
            f"no strategy held each client to its share ({share / 1024:.0f} GiB) here; {took} — use MIG or MPS "
            "with limits",
        )
    best = max(held, key=lambda r: r.metrics["mem_min_mib"].lo)
    got = best.metrics["mem_min_mib"].lo / 1024, best.metrics["mem_max_mib"].hi / 1024
    reason = f"each client held to its share: {got[0]:.0f}–{got[1]:.0f} GiB of {share / 1024:.0f} GiB"
    if worst.strategy not in {r.strategy for r in held}:
        reason += f"; {took}"
    return Recommendation("memory", n, best.strategy, None, None, False, reason)
