"""Orchestrates simulation runs (policies × seeds) for a trace or the embedded scenario, optionally in parallel."""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from contextlib import ExitStack
from dataclasses import dataclass
from multiprocessing import Manager
from queue import Queue

import numpy as np
import numpy.typing as npt

from sharegpu.ledger import DEFAULT_DAEMONS_PER_UNIT, MPS_DAEMON_MEMORY_MIB, Ledger
from sharegpu.model.inventory import NodeSpec
from sharegpu.model.request import GpuRequest
from sharegpu.placement.fragmentation import FragmentationModel, Workload, fragmentation_of
from sharegpu.placement.framework import Scheduler, Unschedulable
from sharegpu.placement.policies import PolicyContext, make_policy
from sharegpu.sim.engine import RunResult, run_arrivals, summary_reason
from sharegpu.sim.mps_rules import MpsRule, MpsSetup, run_label
from sharegpu.sim.openb import TraceTask
from sharegpu.sim.protocol import DEFAULT_UNDECLARED, fgd_arrivals
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
    # MPS tenancy (sim.mps_rules): the rules to run (each policy × seed under each), per-tenant's daemon cap, and
    # whom the pods run as under the rules that tell tenants apart (sim.protocol.draw_tenants).
    mps_rules: tuple[MpsRule, ...] = (MpsRule.NONE,)
    daemons_per_gpu: int = DEFAULT_DAEMONS_PER_UNIT
    users: int = 1
    undeclared: float = DEFAULT_UNDECLARED
    daemon_memory_mib: int = MPS_DAEMON_MEMORY_MIB  # each MPS daemon's own GPU memory, under every rule

    def mps(self, rule: MpsRule) -> MpsSetup:
        return MpsSetup(rule, self.daemons_per_gpu, self.users, self.undeclared, self.daemon_memory_mib)

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
    exp: Experiment,
    workload: Workload,
    policy_name: str,
    seed: int,
    reporter: _Reporter | None = None,
    rule: MpsRule | None = None,
) -> RunResult:
    """One run of ``policy_name`` with ``seed`` under MPS ``rule`` (default: the experiment's first)."""
    mps = exp.mps(rule if rule is not None else exp.mps_rules[0])
    ctx = PolicyContext(workload)
    policy = make_policy(policy_name, ctx)
    frag = fragmentation_of(FragmentationModel(workload))
    nodes, tenancy = mps.nodes(exp.nodes), mps.tenancy()
    if exp.replay:
        tasks = exp.tasks
        if exp.load is not None:
            tasks = overloaded(exp.tasks, exp.capacity_milli, exp.arrivals, seed, exp.load)
        drawn = mps.requests([t.request for t in tasks], seed)
        tasks = tuple(
            t if t.request is r else dataclasses.replace(t, request=r) for t, r in zip(tasks, drawn, strict=True)
        )
        progress = reporter.bind(len(tasks)) if reporter else None
        run = replay_trace(nodes, tasks, policy, exp.priority, seed, progress=progress, tenancy=tenancy).run
    else:
        arrivals: Sequence[GpuRequest] = mps.requests(fgd_arrivals(exp.tasks, exp.capacity_milli, seed, exp.tune), seed)
        progress = reporter.bind(len(arrivals)) if reporter else None
        rank = tie_rank(seed, len(nodes))
        run = run_arrivals(nodes, arrivals, policy, seed, rank=rank, frag=frag, progress=progress, tenancy=tenancy)
    return dataclasses.replace(run, mps_rule=mps.rule.value)


def run_experiment(
    exp: Experiment,
    jobs: int = 0,
    on_done: Callable[[RunResult], None] | None = None,
    on_progress: RunProgress | None = None,
) -> list[RunResult]:
    """Every MPS rule × policy × seed; results in that order. ``jobs`` 0 means one process per core.
    ``on_progress`` hears how far each run has got (every 256 pods), also from worker processes; with several rules
    its policy is named with the rule (``sharegpu [per-tenant]``, :func:`run_label`)."""
    workload = exp.workload()
    combos = [(m, p, s) for m in exp.mps_rules for p in exp.policies for s in exp.seeds]
    jobs = jobs or (os.cpu_count() or 1)
    several = len(exp.mps_rules) > 1
    results: dict[tuple[MpsRule, str, int], RunResult] = {}

    def reporter(m: MpsRule, p: str, s: int, queue: Queue[tuple[str, int, int, int]] | None) -> _Reporter:
        label = run_label(p, m.value if several else None)
        return _Reporter(label, s, sink=on_progress if queue is None else None, queue=queue)

    if jobs <= 1 or len(combos) == 1:
        for m, p, s in combos:
            results[(m, p, s)] = r = run_one(exp, workload, p, s, reporter(m, p, s, None) if on_progress else None, m)
            if on_done:
                on_done(r)
        return [results[c] for c in combos]
    with ExitStack() as stack:
        # Workers ignore Ctrl-C (a terminal sends it to the whole process group): this process alone hears it, and
        # stops them, so that an interrupt is one line from the command and never a traceback from each worker. They
        # ignore it from their very start: SIGINT is blocked here while the pool (and the progress queue's manager)
        # start their processes, which inherit the block, and a worker unblocks it only once it ignores it (a
        # Ctrl-C between a worker's fork and its initializer printed that worker's traceback). A Ctrl-C that came
        # meanwhile is heard here when the block is lifted.
        pool: ProcessPoolExecutor | None = None
        unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            try:
                pool = stack.enter_context(
                    ProcessPoolExecutor(max_workers=min(jobs, len(combos)), initializer=_ignore_interrupts)
                )
                queue = stack.enter_context(Manager()).Queue() if on_progress else None
                futures: dict[Future[RunResult], tuple[MpsRule, str, int]] = {}
                for m, p, s in combos:
                    progress = reporter(m, p, s, queue) if queue else None
                    futures[pool.submit(run_one, exp, workload, p, s, progress, m)] = (m, p, s)
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
            waiting = set(futures)
            while waiting:
                finished, waiting = wait(waiting, timeout=0.2, return_when=FIRST_COMPLETED)
                while queue is not None and on_progress is not None and not queue.empty():
                    on_progress(*queue.get())
                for f in finished:
                    results[futures[f]] = r = f.result()
                    if on_done:
                        on_done(r)
        except KeyboardInterrupt:
            if pool is not None:
                _stop(pool)
            raise
    return [results[c] for c in combos]


def _ignore_interrupts() -> None:
    """A worker's first act: ignore SIGINT, then lift the block it was started under (run_experiments)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _stop(pool: ProcessPoolExecutor) -> None:
    """Stop a pool's workers mid-run (they ignore SIGINT): no queued run starts, and the running ones end now.

    Returns once the pool's manager thread has ended too: it notices its workers gone and closes its wake-up pipe,
    and the interpreter's exit wakes every pool's manager thread through that pipe without a lock (Python 3.11), so
    the two raced and the command's last words were a traceback ("Bad file descriptor", seen under load)."""
    workers = list((getattr(pool, "_processes", None) or {}).values())
    manager = getattr(pool, "_executor_manager_thread", None)  # shutdown(wait=False) forgets it
    pool.shutdown(wait=False, cancel_futures=True)
    for w in workers:
        w.terminate()
    for w in workers:
        w.join(timeout=5)
    if manager is not None:
        manager.join(timeout=10)


@dataclass(frozen=True)
class RunSize:
    """How big an experiment is, said before it starts: runs (MPS rules × policies × seeds) and pods per run."""

    policies: int
    seeds: int
    pods_per_run: int
    estimated: bool  # the FGD protocol's tuned length, estimated from the mean GPU demand per pod
    rules: int = 1  # MPS rules compared (sim.mps_rules)

    @property
    def runs(self) -> int:
        return self.rules * self.policies * self.seeds

    @property
    def decisions(self) -> int:
        return self.runs * self.pods_per_run

    def __str__(self) -> str:
        about = "about " if self.estimated else ""
        policies = f"{self.policies} polic{'y' if self.policies == 1 else 'ies'}"
        seeds = f"{self.seeds:,} seed{'' if self.seeds == 1 else 's'}"
        rules = f"{self.rules} MPS rules × " if self.rules > 1 else ""
        return (
            f"{self.runs:,} run{'' if self.runs == 1 else 's'} ({rules}{policies} × {seeds}) of {about}"
            f"{self.pods_per_run:,} pods each: {self.decisions:,} placement decisions"
        )


def run_size(exp: Experiment) -> RunSize:
    """The size of ``exp`` without building its arrivals (at a large --tune that alone takes a while)."""
    n = len(exp.tasks)
    size = RunSize(len(exp.policies), len(exp.seeds), n, False, len(exp.mps_rules))
    if exp.replay and exp.load is not None:
        return dataclasses.replace(size, pods_per_run=exp.arrivals)
    if exp.replay or not n:
        return size
    demand = sum(t.request.total_milli for t in exp.tasks)
    target = exp.tune * exp.capacity_milli
    if not demand:
        pods = n
    elif demand >= target:
        pods = round(n * target / demand)  # the protocol drops random pods down to the target
    else:
        pods = n + round((target - demand) * n / demand)  # and draws more, of the trace's mean demand each
    return dataclasses.replace(size, pods_per_run=pods, estimated=True)


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
