"""The timed replay: pods arrive at their creation times and leave at their deletion times, and a pending queue
waits for room; optionally with priorities, preemption and consolidation (issue 19). One event loop for both: a
replay without :class:`PriorityOptions` is the plain one.

Tasks without a creation time arrive at 0; without a deletion time they never leave. The pending queue retries
higher priority first (the kube-scheduler's activeQ order), then FIFO. After each event every waiting pod fits
nowhere, and a placement never makes room, so a deletion can only let in pods that fit on the node it freed, and they
can only go there: the queue retries, in order, only the pods whose shape fits that node now
(:class:`~sharegpu.sim.engine.PendingQueue`), which places exactly the pods that retrying the whole queue would,
where it would (``retry_all``, the plain reference, kept for tests and benchmarks).

With priorities a seeded share of the pods is marked high priority. With ``preemption`` a high-priority pod that fits
nowhere evicts lower-priority pods as :func:`plan_preemption` says (on arrival over every node; after each departure
again on the node that departure freed). With ``consolidation`` a pod that still fits nowhere, while enough GPU room
is free in all, gets the moves :func:`plan_consolidation` plans (only lower-priority pods move, and only when
high-priority pods are marked; otherwise any pod). An evicted or moved pod is restarted by its controller: it
re-enters the pending queue (a moved pod is placed at once where the plan says) and runs its whole lifetime again
from its new start, so an eviction costs the work it loses. Handover is instant: the simulator has no grace period.

Waiting time is from a pod's creation to its first placement; a pod never placed counts as waiting until the last
event (a lower bound, so that a run that never places a pod cannot look fast).
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sharegpu.ledger import Ledger, MpsTenancy
from sharegpu.model.inventory import NodeSpec
from sharegpu.placement.consolidation import ConsolidationError, plan_consolidation
from sharegpu.placement.framework import Policy, Scheduler, Unschedulable
from sharegpu.placement.preemption import (
    PodFacts,
    PreemptionError,
    Preemptor,
    kube_candidate_limit,
    plan_preemption,
)
from sharegpu.placement.reasons import ReasonKind
from sharegpu.sim.engine import PendingQueue, Progress, ReplayResult, _result
from sharegpu.sim.metrics import RunLog, sample_timeline
from sharegpu.sim.openb import TraceTask

HIGH = 1000  # the marked pods' priority (a production PriorityClass)
LOW = 0  # everything else (no PriorityClass)
NODE_RETRIES = 4  # waiting high-priority pods that try preemption on a node a departure freed, per departure


@dataclass(frozen=True)
class PriorityOptions:
    """What a priority replay adds to a plain one (all off: the same replay, with a priority-ordered queue)."""

    high_share: float = 0.0  # share of pods marked high priority, 0..1 (seeded per run)
    preemption: bool = False
    consolidation: bool = False
    max_moves: int = 2  # per consolidation plan

    def label(self) -> str:
        parts = [f"high {self.high_share:g}"] if self.high_share else []
        parts += ["preemption"] if self.preemption else []
        parts += [f"consolidation ≤{self.max_moves}"] if self.consolidation else []
        return ", ".join(parts) or "no priorities"


def mark_high(tasks: Sequence[TraceTask], share: float, seed: int) -> frozenset[str]:
    """Names of ``round(share × pods)`` pods drawn without replacement with ``seed`` (same seed, same pods)."""
    names = sorted(t.name for t in tasks)
    k = round(share * len(names))
    if k <= 0:
        return frozenset()
    picks = np.random.default_rng([seed, 0x9A1]).choice(len(names), size=k, replace=False)
    return frozenset(names[i] for i in picks.tolist())


MEAN_GAP_S = 1000.0  # mean time between two arrivals of a loaded redraw


def _loaded_lifetimes(base: Sequence[TraceTask], capacity_milli: int, load: float) -> np.ndarray:
    """Each pod's lifetime in a redraw at ``load``: clipped at the 90th percentile and rescaled (see overloaded)."""
    life = np.array([max(1, (t.deletion_time or 0) - (t.creation_time or 0)) for t in base], dtype=np.float64)
    life = np.minimum(life, np.percentile(life, 90))
    gpus = np.array([t.request.total_milli / 1000 for t in base], dtype=np.float64)
    busy = float((life * gpus).mean())
    if busy <= 0:
        raise ValueError("no pod of the trace with a deletion time asks for a GPU: nothing to load the cluster with")
    scaled: np.ndarray = life * (load * capacity_milli / busy)
    return scaled


def arrivals_to_load(tasks: Sequence[TraceTask], capacity_milli: int, load: float) -> int:
    """How many arrivals a redraw needs for its cluster to reach ``load`` and hold it: it starts empty and fills
    over its longest lifetime, so the arrivals must span twice that (half ramp, half loaded)."""
    base = [t for t in tasks if t.deletion_time is not None]
    if not base:
        raise ValueError("no pod of the trace has a deletion time: a loaded replay needs pod lifetimes")
    return int(np.ceil(2 * float(_loaded_lifetimes(base, capacity_milli, load).max()) / MEAN_GAP_S))


def overloaded(
    tasks: Sequence[TraceTask], capacity_milli: int, pods: int, seed: int, load: float
) -> tuple[TraceTask, ...]:
    """``pods`` pods drawn with replacement from ``tasks`` (those with a deletion time), each keeping its shape and
    lifetime (clipped at the 90th percentile: the trace's tail lives for months and would never settle), arriving as a
    Poisson process (one per 1,000 s on average) with lifetimes rescaled so that the GPU busy on average (Little's
    law) is ``load`` × capacity once the cluster has filled (after about :func:`arrivals_to_load` / 2 arrivals). The
    openb trace as recorded never fills its cluster (its peak is ~1 % of the GPUs), so waiting, preemption and
    consolidation can only be measured on a loaded version of it. (The same generator as bench/sim_speed.py's
    overloaded replay.)"""
    base = [t for t in tasks if t.deletion_time is not None]
    if not base:
        raise ValueError("no pod of the trace has a deletion time: a loaded replay needs pod lifetimes")
    rng = np.random.default_rng(seed)
    picks = rng.integers(len(base), size=pods)
    life = _loaded_lifetimes(base, capacity_milli, load)
    created = np.cumsum(rng.exponential(MEAN_GAP_S, size=pods)).astype(np.int64)
    width = len(str(pods))
    out = []
    for i, (k, c) in enumerate(zip(picks.tolist(), created.tolist(), strict=True)):
        req = dataclasses.replace(base[k].request, name=f"pod-{i:0{width}d}")
        out.append(TraceTask(req, c, c + int(life[k])))
    return tuple(out)


def _window_alloc(times: Sequence[int], allocated: Sequence[int], until: int, total: int) -> float:
    """Allocated GPU, % of capacity, averaged over trace time from the first event to ``until`` (the last arrival):
    the loaded part of a replay. The mean over events would mostly weigh the drain after the last arrival, when
    the cluster empties whatever the policy did."""
    t = np.asarray(times, dtype=np.float64)
    if len(t) < 2 or until <= t[0] or not total:
        return 0.0
    a = np.asarray(allocated, dtype=np.float64)
    edges = np.minimum(np.append(t[1:], until), until)
    span = np.clip(edges - np.minimum(t, until), 0, None)
    return round(100 * float((a * span).sum() / span.sum()) / total, 2) if span.sum() else 0.0


def _pct(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)), 1) if values else 0.0


def replay_trace(
    nodes: Sequence[NodeSpec],
    tasks: Sequence[TraceTask],
    policy: Policy,
    opts: PriorityOptions | None = None,
    seed: int = 0,
    max_pending: int = 10_000,
    progress: Progress | None = None,
    retry_all: bool = False,
    tenancy: MpsTenancy | None = None,
) -> ReplayResult:
    """Replay ``tasks`` on ``nodes`` with ``policy``; ``opts`` adds priorities, preemption and consolidation and their
    figures to the result (without it, only the plain replay's); ``tenancy``: how the ledger counts MPS daemons."""
    prio_opts = opts or PriorityOptions()
    t0 = time.perf_counter()
    ledger = Ledger(nodes, tenancy=tenancy)
    sched = Scheduler(ledger, policy, seed=seed)
    log = RunLog(ledger.total_gpu_milli)
    by_name = {t.name: t for t in tasks}
    high = mark_high(tasks, prio_opts.high_share, seed)
    prio = {name: HIGH if name in high else LOW for name in by_name}
    limit = kube_candidate_limit(len(ledger.nodes))
    start_time: dict[str, float] = {}  # filled in as pods start (the victims' latest-start criterion reads it)
    facts = PodFacts(prio, start_time)
    # (time, kind 0 = delete first, seq, name, epoch): an eviction or move bumps the pod's epoch, and a deletion
    # event of an earlier epoch is stale (the pod it would end was restarted since).
    events: list[tuple[int, int, int, str, int]] = []
    for seq, t in enumerate(sorted(tasks, key=lambda t: (t.creation_time or 0, t.name))):
        heapq.heappush(events, (t.creation_time or 0, 1, seq, t.name, 0))
    epoch: dict[str, int] = {}
    restarted: set[str] = set()
    first_start: dict[str, int] = {}
    pending = PendingQueue(sched)
    high_waiting: dict[str, None] = {}  # high-priority pods in the queue, in arrival order
    waited: set[str] = set()
    counts = {"evictions": 0, "preemptions": 0, "moves": 0, "consolidations": 0, "restarts": 0}
    arrived = 0
    peak = 0
    now = 0
    times: list[int] = []
    pending_sizes: list[int] = []
    seq_next = len(tasks)
    last_arrival = 0

    def started(name: str) -> None:
        """Bookkeeping of a pod that just got its place at ``now``: its end, its start, its first start."""
        nonlocal seq_next
        t = by_name[name]
        log.placed += 1
        first_start.setdefault(name, now)
        start_time[name] = float(now)
        high_waiting.pop(name, None)
        end: int | None = t.deletion_time
        if name in restarted and t.deletion_time is not None:
            end = now + t.deletion_time - (t.creation_time or 0)  # a restart runs its whole lifetime again
        if end is not None:
            end = max(end, now)  # a pod that waited past its deletion time ends at once, not in the past
            heapq.heappush(events, (end, 0, seq_next, name, epoch.get(name, 0)))
            seq_next += 1

    def try_place(name: str) -> bool:
        start = time.perf_counter()
        d = sched.decide(by_name[name].request)
        log.latencies_s.append(time.perf_counter() - start)
        if isinstance(d, Unschedulable):
            return False
        ledger.place(d.assignment)
        started(name)
        return True

    def enqueue(name: str) -> None:
        if len(pending) < max_pending:
            pending.add(name, by_name[name].request, prio[name])
            if prio[name] >= HIGH:
                high_waiting[name] = None
        else:
            log.fail(ReasonKind.QUEUE_FULL)

    def evict(name: str) -> None:
        """Stop ``name`` (a preemption victim or a moved pod): its controller will start it again."""
        ledger.release(name)
        epoch[name] = epoch.get(name, 0) + 1
        restarted.add(name)
        log.placed -= 1  # counted again when it starts again: placed stays "pods running or ended normally"
        counts["restarts"] += 1

    def preempt(name: str, only: list[int] | None = None, queued: bool = False) -> bool:
        req = by_name[name].request
        try:
            plan = plan_preemption(ledger, Preemptor(req, prio[name]), policy, facts, nodes=only, max_candidates=limit)
        except PreemptionError:
            return False
        if queued:  # out of the queue before anything retries it
            pending.remove(name, req, prio[name])
        for v in plan.victim_pods:
            evict(v)
            counts["evictions"] += 1
        ledger.place(plan.assignment)
        counts["preemptions"] += 1
        started(name)
        # Room the preemptor left on the node goes to the queue first (by priority), then the victims try elsewhere.
        pending.retry_on(plan.node_index, try_place)
        for v in plan.victim_pods:
            if not try_place(v):
                enqueue(v)
        return True

    def consolidate(name: str) -> bool:
        # With priorities only high-priority pods get moves, and only lower-priority pods move; without, any pod.
        if high and prio[name] <= LOW:
            return False
        req = by_name[name].request
        movable = {p: by_name[p].request for p in ledger.assignments if not high or prio[p] < prio[name]}
        try:
            plan = plan_consolidation(ledger, req, policy, movable, max_moves=prio_opts.max_moves, max_candidates=limit)
        except ConsolidationError:
            return False
        for m in plan.moves:
            evict(m.pod)
        ledger.place(plan.assignment)
        started(name)
        for m in plan.moves:
            ledger.place(m.assignment)
            started(m.pod)
            counts["moves"] += 1
        counts["consolidations"] += 1
        pending.retry_on(plan.node_index, try_place)
        return True

    while events:
        now, kind, seq, name, ev_epoch = heapq.heappop(events)
        if kind == 0:
            if ev_epoch != epoch.get(name, 0) or name not in ledger:
                continue  # the pod was restarted since: this end belongs to its earlier run
            a = ledger.release(name)
            freed = ledger.node_of(a.node)
            if retry_all:
                pending.retry_all(try_place)
            else:
                pending.retry_on(freed, try_place)
            if prio_opts.preemption and high_waiting:
                # Preemption is retried where the cluster changed: the node this departure freed.
                for w in list(high_waiting)[:NODE_RETRIES]:
                    if preempt(w, [freed], queued=True):
                        break
        else:
            last_arrival = now
            arrived += by_name[name].request.total_milli
            if not try_place(name):
                waited.add(name)
                placed = prio_opts.preemption and prio[name] > LOW and preempt(name)
                if not placed and prio_opts.consolidation:
                    placed = consolidate(name)
                if not placed:
                    enqueue(name)
        peak = max(peak, len(pending))
        log.record(arrived, int(ledger.total_gpu_milli - np.where(ledger.healthy, ledger.free_milli, 0).sum()))
        times.append(now)
        pending_sizes.append(len(pending))
        if progress is not None and kind == 1 and seq % 256 == 0:
            progress(seq)
    for _ in range(len(pending)):
        log.fail(ReasonKind.STILL_PENDING)
    run = _result(policy.name, seed, ledger, log, t0, len(tasks), None)
    total = ledger.total_gpu_milli
    end = times[-1] if times else 0
    stats: dict[str, float] = {
        "waited": len(waited),
        "never_placed": len(pending),
        "peak_pending": peak,
        "mean_alloc_pct": round(100 * float(np.mean(log.allocated)) / total, 2) if total else 0.0,
    }
    if opts is not None:
        stats |= _priority_stats(high, waited, first_start, by_name, end, counts)
        stats["arrival_alloc_pct"] = _window_alloc(times, log.allocated[1:], last_arrival, total)
    timeline = sample_timeline(times, log.allocated[1:], pending_sizes, total)
    return ReplayResult(dataclasses.replace(run, replay=stats, timeline=timeline), len(waited), len(pending), peak)


def _priority_stats(
    high: frozenset[str],
    waited: set[str],
    first_start: dict[str, int],
    by_name: dict[str, TraceTask],
    end: int,
    counts: dict[str, int],
) -> dict[str, float]:
    """How long high- and low-priority pods waited, and what preemption and consolidation did."""

    def waits(names: Sequence[str]) -> list[float]:
        return [float(first_start.get(n, end) - (by_name[n].creation_time or 0)) for n in names]

    high_w = waits(sorted(high))
    low_w = waits(sorted(set(by_name) - high))
    return {
        "high_pods": len(high),
        "high_waited": sum(1 for n in high if n in waited),
        "high_never_placed": sum(1 for n in high if n not in first_start),
        "high_wait_mean_s": round(float(np.mean(high_w)), 1) if high_w else 0.0,
        "high_wait_p50_s": _pct(high_w, 50),
        "high_wait_p95_s": _pct(high_w, 95),
        "high_wait_p99_s": _pct(high_w, 99),
        "low_wait_mean_s": round(float(np.mean(low_w)), 1) if low_w else 0.0,
        "low_wait_p95_s": _pct(low_w, 95),
        **{k: float(v) for k, v in counts.items()},
    }
