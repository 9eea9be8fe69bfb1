"""What a benchmark run measured: one :class:`Measurement` per (strategy, clients, workload, repetition), and the
:class:`Row` that sums the repetitions up (median and min–max spread) — the table, the JSON, the plot and the
recommendation are all built from rows."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

STRATEGIES = ("dedicated", "time-slicing", "mps", "mps-limits", "mig")
STRATEGY_TITLES = {
    "dedicated": "dedicated",
    "time-slicing": "time-slicing",
    "mps": "MPS",
    "mps-limits": "MPS + limits",
    "mig": "MIG",
}
METRICS = ("p50_ms", "p99_ms", "throughput", "completion_s", "busy_pct")
UNITS = {"light": "req/s", "heavy": "TFLOP/s", "batch": "jobs/s", "memory": ""}


@dataclass(frozen=True, slots=True)
class Spread:
    """A metric over the repetitions: the median and the range."""

    value: float
    lo: float
    hi: float

    @staticmethod
    def of(xs: Sequence[float]) -> Spread:
        return Spread(statistics.median(xs), min(xs), max(xs))

    def overlaps(self, other: Spread) -> bool:
        return self.lo <= other.hi and other.lo <= self.hi


@dataclass(frozen=True, slots=True)
class Measurement:
    """One window: the clients' results side by side, and the GPU busy time sampled meanwhile."""

    strategy: str
    clients: int
    kind: str
    rep: int
    results: tuple[dict[str, Any], ...]  # one per client, in client order (a failed client: {"error": ...})
    busy_pct: float | None
    window_s: float

    @property
    def errors(self) -> list[str]:
        return [r["error"] for r in self.results if "error" in r]

    def metrics(self) -> dict[str, float]:
        """The window's figures: latencies pooled over the clients, throughput summed, completion the last job's."""
        ok = [r for r in self.results if "error" not in r]
        out: dict[str, float] = {}
        if self.busy_pct is not None:
            out["busy_pct"] = self.busy_pct
        if not ok or len(ok) < len(self.results):
            return out
        if self.kind in ("light", "heavy"):
            lat = sorted(x for r in ok for x in r["latencies_ms"])
            if lat:
                out["p50_ms"] = lat[len(lat) // 2]
                out["p99_ms"] = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
            out["throughput"] = sum(r["throughput"] for r in ok)
        elif self.kind == "batch":
            out["completion_s"] = max(r["elapsed_s"] for r in ok)
            out["throughput"] = len(ok) / out["completion_s"]
        elif self.kind == "memory":
            out["mem_min_mib"] = min(r["memory_mib"] for r in ok)
            out["mem_max_mib"] = max(r["memory_mib"] for r in ok)
        return out

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["results"] = [{k: v for k, v in r.items() if k != "latencies_ms"} for r in self.results]
        return d


@dataclass(frozen=True, slots=True)
class Row:
    strategy: str
    clients: int
    kind: str
    reps: int
    metrics: dict[str, Spread] = field(default_factory=dict)
    errors: tuple[str, ...] = ()

    def get(self, name: str) -> Spread | None:
        return self.metrics.get(name)

    def to_json(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "clients": self.clients,
            "kind": self.kind,
            "reps": self.reps,
            "metrics": {k: asdict(v) for k, v in self.metrics.items()},
            "errors": list(self.errors),
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> Row:
        return Row(
            d["strategy"],
            int(d["clients"]),
            d["kind"],
            int(d.get("reps", 1)),
            {k: Spread(float(v["value"]), float(v["lo"]), float(v["hi"])) for k, v in d["metrics"].items()},
            tuple(d.get("errors", ())),
        )


def aggregate(measurements: Iterable[Measurement]) -> list[Row]:
    """Rows in run order; a metric is summed up over the repetitions that measured it."""
    groups: dict[tuple[str, int, str], list[Measurement]] = {}
    for m in measurements:
        groups.setdefault((m.strategy, m.clients, m.kind), []).append(m)
    rows = []
    for (strategy, clients, kind), ms in groups.items():
        per: dict[str, list[float]] = {}
        for m in ms:
            for k, v in m.metrics().items():
                per.setdefault(k, []).append(v)
        metrics = {k: Spread.of(v) for k, v in per.items()}
        if "mem_min_mib" in per:  # what any client got, over every repetition
            metrics["mem_min_mib"] = Spread(min(per["mem_min_mib"]), min(per["mem_min_mib"]), max(per["mem_min_mib"]))
            metrics["mem_max_mib"] = Spread(max(per["mem_max_mib"]), min(per["mem_max_mib"]), max(per["mem_max_mib"]))
        errors = tuple(dict.fromkeys(e for m in ms for e in m.errors))
        rows.append(Row(strategy, clients, kind, len(ms), metrics, errors))
    return rows


def find(rows: Iterable[Row], strategy: str, clients: int, kind: str) -> Row | None:
    return next((r for r in rows if (r.strategy, r.clients, r.kind) == (strategy, clients, kind)), None)
