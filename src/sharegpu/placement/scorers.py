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
    node_fragmentation,
    shape_cpu,
    share_fragmentation,
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
        free = free_milli(ledger, nodes).copy()
        if req.gpu_count and req.milli == FULL_MILLI:
            # Only idle GPUs fit a whole-GPU share, and all look alike: the tightest are the first by index.
            idle = free == FULL_MILLI
            free[idle & (np.cumsum(idle, axis=1) <= req.gpu_count)] = 0
        elif req.gpu_count:
            for i in range(len(nodes)):
                order = np.argsort(free[i], kind="stable")
                taken = [g for g in order if free[i, g] >= req.milli][: req.gpu_count]
                free[i, taken] -= req.milli
        cpu = ledger.cpu_free[nodes] - shape_cpu(req)
        return node_fragmentation(free, cpu, self.access(ledger, nodes), self.workload)


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
TIE_SCALE = 1000  # the secondary score lives in [0, TIE_SCALE)


@dataclass(frozen=True)
class FragmentationDeltaScore:
    """sharegpu's score: the least growth of GPU that the expected workload cannot use, tighter nodes first.

    Two kinds of waste grow with a placement. Fragmentation (FGD): free GPU milli that the typical tasks cannot
    use, measured here exactly, since FGD's int(100 · sigmoid(ΔF / 1000)) cannot tell apart changes below about
    40 milli-GPU and leaves most decisions to a tie-break by node name; and with the task shapes weighted half
    by count and half by GPU demand (:meth:`Workload.demand_blended`), so that the few multi-GPU tasks that
    bring much of the demand keep whole idle nodes to land on. And stranding, which FGD sees only once
    a node crosses a task's CPU threshold: free GPUs that the node's free CPU cannot feed at the workload's
    typical CPU per GPU. CPU-only and CPU-heavy tasks therefore go where CPU is in surplus rather than onto
    GPU-rich nodes whose CPU they would use up. Among equal waste the node left with the least free GPU and CPU
    (best fit) wins, so that idle nodes stay idle for the large requests that need them.
    """

    model: FragmentationModel
    name: str = "sharegpu"
    node_local: bool = True

    def score(self, ledger: Ledger, state: CycleState, nodes: IntArray) -> IntArray:
        req = state.request
        if is_sharing(req):
            delta = np.where(state.usable[nodes], self.model.share_delta(ledger, req, nodes), np.inf).min(axis=1)
        else:
            delta = self.model.whole_after(ledger, req, nodes) - self.model.before(ledger, nodes)
        gpu = free_milli(ledger, nodes).sum(axis=1)
        cpu = ledger.cpu_free[nodes]
        stranding = self.model.stranded(gpu - req.total_milli, cpu - req.cpu_milli) - self.model.stranded(gpu, cpu)
        primary: IntArray = -np.round(delta + stranding).astype(np.int64)
        return primary * TIE_SCALE + _tightness(ledger, req, nodes)


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
class FragmentationDeltaGpus:
    """A share on the GPU whose fragmentation grows least, the tightest such GPU first; whole GPUs best-fit."""

    model: FragmentationModel

    def select(self, ledger: Ledger, state: CycleState, node: int) -> list[int]:
        req = state.request
        if not is_sharing(req):
            return BestFitGpus().select(ledger, state, node)
        delta = self.model.share_delta(ledger, req, np.array([node]))[0]
        usable = np.flatnonzero(state.usable[node])
        key = np.lexsort((usable, ledger.free_milli[node, usable], np.round(delta[usable])))
        return [int(usable[key[0]])]
