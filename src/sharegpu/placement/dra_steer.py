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
from sharegpu.placement.dra_allocator import FirstFitGpus
from sharegpu.placement.fragmentation import Workload
from sharegpu.placement.framework import CycleState, IntArray, Policy
from sharegpu.placement.plugins.refined import RefinedFgdScore


def first_fit_gpu(usable: np.ndarray) -> IntArray:
    """(K,) index of the first usable GPU of each row of a (K,G) mask (0 where none is usable)."""
    out: IntArray = np.argmax(usable, axis=1).astype(np.int64)
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
