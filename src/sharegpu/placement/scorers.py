"""Score plugins and GPU selectors: the FGD paper's baselines, FGD itself, and sharegpu's own.

Baselines follow the reference simulator of the FGD paper (kubernetes-scheduler-simulator): integer scores in
0–100 from the node's free CPU and free GPU milli, with its constants (128 CPU cores and 8 GPUs as the scale).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from sharegpu.ledger import Ledger
from sharegpu.model.assignment import Assignment, Mechanism
from sharegpu.model.request import FULL_MILLI, GpuRequest
from sharegpu.placement.fragmentation import (
    Workload,
    fgd_score,
    model_pressure,
    node_fragmentation,
    shape_cpu,
    shape_fragmentation,
    share_fragmentation,
    share_shape_fragmentation,
)
from sharegpu.placement.framework import CycleState, IntArray

MAX_SPEC_CPU = 128_000  # the reference's scale: a 128-core node
MAX_SPEC_GPU = 8 * FULL_MILLI  # and an 8-GPU node

FloatArray = npt.NDArray[np.float64]


def free_milli(ledger: Ledger, nodes: IntArray) -> IntArray:
    """(K,G) free milli of each GPU, 0 where absent or unhealthy."""
    out: IntArray = np.where(ledger.healthy[nodes], ledger.free_milli[nodes], 0)
    return out


def is_sharing(req: GpuRequest) -> bool:
    return req.gpu_count == 1 and req.milli < FULL_MILLI


# ----- baselines ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RandomScore:
    """One feasible node, drawn uniformly, scores 100; the rest 0."""

    name: str = "random"
    node_local: bool = False

    def score(self, ledger: Ledger, state: CycleState, nodes: IntArray) -> IntArray:
        out = np.zeros(len(nodes), dtype=np.int64)
        out[state.rng.integers(len(nodes))] = 100
        return out


@dataclass(frozen=True)
class DotProductScore:
    """Prefers the node whose free (CPU, GPU) vector has the smallest dot product with the request."""

    name: str = "dotprod"
    node_local: bool = True

    def score(self, ledger: Ledger, state: CycleState, nodes: IntArray) -> IntArray:
        req = state.request
        cpu_left = ledger.cpu_free[nodes] / MAX_SPEC_CPU
        gpu_left = free_milli(ledger, nodes).sum(axis=1) / MAX_SPEC_GPU
        d = (cpu_left * shape_cpu(req) / MAX_SPEC_CPU + gpu_left * req.total_milli / MAX_SPEC_GPU) / 2
        out: IntArray = (100 * (1 - d)).astype(np.int64)
        return out


def pod_tag(a: Assignment) -> str | None:
    """The clustering tag of a placed pod: CPU-only pods have none."""
    if not a.shares:
        return None
    s = a.shares[0]
    if len(a.shares) == 1 and s.mechanism is not Mechanism.EXCLUSIVE:
        return "share-gpu"
    return f"{len(a.shares)}-gpu"


def request_tag(req: GpuRequest) -> str | None:
    if req.gpu_count == 0:
        return None
    return "share-gpu" if is_sharing(req) else f"{req.gpu_count}-gpu"


@dataclass(frozen=True)
class GpuClusteringScore:
    """Packs pods of one kind (shared, 1-GPU, 8-GPU, …) together, then by GPU use."""

    name: str = "clustering"
    node_local: bool = True

    def score(self, ledger: Ledger, state: CycleState, nodes: IntArray) -> IntArray:
        tag = request_tag(state.request)
        out = np.zeros(len(nodes), dtype=np.int64)
        if tag is None:
            return out
        used = MAX_SPEC_GPU - free_milli(ledger, nodes).sum(axis=1)
        base = 25 * used // MAX_SPEC_GPU
        for i, n in enumerate(nodes):
            tags = {t for p in ledger.node_pods[n] if (t := pod_tag(ledger.assignments[p])) is not None}
            bonus = (75 if len(tags) == 1 else 50) if tag in tags else 25 if not tags else 0
            out[i] = base[i] + bonus
        return out


@dataclass(frozen=True)
class GpuPackingScore:
    """Prefers partly used GPUs, then partly used nodes, and leaves idle nodes for last."""

    name: str = "packing"
    node_local: bool = True

    def score(self, ledger: Ledger, state: CycleState, nodes: IntArray) -> IntArray:
        req = state.request
        out = np.zeros(len(nodes), dtype=np.int64)
        if req.gpu_count == 0:
            return out
        free = free_milli(ledger, nodes)
        counts = ledger.gpu_count[nodes]
        full = (free == FULL_MILLI).sum(axis=1)
        for i in range(len(nodes)):
            g = int(counts[i])
            f = int(full[i])
            if f == g:
                out[i] = max(33 - f, f)
                continue
            left = free[i, :g]
            chosen = [int(x) for x in left[np.argsort(left, kind="stable")] if x >= req.milli][: req.gpu_count]
            k = sum(1 for x in chosen if x == FULL_MILLI)
            if k > 0:
                out[i] = max(50 - k, 33)
            else:
                s = sum(x * 100 // FULL_MILLI for x in chosen)
                out[i] = max(100 - s // 10, 50)
        return out


@dataclass(frozen=True)
class BestFitScore:
    """Prefers the node with the least CPU and GPU left after placement (equal weights)."""

    name: str = "bestfit"
    node_local: bool = True

    def score(self, ledger: Ledger, state: CycleState, nodes: IntArray) -> IntArray:
        req = state.request
        cpu = (ledger.cpu_free[nodes] - shape_cpu(req)) / MAX_SPEC_CPU
        gpu = (free_milli(ledger, nodes).sum(axis=1) - req.total_milli) / MAX_SPEC_GPU
        out: IntArray = ((1 - (0.5 * cpu + 0.5 * gpu)) * 100).astype(np.int64)
        return out


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


@dataclass(frozen=True)
class FgdScore:
    """Fragmentation gradient descent: the node (and GPU) whose fragmentation grows least."""

    model: FragmentationModel
    name: str = "fgd"
    node_local: bool = True

    def score(self, ledger: Ledger, state: CycleState, nodes: IntArray) -> IntArray:
        req = state.request
        if is_sharing(req):
            per_gpu = fgd_score(np.zeros(1), self.model.share_delta(ledger, req, nodes))
            out: IntArray = np.where(state.usable[nodes], per_gpu, -1).max(axis=1)
            return out
        return fgd_score(self.model.before(ledger, nodes), self.model.whole_after(ledger, req, nodes))


# ----- GPU selectors ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BestFitGpus:
    """The usable GPUs with the least free compute, lowest index first on ties."""

    def select(self, ledger: Ledger, state: CycleState, node: int) -> list[int]:
        usable = np.flatnonzero(state.usable[node])
        order = usable[np.argsort(ledger.free_milli[node, usable], kind="stable")]
        return [int(g) for g in order[: state.request.gpu_count]]


@dataclass(frozen=True)
class RandomGpus:
    """A share on a uniformly drawn usable GPU; whole GPUs first-free by index."""

    def select(self, ledger: Ledger, state: CycleState, node: int) -> list[int]:
        usable = np.flatnonzero(state.usable[node])
        if is_sharing(state.request):
            return [int(usable[state.rng.integers(len(usable))])]
        return [int(g) for g in usable[: state.request.gpu_count]]


@dataclass(frozen=True)
class FgdGpus:
    """A share on the first GPU with the best fragmentation score; whole GPUs best-fit."""

    model: FragmentationModel

    def select(self, ledger: Ledger, state: CycleState, node: int) -> list[int]:
        req = state.request
        if not is_sharing(req):
            return BestFitGpus().select(ledger, state, node)
        per_gpu = fgd_score(np.zeros(1), self.model.share_delta(ledger, req, np.array([node]))[0])
        per_gpu = np.where(state.usable[node], per_gpu, -1)
        return [int(np.argmax(per_gpu))]


# ----- sharegpu -----------------------------------------------------------------------------------------------
_PRIMARY = 10**15  # key layout: FGD's score · 10^15 + refinement · 10^6 + node tightness · 10^3 + GPU tightness
_REFINE = 10**6
_REFINE_SPAN = 10**9  # the refinement, shifted to be non-negative, lives in [0, 10^9)
TIE_SCALE = 1000  # each tightness lives in [0, TIE_SCALE)


@dataclass(frozen=True, eq=False)
class RefinedFgdScore:
    """sharegpu's score: FGD's decision, with its ties settled by what FGD cannot see.

    The primary key is FGD's own integer score (its typical shapes and weights). It is coarse: int(100 ·
    sigmoid(ΔF / 1000)) cannot tell apart changes below about 40 milli-GPU, so FGD leaves most decisions to a
    tie-break by node name. Among the placements FGD rates best, sharegpu takes the one that wastes least:
    1. the exact growth of fragmentation, with the shapes weighted half by how often they arrive and half by the
       GPU they bring, and with the rare large shapes that carry much of the demand (:attr:`Workload.extras`,
       e.g. 8-GPU tasks that only the CPU-richest nodes can host) counted too;
    2. plus the growth of stranded GPU: free GPUs that the node's free CPU cannot feed at the workload's typical
       CPU per GPU, which FGD sees only once a node crosses a task's CPU threshold;
    3. plus, where the workload confines some shapes to some GPU models, the GPU taken from a model in proportion
       to that model's pressure (:func:`model_pressure`: how much of it the confined shapes are expected to claim),
       so that a request that may run anywhere leaves the scarce models to the requests that may run only there;
    4. then the tightest node (least GPU and CPU left), then the tightest GPU, so that idle nodes stay idle.
    Because FGD's score stays the primary key, the refinements can only choose among placements FGD itself
    would have rated best; they never overrule it.

    Every term of a node depends only on that node's state and the request's shape (the framework memoises
    it), and each row is summed on its own (no BLAS), so a node's key does not depend on which other nodes are
    scored with it.
    """

    model: FragmentationModel  # over the typical shapes and the extras
    fgd_weights: FloatArray  # FGD's: task counts over its typical shapes, 0 on the extras
    weights: FloatArray  # the refinement's: half task counts, half GPU demand, over all shapes
    name: str = "sharegpu"
    node_local: bool = True
    # the last ledger asked about and its (models + 1,) pressures: a ledger's nodes and models never change, and
    # one scorer serves one ledger at a time, so an identity check replaces an O(nodes) recount per decision
    _pressures: list[tuple[Ledger, FloatArray]] = field(default_factory=list, init=False, repr=False, compare=False)

    @classmethod
    def of(cls, workload: Workload) -> RefinedFgdScore:
        ext = workload.extended()
        fgd = np.zeros(len(ext.shapes), dtype=np.float64)
        fgd[: len(workload.shapes)] = workload.weights
        return cls(FragmentationModel(ext), fgd, 0.5 * ext.weights + 0.5 * ext.demand_weights())

    def score(self, ledger: Ledger, state: CycleState, nodes: IntArray) -> IntArray:
        keys = self.keys(ledger, state, nodes)
        if keys.ndim == 1:
            return keys
        out: IntArray = np.where(state.usable[nodes], keys, -1).max(axis=1)
        return out

    def keys(self, ledger: Ledger, state: CycleState, nodes: IntArray) -> IntArray:
        """(K,G) keys of a share on each GPU of ``nodes``, or (K,) keys of any other request; higher is better.

        Memoised per node and request shape, so that the GPU selector reads the keys its node was scored with.
        """

        def compute(idx: IntArray) -> IntArray:
            return self._keys(ledger, state, idx)

        out: IntArray = state.per_node(("sharegpu-keys", self, state.request.shape_key()), nodes, compute)
        return out

    def _keys(self, ledger: Ledger, state: CycleState, nodes: IntArray) -> IntArray:
        req = state.request
        model = self.model
        wl = model.workload
        free = free_milli(ledger, nodes)
        cpu = ledger.cpu_free[nodes]
        access = model.access(ledger, nodes)

        def fragmentation(idx: IntArray) -> IntArray:
            return shape_fragmentation(free_milli(ledger, idx), ledger.cpu_free[idx], model.access(ledger, idx), wl)

        before: IntArray = state.per_node(("sharegpu-fragmentation", self), nodes, fragmentation)
        gpu = free.sum(axis=1)
        stranding = model.stranded(gpu - req.total_milli, cpu - req.cpu_milli) - model.stranded(gpu, cpu)
        waste = stranding + req.total_milli * self.pressures(ledger)[ledger.node_model_id[nodes]]
        node_tight = _tightness(ledger, req, nodes)
        if is_sharing(req):
            grow = share_shape_fragmentation(free, cpu, access, wl, req.milli, shape_cpu(req)) - before[:, None, :]
            gpu_tight = np.clip(FULL_MILLI - free, 0, TIE_SCALE - 1)
            return self._combine(grow, waste[:, None], node_tight[:, None], gpu_tight)
        after = shape_fragmentation(model.after_whole(free, req), cpu - shape_cpu(req), access, wl)
        return self._combine(after - before, waste, node_tight, np.zeros_like(node_tight))

    def pressures(self, ledger: Ledger) -> FloatArray:
        """(models + 1,) :func:`model_pressure` of each of the ledger's GPU models, then 0 for nodes without GPUs
        (``node_model_id`` −1 reads the last entry)."""
        if self._pressures and self._pressures[0][0] is ledger:
            return self._pressures[0][1]
        has = ledger.node_model_id >= 0
        capacity: FloatArray = np.bincount(
            ledger.node_model_id[has], weights=ledger.gpu_count[has], minlength=len(ledger.model_names)
        ).astype(np.float64)
        out = np.append(model_pressure(self.model.workload, list(ledger.model_names), capacity), 0.0)
        self._pressures[:] = [(ledger, out)]
        return out

    def _combine(self, grow: IntArray, other: FloatArray, node_tight: IntArray, gpu_tight: IntArray) -> IntArray:
        """``other``: the waste beyond fragmentation (stranded GPU, scarce-model GPU taken), in milli-GPU."""
        primary = fgd_score(np.zeros(1), (grow * self.fgd_weights).sum(axis=-1))
        waste = np.round((grow * self.weights).sum(axis=-1) + other).astype(np.int64)
        refine = np.clip(_REFINE_SPAN // 2 - waste, 0, _REFINE_SPAN - 1)
        out: IntArray = primary * _PRIMARY + refine * _REFINE + node_tight * TIE_SCALE + gpu_tight
        return out


def _tightness(ledger: Ledger, req: GpuRequest, nodes: IntArray) -> IntArray:
    """Best fit in [0, TIE_SCALE): higher when less GPU and CPU stay free on the node after placement."""
    gpu_left = (free_milli(ledger, nodes).sum(axis=1) - req.total_milli) / np.maximum(
        ledger.gpu_count[nodes] * FULL_MILLI, 1
    )
    cpu_left = (ledger.cpu_free[nodes] - req.cpu_milli) / np.maximum(ledger.cpu_total[nodes], 1)
    frac = np.clip(0.5 * gpu_left + 0.5 * cpu_left, 0.0, 1.0)
    out: IntArray = ((1.0 - frac) * (TIE_SCALE - 1)).astype(np.int64)
    return out


@dataclass(frozen=True)
class RefinedFgdGpus:
    """A share on the GPU with the best key of :class:`RefinedFgdScore` (the one its node's score came from,
    first by index on ties); whole GPUs best-fit."""

    scorer: RefinedFgdScore

    def select(self, ledger: Ledger, state: CycleState, node: int) -> list[int]:
        req = state.request
        if not is_sharing(req):
            return BestFitGpus().select(ledger, state, node)
        keys = self.scorer.keys(ledger, state, np.array([node], dtype=np.int64))[0]
        return [int(np.argmax(np.where(state.usable[node], keys, -1)))]
