"""GPU fragmentation against a workload distribution (FGD, USENIX ATC '23), vectorised over nodes.

A node's fragmentation for a task shape m is all its free GPU milli when m cannot run there at all (a CPU-only
shape, a model m may not use, too little CPU, fewer than num_gpu GPUs with enough free milli), and otherwise
the free milli on GPUs whose free milli is below m's share. The node's fragmentation is Σ p_m · F(m).
GPU memory plays no part. All arrays are (nodes × GPU slots) with absent or unhealthy GPUs counted as 0 free.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from sharegpu.model.request import GpuRequest

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


@dataclass(frozen=True)
class Workload:
    """The typical task shapes and their probabilities, as arrays for vectorised use."""

    shapes: tuple[TaskShape, ...]
    weights: FloatArray  # (M,)
    cpu: IntArray  # (M,)
    milli: IntArray  # (M,)
    count: IntArray  # (M,)
    cpu_per_gpu_milli: float = 0.0  # CPU milli the workload asks per milli-GPU (CPU-only tasks included)

    @classmethod
    def from_requests(cls, reqs: Iterable[GpuRequest], coverage: float = 0.95) -> Workload:
        """The most common shapes first until they cover ``coverage`` of the tasks (the crossing one included).

        Equal counts order by (cpu, gpu milli, gpu count, models) descending, as the reference does.
        """
        counts = Counter(
            TaskShape(shape_cpu(r), r.milli if r.gpu_count else 0, r.gpu_count, r.allowed_models) for r in reqs
        )
        if not counts:
            raise ValueError("a workload distribution needs at least one task")
        total = sum(counts.values())
        ordered = sorted(
            counts.items(),
            key=lambda kv: (kv[1], kv[0].cpu_milli, kv[0].gpu_milli, kv[0].gpu_count, "|".join(sorted(kv[0].models))),
            reverse=True,
        )
        chosen: list[tuple[TaskShape, int]] = []
        cum = 0
        for shape, c in ordered:
            chosen.append((shape, c))
            cum += c
            if cum >= coverage * total:
                break
        weights = np.array([c for _, c in chosen], dtype=np.float64) / cum
        shapes = tuple(s for s, _ in chosen)
        cpu = np.array([s.cpu_milli for s in shapes], dtype=np.int64)
        milli = np.array([s.gpu_milli for s in shapes], dtype=np.int64)
        count = np.array([s.gpu_count for s in shapes], dtype=np.int64)
        gpu = float((weights * milli * count).sum())
        ratio = float((weights * cpu).sum()) / gpu if gpu > 0 else 0.0
        return cls(shapes, weights, cpu, milli, count, ratio)

    def demand_blended(self) -> Workload:
        """The same shapes weighted half by how often they arrive and half by the GPU they bring.

        Counting tasks protects the many small shares; counting GPU demand protects the multi-GPU tasks that
        carry most of the allocation but are few. Fragmentation is linear in the weights, so the blend is
        the even mean of both views, computed once.
        """
        demand = self.weights * self.milli * self.count
        if demand.sum() <= 0:
            return self
        weights = 0.5 * self.weights + 0.5 * demand / demand.sum()
        return Workload(self.shapes, weights, self.cpu, self.milli, self.count, self.cpu_per_gpu_milli)

    def access(self, model_names: list[str]) -> BoolArray:
        """(models × shapes): may shape m run on model k."""
        out = np.zeros((len(model_names), len(self.shapes)), dtype=bool)
        for k, name in enumerate(model_names):
            for m, s in enumerate(self.shapes):
                out[k, m] = not s.models or name in s.models
        return out


def node_fragmentation(free: IntArray, cpu_free: IntArray, access: BoolArray, wl: Workload) -> FloatArray:
    """Σ_m p_m · F_m for each node: free (K,G), cpu_free (K,), access (K,M) → (K,)."""
    ge = free[:, :, None] >= wl.milli[None, None, :]  # (K,G,M)
    cnt = ge.sum(axis=1)
    sum_lt = np.where(ge, 0, free[:, :, None]).sum(axis=1)
    idle = free.sum(axis=1)
    return _combine(cnt, sum_lt, idle, cpu_free, access, wl)


def _combine(
    cnt: IntArray, sum_lt: IntArray, idle: IntArray, cpu_free: IntArray, access: BoolArray, wl: Workload
) -> FloatArray:
    runs = access & (wl.milli > 0)[None, :] & (cnt >= wl.count[None, :]) & (cpu_free[:, None] >= wl.cpu[None, :])
    frag = np.where(runs, sum_lt, idle[:, None]).astype(np.float64)
    result: FloatArray = frag @ wl.weights
    return result


def share_fragmentation(
    free: IntArray, cpu_free: IntArray, access: BoolArray, wl: Workload, milli: int, cpu: int
) -> FloatArray:
    """(K,G): each node's fragmentation after one ``milli`` share lands on GPU g (and ``cpu`` leaves the node).

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
    frag = np.where(runs, sum_g, np.broadcast_to(idle_g[:, :, None], runs.shape)).astype(np.float64)
    result: FloatArray = frag @ wl.weights
    return result


def fgd_score(before: FloatArray, after: FloatArray) -> IntArray:
    """The reference's integer score: int(100 · sigmoid((F_before − F_after) / 1000)); higher is better."""
    x = (before - after) / 1000.0
    return (100.0 / (1.0 + np.exp(-x))).astype(np.int64)
