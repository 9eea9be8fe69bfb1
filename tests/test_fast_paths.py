"""The scheduler's fast paths equal plain references: per-shape filter and score memos against a cache-less
decision, the vectorised filter against a per-GPU check, the vectorised reasons against the per-node ones, and
the replay's indexed pending queue against retrying the whole queue."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sharegpu.ledger import MPS_MAX_CLIENTS, GpuMode, Ledger, LedgerConflict, MpsTenancy
from sharegpu.model.assignment import Assignment, GpuShare, Mechanism, MigSlot
from sharegpu.model.catalog import GIB
from sharegpu.model.inventory import GpuDevice, NodeSpec, sim_gpus
from sharegpu.model.request import FULL_MILLI, GpuRequest, InvalidRequest, Isolation, Sharing
from sharegpu.placement.fragmentation import Workload
from sharegpu.placement.framework import BoolArray, CycleState, Decision, Scheduler, Unschedulable
from sharegpu.placement.mechanism import Route, mig_profiles_for, route_for, share_modes, usable_gpus
from sharegpu.placement.policies import PolicyContext, make_policy
from sharegpu.placement.reasons import FilterReason, NodeRoom, RoomArrays, node_kinds, node_reason
from sharegpu.sim.openb import TraceTask
from sharegpu.sim.replay import replay_trace

MODELS = ["A100-40GB", "H100-80GB", "A30-24GB", "T4", "P100", "V100-16GB", "G2"]
NODE_MODELS = ["A100-40GB", "H100-80GB", "T4", "P100", "V100-16GB", "G2"]


def random_cluster(rnd: random.Random, n: int) -> list[NodeSpec]:
    nodes = []
    for i in range(n):
        name = f"n{i:02d}"
        gpus = sim_gpus(name, rnd.choice(NODE_MODELS), rnd.choice([1, 2, 4, 8]))
        # Now and then an unhealthy GPU: it hosts nothing, and the filter must say so.
        gpus = tuple(dataclasses.replace(g, healthy=rnd.random() > 0.1) for g in gpus)
        nodes.append(NodeSpec(name, rnd.choice([8000, 32_000, 96_000]), rnd.choice([16, 64, 256]) * GIB, gpus))
    return nodes


def one_node_reason(req: GpuRequest, room: NodeRoom) -> FilterReason:
    """The rule table applied to one node alone (the reference for the vectorised explanations)."""
    one = RoomArrays(*(np.array([v]) for v in (room.n_allowed, room.n_usable, room.cpu_free, room.mem_free)))
    kind = next((kind for kind, mask in node_kinds(req, one) if mask[0]), None)
    return node_reason(req, room, kind)


def random_request(rnd: random.Random, name: str) -> GpuRequest:
    """Any valid request: whole, shared by compute or memory, MIG by isolation or profile, model-bound, CPU-only."""
    while True:
        kind = rnd.random()
        cpu, mem = rnd.choice([0, 1000, 4000, 16_000]), rnd.choice([0, 1024, 8 * GIB])
        try:
            if kind < 0.1:
                return GpuRequest(name, 0, cpu_milli=cpu, host_memory_mib=mem)
            count = rnd.choice([1, 1, 1, 2, 4])
            compute = rnd.choice([None, None, 100, 300, 500, 1000])
            memory = rnd.choice([None, None, 4 * GIB, 10 * GIB])
            return GpuRequest(
                name,
                1 if (compute or memory) and rnd.random() < 0.8 else count,
                compute_milli=compute,
                memory_mib=memory,
                isolation=rnd.choice([Isolation.NONE, Isolation.NONE, Isolation.MEMORY, Isolation.HARDWARE]),
                sharing=rnd.choice([Sharing.AUTO] * 6 + [Sharing.MPS, Sharing.TIME_SLICING, Sharing.MIG]),
                allowed_models=frozenset(rnd.sample(MODELS, 2)) if rnd.random() < 0.2 else frozenset(),
                cpu_milli=cpu,
                host_memory_mib=mem,
                tenant=rnd.choice([None, None, None, "ns/uid-1000", "pod/a", "pod/b"]),
            )
        except InvalidRequest:
            continue


def mps_tenants_on(ledger: Ledger, n: int, g: int) -> set[str | None]:
    """The tenants of the MPS clients on GPU (n, g), from the assignments alone."""
    node = ledger.nodes[n].name
    return {
        a.tenant
        for a in ledger.assignments.values()
        if a.node == node
        for s in a.shares
        if s.gpu_index == g and s.mig is None and s.mechanism is Mechanism.MPS
    }


def mps_room(ledger: Ledger, n: int, g: int, req: GpuRequest) -> bool:
    """Whether an MPS share of ``req`` fits GPU (n, g) by the daemon rule: under the cap it must have room for a
    daemon of its own (the per-shape filter asks that even of a tenant that runs one there); at the cap only its
    tenant's daemon takes it."""
    tenants = mps_tenants_on(ledger, n, g)
    free = int(ledger.free_mem[n, g])
    mem = req.memory_mib or 0
    if len(tenants) < ledger.tenancy.daemons_per_unit:
        return free >= mem + ledger.tenancy.daemon_memory_mib
    return req.tenant in tenants and free >= mem


def reference_usable(ledger: Ledger, req: GpuRequest) -> BoolArray:
    """GPU by GPU, from the mechanism rules alone: the filter the vectorised plan must equal."""
    out = np.zeros(ledger.present.shape, dtype=bool)
    for n in range(len(ledger.nodes)):
        for g in range(ledger.present.shape[1]):
            if req.gpu_count == 0 or not (ledger.present[n, g] and ledger.healthy[n, g]):
                continue
            model = ledger.gpu_model(n, g)
            route = route_for(req, model)
            mode = GpuMode(int(ledger.mode[n, g]))
            if route == Route.WHOLE:
                out[n, g] = mode is GpuMode.FREE
            elif route == Route.SHARE:
                modes = share_modes(req, model)
                out[n, g] = (
                    ledger.free_milli[n, g] >= req.compute_on(model)
                    and ledger.free_mem[n, g] >= (req.memory_mib or 0)
                    and (mode is GpuMode.FREE or mode in modes)
                    and not (mode is GpuMode.MPS and ledger.clients[n, g] >= MPS_MAX_CLIENTS)
                    and not (
                        GpuMode.MPS in modes and mode is not GpuMode.TIME_SLICING and not mps_room(ledger, n, g, req)
                    )
                )
            elif route == Route.MIG:
                out[n, g] = mig_room(ledger, n, g, req)
    return out


FRESH_TENANT = "reference/a-tenant-that-runs-nowhere"


def mig_room(ledger: Ledger, n: int, g: int, req: GpuRequest) -> bool:
    """Whether the filter lets a MIG share of ``req`` onto GPU (n, g), asked of the ledger itself (not of placement's
    mig_choice, the code under test): some share, in a new instance at any valid start or in an instance already
    there, that a copy of the ledger takes. The per-shape filter is the same for every tenant, so an MPS share is
    tried as a tenant that runs nowhere (it needs room for a daemon of its own, under the cap); where its own tenant
    runs a daemon on an instance of the GPU at the cap, it is also tried as itself (tenant_gpus' overlay)."""
    model = ledger.gpu_model(n, g)
    mps = (req.isolation is Isolation.MEMORY or req.sharing is Sharing.MPS) and req.gpu_count == 1
    inner = Mechanism.MPS if mps else Mechanism.EXCLUSIVE
    shares = []
    for profile in mig_profiles_for(req, model):
        if not mps:
            compute, memory = FULL_MILLI, profile.memory_mib
        elif req.compute_milli is None:
            compute = FULL_MILLI if req.memory_mib is None else -(-req.memory_mib * FULL_MILLI // profile.memory_mib)
            memory = req.memory_mib or 0
        else:
            compute = -(-req.compute_milli * model.compute_slices // profile.compute_slices)
            memory = req.memory_mib or 0
        compute = max(1, min(FULL_MILLI, compute))
        uuid = ledger.nodes[n].gpus[g].uuid
        shares += [
            GpuShare(g, uuid, Mechanism.MIG, compute, memory, MigSlot(profile.name, s), inner) for s in profile.starts
        ]
    tenants: list[str | None] = [FRESH_TENANT] if mps else [None]
    key = ledger.tenant_key(n, req.tenant)
    if mps and any(u[:2] == (n, g) and key in ledger.unit_tenants[u] for u in ledger.full_units):
        tenants.append(req.tenant)
    trial = ledger.copy()
    for tenant in tenants:
        for share in shares:
            try:
                trial.place(Assignment("reference-trial", ledger.nodes[n].name, (share,), 0, 0, tenant))
            except LedgerConflict:
                continue
            return True
    return False


def reference_decide(sched: Scheduler, req: GpuRequest) -> Decision | None:
    """The decision computed from scratch: every node filtered and scored, nothing remembered between cycles."""
    led = sched.ledger
    usable = reference_usable(led, req)
    ok = (led.cpu_free >= req.cpu_milli) & (led.mem_free >= req.host_memory_mib)
    if req.gpu_count:
        ok &= usable.sum(axis=1) >= req.gpu_count
    nodes = np.flatnonzero(ok).astype(np.int64)
    if len(nodes) == 0:
        return None
    state = CycleState(req, usable, np.random.default_rng(0))
    total = np.zeros(len(nodes), dtype=np.int64)
    for plugin, weight in sched.policy.scorers:
        total += weight * plugin.score(led, state, nodes)
    node = sched.pick(nodes, total)
    return Decision(sched.assignment_on(state, node), node, int(total.max()), len(nodes))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1), st.sampled_from(["fgd", "sharegpu", "bestfit", "packing", "clustering", "dotprod"]))
def test_memoised_decisions_equal_decisions_from_scratch(seed: int, policy: str) -> None:
    rnd = random.Random(seed)
    nodes = random_cluster(rnd, rnd.randint(1, 7))
    reqs = [random_request(rnd, f"p{i}") for i in range(40)]
    sched = Scheduler(Ledger(nodes), make_policy(policy, PolicyContext(Workload.from_requests(reqs))), seed=1)
    for req in reqs:
        if sched.ledger.assignments and rnd.random() < 0.2:
            sched.ledger.release(rnd.choice(sorted(sched.ledger.assignments)))
        np.testing.assert_array_equal(sched.feasible(req)[1], reference_usable(sched.ledger, req))
        fast, ref = sched.decide(req), reference_decide(sched, req)
        if ref is None:
            assert isinstance(fast, Unschedulable)
            continue
        assert isinstance(fast, Decision)
        assert (fast.assignment, fast.node_index, fast.score, fast.feasible) == (
            ref.assignment,
            ref.node_index,
            ref.score,
            ref.feasible,
        )
        sched.ledger.place(fast.assignment)
    sched.ledger.check_invariants()


MIG_LAYOUTS = {
    "H100-80GB": [(), (), (("3g.40gb", 0), ("3g.40gb", 4)), (("1g.10gb", 0), ("2g.20gb", 2), ("3g.40gb", 4))],
    "A100-40GB": [(), (), (("3g.20gb", 0), ("3g.20gb", 4)), (("7g.40gb", 0),)],
}


def mig_cluster(rnd: random.Random) -> list[NodeSpec]:
    """MIG-capable GPUs, some with instances an administrator keeps (joined, never removed)."""
    nodes = []
    for i in range(rnd.randint(1, 3)):
        model = rnd.choice(sorted(MIG_LAYOUTS))
        gpus = tuple(
            GpuDevice(
                g,
                f"GPU-m{i}-{g}",
                model,
                rnd.random() > 0.05,
                tuple(MigSlot(*s) for s in rnd.choice(MIG_LAYOUTS[model])),
            )
            for g in range(rnd.choice([1, 2]))
        )
        nodes.append(NodeSpec(f"m{i}", 96_000, 256 * GIB, gpus))
    return nodes


def mig_request(rnd: random.Random, name: str) -> GpuRequest:
    """Mostly small MPS shares inside MIG instances (so instances fill, reach the daemon cap and are joined), now
    and then a MIG instance of its own or any request."""
    pick = rnd.random()
    if pick < 0.15:
        return random_request(rnd, name)
    tenant = rnd.choice([None, "ns/uid-1000", "pod/a", "pod/b", "pod/c"])
    if pick < 0.3:
        return GpuRequest(
            name, 1, sharing=Sharing.MIG, isolation=Isolation.HARDWARE, memory_mib=rnd.choice([None, 9 * GIB])
        )
    return GpuRequest(
        name,
        1,
        compute_milli=rnd.choice([None, 50, 100, 300]),
        # Whole GiB, and an instance's memory exactly or short of its daemon's 66 MiB: where a share fits a profile's
        # memory only without a daemon of its own.
        memory_mib=rnd.choice([None, None, GIB, 4 * GIB, 9 * GIB, 10 * GIB - 100, 10 * GIB, 20 * GIB - 100]),
        sharing=Sharing.MIG,
        isolation=Isolation.MEMORY,
        tenant=tenant,
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1), st.sampled_from([1, 2, 16]))
def test_the_mig_filter_is_what_the_ledger_takes(seed: int, cap: int) -> None:
    """Issue 33: the reference's MIG rule was placement's own mig_choice, the code under test. Here it is the
    ledger's answer (mig_room), on clusters where MIG instances fill, are kept empty, and reach the daemon cap."""
    rnd = random.Random(seed)
    ledger = Ledger(mig_cluster(rnd), tenancy=MpsTenancy(daemons_per_unit=cap))
    reqs = [mig_request(rnd, f"p{i}") for i in range(60)]
    sched = Scheduler(ledger, make_policy("bestfit", PolicyContext(Workload.from_requests(reqs))))
    for req in reqs:
        if ledger.assignments and rnd.random() < 0.15:
            ledger.release(rnd.choice(sorted(ledger.assignments)))
        np.testing.assert_array_equal(sched.feasible(req)[1], reference_usable(ledger, req), err_msg=str(req))
        d = sched.decide(req)
        if isinstance(d, Decision):
            ledger.place(d.assignment)
    ledger.check_invariants()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1))
def test_reasons_counted_at_once_equal_reasons_node_by_node(seed: int) -> None:
    rnd = random.Random(seed)
    nodes = random_cluster(rnd, rnd.randint(1, 7))
    reqs = [random_request(rnd, f"p{i}") for i in range(30)]
    sched = Scheduler(Ledger(nodes), make_policy("bestfit", PolicyContext(Workload.from_requests(reqs))))
    every = np.arange(len(nodes), dtype=np.int64)
    for req in reqs:
        d = sched.decide(req)
        if isinstance(d, Decision):
            sched.ledger.place(d.assignment)
            continue
        expected: dict[str, int] = {}
        for reason in sched._node_reasons(req, usable_gpus(sched.ledger, req), every):
            if reason.kind is not None:
                expected[reason.kind.summary(req)] = expected.get(reason.kind.summary(req), 0) + 1
        assert d.reasons == expected
        assert list(d.reasons) == list(expected)  # same order: ties in the summary go to the first node's reason


def test_fits_and_feasible_agree_after_changes() -> None:
    rnd = random.Random(3)
    nodes = random_cluster(rnd, 6)
    reqs = [random_request(rnd, f"p{i}") for i in range(60)]
    sched = Scheduler(Ledger(nodes), make_policy("bestfit", PolicyContext(Workload.from_requests(reqs))))
    for req in reqs:
        ok = [sched.fits(req, n) for n in range(len(nodes))]  # one node at a time first, then all at once
        assert ok == sched.feasible(req)[0].tolist()
        d = sched.decide(req)
        if isinstance(d, Decision):
            sched.ledger.place(d.assignment)


# ----- the replay's pending queue -------------------------------------------------------------------------------
def placements(monkeypatch: pytest.MonkeyPatch, run: object) -> list[tuple[str, str, tuple[int, ...]]]:
    """Every placement the ledger accepts while ``run()`` runs, in order: (pod, node, GPU indices)."""
    seen: list[tuple[str, str, tuple[int, ...]]] = []
    original = Ledger.place

    def record(self: Ledger, a: Assignment, check_health: bool = True) -> None:
        original(self, a, check_health)
        seen.append((a.pod, a.node, tuple(s.gpu_index for s in a.shares)))

    with monkeypatch.context() as m:
        m.setattr(Ledger, "place", record)
        run()  # type: ignore[operator]
    return seen


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(
    st.integers(0, 2**32 - 1),
    st.sampled_from(["fgd", "sharegpu", "bestfit", "random", "packing"]),
    st.sampled_from([3, 10_000]),
)
def test_indexed_pending_queue_places_what_retrying_everything_places(
    monkeypatch: pytest.MonkeyPatch, seed: int, policy: str, max_pending: int
) -> None:
    rnd = random.Random(seed)
    nodes = random_cluster(rnd, rnd.randint(1, 4))
    tasks = []
    for i in range(80):  # overloaded: far more demand than the small cluster holds at once
        created = rnd.randrange(0, 200)
        deleted = created + rnd.randrange(0, 60) if rnd.random() < 0.85 else None
        tasks.append(TraceTask(random_request(rnd, f"p{i:03d}"), created, deleted))
    pol = make_policy(policy, PolicyContext(Workload.from_requests(t.request for t in tasks)))
    results = {}
    seen = {}
    for retry_all in (False, True):

        def go(retry_all: bool = retry_all) -> None:
            results[retry_all] = replay_trace(nodes, tasks, pol, seed=5, max_pending=max_pending, retry_all=retry_all)

        seen[retry_all] = placements(monkeypatch, go)
    assert seen[False] == seen[True]
    fast, ref = results[False], results[True]
    assert (fast.waited, fast.never_placed, fast.peak_pending) == (ref.waited, ref.never_placed, ref.peak_pending)
    assert fast.run.curve == ref.run.curve and fast.run.failures == ref.run.failures
    assert fast.run.replay == ref.run.replay


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1))
def test_reasons_worded_once_per_distinct_state_equal_reasons_worded_per_node(seed: int) -> None:
    rnd = random.Random(seed)
    nodes = random_cluster(rnd, rnd.randint(1, 9))
    nodes += [dataclasses.replace(n, name=n.name + "-twin") for n in nodes]  # nodes alike: their wording is shared
    reqs = [random_request(rnd, f"p{i}") for i in range(30)]
    sched = Scheduler(Ledger(nodes), make_policy("bestfit", PolicyContext(Workload.from_requests(reqs))))
    led = sched.ledger
    every = np.arange(len(led.nodes), dtype=np.int64)
    for req in reqs:
        usable = usable_gpus(led, req)
        allowed = np.array([req.allows_model(m) for m in led.model_names] + [False], dtype=bool)
        expected = []
        for n in range(len(led.nodes)):
            gpu_ok = allowed[led.model_id[n]] & led.present[n]
            healthy = gpu_ok & led.healthy[n]
            room = NodeRoom(
                int(gpu_ok.sum()),
                int(healthy.sum()),
                int(usable[n].sum()),
                int(np.where(healthy, led.free_mem[n], -1).max(initial=-1)),
                int(np.where(healthy, led.free_milli[n], -1).max(initial=-1)),
                int(led.cpu_free[n]),
                int(led.mem_free[n]),
            )
            expected.append(one_node_reason(req, room))
        assert sched._node_reasons(req, usable, every) == expected
        d = sched.decide(req)
        if isinstance(d, Decision):
            led.place(d.assignment)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1), st.sampled_from(["fgd", "sharegpu", "bestfit", "packing"]))
def test_a_scheduler_given_a_new_policy_decides_as_a_fresh_one(seed: int, policy: str) -> None:
    """What a policy swap keeps (the per-shape filter results and reasons) stays exact while the ledger moves."""
    rnd = random.Random(seed)
    nodes = random_cluster(rnd, rnd.randint(1, 7))
    reqs = [random_request(rnd, f"p{i}") for i in range(40)]
    sched = Scheduler(Ledger(nodes), make_policy("bestfit", PolicyContext(Workload.from_requests(reqs[:3]))), seed=1)
    for i, req in enumerate(reqs):
        if i % 5 == 4:  # the workload drifted: a new policy over the same ledger
            sched = sched.with_policy(make_policy(policy, PolicyContext(Workload.from_requests(reqs[: i + 1]))), 1)
        if sched.ledger.assignments and rnd.random() < 0.2:
            sched.ledger.release(rnd.choice(sorted(sched.ledger.assignments)))
        fresh = Scheduler(sched.ledger, sched.policy, seed=1)
        fast, ref = sched.decide(req), fresh.decide(req)
        every = np.arange(len(nodes), dtype=np.int64)
        usable = sched.feasible(req)[1]
        assert sched.explain_nodes(req, usable, every) == fresh.explain_nodes(req, fresh.feasible(req)[1], every)
        if isinstance(ref, Unschedulable):
            assert isinstance(fast, Unschedulable) and fast.reason == ref.reason
            continue
        assert isinstance(fast, Decision)
        assert (fast.assignment, fast.node_index, fast.score) == (ref.assignment, ref.node_index, ref.score)
        sched.ledger.place(fast.assignment)
