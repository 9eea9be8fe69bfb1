"""What a simulation run measured, and the allocation-vs-arrived curve as the FGD reference computes it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from sharegpu.placement.reasons import ReasonKind

CURVE_MAX = 130  # arrived % levels 0..130


@dataclass
class RunLog:
    """Per-event samples: GPU milli arrived (submitted so far) and allocated, after each event."""

    total_milli: int
    arrived: list[int] = field(default_factory=lambda: [0])
    allocated: list[int] = field(default_factory=lambda: [0])
    latencies_s: list[float] = field(default_factory=list)
    failures: dict[ReasonKind, int] = field(default_factory=dict)
    placed: int = 0
    failed: int = 0
    fragmentation: list[float] = field(default_factory=list)

    def record(self, arrived: int, allocated: int) -> None:
        self.arrived.append(arrived)
        self.allocated.append(allocated)

    def fail(self, reason: ReasonKind) -> None:
        self.failed += 1
        self.failures[reason] = self.failures.get(reason, 0) + 1


def allocation_curve(arrived: npt.ArrayLike, allocated: npt.ArrayLike, total_milli: int) -> list[float | None]:
    """Allocation % at arrived % = 0..130, the reference's way (merge_alloc_discrete).

    Each sample's arrived % is rounded to an integer (half to even, as numpy does) and its allocation % to two
    decimals; a level's value is the mean allocation of its samples, or of the samples within ±1 % when it has
    none. Small clusters step past levels in jumps; there a level takes the allocation of the last sample at or
    below it, and ``None`` only beyond the last sample.
    """
    if total_milli <= 0:
        return [None] * (CURVE_MAX + 1)
    total = total_milli / 1000  # in GPUs; the reference divides milli by GPUs and by 10
    arr = np.round(np.asarray(arrived, dtype=np.float64) / total / 10, 0)
    alloc = np.round(np.asarray(allocated, dtype=np.float64) / total / 10, 2)
    out: list[float | None] = []
    for x in range(CURVE_MAX + 1):
        sel = alloc[arr == x]
        if sel.size == 0:
            sel = alloc[(arr >= x - 1) & (arr <= x + 1)]
        if sel.size == 0:
            sel = alloc[arr <= x][-1:]
            if x > arr.max():
                sel = sel[:0]
        out.append(round(float(sel.mean()), 2) if sel.size else None)
    return out


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


TIMELINE_POINTS = 400


@dataclass(frozen=True)
class Timeline:
    """A replay's state over trace time on an even grid: allocated GPU (% of capacity) and pods pending."""

    time_s: tuple[float, ...]
    alloc_pct: tuple[float, ...]
    pending: tuple[int, ...]

    def to_dict(self) -> dict[str, list[float] | list[int]]:
        return {"time_s": list(self.time_s), "alloc_pct": list(self.alloc_pct), "pending": list(self.pending)}


def sample_timeline(
    times: Sequence[int],
    allocated_milli: Sequence[int],
    pending: Sequence[int],
    total_milli: int,
    points: int = TIMELINE_POINTS,
) -> Timeline:
    """The state after the last event at or before each of ``points`` even steps from the first event to the last
    (events are in time order; several at one time count as one step). A report needs the shape, not every event."""
    if not times:
        return Timeline((), (), ())
    t = np.asarray(times, dtype=np.float64)
    grid = np.linspace(t[0], t[-1], points) if t[-1] > t[0] else t[:1]
    idx = np.searchsorted(t, grid, side="right") - 1
    alloc = np.asarray(allocated_milli, dtype=np.float64)[idx]
    pct = np.round(100 * alloc / total_milli, 2) if total_milli else np.zeros_like(alloc)
    return Timeline(
        tuple(float(x) for x in grid),
        tuple(float(x) for x in pct),
        tuple(int(x) for x in np.asarray(pending, dtype=np.int64)[idx]),
    )
