"""An offline upper bound on the GPU allocation that any placement can reach on a trace prefix.

**What is bounded.** Under the FGD protocol pods arrive one at a time, a pod that fits nowhere is skipped and none
leave, so when the arrived demand reaches a level (100 % of capacity) the allocated GPU is the demand of some
subset of the pods arrived so far, placed so that every node holds what it holds. No policy, online or offline,
can allocate more than the best such placement: the maximum, over subsets of the arrived pods and assignments of
them to nodes that respect the fit rules, of the GPU demand placed. The allocation curve's value at a level is a
mean over samples at or below the end of that level's prefix, and allocation only grows along the prefix, so the
bound on the whole prefix bounds the curve's value.

**The fit rules** (DESIGN §5, as the simulator applies them to openb pods): a node takes a set of pods when their
CPU and memory fit its CPU and memory, their ``gpu_spec`` allows its model, and their GPU demands can be laid on its
GPUs — a sharing pod (one GPU, ``gpu_milli`` below 1000) on one GPU whose pods' milli add up to at most 1000, a
whole-GPU or multi-GPU pod on as many GPUs of its own. The simulator may refuse a set for more reasons (its policy's
choices, one mechanism per GPU) but never accepts a set these rules refuse, so a bound under these rules bounds it.

**The bound** is the linear relaxation of the configuration formulation (Gilmore–Gomory), over node types
(identical nodes aggregated) and pod shapes (CPU, memory, GPU count, milli, allowed models; identical pods
aggregated): a configuration of a node type is a multiset of shapes that one such node can hold under the rules;
``λ[t, c] ≥ 0`` is how many nodes of type t take configuration c. Maximise Σ value(c)·λ subject to Σ_c λ[t, c] ≤
nodes of type t, and, for each shape s, Σ count(s in c)·λ ≤ pods of shape s. Any placement gives an integral
feasible point (each node's pods form a configuration of its type), so the LP optimum bounds every placement.

The LP has too many columns to write down, so it is solved by column generation: a restricted master LP (HiGHS,
through scipy) gives duals π (per shape) ≥ 0, and per node type a pricing MIP (HiGHS) finds the configuration of
largest reduced value, value(c) − Σ count(s in c)·π[s]. The reported bound never relies on column generation having
converged: by weak LP duality, for every π ≥ 0,

    LP* ≤ Σ_s π[s]·pods(s) + Σ_t nodes(t)·max(0, max_c reduced value of c under π),

and the pricing MIP's *dual* bound (an upper bound on its maximum, whether or not it was solved to optimality) is
used for the inner maximum. The smallest such value over the iterations is the bound. The restricted master's
value is a feasible LP value, so ``bound − master`` is how far the bound could still come down.

CPU-only pods are left out: they add no GPU allocation, and skipping a pod is always allowed.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from scipy.optimize import Bounds, LinearConstraint, linprog, milp

from sharegpu.model.inventory import NodeSpec
from sharegpu.model.request import FULL_MILLI, GpuRequest, Isolation

FloatArray = npt.NDArray[np.float64]


class BoundError(ValueError):
    """A cluster or request the bound does not model; the message says which."""


@dataclass(frozen=True)
class NodeType:
    cpu_milli: int
    memory_mib: int
    gpus: int
    model: str
    count: int


@dataclass(frozen=True)
class Shape:
    cpu_milli: int
    memory_mib: int
    gpu_count: int
    milli: int  # per GPU
    allowed_models: frozenset[str]
    count: int

    @property
    def value(self) -> int:
        return self.gpu_count * self.milli

    @property
    def sharing(self) -> bool:
        return self.gpu_count == 1 and self.milli < FULL_MILLI

    def fits(self, t: NodeType) -> bool:
        return (
            self.gpu_count <= t.gpus
            and self.cpu_milli <= t.cpu_milli
            and self.memory_mib <= t.memory_mib
            and (not self.allowed_models or t.model in self.allowed_models)
        )


def node_types(nodes: Sequence[NodeSpec]) -> list[NodeType]:
    """Identical nodes (CPU, memory, GPU count and model) as one type with a count; nodes without GPUs dropped."""
    kinds: Counter[tuple[int, int, int, str]] = Counter()
    for n in nodes:
        models = {g.model for g in n.gpus}
        if len(models) > 1:
            raise BoundError(f"node {n.name} mixes GPU models {sorted(models)}; the bound needs one model per node")
        if any(not g.healthy for g in n.gpus):
            raise BoundError(f"node {n.name} has an unhealthy GPU; the bound models healthy clusters")
        if n.gpus:
            kinds[(n.cpu_milli, n.memory_mib, len(n.gpus), models.pop())] += 1
    return [NodeType(c, m, g, model, k) for (c, m, g, model), k in sorted(kinds.items())]


def shapes(requests: Sequence[GpuRequest]) -> list[Shape]:
    """Identical GPU requests as one shape with a count; CPU-only requests dropped (they add no GPU allocation)."""
    kinds: Counter[tuple[int, int, int, int, frozenset[str]]] = Counter()
    for r in requests:
        if r.gpu_count == 0:
            continue
        if r.memory_mib is not None or r.mig_profile is not None or r.isolation is not Isolation.NONE:
            raise BoundError(
                f"request {r.name!r} asks for GPU memory, a MIG profile or isolation; the bound models trace "
                "requests (whole GPUs and compute shares)"
            )
        if r.gpu_count > 1 and r.milli < FULL_MILLI:
            raise BoundError(f"request {r.name!r}: a multi-GPU request must use whole GPUs")
        kinds[(r.cpu_milli, r.host_memory_mib, r.gpu_count, r.milli, r.allowed_models)] += 1
    return [
        Shape(c, m, g, milli, models, k)
        for (c, m, g, milli, models), k in sorted(kinds.items(), key=lambda kv: (kv[0][:4], sorted(kv[0][4])))
    ]


@dataclass(frozen=True)
class Bound:
    bound_milli: float  # an upper bound on the GPU milli any placement of the requests can allocate
    master_milli: float  # the restricted master's value: a feasible LP value, so LP* lies in [master, bound]
    capacity_milli: int
    demand_milli: int  # GPU milli asked for by the requests
    rounds: int  # of exact pricing
    columns: int
    seconds: float

    @property
    def bound_pct(self) -> float:
        return 100 * self.bound_milli / self.capacity_milli if self.capacity_milli else 0.0

    @property
    def master_pct(self) -> float:
        return 100 * self.master_milli / self.capacity_milli if self.capacity_milli else 0.0


@dataclass(frozen=True)
class _Pricing:
    """The best configuration found for a node type (counts per shape) and an upper bound on the best value."""

    counts: dict[int, int]
    value: float
    upper: float


def _price(t: NodeType, shape_list: Sequence[Shape], reduced: FloatArray, time_limit_s: float) -> _Pricing:
    """Max Σ reduced[s]·y[s] over the multisets y one node of type t can hold (the fit rules in the module doc).

    Whole and multi-GPU shapes take whole GPUs. Sharing shapes are laid on the other GPUs through an arc-flow
    network (Valério de Carvalho's bin-packing formulation): nodes are the loads a GPU can reach (sums of share
    sizes up to 1000), an arc from load p to p + m places a share of m milli, an arc from p to the end closes a
    GPU at load p, and F units of flow from 0 to the end are F GPUs. Every integral flow splits into F paths, one
    GPU's shares each, and every layout gives such a flow, so the model is exact; it has no GPU numbering (no
    symmetry) and a strong relaxation, which keeps the MIP fast."""
    cand = [i for i, s in enumerate(shape_list) if reduced[i] > 1e-9 and s.fits(t)]
    if not cand:
        return _Pricing({}, 0.0, 0.0)
    if t.gpus <= 2:
        return _price_per_gpu(t, shape_list, reduced, cand, time_limit_s)
    g = t.gpus
    sizes = sorted({shape_list[i].milli for i in cand if shape_list[i].sharing})
    loads = [0]
    if sizes:
        reach = {0}
        for p in range(FULL_MILLI + 1):
            if p in reach:
                reach.update(p + m for m in sizes if p + m <= FULL_MILLI)
        loads = sorted(reach)
    at = {p: k for k, p in enumerate(loads)}
    end = len(loads)  # the sink
    arcs = [(p, p + m, m) for p in loads for m in sizes if p + m <= FULL_MILLI] + [(p, -1, 0) for p in loads]
    ny = len(cand)
    f_var = ny  # F: GPUs holding shares
    first_arc = ny + 1
    nvar = first_arc + (len(arcs) if sizes else 0)

    upper = np.zeros(nvar)
    for j, i in enumerate(cand):
        s = shape_list[i]
        per_node = g // s.gpu_count if not s.sharing else g * (FULL_MILLI // s.milli)
        if s.cpu_milli:
            per_node = min(per_node, t.cpu_milli // s.cpu_milli)
        if s.memory_mib:
            per_node = min(per_node, t.memory_mib // s.memory_mib)
        upper[j] = min(per_node, s.count)
    upper[f_var] = g if sizes else 0
    upper[first_arc:] = g  # loads only rise along a path, so each GPU's path uses an arc at most once

    rows: list[dict[int, float]] = []
    lo: list[float] = []
    hi: list[float] = []
    rows.append({j: shape_list[i].cpu_milli for j, i in enumerate(cand)})
    lo.append(-np.inf)
    hi.append(t.cpu_milli)
    rows.append({j: shape_list[i].memory_mib for j, i in enumerate(cand)})
    lo.append(-np.inf)
    hi.append(t.memory_mib)
    gpus = {j: float(shape_list[i].gpu_count) for j, i in enumerate(cand) if not shape_list[i].sharing}
    rows.append({**gpus, f_var: 1.0})
    lo.append(-np.inf)
    hi.append(g)
    if sizes:
        balance: list[dict[int, float]] = [{} for _ in range(end + 1)]
        for a, (p, q, _) in enumerate(arcs):
            balance[at[p]][first_arc + a] = balance[at[p]].get(first_arc + a, 0.0) - 1.0  # leaves p
            sink = end if q < 0 else at[q]
            balance[sink][first_arc + a] = balance[sink].get(first_arc + a, 0.0) + 1.0  # enters q
        balance[0][f_var] = 1.0  # F units leave the source ...
        balance[end][f_var] = -1.0  # ... and reach the end
        for b in balance:
            rows.append(b)
            lo.append(0)
            hi.append(0)
        for m in sizes:
            link = {j: 1.0 for j, i in enumerate(cand) if shape_list[i].sharing and shape_list[i].milli == m}
            link.update({first_arc + a: -1.0 for a, (_, _, size) in enumerate(arcs) if size == m})
            rows.append(link)
            lo.append(0)
            hi.append(0)
    matrix = np.zeros((len(rows), nvar))
    for r, coef in enumerate(rows):
        for idx, c in coef.items():
            matrix[r, idx] = c

    objective = np.zeros(nvar)
    objective[:ny] = -reduced[cand]
    res = milp(
        objective,
        integrality=np.ones(nvar),
        bounds=Bounds(np.zeros(nvar), upper),
        constraints=LinearConstraint(matrix, np.asarray(lo), np.asarray(hi)),
        options={"time_limit": time_limit_s, "mip_rel_gap": 1e-5, "disp": False},
    )
    dual = getattr(res, "mip_dual_bound", None)
    trivial = float(reduced[cand] @ upper[:ny])
    ub = trivial if dual is None or not np.isfinite(dual) else min(trivial, -float(dual))
    if res.x is None:
        return _Pricing({}, 0.0, max(ub, 0.0))
    counts = {i: round(res.x[j]) for j, i in enumerate(cand) if round(res.x[j]) > 0}
    value = float(sum(reduced[i] * c for i, c in counts.items()))
    return _Pricing(counts, value, max(ub, value))


def _price_per_gpu(
    t: NodeType, shape_list: Sequence[Shape], reduced: FloatArray, cand: list[int], time_limit_s: float
) -> _Pricing:
    """:func:`_price` with the GPUs numbered: per-GPU counts of each distinct share size, and whole GPUs marked
    ``o[g]``. Whole GPUs come first and GPU loads do not increase (symmetry breaking: any layout can be permuted
    into that order). Fast for one or two GPUs, where the arc-flow model's many arcs cost more than they save."""
    g = t.gpus
    sharing_milli = sorted({shape_list[i].milli for i in cand if shape_list[i].sharing})
    has_whole = any(not shape_list[i].sharing for i in cand)
    ny, nk = len(cand), len(sharing_milli)
    n_z = nk * g
    n_o = g if has_whole else 0
    nvar = ny + n_z + n_o

    def z(k: int, gpu: int) -> int:
        return ny + k * g + gpu

    def o(gpu: int) -> int:
        return ny + n_z + gpu

    upper = np.zeros(nvar)
    for j, i in enumerate(cand):
        s = shape_list[i]
        per_node = g // s.gpu_count if not s.sharing else g * (FULL_MILLI // s.milli)
        if s.cpu_milli:
            per_node = min(per_node, t.cpu_milli // s.cpu_milli)
        if s.memory_mib:
            per_node = min(per_node, t.memory_mib // s.memory_mib)
        upper[j] = min(per_node, s.count)
    for k, m in enumerate(sharing_milli):
        for gpu in range(g):
            upper[z(k, gpu)] = FULL_MILLI // m
    for gpu in range(n_o):
        upper[o(gpu)] = 1

    rows: list[FloatArray] = []
    lo: list[float] = []
    hi: list[float] = []

    def row(coef: dict[int, float], lower: float, higher: float) -> None:
        r = np.zeros(nvar)
        for idx, c in coef.items():
            r[idx] += c
        rows.append(r)
        lo.append(lower)
        hi.append(higher)

    row({j: shape_list[i].cpu_milli for j, i in enumerate(cand)}, -np.inf, t.cpu_milli)
    row({j: shape_list[i].memory_mib for j, i in enumerate(cand)}, -np.inf, t.memory_mib)
    if has_whole:
        whole = {j: float(shape_list[i].gpu_count) for j, i in enumerate(cand) if not shape_list[i].sharing}
        row({**whole, **{o(gpu): -1.0 for gpu in range(g)}}, 0, 0)
    for k, m in enumerate(sharing_milli):
        link = {j: 1.0 for j, i in enumerate(cand) if shape_list[i].sharing and shape_list[i].milli == m}
        row({**link, **{z(k, gpu): -1.0 for gpu in range(g)}}, 0, 0)

    def load(gpu: int, sign: float) -> dict[int, float]:
        coef = {z(k, gpu): sign * m for k, m in enumerate(sharing_milli)}
        if has_whole:
            coef[o(gpu)] = sign * FULL_MILLI
        return coef

    for gpu in range(g):
        row(load(gpu, 1.0), -np.inf, FULL_MILLI)
    for gpu in range(g - 1):
        row({**load(gpu, 1.0), **{k: v for k, v in load(gpu + 1, -1.0).items()}}, 0, np.inf)
        if has_whole:
            row({o(gpu): 1.0, o(gpu + 1): -1.0}, 0, np.inf)

    objective = np.zeros(nvar)
    for j, i in enumerate(cand):
        objective[j] = -reduced[i]
    res = milp(
        objective,
        integrality=np.ones(nvar),
        bounds=Bounds(np.zeros(nvar), upper),
        constraints=LinearConstraint(np.vstack(rows), np.asarray(lo), np.asarray(hi)),
        options={"time_limit": time_limit_s, "mip_rel_gap": 1e-5, "disp": False},
    )
    dual = getattr(res, "mip_dual_bound", None)
    trivial = float(sum(reduced[i] * upper[j] for j, i in enumerate(cand)))
    ub = trivial if dual is None or not np.isfinite(dual) else min(trivial, -float(dual))
    if res.x is None:
        return _Pricing({}, 0.0, max(ub, 0.0))
    counts = {i: round(res.x[j]) for j, i in enumerate(cand) if round(res.x[j]) > 0}
    value = float(sum(reduced[i] * c for i, c in counts.items()))
    return _Pricing(counts, value, max(ub, value))


def _greedy_columns(types: Sequence[NodeType], shape_list: Sequence[Shape]) -> list[tuple[int, dict[int, int]]]:
    """Configurations of a first-fit-decreasing placement (largest GPU demand first, best fit on the GPU): a
    feasible start for the master, so column generation begins near the optimum instead of at zero."""
    node_type = [i for i, t in enumerate(types) for _ in range(t.count)]
    n = len(node_type)
    width = max(t.gpus for t in types)
    cpu = np.asarray([types[i].cpu_milli for i in node_type], dtype=np.int64)
    mem = np.asarray([types[i].memory_mib for i in node_type], dtype=np.int64)
    free = np.full((n, width), -1, dtype=np.int64)  # -1: no such GPU on this node
    for k, i in enumerate(node_type):
        free[k, : types[i].gpus] = FULL_MILLI
    models = np.asarray([types[i].model for i in node_type])
    held: list[Counter[int]] = [Counter() for _ in range(n)]
    order = sorted(range(len(shape_list)), key=lambda i: (-shape_list[i].value, -shape_list[i].cpu_milli))
    for i in order:
        s = shape_list[i]
        allowed = np.isin(models, list(s.allowed_models)) if s.allowed_models else np.ones(n, dtype=bool)
        for _ in range(s.count):
            ok = allowed & (cpu >= s.cpu_milli) & (mem >= s.memory_mib)
            if s.sharing:
                room = np.where(free >= s.milli, free, np.iinfo(np.int64).max)
                ok &= room.min(axis=1) < np.iinfo(np.int64).max
                if not ok.any():
                    break
                tight = np.where(ok, room.min(axis=1), np.iinfo(np.int64).max)
                k = int(np.argmin(tight))
                free[k, int(np.argmin(room[k]))] -= s.milli
            else:
                whole = (free == FULL_MILLI).sum(axis=1)
                ok &= whole >= s.gpu_count
                if not ok.any():
                    break
                k = int(np.argmin(np.where(ok, whole, width + 1)))
                for gpu in np.flatnonzero(free[k] == FULL_MILLI)[: s.gpu_count]:
                    free[k, gpu] = 0
            cpu[k] -= s.cpu_milli
            mem[k] -= s.memory_mib
            held[int(k)][i] += 1
    columns = {(int(node_type[k]), tuple(sorted(h.items()))) for k, h in enumerate(held) if h}
    return [(t, dict(cnt)) for t, cnt in sorted(columns)]


def _fill(t: NodeType, shape_list: Sequence[Shape], order: Sequence[int]) -> dict[int, int]:
    """One node of type t filled greedily: each shape of ``order`` in turn, as many as fit (sharing pods on the
    fullest GPU with room, whole pods on free GPUs). A heuristic column; the bound never depends on it."""
    cpu, mem = t.cpu_milli, t.memory_mib
    free = [FULL_MILLI] * t.gpus
    counts: dict[int, int] = {}
    for i in order:
        s = shape_list[i]
        while counts.get(i, 0) < s.count and s.cpu_milli <= cpu and s.memory_mib <= mem:
            if s.sharing:
                room = [f for f in free if f >= s.milli]
                if not room:
                    break
                free[free.index(min(room))] -= s.milli
            else:
                whole = [g for g, f in enumerate(free) if f == FULL_MILLI][: s.gpu_count]
                if len(whole) < s.gpu_count:
                    break
                for g in whole:
                    free[g] = 0
            cpu -= s.cpu_milli
            mem -= s.memory_mib
            counts[i] = counts.get(i, 0) + 1
    return counts


def _heuristic_columns(
    t: NodeType, shape_list: Sequence[Shape], reduced: FloatArray, rng: np.random.Generator, tries: int
) -> list[dict[int, int]]:
    """Columns of positive reduced value from greedy fills in the order of reduced value per share of the node's
    resources, the first as it is and the others with noise: cheap, and many per round, so that the master needs
    few rounds of the exact (MIP) pricing."""
    cand = [i for i, s in enumerate(shape_list) if reduced[i] > 1e-9 and s.fits(t)]
    if not cand:
        return []
    use = np.asarray(
        [
            shape_list[i].cpu_milli / t.cpu_milli
            + shape_list[i].memory_mib / t.memory_mib
            + shape_list[i].value / (FULL_MILLI * t.gpus)
            for i in cand
        ]
    )
    density = reduced[cand] / np.maximum(use, 1e-9)
    out = []
    for k in range(tries):
        noisy = density * (rng.uniform(0.5, 1.5, len(cand)) if k else 1.0)
        col = _fill(t, shape_list, [cand[j] for j in np.argsort(-noisy, kind="stable")])
        if sum(reduced[i] * c for i, c in col.items()) > 1e-6:
            out.append(col)
    return out


def allocation_bound(
    nodes: Sequence[NodeSpec],
    requests: Sequence[GpuRequest],
    gap_pct: float = 0.02,
    max_rounds: int = 1000,
    time_limit_s: float = 1800.0,
    pricing_time_limit_s: float = 20.0,
    heuristic_rounds: int = 3,
    heuristic_tries: int = 10,
    on_round: Callable[[int, float, float], None] | None = None,
) -> Bound:
    """An upper bound on the GPU milli any placement of ``requests`` on ``nodes`` can allocate (module doc).

    Each round re-solves the master with cheap heuristic columns until they stop helping (at most
    ``heuristic_rounds`` times), then prices every node type exactly (MIP), which adds columns and gives the bound.
    Stops when the bound is within ``gap_pct`` % of capacity of the master's value, when exact pricing finds no
    column (the LP is solved), or at the limits; the bound is valid at any stop. ``on_round`` hears (round, master
    milli, bound milli)."""
    started = time.perf_counter()
    types = node_types(nodes)
    shape_list = shapes(requests)
    capacity = sum(t.gpus * t.count for t in types) * FULL_MILLI
    demand = sum(s.value * s.count for s in shape_list)
    best = float(min(capacity, demand))  # the trivial bound
    if not shape_list or not types:
        return Bound(0.0, 0.0, capacity, demand, 0, 0, time.perf_counter() - started)
    master = _Master(types, shape_list)
    master.add(_greedy_columns(types, shape_list))
    rng = np.random.default_rng(0)
    rounds = 0
    while rounds < max_rounds:
        rounds += 1
        for _ in range(heuristic_rounds):
            reduced = master.solve()
            fresh = [
                (t_idx, col)
                for t_idx, t in enumerate(types)
                for col in _heuristic_columns(t, shape_list, reduced, rng, heuristic_tries)
            ]
            if not master.add(fresh):
                break
        reduced = master.solve()
        lagrangian = float(master.pi @ master.counts)
        exact = []
        for t_idx, t in enumerate(types):
            p = _price(t, shape_list, reduced, pricing_time_limit_s)
            lagrangian += t.count * max(0.0, p.upper)
            if p.value > 1e-6:
                exact.append((t_idx, p.counts))
        best = min(best, lagrangian)
        if on_round is not None:
            on_round(rounds, master.value, best)
        added = master.add(exact)
        if best - master.value <= gap_pct / 100 * capacity or not added:
            break
        if time.perf_counter() - started > time_limit_s:
            break
    return Bound(best, master.value, capacity, demand, rounds, len(master.columns), time.perf_counter() - started)


class _Master:
    """The restricted master LP: configurations found so far, re-solved with HiGHS for its value and duals."""

    def __init__(self, types: Sequence[NodeType], shape_list: Sequence[Shape]) -> None:
        self.types = types
        self.values = np.asarray([s.value for s in shape_list], dtype=np.float64)
        self.counts = np.asarray([s.count for s in shape_list], dtype=np.float64)
        self.columns: list[tuple[int, dict[int, int]]] = []
        self._seen: set[tuple[int, tuple[tuple[int, int], ...]]] = set()
        self._a = np.zeros((len(shape_list) + len(types), 0))
        self.value = 0.0
        self.pi = np.zeros(len(shape_list))

    def add(self, columns: Sequence[tuple[int, dict[int, int]]]) -> int:
        n_s = len(self.values)
        fresh = []
        for t_idx, cnt in columns:
            key = (t_idx, tuple(sorted(cnt.items())))
            if cnt and key not in self._seen:
                self._seen.add(key)
                self.columns.append((t_idx, cnt))
                col = np.zeros(self._a.shape[0])
                for s, k in cnt.items():
                    col[s] = k
                col[n_s + t_idx] = 1
                fresh.append(col)
        if fresh:
            self._a = np.hstack([self._a, np.column_stack(fresh)])
        return len(fresh)

    def solve(self) -> FloatArray:
        """Solves the master; returns the reduced value of each shape (its GPU milli less its dual price)."""
        n_s = len(self.values)
        if self._a.shape[1]:
            cost = -(self.values @ self._a[:n_s])
            rhs = np.concatenate([self.counts, [float(t.count) for t in self.types]])
            res = linprog(cost, A_ub=self._a, b_ub=rhs, bounds=(0, None), method="highs")
            if res.status != 0:
                raise BoundError(f"the master LP failed: {res.message}")
            self.value = -float(res.fun)
            self.pi = np.clip(-np.asarray(res.ineqlin.marginals[:n_s], dtype=np.float64), 0, None)
        return self.values - self.pi


def prefix_at(arrivals: Sequence[GpuRequest], capacity_milli: int, level_pct: int) -> list[GpuRequest]:
    """The arrivals whose cumulative GPU demand is at or below ``level_pct`` % of capacity as the allocation curve
    rounds it (sim/metrics.py: arrived % rounded to an integer, half to even), i.e. every sample of that level and
    below."""
    total = capacity_milli / FULL_MILLI
    cum = np.cumsum([r.total_milli for r in arrivals], dtype=np.float64)
    level = np.round(cum / total / 10, 0)
    return list(arrivals[: int(np.searchsorted(level, level_pct, side="right"))])
