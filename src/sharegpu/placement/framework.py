"""The placement framework: filter → score → select → reserve, in the shape of the kube-scheduler framework.

A :class:`Policy` is a named set of score plugins with weights and a GPU selector. Filtering is common to all
policies (a node either can host the request or it cannot, and every rejected node gets a reason a user can
act on). Scores are vectorised over the feasible nodes. Plugins whose score of a node depends only on that
node's state and the request's shape declare ``node_local``; the framework then caches their scores per shape
and recomputes only nodes whose state changed since (the ledger bumps a node's version on every change).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from sharegpu.ledger import Ledger
from sharegpu.model.assignment import Assignment, Mechanism
from sharegpu.model.request import GpuRequest
from sharegpu.placement.mechanism import UsablePlan, make_share, route_for, tenant_gpus
from sharegpu.placement.reasons import (
    FilterReason,
    NodeRoom,
    ReasonCode,
    ReasonKind,
    RoomArrays,
    capped_gpus,
    fmt_mib,
    node_kinds,
    node_reason,
)

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


AnyArray = npt.NDArray[Any]


class NodeMemo:
    """Values that depend only on one node's state (and a key such as a request shape), kept per node until the
    ledger changes that node (it bumps the node's version on every change). A decision then recomputes only
    the nodes that changed since the key was last asked for: usually one."""

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger
        self._entries: dict[Hashable, tuple[IntArray, AnyArray]] = {}

    def get(self, key: Hashable, nodes: IntArray, compute: Callable[[IntArray], AnyArray]) -> AnyArray:
        """``compute(nodes)`` (one row per node), from the memo where a node is unchanged since it was computed."""
        versions = self._ledger.version
        entry = self._entries.get(key)
        if entry is None:
            values = compute(nodes)
            seen = np.full(len(versions), -1, dtype=np.int64)
            store = np.zeros((len(versions), *values.shape[1:]), dtype=values.dtype)
            store[nodes] = values
            seen[nodes] = versions[nodes]
            self._entries[key] = (seen, store)
            return values
        seen, store = entry
        stale = nodes[seen[nodes] != versions[nodes]]
        if len(stale):
            store[stale] = compute(stale)
            seen[stale] = versions[stale]
        out: AnyArray = store[nodes]
        return out


@dataclass
class CycleState:
    """Scratch data of one scheduling cycle, shared by its plugins (computed once, read by many)."""

    request: GpuRequest
    usable: BoolArray  # (N,G) GPUs that can host one share now
    rng: np.random.Generator
    data: dict[str, object] = field(default_factory=dict)
    memo: NodeMemo | None = None  # per-node values kept across cycles by the scheduler

    def per_node(self, key: Hashable, nodes: IntArray, compute: Callable[[IntArray], AnyArray]) -> AnyArray:
        """``compute(nodes)``, memoised per node across cycles when the scheduler keeps a memo."""
        if self.memo is None:
            return compute(nodes)
        return self.memo.get(key, nodes, compute)


class ScorePlugin(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def node_local(self) -> bool:
        """True when a node's score depends only on that node's state and the request's shape (cacheable)."""
        ...

    def score(self, ledger: Ledger, state: CycleState, nodes: IntArray) -> IntArray:
        """Integer scores (higher is better) of ``nodes``, all of which passed the filter."""
        ...


class GpuSelector(Protocol):
    def select(self, ledger: Ledger, state: CycleState, node: int) -> list[int]:
        """GPU indices on ``node`` for the request's ``gpu_count`` shares, among ``state.usable[node]``."""
        ...


@dataclass(frozen=True)
class Policy:
    name: str
    scorers: tuple[tuple[ScorePlugin, int], ...]
    selector: GpuSelector
    tie_break: str = "order"  # "order": first node in tie-break order; "random": uniform among the best
    description: str = ""


@dataclass(frozen=True)
class Decision:
    assignment: Assignment
    node_index: int
    score: int
    feasible: int  # nodes that passed the filter


@dataclass(frozen=True)
class Unschedulable:
    request: GpuRequest
    reason: str  # a summary a user can act on, e.g. "largest free share is 12Gi on node-3"
    kinds: dict[ReasonKind, int]  # kind of reason → how many nodes it rejected, in the order of each one's first node

    @property
    def reasons(self) -> dict[str, int]:
        """The same counts under the words of the summary (e.g. "not enough CPU")."""
        return {kind.summary(self.request): count for kind, count in self.kinds.items()}


class NoFit(Exception):
    """Raised by :meth:`Scheduler.place` when a request fits nowhere; carries the explanation."""

    def __init__(self, result: Unschedulable) -> None:
        super().__init__(result.reason)
        self.result = result


@dataclass
class _Feasibility:
    """One request shape's filter result for every node, and the node versions it was computed at."""

    plan: UsablePlan
    seen: IntArray  # (N,)
    ok: BoolArray  # (N,)
    usable: BoolArray  # (N,G)


class Scheduler:
    """Runs a policy's cycle against a ledger. ``rank`` is the tie-break order (default: node name order)."""

    def __init__(
        self, ledger: Ledger, policy: Policy, seed: int = 0, rank: Sequence[int] | IntArray | None = None
    ) -> None:
        self.ledger = ledger
        self.policy = policy
        self.rng = np.random.default_rng(seed)
        n = len(ledger.nodes)
        self.rank: IntArray = np.arange(n, dtype=np.int64) if rank is None else np.asarray(rank, dtype=np.int64)
        if sorted(self.rank.tolist()) != list(range(n)):
            raise ValueError("rank must be a permutation of the node indices")
        self.memo = NodeMemo(ledger)
        self._feasible: dict[tuple[object, ...], _Feasibility] = {}
        self._reasons: dict[tuple[str, tuple[object, ...]], tuple[IntArray, list[FilterReason]]] = {}

    def with_policy(self, policy: Policy, seed: int = 0) -> Scheduler:
        """A scheduler of ``policy`` over the same ledger that keeps what does not depend on the policy: the
        per-shape filter results and reasons (each row kept at its node's version, so they stay exact). Scores are
        the policy's own and start afresh. The cluster view swaps policies when the workload it sees drifts; without
        this every swap made the next cycle of each shape filter and explain every node again."""
        out = Scheduler(self.ledger, policy, seed, self.rank)
        out._feasible = self._feasible
        out._reasons = self._reasons
        return out

    # ----- warm-up ------------------------------------------------------------------------------------------
    def warm(self, req: GpuRequest, chunk: int = 1000) -> Iterator[None]:
        """Fill the caches a first cycle of ``req``'s shape would fill (its per-shape filter on every node, then the
        policy's per-node scores on every node that passes), one slice of at most ``chunk`` nodes per step: a caller
        on an event loop yields between steps. Decides nothing and draws from no random generator of this
        scheduler (plugins that draw get a throwaway one), and every cached row is a function of its node's state
        and the shape alone, so decisions are the same warmed or not. The tenant is not part of the shape: the
        tenancy overlay (:func:`tenant_gpus`) is added per cycle on top of what this caches."""
        f = self._feasibility(req)
        yield
        nodes = np.flatnonzero(f.ok)
        if not len(nodes):
            return
        state = CycleState(req, f.usable, np.random.default_rng(0), memo=self.memo)
        key = req.shape_key()
        for start in range(0, len(nodes), max(1, chunk)):
            part = nodes[start : start + chunk]
            for plugin, _ in self.policy.scorers:
                if plugin.node_local:

                    def compute(stale: IntArray, plugin: ScorePlugin = plugin) -> IntArray:
                        return plugin.score(self.ledger, state, stale)

                    self.memo.get(("score", plugin.name, key), part, compute)
                else:
                    plugin.score(self.ledger, state, part)  # fills what the plugin memoises per node itself
            yield

    # ----- filter --------------------------------------------------------------------------------------------
    def feasible(self, req: GpuRequest) -> tuple[BoolArray, BoolArray]:
        """(N,) nodes that can host ``req`` and the (N,G) GPUs that can host one of its shares (the caller's own
        copies)."""
        ok, usable = self._filtered(req)
        return (ok.copy(), usable.copy()) if ok is self._entry(req).ok else (ok, usable)

    def _filtered(self, req: GpuRequest) -> tuple[BoolArray, BoolArray]:
        """The filter for ``req``: its shape's (shared with the cache, not to be written) and, where its tenant runs
        daemons on units at the cap, those units added (fresh arrays)."""
        f = self._feasibility(req)
        extra = tenant_gpus(self.ledger, req, f.plan)
        if not extra:
            return f.ok, f.usable
        ok, usable = f.ok.copy(), f.usable.copy()
        led = self.ledger
        for n, g in extra:
            usable[n, g] = True
        for n in {n for n, _ in extra}:
            ok[n] = (
                led.cpu_free[n] >= req.cpu_milli
                and led.mem_free[n] >= req.host_memory_mib
                and int(usable[n].sum()) >= req.gpu_count
            )
        return ok, usable

    def _feasibility(self, req: GpuRequest) -> _Feasibility:
        """The filter's result for ``req``'s shape, refreshed on the nodes that changed since it was last asked.

        A node passes when its CPU and host memory fit and enough of its GPUs can host a share; all of that is the
        node's own state, so rows of unchanged nodes stay valid.
        """
        f = self._entry(req)
        stale = np.flatnonzero(f.seen != self.ledger.version)
        if len(stale):
            self._refresh(f, req, stale)
        return f

    def _entry(self, req: GpuRequest) -> _Feasibility:
        key = req.shape_key()
        f = self._feasible.get(key)
        if f is None:
            n, g = self.ledger.present.shape
            f = _Feasibility(
                UsablePlan.of(self.ledger, req),
                np.full(n, -1, dtype=np.int64),
                np.zeros(n, dtype=bool),
                np.zeros((n, g), dtype=bool),
            )
            self._feasible[key] = f
        return f

    def _refresh(self, f: _Feasibility, req: GpuRequest, stale: IntArray) -> None:
        led = self.ledger
        usable = f.plan.usable(led, req, stale)
        ok = (led.cpu_free[stale] >= req.cpu_milli) & (led.mem_free[stale] >= req.host_memory_mib)
        if req.gpu_count > 0:
            ok &= usable.sum(axis=1) >= req.gpu_count
        f.usable[stale] = usable
        f.ok[stale] = ok
        f.seen[stale] = led.version[stale]

    def fits(self, req: GpuRequest, node: int) -> bool:
        """Whether ``node`` passes the filter for ``req`` now (only that node is looked at)."""
        f = self._entry(req)
        if f.seen[node] != self.ledger.version[node]:
            self._refresh(f, req, np.array([node], dtype=np.int64))
        if f.ok[node]:
            return True
        return any(n == node for n, _ in tenant_gpus(self.ledger, req, f.plan)) and bool(self._filtered(req)[0][node])

    def plan(self, req: GpuRequest) -> UsablePlan:
        """How ``req``'s shape meets each GPU model of the ledger (built once per shape)."""
        return self._entry(req).plan

    def explain(self, req: GpuRequest, usable: BoolArray) -> Unschedulable:
        """Why no node fits, counted per kind of reason, with the nearest miss named."""
        kinds = self._kind_counts(req, usable)
        summary = "; ".join(
            f"{c} node(s): {kind.summary(req)}" for kind, c in sorted(kinds.items(), key=lambda kv: -kv[1])
        )
        hint = self._nearest_miss(req)
        return Unschedulable(req, f"{summary or ReasonKind.NO_NODES.sentence}{hint}", kinds)

    def _nearest_miss(self, req: GpuRequest) -> str:
        """The GPU nearest to taking ``req``, among those it may use (present, healthy, of a model that can host it
        at all): where GPUs with room are closed to it by the MPS daemon cap alone, that; else the largest free
        memory where memory is short; else the most free compute."""
        led = self.ledger
        if req.gpu_count == 0 or led.free_mem.size == 0:
            return ""
        capped = capped_gpus(led, req, self.plan(req))
        if capped:
            first = led.nodes[capped[0][0]].name
            return (
                f" ({len(capped)} GPU(s) of an allowed model with room for the share, e.g. on {first}, "
                f"already run {led.tenancy.daemons_per_unit} MPS daemon(s), the most a GPU may: one per tenant (pods "
                "of one namespace and runAsUser, or a pod alone), and this pod's would be another)"
            )
        hosts = np.array([route_for(req, m) is not None for m in led.models] + [False], dtype=bool)
        may = hosts[led.model_id] & led.present & led.healthy
        if not may.any():
            return ""  # no GPU it may use: the counts say so
        free = np.where(may, led.free_mem, -1)
        if req.memory_mib is not None and free.max() < req.memory_mib:
            n, g = np.unravel_index(int(free.argmax()), free.shape)
            return (
                f" (largest free share is {fmt_mib(int(free[n, g]))} on {led.nodes[int(n)].name}, "
                f"{fmt_mib(req.memory_mib)} asked)"
            )
        milli = np.where(may, led.free_milli, -1)
        n, g = np.unravel_index(int(milli.argmax()), milli.shape)
        return f" (most free compute is {int(milli[n, g]) / 10:g}% of a GPU on {led.nodes[int(n)].name})"

    # ----- score and select ----------------------------------------------------------------------------------
    def scores(self, state: CycleState, nodes: IntArray) -> IntArray:
        total = np.zeros(len(nodes), dtype=np.int64)
        key = state.request.shape_key()
        for plugin, weight in self.policy.scorers:
            if plugin.node_local:

                def compute(stale: IntArray, plugin: ScorePlugin = plugin) -> IntArray:
                    return plugin.score(self.ledger, state, stale)

                s = self.memo.get(("score", plugin.name, key), nodes, compute)
            else:
                s = plugin.score(self.ledger, state, nodes)
            total += weight * s
        return total

    def cycle(self, req: GpuRequest, usable: BoolArray) -> CycleState:
        """The scratch state of one cycle for ``req`` (``usable``: its feasibility's GPUs), with this scheduler's
        random generator and per-node memo: every caller that scores outside :meth:`decide` starts here."""
        return CycleState(req, usable, self.rng, memo=self.memo)

    def decide(self, req: GpuRequest) -> Decision | Unschedulable:
        ok, usable = self._filtered(req)
        nodes = np.flatnonzero(ok)
        state = self.cycle(req, usable)
        if len(nodes) == 0:
            return self.explain(req, usable)
        scores = self.scores(state, nodes)
        node = self.pick(nodes, scores)
        return Decision(self.assignment_on(state, node), node, int(scores.max()), len(nodes))

    def pick(self, nodes: IntArray, scores: IntArray) -> int:
        """The node a decision takes among scored ``nodes``: the best score, ties broken by the policy's rule."""
        best = scores.max()
        tied = nodes[scores == best]
        if len(tied) == 1:
            return int(tied[0])
        if self.policy.tie_break == "random":
            return int(tied[self.rng.integers(len(tied))])
        return int(tied[np.argmin(self.rank[tied])])

    def assignment_on(self, state: CycleState, node: int) -> Assignment:
        """The assignment of ``state.request`` on ``node`` (which passed the filter): the selector picks GPUs."""
        req = state.request
        gpus = self.policy.selector.select(self.ledger, self._prefer_tenant(state, node), node) if req.gpu_count else []
        shares = tuple(make_share(self.ledger, node, g, req) for g in gpus)
        # The tenant goes with MPS shares only: it names the daemon they join (an assignment without one reads as any).
        tenant = req.tenant if any(s.sharing is Mechanism.MPS for s in shares) else None
        return Assignment(req.name, self.ledger.nodes[node].name, shares, req.cpu_milli, req.host_memory_mib, tenant)

    def _prefer_tenant(self, state: CycleState, node: int) -> CycleState:
        """The cycle as the GPU selector sees it on ``node``: where the request's tenant already runs a daemon on a GPU
        it may take, only those GPUs (its clients then run together under one server instead of taking turns with
        another daemon's); MIG instances prefer their tenant in :func:`mig_choice`."""
        req = state.request
        if req.gpu_count != 1 or not req.may_use_mps or req.tenant is None:
            return state
        led = self.ledger
        mine = [g for n, g, start in led.units_of(req.tenant) if n == node and start is None and state.usable[n, g]]
        if not mine or len(mine) == int(state.usable[node].sum()):
            return state
        usable = state.usable.copy()
        usable[node] = False
        usable[node, mine] = True
        return replace(state, usable=usable)

    def decide_on(self, req: GpuRequest, node: int) -> Decision | Unschedulable:
        """Like :meth:`decide`, but on the one node that something else (the kube-scheduler) chose."""
        ok, usable = self._filtered(req)
        if not ok[node]:
            reason = self.explain_nodes(req, usable, np.array([node], dtype=np.int64))[0]
            kinds = {reason.kind: 1} if reason.kind is not None else {}
            return Unschedulable(req, f"{self.ledger.nodes[node].name}: {reason.text}", kinds)
        state = self.cycle(req, usable)
        nodes = np.array([node], dtype=np.int64)
        return Decision(self.assignment_on(state, node), node, int(self.scores(state, nodes)[0]), int(ok.sum()))

    def explain_nodes(self, req: GpuRequest, usable: BoolArray, nodes: IntArray) -> list[FilterReason]:
        """Why each of ``nodes`` (rejected by :meth:`feasible`) cannot host ``req``, in words a user can act on.

        A node's reason depends only on its state and the request's shape, so reasons are cached per shape and
        recomputed only for nodes whose ledger version moved (the extender explains every rejected node of every
        cycle).
        """
        led = self.ledger
        key = ("explain", req.shape_key())
        cache = self._reasons.get(key)
        if cache is None or len(cache[0]) != len(led.nodes):
            unknown = FilterReason(ReasonCode.FITS, "")  # a placeholder until the node is explained
            cache = (np.full(len(led.nodes), -1, dtype=np.int64), [unknown] * len(led.nodes))
            self._reasons[key] = cache
        versions, reasons = cache
        stale = nodes[versions[nodes] != led.version[nodes]]
        if len(stale):
            for n, reason in zip(stale.tolist(), self._node_reasons(req, usable, stale), strict=True):
                reasons[n] = reason
            versions[stale] = led.version[stale]
        return [reasons[n] for n in nodes.tolist()]

    def _kind_counts(self, req: GpuRequest, usable: BoolArray) -> dict[ReasonKind, int]:
        """How many nodes each kind of reason rejects, in the order of the first node that gives it; vectorised
        (a request that fits nowhere is explained over every node) by the same gates that explain one node."""
        led = self.ledger
        allowed = np.array([req.allows_model(m) for m in led.model_names] + [False], dtype=bool)
        room = RoomArrays(
            (allowed[led.model_id] & led.present).sum(axis=1), usable.sum(axis=1), led.cpu_free, led.mem_free
        )
        firsts = [(int(np.argmax(mask)), kind, int(mask.sum())) for kind, mask in node_kinds(req, room) if mask.any()]
        return {kind: count for _, kind, count in sorted(firsts, key=lambda f: f[0])}

    def _node_reasons(self, req: GpuRequest, usable: BoolArray, nodes: IntArray) -> list[FilterReason]:
        """Each node's reason: its kind by the gates (vectorised over ``nodes``), then worded by the rule table."""
        led = self.ledger
        allowed = np.array([req.allows_model(m) for m in led.model_names] + [False], dtype=bool)
        gpu_ok = allowed[led.model_id[nodes]] & led.present[nodes]
        healthy = gpu_ok & led.healthy[nodes]
        free_mem = np.where(healthy, led.free_mem[nodes], -1).max(axis=1, initial=-1)
        free_milli = np.where(healthy, led.free_milli[nodes], -1).max(axis=1, initial=-1)
        n_allowed = gpu_ok.sum(axis=1)
        n_healthy = healthy.sum(axis=1)
        n_usable = usable[nodes].sum(axis=1)
        cpu_free = led.cpu_free[nodes]
        mem_free = led.mem_free[nodes]
        kinds: list[ReasonKind | None] = [None] * len(nodes)
        for gated, mask in node_kinds(req, RoomArrays(n_allowed, n_usable, cpu_free, mem_free)):
            for i in np.flatnonzero(mask).tolist():
                kinds[i] = gated
        # A reason is a function of these seven numbers, and nodes of one kind in one state share them (empty
        # nodes, full ones): each distinct tuple is worded once.
        worded: dict[tuple[int, ...], FilterReason] = {}
        out = []
        columns = (n_allowed, n_healthy, n_usable, free_mem, free_milli, cpu_free, mem_free)
        for row, kind in zip(zip(*(c.tolist() for c in columns), strict=True), kinds, strict=True):
            reason = worded.get(row)
            if reason is None:
                reason = worded[row] = node_reason(req, NodeRoom(*row), kind)
            out.append(reason)
        return out

    def place(self, req: GpuRequest) -> Decision:
        """Decide and reserve in the ledger; raises :class:`NoFit` when nothing fits."""
        d = self.decide(req)
        if isinstance(d, Unschedulable):
            raise NoFit(d)
        self.ledger.place(d.assignment)
        return d
