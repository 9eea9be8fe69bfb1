"""Consolidation: move a few movable pods so that a pod that waits only because free GPU room is fragmented fits.

A plan is made on a copy of the ledger and returned only when it is complete: the waiting pod fits on its target
node once the moved pods are gone from it, and every moved pod has a new place elsewhere (chosen by the same
policy, with the waiting pod's room already reserved, so no moved pod can take it). Nothing is evicted for a plan
that would leave a pod without a place.

Per candidate target node (nodes where moving every movable pod away could make room, by a cheap bound), the
fewest pods to move are found as preemption finds victims (:func:`remove_minimal`: take all movable pods off, put
them back largest first while the waiting pod still fits), so that the pods hardest to place elsewhere stay.
Targets are tried fewest moves first, then least GPU moved, then the tie-break order; at most ``max_moves`` moves
and ``max_targets`` tries bound the work and the disruption. Deterministic: same ledger, same plan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from sharegpu.ledger import Ledger
from sharegpu.model.assignment import Assignment
from sharegpu.model.request import GpuRequest
from sharegpu.placement.framework import Decision, Policy, Scheduler
from sharegpu.placement.preemption import copy_ledger, remove_minimal, restore, room_bound

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Move:
    """Move ``pod`` from ``source`` to ``assignment`` (evict it; its controller recreates it; bind it there)."""

    pod: str
    source: str
    assignment: Assignment


@dataclass(frozen=True)
class ConsolidationPlan:
    """Do ``moves``, then the waiting pod gets ``assignment`` on ``node`` (reserve it first, as nominated)."""

    node: str
    node_index: int
    moves: tuple[Move, ...]
    assignment: Assignment
    targets_tried: int


class ConsolidationError(Exception):
    """No consolidation plan; the message says why."""


class AlreadyFits(ConsolidationError):
    """The pod fits somewhere as things are: place it, nothing needs to move."""


class NotEnoughRoom(ConsolidationError):
    """The free GPU room of the models the pod may use is smaller than what it asks: no move can help."""


class NoPlan(ConsolidationError):
    """No target within the bounds where every moved pod finds a new place."""


def free_room_milli(ledger: Ledger, req: GpuRequest) -> int:
    """Free GPU compute, in milli-GPU, on healthy GPUs of the models ``req`` may use (on any node)."""
    if not ledger.models:
        return 0
    allowed = np.array([req.allows_model(m) for m in ledger.model_names] + [False], dtype=bool)
    usable = allowed[ledger.model_id] & ledger.present & ledger.healthy
    return int(ledger.free_milli[usable].sum())


def plan_consolidation(
    ledger: Ledger,
    request: GpuRequest,
    policy: Policy,
    movable: Mapping[str, GpuRequest],
    *,
    max_moves: int = 4,
    max_targets: int = 8,
    rank: Sequence[int] | IntArray | None = None,
    max_candidates: int | None = None,
) -> ConsolidationPlan:
    """A plan of at most ``max_moves`` moves of pods from ``movable`` (pod → the request it was placed with) after
    which ``request`` fits; raises :class:`AlreadyFits`, :class:`NotEnoughRoom` or :class:`NoPlan`.

    ``policy`` places the waiting pod on its target and each moved pod elsewhere. ``rank`` is the tie-break order of
    nodes (default: name order). ``max_candidates`` stops the search for targets once that many are found within
    ``max_moves`` (nodes with the fewest movable pods are searched first); default: every node. The caller's ledger
    is never changed.
    """
    if max_moves < 1 or max_targets < 1:
        raise ValueError(f"max_moves ({max_moves}) and max_targets ({max_targets}) must be at least 1")
    order: IntArray = np.arange(len(ledger.nodes), dtype=np.int64) if rank is None else np.asarray(rank, dtype=np.int64)
    work = copy_ledger(ledger)
    sched = Scheduler(work, policy, rank=order)
    ok, _ = sched.feasible(request)
    if ok.any():
        raise AlreadyFits(f"{request.name} fits on {ledger.nodes[int(np.flatnonzero(ok)[0])].name} already")
    free = free_room_milli(ledger, request)
    if free < request.total_milli:
        raise NotEnoughRoom(
            f"{request.name} asks {request.total_milli / 1000:g} GPU and only {free / 1000:g} GPU is free on GPUs of "
            "models it may use: moving pods cannot make room"
        )
    placed = [p for p in sorted(movable) if p in ledger.assignments]
    maybe = room_bound(ledger, request, placed, sched)
    by_node: dict[int, list[str]] = {}
    for p in placed:
        by_node.setdefault(ledger.index[ledger.assignments[p].node], []).append(p)
    targets: list[tuple[int, int, int, int, list[str]]] = []  # (moves, GPU milli moved, rank, node, pods)
    search = sorted(np.flatnonzero(maybe).tolist(), key=lambda n: (len(by_node.get(n, ())), int(order[n])))
    for node in search:
        if max_candidates is not None and len(targets) >= max_candidates:
            break
        # Largest first: the most wanted back, since a large pod is the hardest to place elsewhere.
        pool = sorted(by_node.get(node, []), key=lambda p: (-ledger.gpu_milli_of(ledger.assignments[p]), p))
        gone = remove_minimal(work, sched, request, node, pool)
        if gone is None:
            continue
        restore(work, ledger, gone)
        if 0 < len(gone) <= max_moves:
            moved = sum(ledger.gpu_milli_of(ledger.assignments[p]) for p in gone)
            targets.append((len(gone), moved, int(order[node]), node, gone))
    targets.sort(key=lambda t: t[:3])
    tried = 0
    for _, _, _, node, gone in targets[:max_targets]:
        tried += 1
        plan = _try_target(ledger, policy, order, request, node, gone, movable, tried)
        if plan is not None:
            return plan
    raise NoPlan(
        f"{request.name}: no node where moving at most {max_moves} movable pod(s) makes room and every moved pod "
        f"finds a new place ({len(targets)} target(s) within the bound, {tried} tried)"
    )


def _try_target(
    ledger: Ledger,
    policy: Policy,
    order: IntArray,
    request: GpuRequest,
    node: int,
    gone: list[str],
    movable: Mapping[str, GpuRequest],
    tried: int,
) -> ConsolidationPlan | None:
    """The plan for one target, on a fresh copy: reserve the waiting pod there first, then re-place the moved pods
    (largest first) anywhere but their old node; None when one of them finds no place."""
    work = copy_ledger(ledger)
    sched = Scheduler(work, policy, rank=order)
    for p in gone:
        work.release(p)
    d = sched.decide_on(request, node)
    if not isinstance(d, Decision):
        return None
    work.place(d.assignment)
    moves: list[Move] = []
    for p in gone:
        req = movable[p]
        if req.name != p:  # the assignment names its pod after the request
            req = replace(req, name=p)
        ok, usable = sched.feasible(req)
        ok[node] = False  # back where it was is no move
        nodes = np.flatnonzero(ok)
        if len(nodes) == 0:
            return None
        state = sched.cycle(req, usable)
        chosen = sched.pick(nodes, sched.scores(state, nodes))
        a = sched.assignment_on(state, chosen)
        work.place(a)
        moves.append(Move(p, ledger.nodes[node].name, a))
    return ConsolidationPlan(ledger.nodes[node].name, node, tuple(moves), d.assignment, tried)
