"""Fragmentation gradient descent (the FGD paper): the node and GPU whose fragmentation grows least."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sharegpu.ledger import Ledger
from sharegpu.placement.fragmentation import (
    FragmentationModel,
    fgd_score,
    is_sharing,
)
from sharegpu.placement.framework import CycleState, IntArray
from sharegpu.placement.plugins.baseline import BestFitGpus


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
