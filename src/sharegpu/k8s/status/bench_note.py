"""The strategy benchmark's result on a Node: ``sharegpu bench --publish`` writes it, ``sharegpu status`` shows it.

The annotation holds a small JSON object (the full result stays in the bench's own JSON file)::

    {"version": 1, "gpu": "NVIDIA H200", "unit": "GPU-…", "measuredAt": "2026-11-26T10:00:00Z",
     "picks": [{"kind": "batch", "clients": 4, "strategy": "mps", "marginPct": 9.1, "versus": "time-slicing"}, …]}

``marginPct`` is how much better the pick did than ``versus``: batch, time to finish; heavy, throughput; light,
GPU busy time saved at equal latency; absent for memory (a pick there is a yes/no: it held each client to its
share). It lives here, below the bench (which imports it only to publish), because ``sharegpu status`` reads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sharegpu.model.contract import BENCH_ANNOTATION

NOTE_VERSION = 1


@dataclass(frozen=True, slots=True)
class BenchPick:
    kind: str  # light | heavy | batch | memory
    clients: int
    strategy: str | None  # None: no strategy qualified
    margin_pct: float | None = None
    versus: str | None = None

    def text(self) -> str:
        """``batch×4: mps +9 %`` — ``light×4: mps busy −68 %`` — ``memory×4: mps-limits``."""
        s = f"{self.kind}×{self.clients}: {self.strategy or 'none'}"
        if self.margin_pct is None or self.versus is None:
            return s
        if self.kind == "light":
            return s + f" busy −{abs(self.margin_pct):.0f} %"
        return s + f" {self.margin_pct:+.0f} %"


@dataclass(frozen=True, slots=True)
class BenchNote:
    gpu: str
    unit: str
    measured_at: str  # RFC 3339, UTC
    picks: tuple[BenchPick, ...]

    def to_annotation(self) -> str:
        return json.dumps(
            {
                "version": NOTE_VERSION,
                "gpu": self.gpu,
                "unit": self.unit,
                "measuredAt": self.measured_at,
                "picks": [
                    {
                        "kind": p.kind,
                        "clients": p.clients,
                        "strategy": p.strategy,
                        **({"marginPct": p.margin_pct} if p.margin_pct is not None else {}),
                        **({"versus": p.versus} if p.versus is not None else {}),
                    }
                    for p in self.picks
                ],
            },
            separators=(",", ":"),
        )

    def text(self) -> str:
        return "; ".join(p.text() for p in self.picks)


class InvalidBenchNote(ValueError):
    pass


def parse_note(text: str) -> BenchNote:
    """Raises :class:`InvalidBenchNote` saying what is wrong (status shows it rather than the note)."""
    try:
        d: Any = json.loads(text)
        if not isinstance(d, dict) or d.get("version") != NOTE_VERSION:
            raise InvalidBenchNote(f"not a version-{NOTE_VERSION} bench note")
        picks = tuple(
            BenchPick(
                str(p["kind"]),
                int(p["clients"]),
                None if p.get("strategy") is None else str(p["strategy"]),
                None if p.get("marginPct") is None else float(p["marginPct"]),
                None if p.get("versus") is None else str(p["versus"]),
            )
            for p in d["picks"]
        )
        return BenchNote(str(d["gpu"]), str(d["unit"]), str(d["measuredAt"]), picks)
    except InvalidBenchNote:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise InvalidBenchNote(
            f"{BENCH_ANNOTATION} cannot be read ({type(e).__name__}: {e}); rerun sharegpu bench --publish"
        ) from None
