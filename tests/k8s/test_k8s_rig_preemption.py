"""Preemption for GPU room through the real kube-scheduler (issue 19 item 3), on the rig's control plane.

Fake nodes (node agents with the simulated backend, no kubelet) are filled with low-priority shares; high-priority
pods then ask for whole GPUs, which the kube-scheduler's own preemption cannot find victims for (it counts
``sharegpu.io/gpu`` in tokens). The extender's leader evicts through the Eviction API; this harness plays the
kubelet's part for the fake nodes (a terminating pod is deleted a moment later, as once its container stopped), and
recomputes the GPUs' use from the API server's objects alone all the while (terminating pods included: they hold
their share until they are gone).

Skipped unless SHAREGPU_TEST_KUBECONFIG names the rig's kubeconfig.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from k8s_helpers import pod_obj
from rig import KUBECONFIG, SKIP_REASON, ReadyProxy, Rig, audit, wait_for

pytestmark = pytest.mark.skipif(not KUBECONFIG, reason=SKIP_REASON)

HIGH_VALUE = 1_000_000
TERMINATION_S = 1.5  # how long a victim's "container" takes to stop on a fake node


def rig_pod(name: str, priority_class: str = "", **kw: Any) -> dict[str, Any]:
    obj = pod_obj(name, **kw)
    for k in ("uid", "resourceVersion", "namespace"):
        obj["metadata"].pop(k, None)
    obj.pop("status", None)
    if priority_class:
        obj["spec"]["priorityClassName"] = priority_class
    return obj


class Watchdog:
    """In a thread, until stopped: the fake nodes' kubelet (delete a terminating pod ``TERMINATION_S`` after its
    deletion began) and an audit of every GPU from the API server's objects every ``every`` seconds."""

    def __init__(self, rig: Rig, ns: str, every: float = 0.5) -> None:
        self.rig, self.ns, self.every = rig, ns, every
        self.findings: list[str] = []
        self.audits = 0
        self.max_pods_per_gpu = 0
        self.seen_terminating: dict[str, float] = {}
        self.deleted: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _main(self) -> None:
        from lightkube.resources.core_v1 import Pod

        while not self._stop.is_set():
            try:
                pods = self.rig.pods(self.ns)
                nodes = [self.rig.node(n) for n in self.rig.nodes]
            except Exception:  # the API server briefly busy: try again next tick
                time.sleep(self.every)
                continue
            result = audit(nodes, pods)
            self.audits += 1
            self.findings.extend(result.findings)
            self.max_pods_per_gpu = max([self.max_pods_per_gpu, *(len(v) for v in result.per_gpu.values())])
            now = time.monotonic()
            for p in pods:
                name = p["metadata"]["name"]
                if p["metadata"].get("deletionTimestamp") and p["spec"].get("nodeName") in self.rig.nodes:
                    first = self.seen_terminating.setdefault(name, now)
                    if now - first >= TERMINATION_S:
                        try:
                            self.rig.client.delete(Pod, name, namespace=self.ns, grace_period=0)
                            self.deleted.append(name)
                        except Exception:
                            pass
            time.sleep(self.every)


def _priority_class(rig: Rig, value: int) -> str:
    from lightkube.resources.scheduling_v1 import PriorityClass

    name = f"{rig.prefix}-p{value}"
    rig.client.create(PriorityClass.from_dict({"metadata": {"name": name}, "value": value}))
    return name


def _delete_priority_class(rig: Rig, name: str) -> None:
    from lightkube.resources.scheduling_v1 import PriorityClass

    rig.client.delete(PriorityClass, name)


def _fill(rig: Rig, ns: str, nodes: int, gpus: int) -> list[str]:
    """Two low-priority 39Gi shares on every GPU (each pod declares no user: a tenant of its own, whose MPS daemon
    takes 66 MiB of the GPU as well, so two of 40Gi no longer fit); returns their names once all are bound."""
    names = [f"low-{i}" for i in range(2 * nodes * gpus)]
    rig.create_pods(ns, [rig_pod(n, memory="39Gi", cpu="100m") for n in names])
    wait_for(lambda: sum(bool(p["spec"].get("nodeName")) for p in rig.pods(ns)) == len(names), "the fill", 120)
    return names


def test_a_burst_of_high_priority_pods_preempts_low_priority_shares(rig: Rig) -> None:
    nodes, gpus, burst = 3, 2, 5
    for i in range(nodes):
        rig.add_node(f"h{i}", [{"model": "H100-80GB", "count": gpus}])
    rig.wait_nodes_published()
    _, url = rig.start_extender(0, "--preemption-interval", "0.5")
    rig.start_scheduler(url)
    ns = rig.namespace()
    high = _priority_class(rig, HIGH_VALUE)
    try:
        lows = _fill(rig, ns, nodes, gpus)
        with Watchdog(rig, ns) as dog:
            t0 = time.monotonic()
            names = [f"high-{i}" for i in range(burst)]
            rig.create_pods(ns, [rig_pod(n, high, gpu=1, cpu="100m") for n in names])
            # Low-priority latecomers that must not take the room freed for the burst.
            rig.create_pods(ns, [rig_pod(f"late-{i}", memory="39Gi", cpu="100m") for i in range(2)])

            def bound() -> int:
                return sum(bool(p["spec"].get("nodeName")) for p in rig.pods(ns) if p["metadata"]["name"] in names)

            wait_for(lambda: bound() == burst, f"all {burst} high-priority pods bound", 180)
            elapsed = time.monotonic() - t0
            time.sleep(2)  # a few more audits after the last bind
        pods = {p["metadata"]["name"]: p for p in rig.pods(ns)}
        evicted = sorted(set(lows) - set(pods))
        print(
            f"\nburst of {burst} high-priority whole-GPU pods on {nodes}x{gpus} GPUs full of {len(lows)} low shares: "
            f"all bound in {elapsed:.1f}s, {len(evicted)} victims evicted, {dog.audits} audits, "
            f"findings {len(dog.findings)}"
        )
        assert dog.findings == [], dog.findings[:5]
        assert dog.audits >= 5
        # Each high pod needs a whole GPU: exactly two low shares per GPU taken, and only low pods were victims.
        assert len(evicted) == 2 * burst, evicted
        assert all(n.startswith("low-") for n in dog.deleted)
        assert not any(pods[f"late-{i}"]["spec"].get("nodeName") for i in range(2))
        final = audit([rig.node(n) for n in rig.nodes], list(pods.values()))
        assert final.findings == []
        events = rig.events(ns)
        preempted = [e for e in events if e.get("reason") == "Preempted"]
        assert len(preempted) == 2 * burst
        assert all("for GPU room on node" in e["message"] and "(priority 1000000)" in e["message"] for e in preempted)
        assert sum(e.get("reason") == "Preempting" for e in events) == burst
    finally:
        _delete_priority_class(rig, high)


def test_the_new_leader_finishes_a_preemption_when_the_leader_is_killed(rig: Rig) -> None:
    from lightkube.resources.coordination_v1 import Lease

    nodes, gpus, burst = 2, 2, 3
    for i in range(nodes):
        rig.add_node(f"h{i}", [{"model": "H100-80GB", "count": gpus}])
    rig.wait_nodes_published()
    lease_ns = rig.namespace()
    flags = ("--leader-elect", "--lease-namespace", lease_ns, "--lease-name", "sharegpu-extender")
    flags += ("--preemption-interval", "0.5")
    a, url_a = rig.start_extender(0, *flags, "--identity", "replica-a", name="extender-a", ready=False)
    b, url_b = rig.start_extender(0, *flags, "--identity", "replica-b", name="extender-b", ready=False)
    high = _priority_class(rig, HIGH_VALUE)
    try:
        with ReadyProxy([(a.health, url_a), (b.health, url_b)]) as proxy:
            wait_for(lambda: proxy.ready is not None, "a leader", 60)
            rig.start_scheduler(proxy.url)
            ns = rig.namespace()
            lows = _fill(rig, ns, nodes, gpus)
            with Watchdog(rig, ns) as dog:
                names = [f"high-{i}" for i in range(burst)]
                rig.create_pods(ns, [rig_pod(n, high, gpu=1, cpu="100m") for n in names])

                def evicting() -> bool:
                    return any(p["metadata"].get("deletionTimestamp") for p in rig.pods(ns))

                wait_for(evicting, "the first eviction", 60)
                holder = rig.client.get(Lease, "sharegpu-extender", namespace=lease_ns).spec.holderIdentity
                leader, follower = (a, b) if holder == "replica-a" else (b, a)
                leader.kill()  # SIGKILL, in the middle of the preemption
                killed = time.monotonic()

                def bound() -> int:
                    return sum(bool(p["spec"].get("nodeName")) for p in rig.pods(ns) if p["metadata"]["name"] in names)

                wait_for(lambda: bound() == burst, "all high-priority pods bound after the takeover", 180)
                after = time.monotonic() - killed
                time.sleep(2)
            pods = {p["metadata"]["name"]: p for p in rig.pods(ns)}
            evicted = sorted(set(lows) - set(pods))
            print(
                f"\nHA: leader killed during a preemption of {burst} pods; all bound {after:.1f}s after the kill, "
                f"{len(evicted)} victims, {dog.audits} audits, findings {len(dog.findings)}"
            )
            assert dog.findings == [], dog.findings[:5]
            assert len(evicted) == 2 * burst, evicted  # no pod evicted twice over, none for nothing
            assert "is now the leader" in follower.text()
    finally:
        _delete_priority_class(rig, high)
