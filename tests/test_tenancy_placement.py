"""MPS tenancy in placement: what the filter offers the ledger takes, for any tenant, and the cap holds.

The per-shape filter is kept for a share that opens a daemon and the scheduler adds the units at the cap that run the
share's own tenant (placement.mechanism.tenant_gpus). A filter that offers a unit the ledger then refuses (a GPU at
the daemon cap, or a MIG instance whose tenant check was left to the ledger) makes the extender promise room it does
not have; these properties fail on any such unit.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sharegpu.ledger import Ledger, LedgerConflict, MpsTenancy
from sharegpu.model.assignment import Assignment
from sharegpu.model.catalog import GIB
from sharegpu.model.inventory import NodeSpec
from sharegpu.model.request import GpuRequest, Isolation, Sharing
from sharegpu.placement.fragmentation import Workload
from sharegpu.placement.framework import Scheduler, Unschedulable
from sharegpu.placement.mechanism import UsablePlan, make_share, usable_gpus
from sharegpu.placement.policies import PolicyContext, make_policy
from test_fast_paths import random_cluster, random_request

TENANTS = [None, "a/uid-0", "a/uid-1000", "b/uid-1000", "pod/x", "pod/y", "pod/z"]


def cluster(rnd: random.Random) -> list[NodeSpec]:
    nodes = random_cluster(rnd, rnd.randint(1, 4))
    # Now and then a node in multi-user mode: one daemon per unit for every tenant.
    return [dataclasses.replace(n, mps_multi_user=rnd.random() < 0.2) for n in nodes]


def request(rnd: random.Random, name: str) -> GpuRequest:
    """Any request, or (often) a small MPS share: plain, or inside a MIG instance, so that units reach the cap."""
    pick = rnd.random()
    if pick < 0.4:
        return random_request(rnd, name)
    memory = rnd.choice([None, GIB, 4 * GIB])
    if pick < 0.7:
        return GpuRequest(name, 1, compute_milli=rnd.choice([50, 100, 200]), memory_mib=memory, sharing=Sharing.MPS)
    return GpuRequest(
        name, 1, compute_milli=rnd.choice([50, 100]), memory_mib=memory, sharing=Sharing.MIG, isolation=Isolation.MEMORY
    )


def offer_and_place(seed: int, cap: int) -> tuple[int, int]:
    """Random requests of random tenants: each GPU the filter offers is tried in the ledger, then the scheduler's
    choice is placed; the per-shape filter is checked to be the same whoever's tenant asks. Returns how many offers
    were tried and how many steps ended with a unit at the cap."""
    rnd = random.Random(seed)
    nodes = cluster(rnd)
    ledger = Ledger(nodes, tenancy=MpsTenancy(daemons_per_unit=cap))
    reqs = [dataclasses.replace(request(rnd, f"p{i}"), tenant=rnd.choice(TENANTS)) for i in range(40)]
    sched = Scheduler(ledger, make_policy("sharegpu", PolicyContext(Workload.from_requests(reqs))))
    offered = at_cap = 0
    every_node = np.arange(len(nodes), dtype=np.int64)
    for req in reqs:
        usable = usable_gpus(ledger, req)
        # The per-shape filter is cached for every pod of the shape, whoever asked first: it may not depend on the
        # tenant (a tenant's own units at the cap are added per cycle, by tenant_gpus, on top of it).
        shape = UsablePlan.of(ledger, req).usable(ledger, req, every_node)
        for other in TENANTS:
            them = dataclasses.replace(req, tenant=other)
            assert (UsablePlan.of(ledger, them).usable(ledger, them, every_node) == shape).all(), (req, other)
        if req.gpu_count == 1:
            for n, g in zip(*usable.nonzero(), strict=True):
                share = make_share(ledger, int(n), int(g), req)
                a = Assignment(req.name, ledger.nodes[int(n)].name, (share,), 0, 0, req.tenant)
                try:
                    ledger.place(a)
                except LedgerConflict as e:
                    raise AssertionError(
                        f"the filter offered GPU {g} of node {n} to {req}, the ledger says: {e}"
                    ) from e
                ledger.release(a.pod)
                offered += 1
        d = sched.decide(req)
        if not isinstance(d, Unschedulable):
            ledger.place(d.assignment)
            ledger.check_invariants()
        # The cap holds on every unit whatever was placed.
        assert all(len(c) <= cap for c in ledger.unit_tenants.values())
        at_cap += bool(ledger.full_units)
    return offered, at_cap


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10_000), cap=st.sampled_from([1, 2, 3]))
def test_every_gpu_the_filter_offers_the_ledger_takes(seed: int, cap: int) -> None:
    offer_and_place(seed, cap)


def test_the_offers_are_many_and_reach_the_cap() -> None:
    """Guard against a vacuous property: the random clusters offer many GPUs, and units do reach the cap."""
    runs = [offer_and_place(seed, 2) for seed in range(10)]
    assert sum(o for o, _ in runs) > 200
    assert sum(c for _, c in runs) > 20


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10_000))
def test_a_unit_at_the_cap_is_offered_to_its_own_tenants_only(seed: int) -> None:
    rnd = random.Random(seed)
    ledger = Ledger(random_cluster(rnd, 2), tenancy=MpsTenancy(daemons_per_unit=2))
    reqs = [dataclasses.replace(request(rnd, f"p{i}"), tenant=rnd.choice(TENANTS[1:])) for i in range(60)]
    sched = Scheduler(ledger, make_policy("bestfit", PolicyContext(Workload.from_requests(reqs))))
    for req in reqs:
        d = sched.decide(req)
        if isinstance(d, Unschedulable):
            continue
        for s in d.assignment.shares:
            unit = (ledger.node_of(d.assignment.node), s.gpu_index, s.mig.start if s.mig else None)
            if unit in ledger.full_units:
                assert req.tenant in ledger.unit_tenants[unit], (unit, req.tenant, ledger.unit_tenants[unit])
        ledger.place(d.assignment)
