"""Trace variants: an openb pod list derived from a base trace with chosen shares of four kinds of pod.

The openb family (cluster-trace-gpu-v2023) varies one share of the default trace at a time, and the shares are
measured the way its file names count them (checked on the visible files: ``cpu050`` has 5.0 % CPU-only pods,
``gpushare40`` 40.1 % of GPU demand in sharing pods, ``gpuspec10`` 10.4 % of GPU pods constrained,
``multigpu20`` 20.4 % of GPU demand in multi-GPU pods):

- **CPU-only** (``num_gpu`` 0): % of all pods, by count;
- **sharing** (one GPU, ``gpu_milli`` below 1000): % of the GPU demand (Σ num_gpu × gpu_milli);
- **multi-GPU** (``num_gpu`` above 1): % of the GPU demand; the rest of the demand is whole single-GPU pods;
- **model-constrained** (``gpu_spec`` set): % of GPU pods, by count.

How a variant is made (:func:`vary`), so that it stays a trace of the same cluster and the same kinds of pod:

1. Rows are resampled by class (stratified): each class (CPU-only, sharing, whole single-GPU, multi-GPU) draws
   rows of its own kind from the base, in passes: each pass is a seeded random permutation of the class's base
   rows, and passes repeat until the class reaches its target. A class that keeps its base target therefore
   keeps exactly its base rows; a smaller target is a random subset without repetition; a larger one repeats
   rows as evenly as possible. A class stops at the row that brings it closest to its target.
2. The total GPU demand is the base's, so the variant loads the cluster as the base does (the FGD protocol then
   tunes both to the same multiple of capacity). Sharing and multi-GPU demand are the given shares of it; a
   share not given keeps the base's proportions: the demand left after the given share is split among the other
   GPU classes in the base's ratio (``--multi-gpu 30`` keeps sharing : whole = base sharing : whole, as the
   family's ``multigpu20`` does). The CPU-only count is the given share (or the base's) of the resulting pods.
3. A row is copied as it is (every column); only ``gpu_spec`` is ever rewritten, and only when the
   model-constrained share is given: constraints are removed from randomly chosen constrained pods, or added to
   randomly chosen unconstrained GPU pods. An added ``gpu_spec`` is drawn from the spec source (the base by
   default) among the constrained pods of the same shape (GPU count, and sharing or whole), so its models are
   ones that such pods really ask for; failing that, among pods asking for at least as many GPUs.
4. Names: a row's first copy keeps its name, the k-th repeat is ``<name>-dup<k>``. Rows keep the base's order.

Everything random comes from one ``numpy`` generator seeded with the given seed, so the same base, options and
seed give the same file, byte for byte.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from fractions import Fraction
from pathlib import Path

import numpy as np

from sharegpu.model.request import FULL_MILLI, GpuRequest
from sharegpu.sim.openb import MAX_ROWS, PodTable, TraceTask

# A variant is read back by the same loader, which reads at most MAX_ROWS rows; a larger one could not be used, and
# making it would only fill memory (--cpu-only 99.99 asks for 10,000 CPU-only pods per GPU pod).
MAX_VARIANT_ROWS = MAX_ROWS


class VariantError(ValueError):
    """Options that cannot produce a variant of the given base; the message says what to change."""


class PodClass(Enum):
    CPU_ONLY = "CPU-only"
    SHARING = "sharing"
    WHOLE = "whole single-GPU"
    MULTI = "multi-GPU"


GPU_CLASSES = (PodClass.SHARING, PodClass.WHOLE, PodClass.MULTI)


def pod_class(r: GpuRequest) -> PodClass:
    if r.gpu_count == 0:
        return PodClass.CPU_ONLY
    if r.gpu_count > 1:
        return PodClass.MULTI
    return PodClass.SHARING if r.milli < FULL_MILLI else PodClass.WHOLE


@dataclass(frozen=True)
class Shares:
    """The four shares of a pod list, measured as the family's file names count them (see the module doc)."""

    pods: int
    gpu_pods: int
    gpu_demand_milli: int
    cpu_only_pct: float  # % of all pods
    sharing_pct: float  # % of GPU demand
    multi_gpu_pct: float  # % of GPU demand
    gpu_spec_pct: float  # % of GPU pods


def measure(tasks: Sequence[TraceTask]) -> Shares:
    reqs = [t.request for t in tasks]
    gpu = [r for r in reqs if r.gpu_count]
    demand = sum(r.total_milli for r in gpu)

    def demand_pct(c: PodClass) -> float:
        return 100 * sum(r.total_milli for r in gpu if pod_class(r) is c) / demand if demand else 0.0

    return Shares(
        pods=len(reqs),
        gpu_pods=len(gpu),
        gpu_demand_milli=demand,
        cpu_only_pct=100 * (len(reqs) - len(gpu)) / len(reqs) if reqs else 0.0,
        sharing_pct=demand_pct(PodClass.SHARING),
        multi_gpu_pct=demand_pct(PodClass.MULTI),
        gpu_spec_pct=100 * sum(1 for r in gpu if r.allowed_models) / len(gpu) if gpu else 0.0,
    )


@dataclass(frozen=True)
class VariantSpec:
    """Target shares in percent (``None``: keep the base's, see the module doc) and the seed."""

    cpu_only: float | None = None
    sharing: float | None = None
    multi_gpu: float | None = None
    gpu_spec: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for flag, v in (("--sharing", self.sharing), ("--multi-gpu", self.multi_gpu), ("--gpu-spec", self.gpu_spec)):
            if v is not None and not 0 <= v <= 100:
                raise VariantError(f"{flag} {v:g} must be a percentage from 0 to 100")
        if self.cpu_only is not None and not 0 <= self.cpu_only < 100:
            raise VariantError(
                f"--cpu-only {self.cpu_only:g} must be a percentage from 0 to below 100 (a trace needs GPU pods)"
            )
        if self.sharing is not None and self.multi_gpu is not None and self.sharing + self.multi_gpu > 100:
            raise VariantError(
                f"--sharing {self.sharing:g} and --multi-gpu {self.multi_gpu:g} add up to more than 100 % of the "
                "GPU demand; lower one of them"
            )
        if self.seed < 0:
            raise VariantError(f"--seed {self.seed} must not be negative")


@dataclass(frozen=True)
class Variant:
    header: tuple[str, ...]
    rows: tuple[dict[str, str], ...]
    tasks: tuple[TraceTask, ...]  # the rows as the loader reads them (names and gpu_spec as written)

    def csv_text(self) -> str:
        out = io.StringIO()
        w = csv.writer(out, lineterminator="\n")
        w.writerow(self.header)
        for row in self.rows:
            w.writerow([row.get(c, "") for c in self.header])
        return out.getvalue()


def _pct(v: float) -> Fraction:
    return Fraction(v).limit_denominator(10**6) / 100


def _demand_targets(base: Mapping[PodClass, int], spec: VariantSpec, what: str) -> dict[PodClass, int]:
    """GPU milli per GPU class: the given shares of the base's total demand, the rest in the base's ratio."""
    total = sum(base.values())
    given = {
        c: _pct(v) for c, v in ((PodClass.SHARING, spec.sharing), (PodClass.MULTI, spec.multi_gpu)) if v is not None
    }
    if not given:
        return dict(base)
    rest = [c for c in GPU_CLASSES if c not in given]
    left = 1 - sum(given.values())
    rest_base = sum(base[c] for c in rest)
    if left > 0 and rest_base == 0:
        names = " or ".join(c.value for c in rest)
        raise VariantError(
            f"{what} has no {names} pods to fill the {float(left) * 100:g} % of GPU demand the given shares leave; "
            "give shares that add up to 100 %"
        )
    share = {**given, **{c: left * Fraction(base[c], rest_base) if rest_base else Fraction(0) for c in rest}}
    return {c: round(total * share[c]) for c in GPU_CLASSES}


class _TooMany(Exception):
    pass


def _resample(
    pool: Sequence[int], rng: np.random.Generator, weight: Callable[[int], int], target: int, limit: int
) -> list[int]:
    """Base rows of one class in passes of seeded permutations, until the sum of ``weight`` is closest to target;
    :class:`_TooMany` once more than ``limit`` rows would be needed."""
    out: list[int] = []
    total = 0
    if target <= 0 or not pool:
        return out
    while True:
        if len(out) > limit:
            raise _TooMany
        for i in rng.permutation(len(pool)):
            w = weight(pool[int(i)])
            if total + w - target >= target - total:  # adding this row would leave it no closer to the target
                return out
            out.append(pool[int(i)])
            total += w


def vary(base: PodTable, spec: VariantSpec, spec_source: PodTable | None = None) -> Variant:
    """A variant of ``base`` with the shares of ``spec`` (the method is in the module doc)."""
    rng = np.random.default_rng(spec.seed)
    what = f"the base trace {base.path}"
    reqs = [t.request for t in base.tasks]
    pools: dict[PodClass, list[int]] = {c: [] for c in PodClass}
    for i, r in enumerate(reqs):
        pools[pod_class(r)].append(i)
    base_demand = {c: sum(reqs[i].total_milli for i in pools[c]) for c in GPU_CLASSES}
    if not sum(base_demand.values()):
        raise VariantError(f"{what} has no GPU pods; a variant needs GPU pods to resample")

    chosen: list[int] = []
    for c, target in _demand_targets(base_demand, spec, what).items():
        if target > 0 and not pools[c]:
            raise VariantError(f"{what} has no {c.value} pods, so it cannot give them a share; choose another base")
        try:
            chosen += _resample(pools[c], rng, lambda i: reqs[i].total_milli, target, MAX_VARIANT_ROWS - len(chosen))
        except _TooMany:
            share = {PodClass.SHARING: "--sharing", PodClass.MULTI: "--multi-gpu"}
            raise VariantError(
                f"the variant would need more than {MAX_VARIANT_ROWS:,} rows, the most a trace may have: its "
                f"{c.value} pods, {base_demand[c] / max(len(pools[c]), 1) / 1000:.2f} GPU each on average in the base, "
                f"must carry {target / 1000:,.0f} GPUs of demand; give a smaller "
                f"{' or '.join(v for k, v in share.items() if k is c) or 'share of the other classes'}"
            ) from None
    gpu_pods = len(chosen)
    cpu_pct = _pct(spec.cpu_only) if spec.cpu_only is not None else Fraction(len(pools[PodClass.CPU_ONLY]), len(reqs))
    cpu_target = round(gpu_pods * cpu_pct / (1 - cpu_pct))
    if gpu_pods + cpu_target > MAX_VARIANT_ROWS:
        # Checked before drawing: the count is known, and drawing it is what filled memory.
        most = 100 * (1 - gpu_pods / MAX_VARIANT_ROWS)
        raise VariantError(
            f"--cpu-only {float(cpu_pct) * 100:g} would make {cpu_target:,} CPU-only pods beside the variant's "
            f"{gpu_pods:,} GPU pods, {gpu_pods + cpu_target:,} rows in all, more than the {MAX_VARIANT_ROWS:,} a trace "
            f"may have; give --cpu-only {most:.2f} or less"
        )
    if cpu_target and not pools[PodClass.CPU_ONLY]:
        raise VariantError(f"{what} has no CPU-only pods to resample; choose a base that has some")
    chosen += _resample(pools[PodClass.CPU_ONLY], rng, lambda i: 1, cpu_target, MAX_VARIANT_ROWS)
    chosen.sort()

    rows = [dict(base.rows[i]) for i in chosen]
    header = base.header
    if spec.gpu_spec is not None:
        if "gpu_spec" not in header:
            at = header.index("gpu_milli") + 1
            header = (*header[:at], "gpu_spec", *header[at:])
        _rewrite_specs(rows, [reqs[i] for i in chosen], spec.gpu_spec, spec_source or base, rng)
    _rename(rows)
    return Variant(header, tuple(rows), tuple(_tasks(rows, [base.tasks[i] for i in chosen])))


def _shape(r: GpuRequest) -> tuple[int, bool]:
    return r.gpu_count, r.milli < FULL_MILLI


def _rewrite_specs(
    rows: list[dict[str, str]], reqs: Sequence[GpuRequest], pct: float, source: PodTable, rng: np.random.Generator
) -> None:
    gpu = [k for k, r in enumerate(reqs) if r.gpu_count]
    has = [k for k in gpu if rows[k].get("gpu_spec", "").strip()]
    target = round(len(gpu) * _pct(pct))
    if target < len(has):
        for k in rng.choice(np.asarray(has), len(has) - target, replace=False):
            rows[int(k)]["gpu_spec"] = ""
        return
    free = [k for k in gpu if not rows[k].get("gpu_spec", "").strip()]
    add = target - len(has)
    if not add:
        return
    specs: dict[tuple[int, bool], list[str]] = {}
    for row, t in zip(source.rows, source.tasks, strict=True):
        text = row.get("gpu_spec", "").strip()
        if text and t.request.gpu_count:
            specs.setdefault(_shape(t.request), []).append(text)
    if not specs:
        raise VariantError(
            f"{source.path} has no pod with a gpu_spec to draw model constraints from; give --spec-source a pod "
            "list that has some (e.g. openb_pod_list_gpuspec10.csv)"
        )
    for k in sorted(int(k) for k in rng.choice(np.asarray(free), add, replace=False)):
        n, sharing = _shape(reqs[k])
        options = specs.get((n, sharing)) or [s for (m, _), v in sorted(specs.items()) for s in v if m >= n]
        if not options:
            raise VariantError(
                f"no pod of {source.path} asks for {n} or more GPUs with a gpu_spec, so a model constraint for a "
                f"{n}-GPU pod cannot be drawn; give --spec-source a pod list that has one"
            )
        rows[k]["gpu_spec"] = options[int(rng.integers(len(options)))]


def _rename(rows: list[dict[str, str]]) -> None:
    names = {r["name"] for r in rows}
    copies: dict[str, int] = {}
    seen: set[str] = set()
    for r in rows:
        name = r["name"]
        if name in seen:
            k = copies.get(name, 0)
            while True:
                k += 1
                new = f"{name}-dup{k}"
                if new not in names:
                    break
            copies[name] = k
            names.add(new)
            r["name"] = new
        seen.add(name)


def _tasks(rows: Sequence[Mapping[str, str]], sources: Sequence[TraceTask]) -> list[TraceTask]:
    out = []
    for row, t in zip(rows, sources, strict=True):
        models = frozenset(m.strip() for m in row.get("gpu_spec", "").split("|") if m.strip())
        req = GpuRequest(
            row["name"],
            gpu_count=t.request.gpu_count,
            compute_milli=t.request.compute_milli,
            allowed_models=models,
            cpu_milli=t.request.cpu_milli,
            host_memory_mib=t.request.host_memory_mib,
            catalog=t.request.catalog,
        )
        out.append(TraceTask(req, t.creation_time, t.deletion_time))
    return out


def write_variant(path: Path, variant: Variant) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(variant.csv_text(), encoding="utf-8", newline="")
