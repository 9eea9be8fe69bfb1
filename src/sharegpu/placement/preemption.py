"""Preemption for GPU shortfalls: which lower-priority pods to evict, and on which node, so that a pending pod fits.

The kube-scheduler's DefaultPreemption cannot do this for GPU shares: it sees ``sharegpu.io/gpu`` as opaque tokens,
so a pod short of GPU memory, compute, MIG slots or whole GPUs finds no victims. This planner does the same
work with the core's own filter, in the kube-scheduler's shape:

1. per node, remove every pod of lower priority than the preemptor; if the preemptor still does not fit, the node
   is no candidate; otherwise put the pods back one by one, most important first (higher priority, then earlier
   start), pods whose eviction would violate a PodDisruptionBudget before the others, and keep back every pod
   whose return still leaves room (selectVictimsOnNode);
2. among the candidate nodes pick, in this order: fewest PDB violations, lowest highest-victim priority, smallest
   sum of victim priorities, fewest victims, latest start of the highest-priority victims, then the tie-break
   order (pickOneNodeForPreemption).

Fit is always the placement framework's filter (:meth:`Scheduler.fits`) on a copy of the ledger with victims
removed: no fit rule is restated here. The caller's ledger is never changed. Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import numpy.typing as npt

from sharegpu.ledger import GpuMode, Ledger
from sharegpu.model.assignment import Assignment, Mechanism
from sharegpu.model.request import FULL_MILLI, GpuRequest
from sharegpu.placement.framework import Decision, Policy, Scheduler

IntArray = npt.NDArray[np.int64]
# kube-scheduler adds MaxInt32 + 1 to each victim's priority before summing, so that negative priorities still
# make a larger set of victims cost more; the same offset keeps our order identical to its order.
PRIORITY_OFFSET = 2**31


class PreemptionPolicy(StrEnum):
    """A pod's ``preemptionPolicy`` (from its PriorityClass)."""

    PREEMPT_LOWER_PRIORITY = "PreemptLowerPriority"
    NEVER = "Never"


@dataclass(frozen=True)
class Preemptor:
    """The pending pod: its request, its priority and whether it may preempt at all."""

    request: GpuRequest
    priority: int
    policy: PreemptionPolicy = PreemptionPolicy.PREEMPT_LOWER_PRIORITY


@dataclass(frozen=True)
class Victim:
    pod: str
    priority: int
    violates_pdb: bool
    start_time: float | None  # None: unknown (counts as "now", the latest, as the kube-scheduler counts it)


@dataclass(frozen=True)
class PreemptionPlan:
    """Evict ``victims`` from ``node``; the preemptor then gets ``assignment`` there (reserve it as nominated)."""

    node: str
    node_index: int
    victims: tuple[Victim, ...]
    assignment: Assignment
    candidates: int  # nodes where evictions could make room (the chosen one among them)

    @property
    def victim_pods(self) -> tuple[str, ...]:
        return tuple(v.pod for v in self.victims)

    @property
    def pdb_violations(self) -> int:
        return sum(v.violates_pdb for v in self.victims)


class PreemptionError(Exception):
    """No preemption; the message says why, in words fit for an Event on the preemptor."""


class PreemptionNotAllowed(PreemptionError):
    """The preemptor's ``preemptionPolicy`` is ``Never``."""


class NoCandidates(PreemptionError):
    """No node where evicting lower-priority pods makes the preemptor fit."""


@dataclass(frozen=True)
class PodFacts:
    """What the caller knows about placed pods besides the ledger: priorities (absent: ``default_priority``, as a
    pod without a PriorityClass has 0), start times (absent: unknown) and whether evicting a pod would violate its
    PodDisruptionBudget (the caller answers from the PDBs' ``disruptionsAllowed``)."""

    priority: Mapping[str, int]
    start_time: Mapping[str, float] | None = None
    violates_pdb: Callable[[str], bool] | None = None
    default_priority: int = 0

    def priority_of(self, pod: str) -> int:
        return self.priority.get(pod, self.default_priority)

    def victim(self, pod: str) -> Victim:
        start = None if self.start_time is None else self.start_time.get(pod)
        pdb = bool(self.violates_pdb(pod)) if self.violates_pdb is not None else False
        return Victim(pod, self.priority_of(pod), pdb, start)


# ----- shared with consolidation -------------------------------------------------------------------------------
def copy_ledger(ledger: Ledger) -> Ledger:
    """An independent copy of ``ledger`` to plan on (:meth:`Ledger.copy`): a plan is made while pods wait."""
    return ledger.copy()


def room_bound(ledger: Ledger, req: GpuRequest, removable: Iterable[str], sched: Scheduler) -> npt.NDArray[np.bool_]:
    """(N,) nodes where ``req`` could fit if all of ``removable`` were gone: a necessary condition (an upper bound
    of the room), vectorised, so that the exact check on a ledger copy runs only on nodes where it can succeed.

    Bounds: a node's CPU and host memory plus what the removable pods hold; a non-MIG GPU's free compute and memory
    plus the removable shares on it (all of it once every share goes); a MIG GPU with a removable share counts as
    wholly free (its instances may go)."""
    n, g = ledger.present.shape
    cpu = ledger.cpu_free.copy()
    mem = ledger.mem_free.copy()
    milli = ledger.free_milli.copy()
    gmem = ledger.free_mem.copy()
    freed_clients = np.zeros((n, g), dtype=np.int64)
    mig_touched = np.zeros((n, g), dtype=bool)
    for pod in removable:
        a = ledger.assignments.get(pod)
        if a is None:
            continue
        i = ledger.index[a.node]
        cpu[i] += a.cpu_milli
        mem[i] += a.host_memory_mib
        for s in a.shares:
            if s.mechanism is Mechanism.MIG:
                mig_touched[i, s.gpu_index] = True
            else:
                milli[i, s.gpu_index] += s.compute_milli
                # An MPS client may take its daemon's server with it: counted as freed (a bound may be generous).
                daemon = ledger.tenancy.daemon_memory_mib if s.mechanism is Mechanism.MPS else 0
                gmem[i, s.gpu_index] += s.memory_mib + daemon
                freed_clients[i, s.gpu_index] += 1
    emptied = (freed_clients == ledger.clients) & (ledger.mode != GpuMode.MIG)
    whole = mig_touched | emptied
    milli = np.where(whole, FULL_MILLI, milli)
    gmem = np.where(whole, ledger.gpu_mem_total, gmem)
    ok = (cpu >= req.cpu_milli) & (mem >= req.host_memory_mib)
    if req.gpu_count == 0:
        return ok
    plan = sched.plan(req)
    mid = ledger.model_id
    route = plan.route[mid]  # 0: the model cannot host it
    # A whole GPU needs all of it free; a share its compute; a MIG share is not bounded here (it may join an
    # instance that has room while the GPU's uncovered compute is 0).
    need = np.where(route == 1, FULL_MILLI, np.where(route == 2, plan.compute[mid], 0))
    room = ledger.present & ledger.healthy & (route > 0) & (milli >= need)
    room &= (route != 2) | (gmem >= plan.memory)
    out: npt.NDArray[np.bool_] = ok & (room.sum(axis=1) >= req.gpu_count)
    return out


def remove_minimal(
    work: Ledger,
    sched: Scheduler,
    req: GpuRequest,
    node: int,
    removable: Sequence[str],
) -> list[str] | None:
    """On ``work`` (a copy), the pods of ``removable`` (all on ``node``, in reprieve order: the first is the most
    wanted back) that must go for ``req`` to fit on ``node``, or None when even removing all is not enough.

    Leaves ``work`` with exactly those pods removed: the caller restores them (``work.place``) when done."""
    held = {p: work.release(p) for p in removable}
    if not sched.fits(req, node):
        for a in held.values():
            work.place(a, check_health=False)
        return None
    gone: list[str] = []
    for pod in removable:
        work.place(held[pod], check_health=False)
        if not sched.fits(req, node):
            work.release(pod)
            gone.append(pod)
    return gone


def restore(work: Ledger, original: Ledger, pods: Iterable[str]) -> None:
    """Put ``pods`` back on ``work`` as ``original`` holds them (a subset of valid assignments is valid, and adding
    one back to a subset of the original set is too, so this never conflicts)."""
    for p in pods:
        work.place(original.assignments[p], check_health=False)


# ----- preemption -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Candidate:
    node: int
    victims: tuple[Victim, ...]

    def key(self, rank: IntArray) -> tuple[float, ...]:
        """pickOneNodeForPreemption's order as one sort key (smaller is better)."""
        if not self.victims:
            return (0, -math.inf, 0, 0, 0, float(rank[self.node]))
        top = max(v.priority for v in self.victims)
        starts = [math.inf if v.start_time is None else v.start_time for v in self.victims if v.priority == top]
        return (
            sum(v.violates_pdb for v in self.victims),
            top,
            sum(v.priority + PRIORITY_OFFSET for v in self.victims),
            len(self.victims),
            -min(starts),  # the latest earliest-start of the highest-priority victims wins
            float(rank[self.node]),
        )


def kube_candidate_limit(n_nodes: int) -> int:
    """How many candidate nodes the kube-scheduler's dry run looks for before it picks one: 10 % of the nodes
    (minCandidateNodesPercentage), at least 100 (minCandidateNodesAbsolute), at most all of them."""
    return max(1, min(n_nodes, max(100, n_nodes // 10)))


def _importance(v: Victim) -> tuple[float, float, str]:
    # MoreImportantPod: higher priority first, then the pod that started earlier (unknown start: now, the latest).
    return (-v.priority, math.inf if v.start_time is None else v.start_time, v.pod)


def plan_preemption(
    ledger: Ledger,
    preemptor: Preemptor,
    policy: Policy,
    facts: PodFacts,
    *,
    nodes: Collection[int] | None = None,
    rank: Sequence[int] | IntArray | None = None,
    max_candidates: int | None = None,
) -> PreemptionPlan:
    """Where ``preemptor`` gets room by evicting pods of lower priority, and whom to evict; raises
    :class:`PreemptionNotAllowed` or :class:`NoCandidates` when it cannot.

    ``policy`` chooses the preemptor's GPUs on the chosen node (its selector), ``nodes`` limits the nodes looked at
    (default: all), ``rank`` is the final tie-break order of nodes (default: name order). A node where the
    preemptor fits already is a candidate with no victims, and wins.

    ``max_candidates`` stops the search once that many candidate nodes are found, as the kube-scheduler's dry run
    does (:func:`kube_candidate_limit`); default: every node. Nodes are searched fewest lower-priority pods first
    (then in ``rank`` order), so that a capped search meets the nodes likely to need the fewest victims early.
    """
    req = preemptor.request
    if preemptor.policy is PreemptionPolicy.NEVER:
        raise PreemptionNotAllowed(f"{req.name} has preemptionPolicy Never: it waits for room instead")
    if max_candidates is not None and max_candidates < 1:
        raise ValueError(f"max_candidates {max_candidates} must be at least 1 (or None: no limit)")
    order: IntArray = np.arange(len(ledger.nodes), dtype=np.int64) if rank is None else np.asarray(rank, dtype=np.int64)
    if nodes is None:
        pods: Iterable[str] = ledger.assignments
    else:
        pods = [p for n in sorted(set(nodes)) for p in sorted(ledger.node_pods[n])]
    lower = [p for p in pods if facts.priority_of(p) < preemptor.priority]
    work = copy_ledger(ledger)
    sched = Scheduler(work, policy, rank=order)
    maybe = room_bound(ledger, req, lower, sched)
    if nodes is not None:
        keep = np.zeros(len(ledger.nodes), dtype=bool)
        keep[np.fromiter(nodes, dtype=np.int64, count=len(nodes))] = True
        maybe &= keep
    by_node: dict[int, list[str]] = {}
    for p in lower:
        by_node.setdefault(ledger.index[ledger.assignments[p].node], []).append(p)
    search = sorted(np.flatnonzero(maybe).tolist(), key=lambda n: (len(by_node.get(n, ())), int(order[n])))
    found: list[_Candidate] = []
    for node in search:
        pool = sorted((facts.victim(p) for p in by_node.get(node, ())), key=_importance)
        # Reprieve PDB-protected pods first, so that they are the last to be chosen (filterPodsWithPDBViolation).
        pool = [v for v in pool if v.violates_pdb] + [v for v in pool if not v.violates_pdb]
        gone = remove_minimal(work, sched, req, node, [v.pod for v in pool])
        if gone is None:
            continue
        restore(work, ledger, gone)
        facts_of = {v.pod: v for v in pool}
        found.append(_Candidate(node, tuple(sorted((facts_of[p] for p in gone), key=_importance))))
        if max_candidates is not None and len(found) >= max_candidates:
            break
    if not found:
        raise NoCandidates(
            f"{req.name} (priority {preemptor.priority}) fits on no node even if every pod of lower priority were "
            f"evicted ({len(lower)} such pod(s) in the cluster)"
        )
    best = min(found, key=lambda c: c.key(order))
    for v in best.victims:
        work.release(v.pod)
    decision = sched.decide_on(req, best.node)
    if not isinstance(decision, Decision):  # the filter said it fits on this very state: a bug, not a user error
        raise AssertionError(f"preemption chose {ledger.nodes[best.node].name} but {decision.reason}")
    return PreemptionPlan(ledger.nodes[best.node].name, best.node, best.victims, decision.assignment, len(found))
