"""Orchestrates simulation runs (policies × seeds) for a trace or the embedded scenario, optionally in parallel."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from sharegpu.ledger import Ledger
from sharegpu.model.inventory import NodeSpec
from sharegpu.model.request import GpuRequest
from sharegpu.placement.fragmentation import Workload
from sharegpu.placement.policies import PolicyContext, make_policy
from sharegpu.placement.scorers import FragmentationModel
from sharegpu.sim.engine import RunResult, replay_timed, run_arrivals
from sharegpu.sim.openb import TraceTask
from sharegpu.sim.protocol import fgd_arrivals


@dataclass(frozen=True)
class Experiment:
    name: str
    nodes: tuple[NodeSpec, ...]
    tasks: tuple[TraceTask, ...]
    policies: tuple[str, ...]
    seeds: tuple[int, ...]
    tune: float = 1.3
    replay: bool = False  # honour creation/deletion times instead of the FGD protocol

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


def fragmentation_of(model: FragmentationModel) -> Callable[[Ledger], float]:
    def measure(ledger: Ledger) -> float:
        if ledger.present.size == 0:
            return 0.0  # no nodes or no GPUs: nothing to fragment
        return float(model.before(ledger, np.arange(len(ledger.nodes), dtype=np.int64)).sum())

    return measure


def run_one(exp: Experiment, workload: Workload, policy_name: str, seed: int) -> RunResult:
    ctx = PolicyContext(workload)
    policy = make_policy(policy_name, ctx)
    frag = fragmentation_of(FragmentationModel(workload))
    if exp.replay:
        return replay_timed(exp.nodes, exp.tasks, policy, seed).run
    arrivals: Sequence[GpuRequest] = fgd_arrivals(exp.tasks, exp.capacity_milli, seed, exp.tune)
    return run_arrivals(exp.nodes, arrivals, policy, seed, rank=tie_rank(seed, len(exp.nodes)), frag=frag)


def run_experiment(
    exp: Experiment, jobs: int = 0, on_done: Callable[[RunResult], None] | None = None
) -> list[RunResult]:
    """Every policy × seed; results in (policy, seed) order. ``jobs`` 0 means one process per core."""
    workload = exp.workload()
    combos = [(p, s) for p in exp.policies for s in exp.seeds]
    jobs = jobs or (os.cpu_count() or 1)
    results: dict[tuple[str, int], RunResult] = {}
    if jobs <= 1 or len(combos) == 1:
        for p, s in combos:
            results[(p, s)] = r = run_one(exp, workload, p, s)
            if on_done:
                on_done(r)
    else:
        with ProcessPoolExecutor(max_workers=min(jobs, len(combos))) as pool:
            futures = {pool.submit(run_one, exp, workload, p, s): (p, s) for p, s in combos}
            for f in as_completed(futures):
                results[futures[f]] = r = f.result()
                if on_done:
                    on_done(r)
    return [results[c] for c in combos]
