"""Steering the stock scheduler's DRA placement (the ``dra-steered`` policy): sharegpu chooses the node, the DRA
allocator still chooses the device.

On the DRA path the kube-scheduler's allocator takes the first device that fits on whatever node the scheduler
picks (``dra_allocator.FirstFitGpus``). The extender cannot change that, but its filter can leave the scheduler
one node: the one sharegpu would pick *knowing* that the device there will be first fit's, not sharegpu's best.
So each node is scored by sharegpu's key of the GPU first fit takes there (a share's key depends on the GPU it
lands on; a whole-GPU request's does not), and the device is first fit's. This is what the extender's filter
decides for DRA pods (:mod:`sharegpu.k8s.extender.dra_steer`) and what the simulator measures against ``dra-default``
(GPU-blind node, first-fit device) and ``sharegpu`` (sharegpu's node and device).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sharegpu.ledger import Ledger
from sharegpu.model.request import GpuRequest
from sharegpu.placement.dra_allocator import FirstFitGpus
from sharegpu.placement.fragmentation import Workload
from sharegpu.placement.framework import BoolArray, CycleState, IntArray, Policy
from sharegpu.placement.mechanism import UsablePlan, capped_gpus
from sharegpu.placement.plugins.refined import RefinedFgdScore


def first_fit_gpu(usable: np.ndarray) -> IntArray:
    """(K,) index of the first usable GPU of each row of a (K,G) mask (0 where none is usable)."""
    out: IntArray = np.argmax(usable, axis=1).astype(np.int64)
    return out


def beyond_cap(ledger: Ledger, req: GpuRequest, usable: np.ndarray, nodes: IntArray) -> BoolArray:
    """(K,) for each of ``nodes``: whether the allocator's first fit there would open a daemon beyond the cap. The
    allocator knows no tenants: it takes the lowest-indexed GPU with capacity for the share, which may be one that
    already runs the most MPS daemons a GPU may (none of them the share's tenant's) and that sharegpu's ``usable``
    (N,G) therefore leaves out. On the other nodes its first fit is the first usable GPU, as
    :class:`FirstFitSharegpuScore` scores it."""
    out: BoolArray = np.zeros(len(nodes), dtype=bool)
    if req.gpu_count != 1 or not req.may_use_mps or not ledger.full_units:
        return out  # the common case, at no cost: no GPU is at the cap
    capped = capped_gpus(ledger, req, UsablePlan.of(ledger, req))
    if not capped:
        return out
    rows = usable[nodes]
    first = first_fit_gpu(rows)
    some: BoolArray = np.asarray(rows.any(axis=1), dtype=bool)
    where = {int(n): i for i, n in enumerate(nodes)}
    for n, g in capped:
        i = where.get(n)
        if i is not None and not usable[n, g] and (not some[i] or g < first[i]):
            out[i] = True
    return out


@dataclass(frozen=True)
class FirstFitSharegpuScore:
    """sharegpu's key of the placement the DRA allocator will make on each node: for a share, the key of the first
    usable GPU (not of the best one); for whole GPUs sharegpu's key as it is (it does not depend on which idle
    GPUs are taken)."""

    inner: RefinedFgdScore
    name: str = "sharegpu-first-fit"

    @property
    def node_local(self) -> bool:
        """As sharegpu's key: not where the model pressure follows the whole cluster's free capacity."""
        return self.inner.node_local

    def score(self, ledger: Ledger, state: CycleState, nodes: IntArray) -> IntArray:
        keys = self.inner.keys(ledger, state, nodes)
        if keys.ndim == 1:
            return keys
        first = first_fit_gpu(state.usable[nodes])
        out: IntArray = keys[np.arange(len(nodes)), first]
        return out


def dra_steered_policy(workload: Workload) -> Policy:
    return Policy(
        "dra-steered",
        ((FirstFitSharegpuScore(RefinedFgdScore.of(workload)), 1),),
        FirstFitGpus(),
        description="DRA steered by the extender: sharegpu's node choice for the device first fit takes there",
    )
