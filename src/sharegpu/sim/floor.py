"""A floor under the GPUs that any *work-conserving* policy leaves idle on a trace prefix.

:mod:`sharegpu.sim.bound` bounds what any placement could allocate, online or offline, and may drop any pod. A
scheduler does not drop a pod that fits: under the FGD protocol a pod is skipped only when no node can take it.
Such a policy (every policy of this simulator, FGD and ``sharegpu`` included) is *work-conserving*, and that alone
puts a floor under the GPUs it leaves idle, whatever it scores:

**Shares pack with waste.** Every GPU that holds compute shares (one-GPU pods asking less than a whole GPU) idles
1000 milli less their sum, and whole-GPU pods can use only the GPUs that hold no share. Given the set Y of shares
placed, the linear relaxation of packing Y into GPUs, with whole-GPU pods filling the GPUs left over
(:func:`least_idle`), bounds the idle milli from below. On the openb traces a share of 810 milli fits with nothing
larger than 190 milli, so every such share costs about 190 idle milli on its own.

**Until a share fails, every share is placed; once one fails, no GPU it could have used is left.** Let t be the
first arrival of a share that no node takes (s its milli, c and m its CPU and memory, M its models). Every share
that arrived before t is placed. When t fails, no node of a model in M has a GPU with s milli free and c CPU and m
memory left, and with no departures nothing frees up later, so every pod after t that needs at least that fails
too: a whole-GPU or multi-GPU pod asking at least c CPU and m memory, a share of at least s milli asking as much, if
it may run only on models in M. So with t the first failure, lo(t) ≤ Y ≤ hi(t) (the shares before t; every share
less t and those failing with it) and the whole pods placed are at most those not failing with t.

The floor is the least of :func:`least_idle` over every share of the prefix as the first failure, and over "none
fails", since the policy decides which share fails first. A cheap first cut (every pod that may be placed placed)
and a lower bound that grows with t (lo(t) placed, nothing failing with t) leave few candidates for the exact LP.

What it assumes: GPUs of 1000 milli that are healthy, requests as the openb traces give them (whole GPUs or a
compute share of one GPU, no GPU memory, MIG or isolation asked), pods that never leave, and that a GPU with a
share's milli free takes the share when its node has the CPU and memory (the simulator's fit rules for these
requests). It is a floor for work-conserving policies only: a policy that turned away a share that fits could
leave fewer GPUs idle, down to what :func:`sharegpu.sim.bound.allocation_bound` allows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from scipy.optimize import linprog

from sharegpu.model.inventory import NodeSpec
from sharegpu.model.request import FULL_MILLI, GpuRequest
from sharegpu.placement.fragmentation import is_sharing
from sharegpu.sim.bound import BoundError, node_types, shapes

FloatArray = npt.NDArray[np.float64]

# Column generation stops when no pattern prices above the GPU's 1000 milli by more than this (relative): the LP
# is then solved to HiGHS's own tolerance, far below the tenth of a GPU the reports show.
_PRICING_TOL = 1e-9
_MAX_ROUNDS = 10_000
# The capacity row's slack costs far more than any milli placed is worth (1), so the LP uses it only where lo
# cannot fit otherwise; above this much slack, that is what it means.
_SLACK_COST = 1000.0
_INFEASIBLE_SLACK = 1e-6


@dataclass(frozen=True)
class Floor:
    """The floor of one prefix (module doc)."""

    idle_milli: float  # no work-conserving policy leaves fewer GPU milli idle at the end of the prefix
    all_placed_milli: float  # the floor if every share of the prefix is placed (inf: they cannot all be)
    first_failure: int | None  # arrival index (in the prefix) of the failing share that gives the floor; None: none
    capacity_milli: int
    arrived_milli: int
    lp_solves: int

    @property
    def idle_gpus(self) -> float:
        return self.idle_milli / FULL_MILLI

    @property
    def alloc_pct(self) -> float:
        """The allocation % of capacity that no work-conserving policy exceeds at the end of the prefix."""
        return 100 * (self.capacity_milli - self.idle_milli) / self.capacity_milli if self.capacity_milli else 0.0


class PatternPool:
    """Packings of one GPU found so far, shared by the LPs of one prefix: each LP starts from all of them."""

    def __init__(self, sizes: Sequence[int], capacity: int = FULL_MILLI) -> None:
        for s in sizes:
            if not 0 < s <= capacity:
                raise BoundError(f"a share of {s} milli does not fit a GPU of {capacity} milli")
        self.sizes = sorted(set(sizes))
        self.capacity = capacity
        self.step = math.gcd(capacity, *self.sizes)
        self.patterns: list[npt.NDArray[np.int64]] = []
        for i, s in enumerate(self.sizes):
            p = np.zeros(len(self.sizes), dtype=np.int64)
            p[i] = capacity // s
            self.patterns.append(p)


def least_idle(
    lo: Mapping[int, int],
    hi: Mapping[int, int],
    whole_milli: float,
    capacity_milli: int,
    pool: PatternPool | None = None,
) -> float:
    """The least idle milli on GPUs of ``pool.capacity`` milli each (``capacity_milli`` in all) when a set Y of
    shares, lo ≤ Y ≤ hi (counts per size in milli), is placed, and whole-GPU pods take at most ``whole_milli`` of
    the GPUs that no share uses; ``math.inf`` where even that relaxation cannot place lo.

    The linear relaxation: variables x_p ≥ 0 (GPUs packed by pattern p: sizes whose sum is at most a GPU), y (the
    shares placed) and u (the whole-GPU milli placed); minimise capacity − Σ size · y − u subject to u + GPU · Σ x_p
    ≤ capacity, Σ_p x_p · (count of s in p) ≥ y_s, lo ≤ y ≤ hi, 0 ≤ u ≤ ``whole_milli``. Solved exactly by column
    generation over the patterns, priced by an unbounded knapsack over the sizes; the capacity row has a slack at a
    prohibitive cost, so that the restricted LP stays feasible while patterns are still missing."""
    asked = sorted({s for s, c in hi.items() if c} | {s for s, c in lo.items() if c})
    pool = pool or PatternPool(asked)
    for s in asked:
        if s not in pool.sizes:
            raise BoundError(f"shares of {s} milli are not among the pool's sizes")
        if lo.get(s, 0) > hi.get(s, 0):
            raise BoundError(f"{lo[s]} shares of {s} milli must be placed but only {hi.get(s, 0)} arrived")
    sizes = pool.sizes
    n = len(sizes)
    value = np.asarray(sizes, dtype=np.float64)
    lower = np.asarray([lo.get(s, 0) for s in sizes], dtype=np.float64)
    upper = np.asarray([hi.get(s, 0) for s in sizes], dtype=np.float64)
    cap = float(pool.capacity)
    whole = max(0.0, min(float(whole_milli), float(capacity_milli)))
    if n == 0 or not upper.any():
        return capacity_milli - whole
    for _ in range(_MAX_ROUNDS):
        a = np.column_stack(pool.patterns).astype(np.float64)  # n × patterns
        k = a.shape[1]
        # variables: x (k patterns), y (n sizes), u, e (the capacity row's slack)
        cost = np.concatenate([np.zeros(k), -value, [-1.0, _SLACK_COST]])
        capacity_row = np.concatenate([np.full(k, cap), np.zeros(n), [1.0, -1.0]])
        a_ub = np.vstack([capacity_row, np.hstack([-a, np.eye(n), np.zeros((n, 2))])])
        b_ub = np.concatenate([[float(capacity_milli)], np.zeros(n)])
        bounds = [(0.0, None)] * k + list(zip(lower.tolist(), upper.tolist(), strict=True)) + [(0.0, whole), (0, None)]
        res = linprog(cost, A_ub=a_ub, b_ub=b_ub, bounds=bounds, method="highs")
        if res.status != 0:
            raise BoundError(f"the share-packing LP failed: {res.message}")
        duals = np.clip(-np.asarray(res.ineqlin.marginals, dtype=np.float64), 0.0, None)
        mu, pi = duals[0], duals[1:]
        # a pattern p improves the LP iff Σ_s π_s · count_s(p) > GPU · μ
        best, counts = _knapsack(sizes, pi, pool.capacity, pool.step)
        if best <= cap * mu + _PRICING_TOL * cap * max(mu, 1.0):
            if res.x[-1] > _INFEASIBLE_SLACK:
                return math.inf  # lo does not fit on the GPUs at all
            return max(0.0, capacity_milli + float(res.fun))
        pool.patterns.append(counts)
    raise BoundError("the share-packing LP did not converge")


def _knapsack(sizes: Sequence[int], price: FloatArray, capacity: int, step: int) -> tuple[float, npt.NDArray[np.int64]]:
    """The most a GPU's worth of shares is worth at ``price`` per share (unbounded knapsack, sizes in units of
    ``step``), and how many of each size that takes."""
    cap = capacity // step
    units = [s // step for s in sizes]
    best = np.zeros(cap + 1, dtype=np.float64)
    take = np.full(cap + 1, -1, dtype=np.int64)
    for c in range(1, cap + 1):
        best[c] = best[c - 1]
        take[c] = -1
        for i, u in enumerate(units):
            if u <= c and best[c - u] + price[i] > best[c]:
                best[c] = best[c - u] + price[i]
                take[c] = i
    counts = np.zeros(len(sizes), dtype=np.int64)
    c = cap
    while c > 0:
        i = int(take[c])
        if i < 0:
            c -= 1
        else:
            counts[i] += 1
            c -= units[i]
    return float(best[cap]), counts


def work_conserving_floor(nodes: Sequence[NodeSpec], prefix: Sequence[GpuRequest]) -> Floor:
    """The floor (module doc) for the arrivals ``prefix`` on ``nodes``."""
    types = node_types(nodes)  # refuses what the argument does not cover: unhealthy GPUs, mixed models
    shapes(prefix)  # and requests with GPU memory, MIG or isolation
    capacity = sum(t.gpus * t.count for t in types) * FULL_MILLI
    all_models = frozenset(t.model for t in types)
    arrived = sum(r.total_milli for r in prefix)
    gpu = [i for i, r in enumerate(prefix) if r.gpu_count]
    idx = np.asarray(gpu, dtype=np.int64)
    milli = np.asarray([prefix[i].milli for i in gpu], dtype=np.int64)
    demand = np.asarray([prefix[i].total_milli for i in gpu], dtype=np.float64)
    cpu = np.asarray([prefix[i].cpu_milli for i in gpu], dtype=np.int64)
    mem = np.asarray([prefix[i].host_memory_mib for i in gpu], dtype=np.int64)
    share = np.asarray([is_sharing(prefix[i]) for i in gpu], dtype=bool)
    models = [prefix[i].allowed_models or all_models for i in gpu]
    sizes = sorted({int(m) for m in milli[share]})
    col = {s: j for j, s in enumerate(sizes)}
    size_col = np.asarray([col.get(int(m), 0) for m in milli], dtype=np.int64)
    hi_all = np.bincount(size_col[share], minlength=len(sizes))
    whole_arrived = float(demand[~share].sum())
    within: dict[frozenset[str], npt.NDArray[np.bool_]] = {}  # per model set M: which pods may run only on M

    def blocked(j: int) -> tuple[float, npt.NDArray[np.int64]]:
        """If the share at ``j`` (an index into the GPU pods) is the first to fail, the pods that must fail with it
        (itself, and every later pod that needs at least a GPU with its free milli, its CPU and its memory on its
        models): the whole pods' GPU milli, and the shares' counts per size."""
        m = models[j]
        if m not in within:
            within[m] = np.asarray([x <= m for x in models], dtype=bool)
        later = (idx > idx[j]) & (milli >= milli[j]) & (cpu >= cpu[j]) & (mem >= mem[j]) & within[m]
        later[j] = True
        return float(demand[later & ~share].sum()), np.bincount(size_col[later & share], minlength=len(sizes))

    pool = PatternPool(sizes)
    k_shares = [j for j in range(len(gpu)) if share[j]]
    lo_counts = np.zeros(len(sizes), dtype=np.int64)
    solves = 0

    def lp(lo: npt.NDArray[np.int64], hi: npt.NDArray[np.int64], whole: float) -> float:
        nonlocal solves
        solves += 1
        return least_idle(_by_size(sizes, lo), _by_size(sizes, hi), whole, capacity, pool)

    # None fails: every share is placed, the whole pods take what GPUs are left at best.
    all_placed = lp(hi_all, hi_all, whole_arrived)
    best = all_placed
    best_t: int | None = None
    # Each candidate first failure k: lo(k) the shares before it; hi(k) and the whole pods, less those failing with it.
    cands: list[tuple[float, npt.NDArray[np.int64], npt.NDArray[np.int64], float, int]] = []
    for j in k_shares:
        f_whole, f_shares = blocked(j)
        hi = hi_all - f_shares
        whole = whole_arrived - f_whole
        # every pod it may place placed: a first cut before any LP
        cut = capacity - float(np.dot(sizes, hi)) - whole
        cands.append((cut, lo_counts.copy(), hi, whole, int(idx[j])))
        lo_counts[size_col[j]] += 1
    # w(k), the floor with lo(k) placed and nothing else failing, grows with k and is below g(k): binary search for
    # the last candidate whose w is below the best so far; only those up to it, with a first cut below the best,
    # remain.
    low: dict[int, float] = {}

    def w(k: int) -> float:
        if k not in low:
            low[k] = lp(cands[k][1], hi_all, whole_arrived)
        return low[k]

    done: set[int] = set()
    while True:
        lo_k, hi_k = -1, len(cands) - 1
        while lo_k < hi_k:
            mid = (lo_k + hi_k + 1) // 2
            if w(mid) < best:
                lo_k = mid
            else:
                hi_k = mid - 1
        todo = [k for k in range(lo_k + 1) if k not in done and cands[k][0] < best]
        if not todo:
            break
        k = min(todo, key=lambda k: cands[k][0])
        done.add(k)
        _, lo, hi, whole, t = cands[k]
        g = lp(lo, hi, whole)
        if g < best:
            best, best_t = g, t
    return Floor(best, all_placed, best_t, capacity, arrived, solves)


def _by_size(sizes: Sequence[int], counts: npt.NDArray[np.int64]) -> dict[int, int]:
    return {s: int(c) for s, c in zip(sizes, counts.tolist(), strict=True) if c}
