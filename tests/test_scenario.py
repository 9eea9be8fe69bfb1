"""The embedded default scenario: every mechanism is exercised and the ledger's invariants hold throughout."""

from __future__ import annotations

from collections import Counter

import pytest

from sharegpu.ledger import Ledger
from sharegpu.model.assignment import Mechanism
from sharegpu.placement.fragmentation import Workload
from sharegpu.placement.framework import Decision, Scheduler
from sharegpu.placement.policies import PolicyContext, make_policy
from sharegpu.sim.openb import TraceTask
from sharegpu.sim.protocol import fgd_arrivals, with_users
from sharegpu.sim.scenario import scenario_nodes, scenario_tasks


def test_scenario_is_deterministic_and_mixed() -> None:
    a, b = scenario_tasks(seed=3), scenario_tasks(seed=3)
    assert a == b and a != scenario_tasks(seed=4)
    kinds = Counter(
        "cpu" if r.gpu_count == 0 else "whole" if r.is_whole else str(r.isolation) for r in scenario_tasks()
    )
    assert set(kinds) == {"cpu", "whole", "none", "memory", "hardware"}
    assert all(n > 40 for n in kinds.values())


@pytest.mark.parametrize(("policy", "users"), [("sharegpu", 1), ("fgd", 1), ("sharegpu", 3)])
def test_scenario_run_uses_every_mechanism_and_keeps_invariants(policy: str, users: int) -> None:
    nodes = scenario_nodes()
    tasks = scenario_tasks()
    ledger = Ledger(nodes)
    sched = Scheduler(ledger, make_policy(policy, PolicyContext(Workload.from_requests(tasks))), seed=1)
    mechanisms: Counter[Mechanism] = Counter()
    arrivals = with_users(fgd_arrivals([TraceTask(t) for t in tasks], ledger.total_gpu_milli, 1, 1.3), users, 1)
    for i, req in enumerate(arrivals):
        d = sched.decide(req)
        if isinstance(d, Decision):
            ledger.place(d.assignment)
            mechanisms.update(s.mechanism for s in d.assignment.shares)
        if i % 100 == 0:
            ledger.check_invariants()
    ledger.check_invariants()
    assert set(mechanisms) == set(Mechanism)
    assert ledger.allocated_gpu_milli > (0.9 if users == 1 else 0.8) * ledger.total_gpu_milli
    for pod in list(ledger.assignments):
        ledger.release(pod)
    assert ledger.state() == Ledger(nodes).state()
