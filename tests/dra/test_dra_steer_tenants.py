"""MPS tenancy in the control plane's DRA ledger and steering (issue 32): a daemon per (GPU, tenant of the pods a
claim is reserved for), at most the cap per GPU, each with its server's memory, as on the device-plugin path; one
daemon for all on a multi-user node."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_dra_steer_units import Steering, a100, claim, node_obj

from sharegpu.k8s.cache.view import ClusterView
from sharegpu.k8s.dra_objects import claim_tenant
from sharegpu.k8s.extender.dra_steer import DraSteering
from sharegpu.kube.schema import Node, Pod, ResourceClaim, ResourceSlice
from sharegpu.ledger import DEFAULT_DAEMONS_PER_UNIT, MPS_DAEMON_MEMORY_MIB, Ledger, MpsTenancy
from sharegpu.model.tenant import MULTI_USER_TENANT, own_tenant, user_tenant
from sharegpu.node.dra import driver as node_driver
from sharegpu.node.dra.slices import build_slices, resource_slice

GPU_MIB = 81920


def slices(name: str, gpus: int = 1, multi_user: bool = False) -> list[dict[str, Any]]:
    specs = build_slices(name, [a100(name, i) for i in range(gpus)], mps_multi_user=multi_user)
    return [resource_slice(s, name, 1, len(specs), {"name": name, "uid": "u"}) for s in specs]


def user_pod(name: str, claim_name: str, uid: int | None = None, ns: str = "ml") -> dict[str, Any]:
    """A pod whose container uses ``claim_name``, as ``uid`` (None: the image's user, a tenant of its own)."""
    container: dict[str, Any] = {
        "name": "m",
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "claims": [{"name": "gpu"}]},
    }
    if uid is not None:
        container["securityContext"] = {"runAsUser": uid}
    return {
        "metadata": {"namespace": ns, "name": name, "uid": f"uid-{name}"},
        "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimName": claim_name}], "containers": [container]},
    }


def reserved(obj: dict[str, Any], *pods: str) -> dict[str, Any]:
    obj.setdefault("status", {})["reservedFor"] = [{"resource": "pods", "name": p, "uid": f"uid-{p}"} for p in pods]
    return obj


def state(nodes: dict[str, bool], daemons: int = DEFAULT_DAEMONS_PER_UNIT, gpus: int = 1) -> Steering:
    """DRA nodes (name → multi-user?) of ``gpus`` A100s each, steering on, the daemon cap ``daemons``."""
    s = Steering()
    s.view = ClusterView(follow_dra=True, tenancy=MpsTenancy(daemons_per_unit=daemons))
    assert s.view.dra is not None
    s.dra = s.view.dra
    s.steering = DraSteering(s.dra)
    s.view.relisted(
        [Node.model_validate(node_obj(n)) for n in nodes],
        [],
        [ResourceSlice.model_validate(x) for n, multi in nodes.items() for x in slices(n, gpus, multi)],
        [],
    )
    s.view.synced = True
    return s


def allocate(
    s: Steering, name: str, uid: int | None, node: str, gpu: int = 0, mem: str = "1Gi", pct: str = "5"
) -> None:
    """A pod of user ``uid`` and its claim, allocated on ``node``'s GPU ``gpu`` and reserved for the pod."""
    s.apply("pod", "ADDED", user_pod(name, name, uid))
    s.apply("claim", "ADDED", reserved(claim(name, mem, pct, allocated=(node, f"gpu-{gpu}")), name))


def steer_new(s: Steering, name: str, uid: int | None, nodes: list[str]) -> list[str]:
    s.apply("claim", "ADDED", claim(name, "1Gi", "5"))
    got = s.steer(Pod.model_validate(user_pod(name, name, uid)), nodes)
    return got.keep


def test_a_seventeenth_tenant_is_steered_away_from_a_gpu_running_sixteen_daemons() -> None:
    s = state({"a": False, "b": False})
    for i in range(16):
        allocate(s, f"t{i}", None if i % 2 else 1000 + i, "a")  # 16 tenants: 8 of their own UID, 8 undeclared
    led = s.ledger()
    assert led.daemons_on((led.index["a"], 0, None)) == 16
    # a has room for the share (80 % of its compute used) but no 17th daemon: the pick is b.
    assert steer_new(s, "new", None, ["a", "b"]) == ["b"]
    # Where a is the only candidate, steering passes it (the scheduler's own filter decides) and says why: the cap.
    s.dra.drop_hold("uid-new")
    got = s.steer(Pod.model_validate(user_pod("new", "new", None)), ["a"])
    assert got.keep == ["a"] and got.assignment is None
    assert f"already run {DEFAULT_DAEMONS_PER_UNIT} MPS daemon(s)" in got.why, got.why
    # A pod of a tenant that already runs a daemon on a joins it: a stays the pick (it packs).
    assert steer_new(s, "again", 1000, ["a", "b"]) == ["a"]


def test_each_daemon_takes_its_servers_memory_and_same_tenant_pods_share_one() -> None:
    s = state({"a": False})
    allocate(s, "p1", 1000, "a", mem="10Gi")
    allocate(s, "p2", 1000, "a", mem="10Gi")  # the same namespace and UID: the same daemon
    allocate(s, "p3", None, "a", mem="10Gi")  # the image's user: a daemon of its own
    led = s.ledger()
    unit = (led.index["a"], 0, None)
    assert led.unit_tenants[unit] == {user_tenant("ml", 1000): 2, own_tenant("uid-p3"): 1}
    assert int(led.free_mem[unit[0], 0]) == GPU_MIB - 3 * 10240 - 2 * MPS_DAEMON_MEMORY_MIB
    led.check_invariants()


def test_a_multi_user_node_runs_one_daemon_per_gpu_whatever_the_tenants() -> None:
    s = state({"a": True, "b": False})
    for i in range(20):
        allocate(s, f"t{i}", None, "a", pct="4")  # 20 tenants of their own, 4 % each
    led = s.ledger()
    unit = (led.index["a"], 0, None)
    assert led.unit_tenants[unit] == {MULTI_USER_TENANT: 20}
    assert int(led.free_mem[unit[0], 0]) == GPU_MIB - 20 * 1024 - MPS_DAEMON_MEMORY_MIB
    assert steer_new(s, "new", None, ["a", "b"]) == ["a"]  # no cap per tenant there: it packs


def test_a_claim_is_counted_under_its_pods_tenant_once_the_pod_is_seen_as_a_rebuild_would() -> None:
    s = state({"a": False})
    led = s.ledger()
    s.apply("claim", "ADDED", reserved(claim("c", allocated=("a", "gpu-0")), "p"))  # its pod not seen yet
    assert led.unit_tenants[(0, 0, None)] == {own_tenant("ml/c"): 1}
    s.apply("pod", "ADDED", user_pod("p", "c", 1000))
    s.apply("pod", "ADDED", user_pod("q", "d", 1000))
    s.apply("claim", "ADDED", reserved(claim("d", allocated=("a", "gpu-0")), "q"))
    assert s.ledger() is led
    assert led.unit_tenants[(0, 0, None)] == {user_tenant("ml", 1000): 2}
    fresh = state({"a": False})
    fresh.view.relisted(
        [Node.model_validate(node_obj("a"))],
        [Pod.model_validate(user_pod("p", "c", 1000)), Pod.model_validate(user_pod("q", "d", 1000))],
        [ResourceSlice.model_validate(x) for x in slices("a")],
        [
            ResourceClaim.model_validate(reserved(claim(n, allocated=("a", "gpu-0")), p))
            for n, p in (("c", "p"), ("d", "q"))
        ],
    )
    for field in ("free_milli", "free_mem", "daemons"):
        assert getattr(led, field).tolist() == getattr(fresh.ledger(), field).tolist(), field


def test_claims_the_allocator_fit_by_capacity_alone_fill_the_gpu_beside_their_daemons() -> None:
    # Two half-GPU claims of two tenants: the allocator counts 40Gi + 40Gi, the GPU also runs two MPS servers.
    s = state({"a": False})
    allocate(s, "p1", 1000, "a", mem="40Gi", pct="50")
    allocate(s, "p2", 2000, "a", mem="40Gi", pct="50")
    led = s.ledger()
    assert {"claim:ml/p1", "claim:ml/p2"} <= set(led.assignments)  # both counted: none left out
    assert (int(led.free_mem[0, 0]), int(led.free_milli[0, 0]), led.daemons_on((0, 0, None))) == (0, 0, 2)
    led.check_invariants()
    s.apply("claim", "DELETED", claim("p2"))
    assert int(s.ledger().free_mem[0, 0]) == GPU_MIB - 40960 - MPS_DAEMON_MEMORY_MIB


@pytest.mark.parametrize(
    "pod",
    [
        user_pod("p", "c", 1000),
        user_pod("p", "c", None),
        user_pod("p", "other", 1000),  # its container uses another claim: it decides nothing for c
        {**user_pod("p", "c", 1000), "spec": {**user_pod("p", "c", 1000)["spec"], "hostUsers": False}},
    ],
)
def test_the_control_plane_reads_a_claims_tenant_as_the_node_driver_does(pod: dict[str, Any]) -> None:
    p = Pod.model_validate(pod)
    assert claim_tenant(p, "c") == node_driver.claim_tenant(p, "c")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(min_value=0, max_value=9), min_size=1, max_size=24))
def test_steered_claims_never_put_more_daemons_on_a_gpu_than_the_cap(users: list[int]) -> None:
    # Pods of up to ten tenants (UID 0-8, or 9: the image's user, a tenant per pod), 5 % each, a cap of 3 daemons per
    # GPU: each steered pod's claim is then allocated as the allocator does, tenant-blind: on the kept node's
    # lowest-indexed GPU with capacity (compute here: 1Gi claims never fill a GPU's memory), which must be the GPU
    # steering predicted.
    cap = 3
    s = state({"a": False, "b": False}, daemons=cap, gpus=2)
    placed: dict[tuple[str, int], set[str]] = {}  # (node, GPU) → the tenants of the claims allocated there
    claimed: dict[tuple[str, int], int] = {}  # (node, GPU) → the compute % its claims consume
    for i, u in enumerate(users):
        uid = None if u == 9 else u
        name = f"p{i}"
        s.apply("pod", "ADDED", user_pod(name, name, uid))
        s.apply("claim", "ADDED", claim(name, "1Gi", "5"))
        got = s.steer(Pod.model_validate(user_pod(name, name, uid)), ["a", "b"])
        if got.assignment is None:
            continue  # nothing fits in the model: not steered
        node = got.keep[0]
        first_fit = next(g for g in range(2) if claimed.get((node, g), 0) + 5 <= 100)
        (share,) = got.assignment.shares
        assert share.gpu_index == first_fit, (node, share.gpu_index, first_fit, placed)
        claimed[(node, first_fit)] = claimed.get((node, first_fit), 0) + 5
        s.apply("claim", "MODIFIED", reserved(claim(name, "1Gi", "5", allocated=(node, f"gpu-{first_fit}")), name))
        placed.setdefault((node, first_fit), set()).add(
            own_tenant(f"uid-{name}") if uid is None else user_tenant("ml", uid)
        )
        led: Ledger = s.ledger()
        assert all(len(tenants) <= cap for tenants in led.unit_tenants.values()), led.unit_tenants
        # A daemon per tenant: each claim is counted in its own tenant's, never in another's.
        for (node, g), tenants in placed.items():
            assert set(led.unit_tenants[(led.index[node], g, None)]) == tenants
        led.check_invariants()


def test_a_node_whose_first_fit_gpu_is_at_the_cap_is_not_picked_for_a_new_tenant() -> None:
    """The allocator knows no tenants: on the node steering leaves, it takes the lowest-indexed GPU with capacity. On
    a, GPU 0 runs the two daemons the cap allows (uid 1000's, an undeclared pod's) with most of its capacity free,
    and GPU 1 runs uid 2000's: sharegpu would pack a new tenant onto a's GPU 1, but the allocator would put it on GPU 0,
    a third daemon. So a new tenant goes to b; a tenant of GPU 0's daemons, or of GPU 1's alone, still packs onto a."""
    s = state({"a": False, "b": False}, daemons=2, gpus=2)
    allocate(s, "t0", 1000, "a", gpu=0)
    allocate(s, "t1", None, "a", gpu=0)
    allocate(s, "t2", 2000, "a", gpu=1)
    led = s.ledger()
    assert led.daemons_on((led.index["a"], 0, None)) == 2
    assert steer_new(s, "new", 3000, ["a", "b"]) == ["b"]
    assert steer_new(s, "joins", 1000, ["a", "b"]) == ["a"]  # first fit is GPU 0, where its daemon runs
    # Where a is the only candidate, steering passes it and says why.
    s.apply("claim", "ADDED", claim("lone", "1Gi", "5"))
    got = s.steer(Pod.model_validate(user_pod("lone", "lone", 4000)), ["a"])
    assert got.keep == ["a"] and got.assignment is None
    assert "allocator's first fit is a GPU that already runs 2 MPS daemon(s)" in got.why, got.why
