"""The FGD paper's baselines: Random, DotProduct, GpuClustering, GpuPacking and BestFit, and the plain GPU selectors.

They follow the reference simulator of the FGD paper (kubernetes-scheduler-simulator): integer scores in 0–100 from the
node's free CPU and free GPU milli, with its constants (128 CPU cores and 8 GPUs as the scale).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sharegpu.ledger import Ledger
from sharegpu.model.assignment import Assignment, Mechanism
from sharegpu.model.request import FULL_MILLI, GpuRequest
from sharegpu.placement.fragmentation import (
    free_milli,
    is_sharing,
    shape_cpu,
)
from sharegpu.placement.framework import CycleState, IntArray

MAX_SPEC_CPU = 128_000  # the reference's scale: a 128-core node
MAX_SPEC_GPU = 8 * FULL_MILLI  # and an 8-GPU node


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
