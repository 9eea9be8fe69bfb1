"""The simulator's MPS tenancy (issue 32 item 5): whom the pods run as, the four rules, and what each places.

`sharegpu sim` draws a share of pods that declare no user (each a tenant of its own) and the others among N UIDs,
and places under one of four rules: none, one-user (one tenant a unit, the cap before issue 32), per-tenant (a
daemon per tenant, what sharegpu does) and multi-user (one daemon a unit for all).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sharegpu.ledger import Ledger, MpsTenancy
from sharegpu.model.inventory import GpuDevice, NodeSpec
from sharegpu.model.request import GpuRequest, Isolation
from sharegpu.model.tenant import MULTI_USER_TENANT, own_tenant, user_tenant
from sharegpu.placement.fragmentation import Workload
from sharegpu.placement.framework import Decision, Scheduler
from sharegpu.placement.policies import PolicyContext, make_policy
from sharegpu.sim.engine import run_arrivals
from sharegpu.sim.mps_rules import ALL_RULES, MpsRule, MpsSetup, UnknownRule, parse_rules
from sharegpu.sim.openb import TraceTask, load_nodes, load_pods
from sharegpu.sim.protocol import DEFAULT_UNDECLARED, draw_tenants, with_users
from sharegpu.sim.replay import replay_trace
from sharegpu.sim.runner import Experiment, run_one
from test_fast_paths import placements, random_cluster, random_request

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "openb"


def small_shares(n: int, memory_mib: int | None = None, compute: int = 250) -> list[GpuRequest]:
    return [
        GpuRequest(f"p{i:03d}", 1, compute_milli=compute, memory_mib=memory_mib, isolation=Isolation.MEMORY)
        for i in range(n)
    ]


# ----- whom the pods run as ---------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(st.floats(0, 1), st.integers(1, 50), st.integers(0, 2**32 - 1))
def test_the_undeclared_share_is_drawn_as_asked(undeclared: float, users: int, seed: int) -> None:
    reqs = small_shares(2000)
    drawn = draw_tenants(reqs, users, seed, undeclared)
    assert [r.name for r in drawn] == [r.name for r in reqs]
    alone = [r.tenant == own_tenant(r.name) for r in drawn]
    share = sum(alone) / len(alone)
    # Each pod drawn on its own: within 5 standard deviations of the share asked (a false alarm once in ~3.5 million),
    # and 3 pods, for shares so near 0 or 1 that one pod is many deviations.
    assert abs(share - undeclared) <= 5 * math.sqrt(undeclared * (1 - undeclared) / len(reqs)) + 3 / len(reqs)
    declared = {r.tenant for r, own in zip(drawn, alone, strict=True) if not own}
    assert declared <= {user_tenant("sim", 1000 + u) for u in range(users)}
    assert drawn == draw_tenants(reqs, users, seed, undeclared)  # seeded: the same draw again


def test_draws_are_seeded_and_the_uids_are_those_of_every_pod_declaring_one() -> None:
    reqs = small_shares(300)
    assert [r.tenant for r in draw_tenants(reqs, 3, 42)] != [r.tenant for r in draw_tenants(reqs, 3, 43)]
    # Nobody undeclared: every pod gets the UID with_users gives it (the draw before --undeclared existed).
    assert [r.tenant for r in draw_tenants(reqs, 3, 42, 0.0)] == [r.tenant for r in with_users(reqs, 3, 42)]
    assert all(r.tenant == own_tenant(r.name) for r in draw_tenants(reqs, 3, 42, 1.0))
    # The undeclared pods are drawn from a stream of their own: more of them leave the others' UIDs as they were.
    few, many = draw_tenants(reqs, 3, 42, 0.2), draw_tenants(reqs, 3, 42, 0.6)
    for a, b in zip(few, many, strict=True):
        assert a.tenant == b.tenant or b.tenant == own_tenant(b.name)
    counts = Counter(r.tenant == own_tenant(r.name) for r in draw_tenants(reqs, 3, 42))
    assert 0.7 * 300 < counts[True] < 0.9 * 300  # the default: DEFAULT_UNDECLARED of the pods
    assert DEFAULT_UNDECLARED == 0.8


def test_a_request_that_is_never_an_mps_client_keeps_its_tenant() -> None:
    reqs = [
        GpuRequest("whole", 1),
        GpuRequest("cpu", 0, cpu_milli=1000),
        GpuRequest("fault", 1, compute_milli=300, isolation=Isolation.FAULT),
        GpuRequest("mps", 1, compute_milli=300),
    ]
    drawn = draw_tenants(reqs, 2, 1, 1.0)
    assert [r.tenant for r in drawn] == [None, None, None, own_tenant("mps")]
    assert drawn[0] is reqs[0]


def test_bad_draws_are_refused() -> None:
    with pytest.raises(ValueError, match="users 0"):
        draw_tenants(small_shares(2), 0, 1)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="undeclared"):
            draw_tenants(small_shares(2), 1, 1, bad)


# ----- the rules ----------------------------------------------------------------------------------------------
def test_rules_parse_as_written() -> None:
    assert parse_rules("per-tenant") == (MpsRule.PER_TENANT,)
    assert parse_rules(" one-user , none ") == (MpsRule.ONE_USER, MpsRule.NONE)
    assert parse_rules("all") == ALL_RULES and ALL_RULES[0] is MpsRule.NONE
    for bad, words in (("", "names no rule"), ("none,,per-tenant", "empty"), ("tenant", "not a rule"),
                       ("none,none", "more than once")):  # fmt: skip
        with pytest.raises(UnknownRule, match=words):
            parse_rules(bad)


def test_each_rule_sets_up_its_ledger() -> None:
    node = NodeSpec("n", 64_000, 262_144, (GpuDevice(0, "GPU-0", "V100-16GB"),))
    reqs = small_shares(4)
    assert MpsSetup(MpsRule.ONE_USER).tenancy().daemons_per_unit == 1
    assert MpsSetup(MpsRule.PER_TENANT, daemons_per_gpu=5).tenancy().daemons_per_unit == 5
    assert MpsSetup(MpsRule.MULTI_USER).nodes([node])[0].mps_multi_user
    assert not MpsSetup(MpsRule.PER_TENANT).nodes([node])[0].mps_multi_user
    # none and multi-user leave the tenants as the trace has them (every tenant shares a unit's daemon there)
    for rule in (MpsRule.NONE, MpsRule.MULTI_USER):
        assert MpsSetup(rule, undeclared=1.0).requests(reqs, 1) == reqs
    for rule in (MpsRule.ONE_USER, MpsRule.PER_TENANT):
        assert {r.tenant for r in MpsSetup(rule, undeclared=1.0).requests(reqs, 1)} == {
            own_tenant(r.name) for r in reqs
        }


def placed_under(setup: MpsSetup, nodes: list[NodeSpec], reqs: list[GpuRequest], seed: int = 7) -> Ledger:
    """Every request decided once, in order, under ``setup`` (the simulator's own threading of the rule)."""
    ledger = Ledger(setup.nodes(nodes), tenancy=setup.tenancy())
    arrivals = setup.requests(reqs, seed)
    sched = Scheduler(ledger, make_policy("bestfit", PolicyContext(Workload.from_requests(arrivals))), seed=seed)
    for r in arrivals:
        d = sched.decide(r)
        if isinstance(d, Decision):
            ledger.place(d.assignment)
    ledger.check_invariants()
    return ledger


def four_v100s() -> list[NodeSpec]:
    return [NodeSpec("n", 64_000, 262_144, tuple(GpuDevice(i, f"GPU-{i}", "V100-16GB") for i in range(4)))]


def test_a_daemon_per_tenant_places_as_densely_as_no_rule_where_one_user_per_unit_does_not() -> None:
    # 16 quarter-GPU memory-isolated shares (MPS only) of pods that declare no user: 4 GPUs' worth.
    reqs = small_shares(16, memory_mib=3 * 1024)
    counts = {
        rule: len(placed_under(MpsSetup(rule, undeclared=1.0), four_v100s(), reqs).assignments) for rule in MpsRule
    }
    assert counts == {MpsRule.NONE: 16, MpsRule.ONE_USER: 4, MpsRule.PER_TENANT: 16, MpsRule.MULTI_USER: 16}
    # The cap binds as configured: two daemons a GPU take two tenants' shares each.
    assert len(placed_under(MpsSetup(MpsRule.PER_TENANT, 2, undeclared=1.0), four_v100s(), reqs).assignments) == 8
    # Declared users: one user is one tenant, whose shares share daemons even under one-user.
    one = placed_under(MpsSetup(MpsRule.ONE_USER, users=1, undeclared=0.0), four_v100s(), reqs)
    assert len(one.assignments) == 16


def test_each_daemon_takes_its_memory_and_a_multi_user_unit_runs_one() -> None:
    reqs = small_shares(16, memory_mib=3 * 1024)
    gpu_mib = 16 * 1024  # V100-16GB
    share_mib = 3 * 1024
    per_tenant = placed_under(MpsSetup(MpsRule.PER_TENANT, undeclared=1.0), four_v100s(), reqs)
    multi = placed_under(MpsSetup(MpsRule.MULTI_USER, undeclared=1.0), four_v100s(), reqs)
    none = placed_under(MpsSetup(MpsRule.NONE), four_v100s(), reqs)
    daemon = MpsTenancy().daemon_memory_mib
    assert per_tenant.daemons[0].tolist() == [4, 4, 4, 4]  # one per pod: each declares no user
    assert per_tenant.free_mem[0, :4].tolist() == [gpu_mib - 4 * (share_mib + daemon)] * 4
    for ledger in (multi, none):
        assert ledger.daemons[0].tolist()[:4] == [1, 1, 1, 1]
        assert ledger.free_mem[0, :4].tolist() == [gpu_mib - 4 * share_mib - daemon] * 4
    assert set(multi.tenant_units) == {MULTI_USER_TENANT}


def test_the_daemon_memory_is_what_the_setup_says() -> None:
    reqs = small_shares(16, memory_mib=3 * 1024)
    free = placed_under(MpsSetup(MpsRule.PER_TENANT, undeclared=1.0, daemon_memory_mib=0), four_v100s(), reqs)
    assert free.free_mem[0, :4].tolist() == [16 * 1024 - 4 * 3 * 1024] * 4
    # 1,100 MiB a daemon: a GPU takes three of these shares with their daemons, not four
    big = placed_under(MpsSetup(MpsRule.PER_TENANT, undeclared=1.0, daemon_memory_mib=1100), four_v100s(), reqs)
    assert len(big.assignments) == 12
    one = placed_under(MpsSetup(MpsRule.MULTI_USER, undeclared=1.0, daemon_memory_mib=1100), four_v100s(), reqs)
    assert len(one.assignments) == 16  # one daemon a GPU: 4 × 3 GiB + 1,100 MiB fit in 16 GiB
    assert "1024 MiB a daemon" in MpsSetup(MpsRule.NONE, daemon_memory_mib=1024).label()


def test_the_runner_applies_the_rule_it_is_given() -> None:
    # A cluster that one-user per unit cannot fill with undeclared memory-isolated shares; the other rules can.
    tasks = tuple(TraceTask(r) for r in small_shares(40, memory_mib=3 * 1024))
    exp = Experiment("t", tuple(four_v100s()), tasks, ("bestfit",), (1,), tune=1.0, mps_rules=ALL_RULES)
    runs = {rule: run_one(exp, exp.workload(), "bestfit", 1, rule=rule) for rule in ALL_RULES}
    assert {rule: r.mps_rule for rule, r in runs.items()} == {rule: rule.value for rule in ALL_RULES}
    assert runs[MpsRule.ONE_USER].placed < runs[MpsRule.PER_TENANT].placed == runs[MpsRule.NONE].placed
    assert runs[MpsRule.MULTI_USER].curve == runs[MpsRule.NONE].curve


# ----- the replay's pending queue under tenants ---------------------------------------------------------------------
@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(st.integers(0, 2**32 - 1), st.sampled_from([1, 2, 16]), st.sampled_from(["bestfit", "sharegpu"]))
def test_the_indexed_pending_queue_places_what_retrying_everything_places_under_tenants(
    monkeypatch: pytest.MonkeyPatch, seed: int, cap: int, policy: str
) -> None:
    """Pods of one shape fit alike except where their tenant runs a daemon on a unit at the cap (under one daemon a
    unit: every MPS unit): the queue groups them by tenant too, and places what retrying every pod places."""
    rnd = random.Random(seed)
    nodes = random_cluster(rnd, rnd.randint(1, 3))
    reqs = [dataclasses.replace(random_request(rnd, f"p{i:03d}"), tenant=None) for i in range(80)]
    reqs = draw_tenants(reqs, rnd.choice([1, 2, 3]), seed, rnd.choice([0.0, 0.5, 0.8]))
    tasks = []
    for r in reqs:
        created = rnd.randrange(0, 200)
        tasks.append(TraceTask(r, created, created + rnd.randrange(0, 60) if rnd.random() < 0.85 else None))
    pol = make_policy(policy, PolicyContext(Workload.from_requests(reqs)))
    tenancy = MpsTenancy(daemons_per_unit=cap)
    seen, results = {}, {}
    for retry_all in (False, True):

        def go(retry_all: bool = retry_all) -> None:
            results[retry_all] = replay_trace(nodes, tasks, pol, seed=5, retry_all=retry_all, tenancy=tenancy)

        seen[retry_all] = placements(monkeypatch, go)
    assert seen[False] == seen[True]
    assert results[False].run.replay == results[True].run.replay


def test_a_freed_unit_of_one_tenant_lets_in_that_tenants_waiting_pod_behind_another_tenants() -> None:
    """Two tenants' pods of one shape wait; a share of tenant B leaves a unit only B may join (one daemon a unit).
    Grouped by shape alone, the queue would ask the first waiting pod (tenant A) whether the shape fits, hear no,
    and leave B's pod waiting where retrying every pod places it."""
    node = NodeSpec("n", 64_000, 262_144, tuple(GpuDevice(i, f"GPU-{i}", "V100-16GB") for i in range(2)))
    a, b = user_tenant("sim", 1000), user_tenant("sim", 1001)

    def task(name: str, tenant: str, created: int, deleted: int | None = None) -> TraceTask:
        req = GpuRequest(name, 1, compute_milli=500, isolation=Isolation.MEMORY, tenant=tenant)
        return TraceTask(req, created, deleted)

    tasks = [task("a1", a, 0), task("a1b", a, 0), task("b1", b, 0), task("b1b", b, 0, 2), task("a2", a, 1)]
    tasks.append(task("b2", b, 1))
    pol = make_policy("bestfit", PolicyContext(Workload.from_requests(t.request for t in tasks)))
    one_user = MpsTenancy(daemons_per_unit=1)
    fast = replay_trace([node], tasks, pol, tenancy=one_user).run
    whole = replay_trace([node], tasks, pol, tenancy=one_user, retry_all=True).run
    assert whole.placed == 5  # a1, a1b, b1, b1b, then b2 in b1b's room
    assert (fast.placed, fast.replay) == (whole.placed, whole.replay)


# ----- the openb traces ---------------------------------------------------------------------------------------
@pytest.mark.skipif(not (DATA / "openb_pod_list_gpushare40.csv").exists(), reason=f"the openb trace is not at {DATA}")
def test_on_openb_a_daemon_per_tenant_places_within_a_tenth_of_a_point_of_no_rule() -> None:
    """Issue 32's target on one seed of the trace with the most shares: a daemon per tenant, users drawn as the
    common case, within 0.1 pp of placement without any rule at arrived 100 %."""
    nodes = tuple(load_nodes(DATA / "openb_node_list_gpu_node.csv"))
    tasks = tuple(load_pods(DATA / "openb_pod_list_gpushare40.csv"))
    exp = Experiment("gpushare40", nodes, tasks, ("fgd",), (42,), mps_rules=(MpsRule.NONE, MpsRule.PER_TENANT))
    none, per_tenant = (run_one(exp, exp.workload(), "fgd", 42, rule=rule) for rule in exp.mps_rules)
    a, b = none.alloc_at(100), per_tenant.alloc_at(100)
    assert a is not None and b is not None
    assert abs(a - b) <= 0.1, (a, b)


def test_run_arrivals_counts_daemons_as_told() -> None:
    reqs = MpsSetup(MpsRule.PER_TENANT, undeclared=1.0).requests(small_shares(16, memory_mib=3 * 1024), 1)
    pol = make_policy("bestfit", PolicyContext(Workload.from_requests(reqs)))
    per_tenant = run_arrivals(four_v100s(), reqs, pol, 1, tenancy=MpsTenancy())
    one_user = run_arrivals(four_v100s(), reqs, pol, 1, tenancy=MpsTenancy(daemons_per_unit=1))
    assert (per_tenant.placed, one_user.placed) == (16, 4)
