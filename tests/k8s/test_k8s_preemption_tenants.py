"""Preemption keeps room across MPS tenants (issue 32): a unit shared through MPS runs a daemon per tenant (the pods
of one namespace and runAsUser, or a pod alone), each taking its server's memory, at most the cap. The preemptor may
be of another tenant than its victims; the room kept for it while they terminate must hold its own daemon, never
one of a tenant that left.

The harness is test_k8s_preemption's: the extender, the preemption controller and the in-memory API server. One
H100 of 81,920 MiB; each MPS daemon takes 66 MiB.
"""

from __future__ import annotations

from test_k8s_preemption import Harness, run, until

from sharegpu.kube.schema import ExtenderBindingArgs
from sharegpu.ledger import MPS_DAEMON_MEMORY_MIB, MpsTenancy

DAEMON = MPS_DAEMON_MEMORY_MIB
GPU = 81920


def tenants(h: Harness) -> dict[str, int]:
    """The MPS clients per tenant on n1's GPU, as the view's ledger counts them."""
    led = h.view.ledger
    return dict(led.unit_tenants.get((led.index["n1"], 0, None), {}))


async def bind(h: Harness, key: str, node: str = "n1") -> None:
    name = key.partition("/")[2]
    args = ExtenderBindingArgs(PodName=name, PodNamespace="default", PodUID=h.uid(key), Node=node)
    assert (await h.ext.bind(args)).Error == ""
    await until(lambda: (p := h.view.pod(key)) is not None and p.spec.node_name == node, f"{key} bound")


def test_a_preemptor_of_another_tenant_takes_room_freed_on_an_mps_gpu() -> None:
    """Pods that declare no user, each a tenant of its own: the victim's daemon closes as it leaves, the preemptor
    opens its own in its place."""

    async def body(h: Harness) -> None:
        await h.nodes("n1", gpus=1)
        a = await h.placed("a", "n1", memory="39Gi")
        await h.placed("b", "n1", memory="39Gi", priority=10)
        high = await h.waiting("high", memory="39Gi")
        assert tenants(h) == {"pod/uid-default-a": 1, "pod/uid-default-b": 1}
        report = await h.ctrl.round()
        assert report.preempted == (high,) and h.api.evictions == [a]
        h.api.terminate(a)
        await until(lambda: h.view.held(high) is not None, "room held for the preemptor")
        assert h.filter(high) == ["n1"]
        await bind(h, high)
        assert tenants(h) == {"pod/uid-default-b": 1, "pod/uid-default-high": 1}
        assert int(h.view.ledger.free_mem[0, 0]) == GPU - 2 * 39 * 1024 - 2 * DAEMON
        h.view.ledger.check_invariants()

    run(body)


def test_the_free_part_of_the_room_holds_the_preemptors_own_daemon() -> None:
    """The victim's tenant keeps its daemon (another pod of uid 1000 stays), so the victim frees its 30Gi and no
    daemon; the preemptor (uid 2000) needs 30Gi and a daemon of its own: 66 MiB that must come from the free memory
    and be held while the victim terminates. A pod of uid 1000 that joins the daemon left running asks exactly what
    is free beside it: without that hold it took the 66 MiB, and the preemptor never fitted."""

    async def body(h: Harness) -> None:
        await h.nodes("n1", gpus=1)
        a = await h.placed("a", "n1", memory="30Gi", run_as_user=1000)
        await h.placed("b", "n1", memory="30Gi", run_as_user=1000, priority=10)
        free = GPU - 2 * 30 * 1024 - DAEMON
        assert tenants(h) == {"default/uid-1000": 2} and int(h.view.ledger.free_mem[0, 0]) == free
        high = await h.waiting("high", memory="30Gi", run_as_user=2000)
        report = await h.ctrl.round()
        assert report.preempted == (high,) and h.api.evictions == [a]
        kept = h.view.kept_room(high, None)
        assert kept is not None and kept.assignment.tenant == "default/uid-2000"
        assert tenants(h) == {"default/uid-1000": 2, "default/uid-2000": 1}  # the preemptor's daemon, held
        assert int(h.view.ledger.free_mem[0, 0]) == free - DAEMON
        late = await h.waiting("late", priority=0, memory=f"{free}Mi", run_as_user=1000)
        assert h.filter(late) == []  # the 66 MiB of the preemptor's daemon is not free
        h.api.terminate(a)
        await until(lambda: h.view.held(high) is not None, "room held for the preemptor")
        assert h.filter(late) == [] and h.filter(high) == ["n1"]
        await bind(h, high)
        assert tenants(h) == {"default/uid-1000": 1, "default/uid-2000": 1}
        assert [k for k in h.view.ledger.assignments if "#" in k] == []
        h.view.ledger.check_invariants()

    run(body)


def test_a_gone_victims_room_is_kept_as_the_preemptors_tenant() -> None:
    """Two victims of two tenants: the first gone, its room is kept for the preemptor while the other terminates, as
    the preemptor's tenant (the daemon that will run there), not as a daemon of the tenant that left."""

    async def body(h: Harness) -> None:
        await h.nodes("n1", gpus=1)
        a = await h.placed("a", "n1", memory="20Gi", run_as_user=1000)
        c = await h.placed("c", "n1", memory="20Gi", run_as_user=4000)
        await h.placed("b", "n1", memory="20Gi", run_as_user=3000, priority=10)
        high = await h.waiting("high", memory="50Gi", run_as_user=2000)
        report = await h.ctrl.round()
        assert report.preempted == (high,) and sorted(h.api.evictions) == [a, c]
        h.api.terminate(a)
        await until(lambda: h.view.kept_room(high, a) is not None, "the gone victim's room kept")
        kept = h.view.kept_room(high, a)
        assert kept is not None and kept.assignment.tenant == "default/uid-2000"
        # The room and the free part beside it are the preemptor's daemon's; uid 1000 runs none any more.
        assert tenants(h) == {"default/uid-2000": 2, "default/uid-3000": 1, "default/uid-4000": 1}
        h.view.ledger.check_invariants()
        h.api.terminate(c)
        await until(lambda: h.view.held(high) is not None, "room held for the preemptor")
        await bind(h, high)
        assert tenants(h) == {"default/uid-2000": 1, "default/uid-3000": 1}
        assert [k for k in h.view.ledger.assignments if "#" in k] == []
        h.view.ledger.check_invariants()

    run(body)


def test_at_the_daemon_cap_a_gone_victims_room_stays_its_tenants_while_that_daemon_runs() -> None:
    """At a cap of two: uid 1000 runs two pods, uid 3000 one; the preemptor (uid 2000) has memory but no daemon slot,
    so both pods of uid 1000 go. The first gone, its room cannot be the preemptor's daemon (a third one): it is kept
    as uid 1000's, whose daemon still serves the second; once that is gone too the room is the preemptor's."""

    async def body(h: Harness) -> None:
        await h.nodes("n1", gpus=1)
        a1 = await h.placed("a1", "n1", memory="20Gi", run_as_user=1000)
        a2 = await h.placed("a2", "n1", memory="20Gi", run_as_user=1000)
        await h.placed("b", "n1", memory="30Gi", run_as_user=3000, priority=10)
        high = await h.waiting("high", memory="10Gi", run_as_user=2000)
        report = await h.ctrl.round()
        assert report.preempted == (high,) and sorted(h.api.evictions) == [a1, a2]
        h.api.terminate(a1)
        await until(lambda: h.view.kept_room(high, a1) is not None, "the gone victim's room kept")
        kept = h.view.kept_room(high, a1)
        assert kept is not None and kept.assignment.tenant == "default/uid-1000"
        assert tenants(h) == {"default/uid-1000": 2, "default/uid-3000": 1}
        h.api.terminate(a2)
        await until(lambda: h.view.held(high) is not None, "room held for the preemptor")
        assert h.filter(high) == ["n1"]
        await bind(h, high)
        assert tenants(h) == {"default/uid-2000": 1, "default/uid-3000": 1}
        h.view.ledger.check_invariants()

    run(body, tenancy=MpsTenancy(daemons_per_unit=2))


def test_victims_free_a_daemon_slot_when_the_cap_is_what_is_short() -> None:
    """At a cap of two: uid 1000 runs two small pods, an undeclared pod of higher priority one; a pod of a third
    tenant fits in memory but needs a daemon slot. Evicting one pod of uid 1000 would free memory and no slot (its
    daemon keeps serving the other): both go, as the kube-scheduler's victim selection does with the fit that counts
    daemons (the more important pod is reprieved first, and keeping either pod of uid 1000 keeps its daemon)."""

    async def body(h: Harness) -> None:
        await h.nodes("n1", gpus=1)
        u1 = await h.placed("u1", "n1", memory="5Gi", run_as_user=1000)
        u2 = await h.placed("u2", "n1", memory="5Gi", run_as_user=1000, priority=5)
        await h.placed("alone", "n1", memory="5Gi", priority=10)
        high = await h.waiting("high", memory="5Gi", run_as_user=2000)
        report = await h.ctrl.round()
        assert report.preempted == (high,) and sorted(h.api.evictions) == [u1, u2]
        h.api.terminate(u1)
        await until(lambda: h.view.pod(u1) is None, "first victim gone")
        assert h.view.held(high) is None  # uid 1000's daemon still serves u2: no slot yet
        h.api.terminate(u2)
        await until(lambda: h.view.held(high) is not None, "room held for the preemptor")
        await bind(h, high)
        assert tenants(h) == {"pod/uid-default-alone": 1, "default/uid-2000": 1}
        h.view.ledger.check_invariants()

    run(body, tenancy=MpsTenancy(daemons_per_unit=2))
