"""Runs requests through the same scheduler the cluster uses, and records what happened."""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from sharegpu.ledger import Ledger, MpsTenancy
from sharegpu.model.inventory import NodeSpec
from sharegpu.model.request import GpuRequest
from sharegpu.model.tenant import own_tenant
from sharegpu.placement.framework import Policy, Scheduler, Unschedulable
from sharegpu.placement.reasons import ReasonKind
from sharegpu.sim.metrics import RunLog, Timeline, allocation_curve, percentile

Progress = Callable[[int], None]


@dataclass(frozen=True)
class RunResult:
    policy: str
    seed: int
    wall_s: float
    pods: int
    placed: int
    failed: int
    total_gpus: int
    curve: list[float | None]  # allocation % at arrived 0..130 %
    failures: dict[ReasonKind, int]  # why pods were not placed → how many
    latency_p50_ms: float
    latency_p99_ms: float
    fragmentation_pct: float | None  # free GPU milli that the workload cannot use, % of capacity, at the end
    final_alloc_pct: float
    replay: dict[str, float] | None = None  # replay mode: queueing figures (see ReplayResult)
    timeline: Timeline | None = None  # replay mode: allocation and pending pods over trace time
    mps_rule: str | None = None  # the MPS tenancy rule it ran under (sim.mps_rules), where the runner says

    def alloc_at(self, arrived_pct: int) -> float | None:
        return self.curve[arrived_pct] if 0 <= arrived_pct < len(self.curve) else None

    def to_dict(self) -> dict[str, object]:
        a100, a130 = self.alloc_at(100), self.alloc_at(130)
        return {
            "policy": self.policy,
            "seed": self.seed,
            "wall_s": round(self.wall_s, 3),
            "pods": self.pods,
            "placed": self.placed,
            "failed": self.failed,
            "total_gpus": self.total_gpus,
            "alloc_pct_at_arrived": {"100": a100, "130": a130},
            "unallocated_gpu_pct_at_arrived": {
                "100": None if a100 is None else round(100 - a100, 2),
                "130": None if a130 is None else round(100 - a130, 2),
            },
            "final_alloc_pct": round(self.final_alloc_pct, 2),
            "fragmentation_pct": None if self.fragmentation_pct is None else round(self.fragmentation_pct, 2),
            "failures_by_reason": {k.value: n for k, n in sorted(self.failures.items(), key=lambda kv: -kv[1])},
            "decision_latency_ms": {"p50": round(self.latency_p50_ms, 3), "p99": round(self.latency_p99_ms, 3)},
            "curve_alloc_pct_by_arrived_pct": self.curve,
            **({"mps_rule": self.mps_rule} if self.mps_rule is not None else {}),
            **({"replay": self.replay} if self.replay is not None else {}),
            **({"timeline": self.timeline.to_dict()} if self.timeline is not None else {}),
        }


def summary_reason(d: Unschedulable) -> ReasonKind:
    """The reason most nodes that could ever host the request gave (a model mismatch explains nothing)."""
    telling = {k: c for k, c in d.kinds.items() if not k.model_mismatch} or d.kinds
    return max(telling.items(), key=lambda kv: kv[1])[0] if telling else ReasonKind.NO_NODES


def run_arrivals(
    nodes: Sequence[NodeSpec],
    arrivals: Sequence[GpuRequest],
    policy: Policy,
    seed: int,
    rank: Sequence[int] | npt.NDArray[np.int64] | None = None,
    frag: Callable[[Ledger], float] | None = None,
    progress: Progress | None = None,
    tenancy: MpsTenancy | None = None,
) -> RunResult:
    """The FGD protocol: submit one at a time; a request that fits nowhere is skipped for good; none leave.
    ``tenancy``: how the ledger counts MPS daemons (default: a daemon per tenant, sharegpu's)."""
    t0 = time.perf_counter()
    ledger = Ledger(nodes, tenancy=tenancy)
    sched = Scheduler(ledger, policy, seed=seed, rank=rank)
    log = RunLog(ledger.total_gpu_milli)
    arrived = allocated = 0
    for i, req in enumerate(arrivals):
        arrived += req.total_milli
        t = time.perf_counter()
        d = sched.decide(req)
        if isinstance(d, Unschedulable):
            log.latencies_s.append(time.perf_counter() - t)
            log.fail(summary_reason(d))
        else:
            ledger.place(d.assignment)
            log.latencies_s.append(time.perf_counter() - t)
            log.placed += 1
            allocated += ledger.gpu_milli_of(d.assignment)
        log.record(arrived, allocated)
        if progress is not None and i % 256 == 0:
            progress(i)
    return _result(policy.name, seed, ledger, log, t0, len(arrivals), frag)


def _result(
    policy: str, seed: int, ledger: Ledger, log: RunLog, t0: float, pods: int, frag: Callable[[Ledger], float] | None
) -> RunResult:
    total = ledger.total_gpu_milli
    return RunResult(
        policy=policy,
        seed=seed,
        wall_s=time.perf_counter() - t0,
        pods=pods,
        placed=log.placed,
        failed=log.failed,
        total_gpus=total // 1000,
        curve=allocation_curve(log.arrived, log.allocated, total),
        failures=log.failures,
        latency_p50_ms=percentile(log.latencies_s, 50) * 1000,
        latency_p99_ms=percentile(log.latencies_s, 99) * 1000,
        fragmentation_pct=None if frag is None else 100 * frag(ledger) / total,
        final_alloc_pct=100 * ledger.allocated_gpu_milli / total if total else 0.0,
    )


@dataclass(frozen=True)
class ReplayResult:
    run: RunResult
    waited: int  # requests that waited in the pending queue at least once
    never_placed: int
    peak_pending: int


class PendingQueue:
    """Pods waiting for room, in arrival order, indexed by request shape and MPS tenant.

    Retrying after a deletion asks, for all waiting shapes at once, a cheap necessary condition on the freed
    node (its free CPU, host memory and enough GPUs with enough free compute), then the scheduler's exact
    filter for the shapes that pass, and tries only the pods of shapes that fit, in FIFO order, re-checking
    a shape on that node after every placement. Cost per deletion: one vector operation over the waiting
    shapes plus the pods that could actually go in, instead of one decision per waiting pod.

    Pods of one shape fit alike except where their tenant already runs a daemon on a unit at the daemon cap (which
    the scheduler adds to the shape's filter for that tenant alone; every MPS unit under one daemon per unit), so a
    shape's pods are grouped by tenant too. A pod that is a tenant of its own (it declares no user) runs no daemon
    while it waits, and fits as its shape does: those pods share their shape's group, so that a queue of undeclared
    pods stays one group per shape.
    """

    def __init__(self, sched: Scheduler) -> None:
        self._sched = sched
        self._seq = 0
        self._size = 0
        self._by_shape: dict[tuple[object, ...], int] = {}  # (priority, tenant, shape) → shape index
        self._requests: list[GpuRequest] = []  # one request per shape and tenant (all of one filter alike)
        self._queues: list[deque[tuple[tuple[int, int], str]]] = []  # per shape: ((-priority, seq), pod name)
        self._cpu: list[int] = []
        self._mem: list[int] = []
        self._count: list[int] = []
        self._milli: list[int] = []  # least compute per GPU the shape needs on any model (0: unknown, e.g. MIG)
        self._arrays: tuple[npt.NDArray[np.int64], ...] | None = None

    def __len__(self) -> int:
        return self._size

    def add(self, name: str, req: GpuRequest, priority: int = 0) -> None:
        """Queue ``name``; higher ``priority`` is retried first (the kube-scheduler's activeQ order), then FIFO."""
        key = _queue_key(name, req, priority)
        i = self._by_shape.get(key)
        if i is None:
            i = self._by_shape[key] = len(self._requests)
            self._requests.append(req)
            self._queues.append(deque())
            self._cpu.append(req.cpu_milli)
            self._mem.append(req.host_memory_mib)
            self._count.append(req.gpu_count)
            self._milli.append(self._sched.plan(req).least_compute)
            self._arrays = None
        self._queues[i].append(((-priority, self._seq), name))
        self._seq += 1
        self._size += 1

    def remove(self, name: str, req: GpuRequest, priority: int = 0) -> None:
        """Take ``name`` out of the queue (placed some other way: by preemption or consolidation)."""
        q = self._queues[self._by_shape[_queue_key(name, req, priority)]]
        for item in q:
            if item[1] == name:
                q.remove(item)
                self._size -= 1
                return
        raise KeyError(name)

    def retry_all(self, try_place: Callable[[str], bool]) -> None:
        """The plain way: try every waiting pod in FIFO order (the reference the indexed retry must equal)."""
        waiting = sorted((seq, i, name) for i, q in enumerate(self._queues) for seq, name in q)
        for q in self._queues:
            q.clear()
        self._size = 0
        for seq, i, name in waiting:
            if not try_place(name):
                self._queues[i].append((seq, name))
                self._size += 1

    def retry_on(self, node: int, try_place: Callable[[str], bool]) -> None:
        """Try, in FIFO order, the waiting pods whose shape fits ``node`` (the one a deletion freed)."""
        if self._size == 0:
            return
        led = self._sched.ledger
        if self._arrays is None:
            self._arrays = tuple(np.array(v, dtype=np.int64) for v in (self._cpu, self._mem, self._count, self._milli))
        cpu, mem, count, milli = self._arrays
        free = np.sort(np.where(led.healthy[node], led.free_milli[node], -1))[::-1]  # most free first
        kth = np.append(free, -1)[np.clip(count - 1, 0, len(free))]  # the count-th most free GPU
        maybe = (cpu <= led.cpu_free[node]) & (mem <= led.mem_free[node]) & ((count == 0) | (kth >= milli))
        heads: list[tuple[tuple[int, int], int]] = []  # ((-priority, seq) of the shape's first pod, shape)
        for i in np.flatnonzero(maybe).tolist():
            q = self._queues[i]
            if q and self._sched.fits(self._requests[i], node):
                heads.append((q[0][0], i))
        heapq.heapify(heads)
        while heads:
            _, i = heapq.heappop(heads)
            q = self._queues[i]
            if not self._sched.fits(self._requests[i], node):
                continue  # the pods placed here since took the room this shape needs
            name = q[0][1]
            if not try_place(name):
                continue  # cannot happen while placements never make room; the pod waits on
            q.popleft()
            self._size -= 1
            if q:
                heapq.heappush(heads, (q[0][0], i))


def _queue_key(name: str, req: GpuRequest, priority: int) -> tuple[object, ...]:
    """The pending queue's group of a pod: its priority, its shape, and its tenant where the tenant may run daemons
    that the pod could join (a tenant of several pods; not one of the pod's own, nor a request that is never MPS)."""
    tenant = req.tenant if req.may_use_mps and req.tenant != own_tenant(name) else None
    return (priority, tenant, *req.shape_key())
