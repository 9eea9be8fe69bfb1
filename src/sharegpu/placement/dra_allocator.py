"""A model of the stock kube-scheduler placing a pod whose GPU comes from a DRA claim (the ``dra-default`` policy).

On the DRA path sharegpu does not choose: the kube-scheduler's default profile picks the node and the
structured-parameters allocator (k8s.io/dynamic-resource-allocation/structured) picks the device. This module
reproduces both choices so the simulator can measure what they cost against sharegpu's own placement.

Node choice. Of the default profile's score plugins, only two tell nodes apart in the simulator (no taints,
affinities, images or spread constraints): NodeResourcesFit with the LeastAllocated strategy on cpu and memory
(weight 1 each) and NodeResourcesBalancedAllocation over the same two resources; both plugins weigh 1 in the
profile. Neither sees GPUs: a claim's devices are not node resources, so GPU use plays no part in the node's
score, and LeastAllocated spreads pods over the emptiest nodes. Ties are broken uniformly at random, as the
scheduler's selectHost does.

- LeastAllocated, per resource: ``(allocatable - requested) * 100 // allocatable`` (integer), 0 when the
  request exceeds the allocatable; the node's score is the weighted integer mean. ``requested`` is what the
  node's pods request plus the incoming pod's request, where a pod that asks for no cpu (memory) counts as
  100m (200Mi): the scheduler's "non-zero" requests, which keep best-effort pods from piling up.
- BalancedAllocation: the fractions ``requested / allocatable`` (capped at 1, actual requests, no non-zero
  defaults) of cpu and memory; ``int((1 - |f_cpu - f_mem| / 2) * 100)``. A pod that requests neither is not
  scored by it (every node gets 0).

Device choice. The allocator walks the node's pools, their slices and each slice's devices in order and takes
the first full solution: first fit, no scoring. Our driver publishes one device slice per GPU, in index order
(``node/dra/slices.py``), so first fit is taken in GPU index order: a share lands on the lowest-indexed GPU with
enough capacity left, a whole-GPU claim on the lowest-indexed idle GPUs. (The scheduler hands the allocator the
slices in the order its informer lists them, which Kubernetes does not promise to be the publishing order;
index order is the driver's order and the one a user reading the slices would expect.)

Known gaps: non-zero defaults apply to the incoming pod only (residents count what they asked; one pod in
the openb traces asks for no cpu), and ``percentageOfNodesToScore`` (the scheduler scores only the first
feasible nodes it finds, about 41 % of a 1,213-node cluster, found round-robin) is not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from sharegpu.ledger import Ledger
from sharegpu.placement.framework import CycleState, IntArray, Policy

MAX_NODE_SCORE = 100  # the scheduler framework's MaxNodeScore
NON_ZERO_CPU_MILLI = 100  # what the scheduler counts for a pod that requests no cpu ...
NON_ZERO_MEMORY_MIB = 200  # ... and no memory (DefaultMemoryRequest, 200 MiB)


def least_allocated(requested: IntArray, allocatable: IntArray) -> IntArray:
    """LeastAllocated's per-resource score: the unused share of the allocatable, on 0..100, rounded down."""
    cap = np.maximum(allocatable, 1)
    out: IntArray = np.where(
        (allocatable > 0) & (requested <= allocatable), (allocatable - requested) * MAX_NODE_SCORE // cap, 0
    )
    return out


def balanced_allocation(fractions: npt.NDArray[np.float64]) -> IntArray:
    """BalancedAllocation's score from (K,2) requested fractions of cpu and memory: 100 when they are equal."""
    f = np.minimum(fractions, 1.0)
    std = np.abs(f[:, 0] - f[:, 1]) / 2
    out: IntArray = ((1.0 - std) * MAX_NODE_SCORE).astype(np.int64)  # truncation, as Go's int64() of a float
    return out


@dataclass(frozen=True)
class LeastAllocatedScore:
    """NodeResourcesFit, LeastAllocated strategy, cpu and memory weighing 1 each."""

    name: str = "least-allocated"
    node_local: bool = True

    def score(self, ledger: Ledger, state: CycleState, nodes: IntArray) -> IntArray:
        req = state.request
        cpu = (ledger.cpu_total[nodes] - ledger.cpu_free[nodes]) + (req.cpu_milli or NON_ZERO_CPU_MILLI)
        mem = (ledger.mem_total[nodes] - ledger.mem_free[nodes]) + (req.host_memory_mib or NON_ZERO_MEMORY_MIB)
        total: IntArray = least_allocated(cpu, ledger.cpu_total[nodes]) + least_allocated(mem, ledger.mem_total[nodes])
        return total // 2


@dataclass(frozen=True)
class BalancedAllocationScore:
    """NodeResourcesBalancedAllocation over cpu and memory."""

    name: str = "balanced-allocation"
    node_local: bool = True

    def score(self, ledger: Ledger, state: CycleState, nodes: IntArray) -> IntArray:
        req = state.request
        if req.cpu_milli == 0 and req.host_memory_mib == 0:
            return np.zeros(len(nodes), dtype=np.int64)  # skipped for best-effort pods
        cpu = (ledger.cpu_total[nodes] - ledger.cpu_free[nodes] + req.cpu_milli) / np.maximum(
            ledger.cpu_total[nodes], 1
        )
        mem = (ledger.mem_total[nodes] - ledger.mem_free[nodes] + req.host_memory_mib) / np.maximum(
            ledger.mem_total[nodes], 1
        )
        return balanced_allocation(np.stack([cpu, mem], axis=1))


@dataclass(frozen=True)
class FirstFitGpus:
    """The allocator's device choice: the first GPUs in index order that can take the claim (first fit)."""

    def select(self, ledger: Ledger, state: CycleState, node: int) -> list[int]:
        usable = np.flatnonzero(state.usable[node])
        return [int(g) for g in usable[: state.request.gpu_count]]


def dra_default_policy() -> Policy:
    return Policy(
        "dra-default",
        ((LeastAllocatedScore(), 1), (BalancedAllocationScore(), 1)),
        FirstFitGpus(),
        tie_break="random",
        description="the stock kube-scheduler and DRA allocator: GPU-blind node score, first-fit device",
    )
