"""sharegpu's own score: FGD refined (model pressure, the workload's extra shapes, tightness as the tie-break)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from sharegpu.ledger import Ledger
from sharegpu.model.request import FULL_MILLI, GpuRequest
from sharegpu.placement.fragmentation import (
    FloatArray,
    FragmentationModel,
    ModelPressure,
    Workload,
    fgd_score,
    free_milli,
    is_sharing,
    shape_cpu,
    shape_fragmentation,
    share_shape_fragmentation,
)
from sharegpu.placement.framework import CycleState, IntArray
from sharegpu.placement.plugins.baseline import BestFitGpus

# ----- sharegpu -----------------------------------------------------------------------------------------------
_PRIMARY = 10**15  # key layout: primary score · 10^15 + refinement · 10^6 + node tightness · 10^3 + GPU tightness
_REFINE = 10**6
_REFINE_SPAN = 10**9  # the refinement, shifted to be non-negative, lives in [0, 10^9)
TIE_SCALE = 1000  # each tightness lives in [0, TIE_SCALE)
# FGD's integer score 100 · sigmoid(−ΔF / 1000) changes by 25 points per GPU (1000 milli) of ΔF around ΔF = 0:
# the rate at which the model pressure's cost, in milli-GPU, is taken off FGD's score.
_SCORE_PER_GPU = 25
# Bound on that deduction, in score points, so that keys stay within int64 when a model's free capacity nears 0
# and its pressure grows without bound (1000 points is 40 GPUs of cost: far beyond any real difference).
_MAX_DEDUCTION = 1000
_UNUSABLE = np.iinfo(np.int64).min  # the key of a GPU that cannot host the share (keys may be negative)


@dataclass(frozen=True, eq=False)
class RefinedFgdScore:
    """sharegpu's score: FGD's decision, less the cost of claiming scarce GPU models, with its ties settled by
    what FGD cannot see.

    The primary key is FGD's own integer score (its typical shapes and weights), less, where the workload confines
    some shapes to some GPU models, the **model pressure** cost: the GPU the placement takes from a model, or
    strands there by taking the node's CPU, times that model's pressure (:func:`model_pressure` over the free
    capacity of each model *now*: how much of what is left of it the confined shapes are expected to claim),
    converted to score points at FGD's own rate around ΔF = 0. So a request that may run anywhere leaves the
    models that confined requests will need, unless FGD sees a fragmentation gain that outweighs it. Without
    confined shapes every pressure is 0 and the primary key is FGD's score exactly: there sharegpu only chooses
    among the placements FGD rates best, never overruling it.

    FGD's score is coarse: int(100 · sigmoid(ΔF / 1000)) cannot tell apart changes below about 40 milli-GPU, so
    FGD leaves most decisions to a tie-break by node name. Among the placements rated best, sharegpu takes the one
    that wastes least:
    1. the exact growth of fragmentation, with the shapes weighted half by how often they arrive and half by the
       GPU they bring, and with the rare large shapes that carry much of the demand (:attr:`Workload.extras`,
       e.g. 8-GPU tasks that only the CPU-richest nodes can host) counted too;
    2. plus the growth of stranded GPU: free GPUs that the node's free CPU cannot feed at the workload's typical
       CPU per GPU, which FGD sees only once a node crosses a task's CPU threshold;
    3. plus the model pressure cost in milli-GPU, exactly;
    4. then the tightest node (least GPU and CPU left), then the tightest GPU, so that idle nodes stay idle.

    The pressure follows the whole cluster's free capacity, so a node's key is not a function of that node alone
    (``node_local`` is False where some shape is confined): the scorer memoises the parts of a key that are (fragmentation growth, stranding,
    tightness) per node and request shape, and adds the pressure cost on every decision. Each row is summed on its
    own (no BLAS), so a node's key does not depend on which other nodes are scored with it.
    """

    model: FragmentationModel  # over the typical shapes and the extras
    fgd_weights: FloatArray  # FGD's: task counts over its typical shapes, 0 on the extras
    weights: FloatArray  # the refinement's: half task counts, half GPU demand, over all shapes
    name: str = "sharegpu"
    # False where some shape is confined to GPU models: the pressure follows the whole cluster (see :meth:`of`)
    node_local: bool = False
    # the constrained shapes over each list of model names (a ledger's models never change): a memo, since every
    # decision asks for the pressures
    _pressure: dict[tuple[str, ...], ModelPressure] = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def of(cls, workload: Workload) -> RefinedFgdScore:
        ext = workload.extended()
        fgd = np.zeros(len(ext.shapes), dtype=np.float64)
        fgd[: len(workload.shapes)] = workload.weights
        # Without a shape confined to some models no pressure ever arises and a key depends on its node alone, so
        # the framework may memoise scores per node as it did before the pressure followed the free capacity.
        confined = any(s.models for s in ext.shapes)
        return cls(
            FragmentationModel(ext), fgd, 0.5 * ext.weights + 0.5 * ext.demand_weights(), node_local=not confined
        )

    def score(self, ledger: Ledger, state: CycleState, nodes: IntArray) -> IntArray:
        keys = self.keys(ledger, state, nodes)
        if keys.ndim == 1:
            return keys
        out: IntArray = np.where(state.usable[nodes], keys, _UNUSABLE).max(axis=1)
        return out

    def keys(self, ledger: Ledger, state: CycleState, nodes: IntArray) -> IntArray:
        """(K,G) keys of a share on each GPU of ``nodes``, or (K,) keys of any other request; higher is better.

        The node-local parts are memoised per node and request shape; the pressure is the ledger's of now, so the
        GPU selector, asking in the same cycle, reads the keys its node was scored with.
        """

        req = state.request
        if not self.confined(ledger):
            # No pressure anywhere: a key depends on its node alone, and whole keys are memoised.
            def compute_keys(idx: IntArray) -> IntArray:
                return self._combine(self._parts(ledger, state, idx), req.total_milli, None)

            keys: IntArray = state.per_node(("sharegpu-keys", self, req.shape_key()), nodes, compute_keys)
            return keys

        def compute(idx: IntArray) -> FloatArray:
            return self._parts(ledger, state, idx)

        parts: FloatArray = state.per_node(("sharegpu-parts", self, req.shape_key()), nodes, compute)
        pressure = self.pressures(ledger)[ledger.node_model_id[nodes]]
        return self._combine(parts, req.total_milli, pressure if parts.ndim == 2 else pressure[:, None])

    def _parts(self, ledger: Ledger, state: CycleState, nodes: IntArray) -> FloatArray:
        """(K,5) or (K,G,5): FGD-weighted and refinement-weighted fragmentation growth, stranding growth, node
        tightness, GPU tightness."""
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
        node_tight = _tightness(ledger, req, nodes).astype(np.float64)
        if is_sharing(req):
            grow = share_shape_fragmentation(free, cpu, access, wl, req.milli, shape_cpu(req)) - before[:, None, :]
            gpu_tight = np.clip(FULL_MILLI - free, 0, TIE_SCALE - 1).astype(np.float64)
            k, g = free.shape
            return np.stack(
                [
                    (grow * self.fgd_weights).sum(axis=-1),
                    (grow * self.weights).sum(axis=-1),
                    np.broadcast_to(stranding[:, None], (k, g)),
                    np.broadcast_to(node_tight[:, None], (k, g)),
                    gpu_tight,
                ],
                axis=-1,
            )
        grow = shape_fragmentation(model.after_whole(free, req), cpu - shape_cpu(req), access, wl) - before
        return np.stack(
            [
                (grow * self.fgd_weights).sum(axis=-1),
                (grow * self.weights).sum(axis=-1),
                stranding,
                node_tight,
                np.zeros_like(node_tight),
            ],
            axis=-1,
        )

    def pressures(self, ledger: Ledger) -> FloatArray:
        """(models + 1,) :func:`model_pressure` of each of the ledger's GPU models over their free capacity now
        (healthy GPUs' free milli), then 0 for nodes without GPUs (``node_model_id`` −1 reads the last entry)."""
        names = tuple(ledger.model_names)
        pressure = self._pressure_of(ledger)
        if not len(pressure.demand):
            return np.zeros(len(names) + 1, dtype=np.float64)  # no confined shape: no pressure, nothing to count
        has = ledger.node_model_id >= 0
        free = np.where(ledger.healthy, ledger.free_milli, 0).sum(axis=1)
        capacity: FloatArray = np.bincount(ledger.node_model_id[has], weights=free[has], minlength=len(names)).astype(
            np.float64
        )
        return np.append(pressure(capacity), 0.0)

    def confined(self, ledger: Ledger) -> bool:
        """Whether any typical shape may run on some of the ledger's GPU models but not all (else every pressure
        is 0)."""
        return bool(len(self._pressure_of(ledger).demand))

    def _pressure_of(self, ledger: Ledger) -> ModelPressure:
        names = tuple(ledger.model_names)
        pressure = self._pressure.get(names)
        if pressure is None:
            pressure = self._pressure[names] = ModelPressure.of(self.model.workload, list(names))
        return pressure

    def _combine(self, parts: FloatArray, total_milli: int, pressure: FloatArray | None) -> IntArray:
        """Keys from the memoised parts and the pressure of each row's model (broadcast over GPUs for a share;
        None where no model is under pressure)."""
        fgd_growth, growth, stranding, node_tight, gpu_tight = (parts[..., i] for i in range(5))
        primary = fgd_score(np.zeros(1), fgd_growth)
        other = stranding
        if pressure is not None:
            # the GPU of a pressured model that the placement takes, or strands there by taking CPU, times the
            # pressure
            claimed = total_milli * pressure + pressure * stranding
            deduction = np.clip(np.round(_SCORE_PER_GPU * claimed / FULL_MILLI), -_MAX_DEDUCTION, _MAX_DEDUCTION)
            primary = primary - deduction.astype(np.int64)
            other = stranding + claimed
        waste = np.round(growth + other).astype(np.int64)
        refine = np.clip(_REFINE_SPAN // 2 - waste, 0, _REFINE_SPAN - 1)
        out: IntArray = (
            primary * _PRIMARY + refine * _REFINE + node_tight.astype(np.int64) * TIE_SCALE + gpu_tight.astype(np.int64)
        )
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
        return [int(np.argmax(np.where(state.usable[node], keys, _UNUSABLE)))]
