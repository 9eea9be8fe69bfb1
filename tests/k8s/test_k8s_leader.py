"""Leader election on a Lease (client-go's protocol), against the in-memory API server and a clock the test moves."""

from __future__ import annotations

import asyncio

import pytest
from k8s_helpers import node_spec, pod_obj
from memory_api import MemoryClusterApi
from starlette.testclient import TestClient

from sharegpu.k8s.cache.view import ClusterView
from sharegpu.k8s.extender.leader import LeaderElector
from sharegpu.k8s.extender.server import Extender, make_app
from sharegpu.kube.schema import Node


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def pair(api: MemoryClusterApi, clock: Clock) -> tuple[LeaderElector, LeaderElector]:
    def make(me: str) -> LeaderElector:
        return LeaderElector(api, "gpu-system", "sharegpu-extender", me, clock=clock)

    return make("a"), make("b")


def test_one_replica_leads_and_the_other_waits_while_it_renews() -> None:
    async def main() -> None:
        api, clock = MemoryClusterApi(), Clock()
        a, b = pair(api, clock)
        assert await a.try_once() and a.is_leader()
        for _ in range(20):  # 30 s of renewals: b never takes over
            clock.t += 1.5
            assert await a.try_once()
            assert not await b.try_once() and not b.is_leader()
        assert b.holder == "a"
        assert api.leases["gpu-system/sharegpu-extender"].holder == "a"

    asyncio.run(main())


def test_a_dead_leader_is_replaced_after_the_lease_duration_on_the_followers_clock() -> None:
    async def main() -> None:
        api, clock = MemoryClusterApi(), Clock()
        a, b = pair(api, clock)
        assert await a.try_once()
        assert not await b.try_once()  # b first sees the record now
        clock.t += a.lease_s - 0.1  # a is killed: it renews no more
        assert not await b.try_once()
        assert not a.is_leader()  # past its renew deadline, a no longer counts itself leader either
        clock.t += 0.2
        assert await b.try_once() and b.is_leader()
        lease = api.leases["gpu-system/sharegpu-extender"]
        assert lease.holder == "b" and lease.transitions == 1

    asyncio.run(main())


def test_a_leader_cut_off_from_the_api_server_stops_leading_before_anyone_can_take_over() -> None:
    async def main() -> None:
        api, clock = MemoryClusterApi(), Clock()
        a, b = pair(api, clock)
        assert await a.try_once()
        assert not await b.try_once()
        api.down = True
        clock.t += a.renew_deadline_s
        assert not await a.try_once() and not a.is_leader()
        api.down = False
        assert not await b.try_once()  # the lease has not expired yet: nobody leads for a moment, never two
        clock.t += a.lease_s
        assert await b.try_once() and b.is_leader() and not a.is_leader()

    asyncio.run(main())


def test_of_two_replicas_racing_for_an_expired_lease_one_wins() -> None:
    async def main() -> None:
        api, clock = MemoryClusterApi(), Clock()
        a, b = pair(api, clock)
        c = LeaderElector(api, "gpu-system", "sharegpu-extender", "c", clock=clock)
        assert await c.try_once()
        assert not await a.try_once() and not await b.try_once()
        clock.t += c.lease_s + 1
        won = await asyncio.gather(a.try_once(), b.try_once())
        assert sorted(won) == [False, True]
        assert a.is_leader() != b.is_leader()

    asyncio.run(main())


def test_a_replica_that_stops_cleanly_hands_over_at_once() -> None:
    async def main() -> None:
        api, clock = MemoryClusterApi(), Clock()
        a, b = pair(api, clock)
        stop = asyncio.Event()
        changes: list[bool] = []
        a.on_change = changes.append
        task = asyncio.ensure_future(a.run(stop))
        while not a.is_leader():
            await asyncio.sleep(0.01)
        assert not await b.try_once()
        stop.set()
        await task
        assert changes == [True, False]
        assert api.leases["gpu-system/sharegpu-extender"].holder == ""
        assert await b.try_once()  # no need to wait for the lease to expire

    asyncio.run(main())


def test_an_unreachable_api_server_is_not_leadership() -> None:
    async def main() -> None:
        api = MemoryClusterApi()
        api.down = True
        a = LeaderElector(api, "gpu-system", "sharegpu-extender", "a")
        assert not await a.try_once() and not a.is_leader()

    asyncio.run(main())


def test_timings_must_nest() -> None:
    with pytest.raises(ValueError, match="renew deadline"):
        LeaderElector(MemoryClusterApi(), "ns", "l", "a", lease_s=5, renew_deadline_s=6, retry_s=1)


def test_a_replica_that_is_not_the_leader_is_not_ready_holds_nothing_and_binds_nothing() -> None:
    api = MemoryClusterApi()
    spec = node_spec("node-a", gpus=1)
    api.put_node("node-a", spec)
    view = ClusterView()
    view.reset([Node.model_validate(api.nodes["node-a"])], [])
    view.synced = True
    leader = False
    client = TestClient(make_app(Extender(view, api, is_leader=lambda: leader, policy="bestfit")))
    pod = api.put_pod(pod_obj("p", memory="10Gi"))
    assert client.get("/readyz").status_code == 503
    assert client.post("/prioritize", json={"Pod": pod, "NodeNames": ["node-a"]}).status_code == 200
    assert view.holds() == 0
    bind = {"PodName": "p", "PodNamespace": "default", "PodUID": pod["metadata"]["uid"], "Node": "node-a"}
    assert "not the leader" in client.post("/bind", json=bind).json()["Error"]
    assert not api.pods["default/p"]["spec"].get("nodeName")
    leader = True
    assert client.get("/readyz").status_code == 200
    client.post("/prioritize", json={"Pod": pod, "NodeNames": ["node-a"]})
    assert view.holds() == 1
    assert client.post("/bind", json=bind).json()["Error"] == ""
    assert view.holds() == 0 and api.pods["default/p"]["spec"]["nodeName"] == "node-a"
