"""GPU fragmentation against a workload distribution (FGD, USENIX ATC '23), vectorised over nodes.

A node's fragmentation for a task shape m is all its free GPU milli when m cannot run there at all (a CPU-only
shape, a model m may not use, too little CPU, fewer than num_gpu GPUs with enough free milli), and otherwise
the free milli on GPUs whose free milli is below m's share. The node's fragmentation is Σ p_m · F(m).
GPU memory plays no part. All arrays are (nodes × GPU slots) with absent or unhealthy GPUs counted as 0 free.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from sharegpu.model.request import FULL_MILLI, GpuRequest

if TYPE_CHECKING:  # types only: the ledger is read, never imported at run time here
    from sharegpu.ledger import Ledger

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

# The reference counts a CPU request of 0 as 100m (kube-scheduler's non-zero default).
DEFAULT_CPU_MILLI = 100


def shape_cpu(req: GpuRequest) -> int:
    return req.cpu_milli if req.cpu_milli > 0 else DEFAULT_CPU_MILLI


@dataclass(frozen=True)
class TaskShape:
    cpu_milli: int
    gpu_milli: int  # per GPU; 0 for CPU-only
    gpu_count: int
    models: frozenset[str]  # allowed models; empty = any


# A workload taken from the pods (or claims) seen is taken again once their number moved by this share since: the
# policy's fragmentation measure follows the workload without rebuilding it for every pod.
WORKLOAD_DRIFT = 0.1


def workload_drifted(seen_then: int, seen_now: int) -> bool:
    """Whether a workload taken from ``seen_then`` requests is stale now that ``seen_now`` are seen (one taken from
    none is stale as soon as any is seen)."""
    if seen_then <= 0:
        return seen_now != seen_then
    return abs(seen_now - seen_then) >= WORKLOAD_DRIFT * seen_then


@dataclass(frozen=True)
class Workload:
    """The typical task shapes and their probabilities, as arrays for vectorised use."""

    shapes: tuple[TaskShape, ...]
    weights: FloatArray  # (M,)
    cpu: IntArray  # (M,)
    milli: IntArray  # (M,)
    count: IntArray  # (M,)
    cpu_per_gpu_milli: float = 0.0  # CPU milli the workload asks per milli-GPU (CPU-only tasks included)
    # Shapes beyond ``shapes`` that, with them, cover most of the GPU demand (rare but large, e.g. 8-GPU tasks
    # that only the CPU-richest nodes can host), with their task counts. FGD ignores them; see :meth:`extended`.
    extras: tuple[tuple[TaskShape, int], ...] = ()
    counts: tuple[int, ...] = ()  # task count of each of ``shapes``

    @classmethod
    def from_requests(
        cls, reqs: Iterable[GpuRequest], coverage: float = 0.95, demand_coverage: float = 0.95
    ) -> Workload:
        """The most common shapes first until they cover ``coverage`` of the tasks (the crossing one included).

        Equal counts order by (cpu, gpu milli, gpu count, models) descending, as the reference does. The shapes
        that bring the most GPU demand first, until they cover ``demand_coverage`` of it, are kept beside them as
        :attr:`extras` when they are not among them.
        """
        counts = Counter(
            TaskShape(shape_cpu(r), r.milli if r.gpu_count else 0, r.gpu_count, r.allowed_models) for r in reqs
        )
        if not counts:
            raise ValueError("a workload distribution needs at least one task")

        def tie(shape: TaskShape) -> tuple[int, int, int, str]:
            return (shape.cpu_milli, shape.gpu_milli, shape.gpu_count, "|".join(sorted(shape.models)))

        ordered = sorted(counts.items(), key=lambda kv: (kv[1], *tie(kv[0])), reverse=True)
        chosen = _cover(ordered, lambda s, c: c, coverage)
        by_demand = sorted(counts.items(), key=lambda kv: (_demand(kv[0]) * kv[1], *tie(kv[0])), reverse=True)
        have = {s for s, _ in chosen}
        extras = tuple(
            (s, c) for s, c in _cover(by_demand, lambda s, c: _demand(s) * c, demand_coverage) if s not in have
        )
        return cls.of(chosen, extras)

    @classmethod
    def of(cls, chosen: list[tuple[TaskShape, int]], extras: tuple[tuple[TaskShape, int], ...] = ()) -> Workload:
        """Shapes weighted by their task counts."""
        cum = sum(c for _, c in chosen)
        weights = np.array([c for _, c in chosen], dtype=np.float64) / cum
        shapes = tuple(s for s, _ in chosen)
        cpu = np.array([s.cpu_milli for s in shapes], dtype=np.int64)
        milli = np.array([s.gpu_milli for s in shapes], dtype=np.int64)
        count = np.array([s.gpu_count for s in shapes], dtype=np.int64)
        gpu = float((weights * milli * count).sum())
        ratio = float((weights * cpu).sum()) / gpu if gpu > 0 else 0.0
        return cls(shapes, weights, cpu, milli, count, ratio, extras, tuple(c for _, c in chosen))

    def extended(self) -> Workload:
        """The typical shapes and the :attr:`extras`, weighted by task counts over all of them."""
        if not self.extras:
            return self
        return Workload.of([*zip(self.shapes, self.counts, strict=True), *self.extras])

    def demand_weights(self) -> FloatArray:
        """Weights by GPU demand (how often a shape arrives times the GPU it brings); counts where none asks."""
        demand = self.weights * self.milli * self.count
        if demand.sum() <= 0:
            return self.weights
        out: FloatArray = demand / demand.sum()
        return out

    def access(self, model_names: list[str]) -> BoolArray:
        """(models × shapes): may shape m run on model k."""
        out = np.zeros((len(model_names), len(self.shapes)), dtype=bool)
        for k, name in enumerate(model_names):
            for m, s in enumerate(self.shapes):
                out[k, m] = not s.models or name in s.models
        return out


def model_pressure(wl: Workload, model_names: list[str], capacity: FloatArray) -> FloatArray:
    """(K,) how much of each GPU model's capacity the model-constrained shapes of ``wl`` are expected to claim.

    A constrained shape (one that may run on some models but not all) brings its share of the GPU demand
    (:meth:`Workload.demand_weights`) to the set S of models it allows; spread over S in proportion to capacity,
    that is ``demand share / capacity share of S`` per unit of capacity of each model in S. Summed over the shapes,
    a model's pressure is 0 when no shape is confined to it, about 1 when the constrained demand alone would fill
    its share of the cluster, and above 1 when it would overflow it. ``capacity`` is the (K,) capacity of each
    model (its GPU count, or its free GPU now). Without constrained shapes every pressure is 0.
    """
    return ModelPressure.of(wl, model_names)(capacity)


@dataclass(frozen=True)
class ModelPressure:
    """:func:`model_pressure` for one workload and one list of models, with the constrained shapes found once, so
    that it can follow a capacity that changes with every placement."""

    allowed: BoolArray  # (S, K): may constrained shape s run on model k
    demand: FloatArray  # (S,) each constrained shape's share of the GPU demand

    @classmethod
    def of(cls, wl: Workload, model_names: list[str]) -> ModelPressure:
        table = wl.access(model_names)  # (K, M)
        demand = wl.demand_weights()
        confined = [
            m for m in range(len(wl.shapes)) if not table[:, m].all() and table[:, m].any() and wl.milli[m] != 0
        ]
        return cls(table[:, confined].T.copy(), demand[confined].astype(np.float64))

    def __call__(self, capacity: FloatArray) -> FloatArray:
        total = float(capacity.sum())
        if total <= 0 or not len(self.demand):
            return np.zeros(self.allowed.shape[1], dtype=np.float64)
        share = np.where(self.allowed, capacity[None, :], 0.0).sum(axis=1) / total  # (S,) share of each S
        per = np.divide(self.demand, share, out=np.zeros_like(share), where=share > 0)
        # summed over the shapes in order (a reduction over the first axis adds row after row), as a loop would
        out: FloatArray = np.where(self.allowed, per[:, None], 0.0).sum(axis=0)
        return out


def _demand(shape: TaskShape) -> int:
    return shape.gpu_milli * shape.gpu_count


def _cover(
    ordered: list[tuple[TaskShape, int]], size: Callable[[TaskShape, int], int], coverage: float
) -> list[tuple[TaskShape, int]]:
    """The first of ``ordered`` until their sizes reach ``coverage`` of the total (the crossing one included)."""
    total = sum(size(s, c) for s, c in ordered)
    chosen: list[tuple[TaskShape, int]] = []
    cum = 0
    for shape, c in ordered:
        if total <= 0 or cum >= coverage * total:
            break
        chosen.append((shape, c))
        cum += size(shape, c)
    return chosen


def node_fragmentation(free: IntArray, cpu_free: IntArray, access: BoolArray, wl: Workload) -> FloatArray:
    """Σ_m p_m · F_m for each node: free (K,G), cpu_free (K,), access (K,M) → (K,)."""
    result: FloatArray = shape_fragmentation(free, cpu_free, access, wl).astype(np.float64) @ wl.weights
    return result


def shape_fragmentation(free: IntArray, cpu_free: IntArray, access: BoolArray, wl: Workload) -> IntArray:
    """(K,M) F_m of each node for each shape m, in milli-GPU."""
    ge = free[:, :, None] >= wl.milli[None, None, :]  # (K,G,M)
    cnt = ge.sum(axis=1)
    sum_lt = np.where(ge, 0, free[:, :, None]).sum(axis=1)
    idle = free.sum(axis=1)
    runs = access & (wl.milli > 0)[None, :] & (cnt >= wl.count[None, :]) & (cpu_free[:, None] >= wl.cpu[None, :])
    out: IntArray = np.where(runs, sum_lt, idle[:, None])
    return out


def share_fragmentation(
    free: IntArray, cpu_free: IntArray, access: BoolArray, wl: Workload, milli: int, cpu: int
) -> FloatArray:
    """(K,G): each node's fragmentation after one ``milli`` share lands on GPU g (and ``cpu`` leaves the node)."""
    frag = share_shape_fragmentation(free, cpu_free, access, wl, milli, cpu).astype(np.float64)
    result: FloatArray = frag @ wl.weights
    return result


def share_shape_fragmentation(
    free: IntArray, cpu_free: IntArray, access: BoolArray, wl: Workload, milli: int, cpu: int
) -> IntArray:
    """(K,G,M): F_m of each node after one ``milli`` share lands on GPU g (and ``cpu`` leaves the node).

    Only GPU g changes, so the per-shape counts and sums are corrected for that one GPU instead of recomputed.
    """
    ge = free[:, :, None] >= wl.milli[None, None, :]  # (K,G,M)
    cnt = ge.sum(axis=1)  # (K,M)
    below = np.where(ge, 0, free[:, :, None])
    sum_lt = below.sum(axis=1)
    idle = free.sum(axis=1)
    after = free - milli  # (K,G): GPU g's free milli once the share is there
    ge_after = after[:, :, None] >= wl.milli[None, None, :]
    cnt_g = cnt[:, None, :] - ge + ge_after  # (K,G,M)
    sum_g = sum_lt[:, None, :] - below + np.where(ge_after, 0, after[:, :, None])
    idle_g = (idle - milli)[:, None]
    cpu_after = cpu_free - cpu
    runs = (
        access[:, None, :]
        & (wl.milli > 0)[None, None, :]
        & (cnt_g >= wl.count[None, None, :])
        & (cpu_after[:, None, None] >= wl.cpu[None, None, :])
    )
    out: IntArray = np.where(runs, sum_g, np.broadcast_to(idle_g[:, :, None], runs.shape))
    return out


def fgd_score(before: FloatArray, after: FloatArray) -> IntArray:
    """The reference's integer score: int(100 · sigmoid((F_before − F_after) / 1000)); higher is better."""
    x = (before - after) / 1000.0
    return (100.0 / (1.0 + np.exp(-x))).astype(np.int64)


def fragmentation_of(model: FragmentationModel) -> Callable[[Ledger], float]:
    """The cluster's fragmentation measure (free GPU milli the workload's typical shapes cannot use, summed over
    nodes): what ``sharegpu sim`` reports as fragmentation_pct × capacity and ``sharegpu status`` shows live."""

    def measure(ledger: Ledger) -> float:
        if ledger.present.size == 0:
            return 0.0  # no nodes or no GPUs: nothing to fragment
        return float(model.before(ledger, np.arange(len(ledger.nodes), dtype=np.int64)).sum())

    return measure


def free_milli(ledger: Ledger, nodes: IntArray) -> IntArray:
    """(K,G) free milli of each GPU, 0 where absent or unhealthy."""
    out: IntArray = np.where(ledger.healthy[nodes], ledger.free_milli[nodes], 0)
    return out


def is_sharing(req: GpuRequest) -> bool:
    return req.gpu_count == 1 and req.milli < FULL_MILLI


# ----- FGD ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class FragmentationModel:
    """Everything FGD needs beyond the ledger: the workload distribution and node → shape access.

    Compared and hashed by identity, so that it can key a scheduler's per-node memo.
    """

    workload: Workload
    # (models + 1) × shapes access tables per list of model names, the last row (node without GPUs) all False:
    # a memo, since every score asks for it.
    _tables: dict[tuple[str, ...], npt.NDArray[np.bool_]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def access(self, ledger: Ledger, nodes: IntArray) -> npt.NDArray[np.bool_]:
        names = tuple(ledger.model_names)
        table = self._tables.get(names)
        if table is None:
            table = np.zeros((len(names) + 1, len(self.workload.shapes)), dtype=bool)
            table[: len(names)] = self.workload.access(ledger.model_names)
            self._tables[names] = table
        out: npt.NDArray[np.bool_] = table[ledger.node_model_id[nodes]]  # id -1 reads the last row
        return out

    def stranded(self, gpu_free: FloatArray | IntArray, cpu_free: FloatArray | IntArray) -> FloatArray:
        """Free GPU milli beyond what the free CPU can feed at the workload's CPU per GPU."""
        ratio = self.workload.cpu_per_gpu_milli
        if ratio <= 0:
            return np.zeros(np.shape(gpu_free), dtype=np.float64)
        out: FloatArray = np.maximum(0.0, gpu_free - np.maximum(cpu_free, 0) / ratio)
        return out

    def before(self, ledger: Ledger, nodes: IntArray) -> FloatArray:
        return node_fragmentation(
            free_milli(ledger, nodes), ledger.cpu_free[nodes], self.access(ledger, nodes), self.workload
        )

    def per_gpu_after(self, ledger: Ledger, req: GpuRequest, nodes: IntArray) -> FloatArray:
        """(K,G) fragmentation after a one-GPU share lands on each GPU."""
        return share_fragmentation(
            free_milli(ledger, nodes),
            ledger.cpu_free[nodes],
            self.access(ledger, nodes),
            self.workload,
            req.milli,
            shape_cpu(req),
        )

    def share_delta(self, ledger: Ledger, req: GpuRequest, nodes: IntArray) -> FloatArray:
        """(K,G) growth of each node's fragmentation if a one-GPU share lands on each of its GPUs.

        Before and after are computed over the same nodes in one call, never taken from values computed over
        another set of nodes: BLAS rounds a row's weighted sum differently depending on the batch it sits in, so
        mixing batches would move FGD's integer scores and ties (a CPU-only pod's growth on a node whose CPU is
        not short would no longer be exactly 0).
        """
        return self.per_gpu_after(ledger, req, nodes) - self.before(ledger, nodes)[:, None]

    def whole_after(self, ledger: Ledger, req: GpuRequest, nodes: IntArray) -> FloatArray:
        """Fragmentation after a CPU-only or whole-GPU request takes the tightest GPUs that fit."""
        free = self.after_whole(free_milli(ledger, nodes), req)
        cpu = ledger.cpu_free[nodes] - shape_cpu(req)
        return node_fragmentation(free, cpu, self.access(ledger, nodes), self.workload)

    @staticmethod
    def after_whole(free: IntArray, req: GpuRequest) -> IntArray:
        """(K,G) free milli once a CPU-only or whole-GPU request has taken the tightest GPUs that fit."""
        free = free.copy()
        if req.gpu_count and req.milli == FULL_MILLI:
            # Only idle GPUs fit a whole-GPU share, and all look alike: the tightest are the first by index.
            idle = free == FULL_MILLI
            free[idle & (np.cumsum(idle, axis=1) <= req.gpu_count)] = 0
        elif req.gpu_count:
            for i in range(len(free)):
                order = np.argsort(free[i], kind="stable")
                taken = [g for g in order if free[i, g] >= req.milli][: req.gpu_count]
                free[i, taken] -= req.milli
        return free
