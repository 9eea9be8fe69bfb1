"""Orchestrates simulation runs (policies × seeds) for a trace or the embedded scenario, optionally in parallel."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from contextlib import ExitStack
from dataclasses import dataclass
from multiprocessing import Manager
from queue import Queue

import numpy as np
import numpy.typing as npt

from sharegpu.ledger import Ledger
from sharegpu.model.inventory import NodeSpec
from sharegpu.model.request import GpuRequest
from sharegpu.placement.fragmentation import FragmentationModel, Workload, fragmentation_of
from sharegpu.placement.framework import Scheduler, Unschedulable
from sharegpu.placement.policies import PolicyContext, make_policy
from sharegpu.sim.engine import RunResult, run_arrivals, summary_reason
from sharegpu.sim.openb import TraceTask
from sharegpu.sim.protocol import fgd_arrivals, with_users
from sharegpu.sim.replay import PriorityOptions, overloaded, replay_trace


@dataclass(frozen=True)
class Experiment:
    name: str
    nodes: tuple[NodeSpec, ...]
    tasks: tuple[TraceTask, ...]
    policies: tuple[str, ...]
    seeds: tuple[int, ...]
    tune: float = 1.3
    replay: bool = False  # honour creation/deletion times instead of the FGD protocol
    priority: PriorityOptions | None = None  # replay with priorities, preemption, consolidation (issue 19)
    load: float | None = None  # replay a loaded redraw of the trace (see sim.replay.overloaded) instead
    arrivals: int = 0  # pods of that redraw
    users: int = 1  # Unix users the pods are drawn among (sim.protocol.with_users)

    @property
    def capacity_milli(self) -> int:
        return sum(len(n.gpus) for n in self.nodes) * 1000

    @property
    def total_gpus(self) -> int:
        return sum(len(n.gpus) for n in self.nodes)

    def workload(self) -> Workload:
        """Typical task shapes, from the trace as given (before tuning), CPU-only tasks included."""
        return Workload.from_requests(sorted((t.request for t in self.tasks), key=lambda r: r.name))


def tie_rank(seed: int, n: int) -> npt.NDArray[np.int64]:
    """The tie-break order of a run: the reference prefixes node names with a seeded random permutation, and
    ties go to the smallest name, so ties follow a per-seed random but fixed order of nodes."""
    return np.random.default_rng([seed, 0x5EED]).permutation(n).astype(np.int64)


RunProgress = Callable[[str, int, int, int], None]
"""Progress within a run: policy, seed, pods submitted so far, pods in the run."""


@dataclass(frozen=True)
class _Reporter:
    """A run's progress callback: direct in this process, or through a queue from a worker process."""

    policy: str
    seed: int
    sink: RunProgress | None = None
    queue: Queue[tuple[str, int, int, int]] | None = None

    def bind(self, total: int) -> Callable[[int], None]:
        def report(done: int) -> None:
            item = (self.policy, self.seed, done, total)
            if self.sink is not None:
                self.sink(*item)
            if self.queue is not None:
                self.queue.put(item)

        return report


def run_one(
    exp: Experiment, workload: Workload, policy_name: str, seed: int, reporter: _Reporter | None = None
) -> RunResult:
    ctx = PolicyContext(workload)
    policy = make_policy(policy_name, ctx)
    frag = fragmentation_of(FragmentationModel(workload))
    if exp.replay:
        tasks = exp.tasks
        if exp.load is not None:
            tasks = overloaded(exp.tasks, exp.capacity_milli, exp.arrivals, seed, exp.load)
        users = with_users([t.request for t in tasks], exp.users, seed)
        tasks = tuple(dataclasses.replace(t, request=r) for t, r in zip(tasks, users, strict=True))
        progress = reporter.bind(len(tasks)) if reporter else None
        return replay_trace(exp.nodes, tasks, policy, exp.priority, seed, progress=progress).run
    arrivals: Sequence[GpuRequest] = with_users(
        fgd_arrivals(exp.tasks, exp.capacity_milli, seed, exp.tune), exp.users, seed
    )
    progress = reporter.bind(len(arrivals)) if reporter else None
    return run_arrivals(
        exp.nodes, arrivals, policy, seed, rank=tie_rank(seed, len(exp.nodes)), frag=frag, progress=progress
    )


def run_experiment(
    exp: Experiment,
    jobs: int = 0,
    on_done: Callable[[RunResult], None] | None = None,
    on_progress: RunProgress | None = None,
) -> list[RunResult]:
    """Every policy × seed; results in (policy, seed) order. ``jobs`` 0 means one process per core.
    ``on_progress`` hears how far each run has got (every 256 pods), also from worker processes."""
    if exp.users == 1:
        # One user for every run: given to the tasks once here, so that no run copies every request for it (a run
        # then finds each request already of user 0, and tuned copies keep it).
        users = with_users([t.request for t in exp.tasks], 1, 0)
        exp = dataclasses.replace(
            exp, tasks=tuple(dataclasses.replace(t, request=r) for t, r in zip(exp.tasks, users, strict=True))
        )
    workload = exp.workload()
    combos = [(p, s) for p in exp.policies for s in exp.seeds]
    jobs = jobs or (os.cpu_count() or 1)
    results: dict[tuple[str, int], RunResult] = {}
    if jobs <= 1 or len(combos) == 1:
        for p, s in combos:
            reporter = _Reporter(p, s, sink=on_progress) if on_progress else None
            results[(p, s)] = r = run_one(exp, workload, p, s, reporter)
            if on_done:
                on_done(r)
        return [results[c] for c in combos]
    with ExitStack() as stack:
        pool = stack.enter_context(ProcessPoolExecutor(max_workers=min(jobs, len(combos))))
        queue = stack.enter_context(Manager()).Queue() if on_progress else None
        futures = {
            pool.submit(run_one, exp, workload, p, s, _Reporter(p, s, queue=queue) if queue else None): (p, s)
            for p, s in combos
        }
        waiting = set(futures)
        while waiting:
            finished, waiting = wait(waiting, timeout=0.2, return_when=FIRST_COMPLETED)
            while queue is not None and on_progress is not None and not queue.empty():
                on_progress(*queue.get())
            for f in finished:
                results[futures[f]] = r = f.result()
                if on_done:
                    on_done(r)
    return [results[c] for c in combos]


@dataclass(frozen=True)
class RunSize:
    """How big an experiment is, said before it starts: runs (policies × seeds) and pods per run."""

    policies: int
    seeds: int
    pods_per_run: int
    estimated: bool  # the FGD protocol's tuned length, estimated from the mean GPU demand per pod

    @property
    def runs(self) -> int:
        return self.policies * self.seeds

    @property
    def decisions(self) -> int:
        return self.runs * self.pods_per_run

    def __str__(self) -> str:
        about = "about " if self.estimated else ""
        policies = f"{self.policies} polic{'y' if self.policies == 1 else 'ies'}"
        seeds = f"{self.seeds:,} seed{'' if self.seeds == 1 else 's'}"
        return (
            f"{self.runs:,} run{'' if self.runs == 1 else 's'} ({policies} × {seeds}) of {about}"
            f"{self.pods_per_run:,} pods each: {self.decisions:,} placement decisions"
        )


def run_size(exp: Experiment) -> RunSize:
    """The size of ``exp`` without building its arrivals (at a large --tune that alone takes a while)."""
    n = len(exp.tasks)
    if exp.replay and exp.load is not None:
        return RunSize(len(exp.policies), len(exp.seeds), exp.arrivals, False)
    if exp.replay or not n:
        return RunSize(len(exp.policies), len(exp.seeds), n, False)
    demand = sum(t.request.total_milli for t in exp.tasks)
    target = exp.tune * exp.capacity_milli
    if not demand:
        pods = n
    elif demand >= target:
        pods = round(n * target / demand)  # the protocol drops random pods down to the target
    else:
        pods = n + round((target - demand) * n / demand)  # and draws more, of the trace's mean demand each
    return RunSize(len(exp.policies), len(exp.seeds), pods, True)


def never_fit(nodes: Sequence[NodeSpec], tasks: Sequence[TraceTask]) -> dict[str, tuple[int, str]]:
    """GPU pods that fit on no node even with the cluster empty, by the reason most nodes give, in the words of a
    summary over nodes: words → (pods, an example pod's name). Every policy filters alike (they differ in scores), so one policy's filter speaks for all;
    one decision per distinct shape (a few hundred for the openb traces, 0.1 s)."""
    ledger = Ledger(nodes)
    sched = Scheduler(
        ledger, make_policy("bestfit", PolicyContext(Workload.from_requests([t.request for t in tasks]))), seed=0
    )
    verdict: dict[tuple[object, ...], str | None] = {}
    out: dict[str, tuple[int, str]] = {}
    for t in tasks:
        req = t.request
        if not req.gpu_count:
            continue
        key = req.shape_key()
        if key not in verdict:
            d = sched.decide(req)
            verdict[key] = summary_reason(d).summary(req) if isinstance(d, Unschedulable) else None
        reason = verdict[key]
        if reason is not None:
            count, example = out.get(reason, (0, req.name))
            out[reason] = (count + 1, example)
    return out
