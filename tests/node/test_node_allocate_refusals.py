"""Whose container is starting: PreStartContainer reads it from the kubelet's records (its pod-resources API and its
device-manager checkpoint), ties each device ID to one share of that pod for the pod's life, and refuses rather than
guess when the records do not name exactly one pod of the API."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import pytest
from node_fakes import (
    SIM_YAML,
    FakeKube,
    KubeletRecord,
    agent_config,
    assignment,
    cdi_spec,
    pod,
    record_for,
    share,
    start_container,
)

from sharegpu.kube.schema import Pod
from sharegpu.model.assignment import GpuShare, Mechanism
from sharegpu.model.contract import cdi_allocation_name
from sharegpu.node.agent import NodeAgent
from sharegpu.node.allocation import AllocationError
from sharegpu.node.backends.sim import SimBackend
from sharegpu.node.backends.sim_config import parse_sim_config
from sharegpu.node.kube import ContainerInfo, NodeInfo, pod_info
from sharegpu.node.mps import SimMpsDaemon


@dataclass
class Node:
    agent: NodeAgent
    kube: FakeKube
    record: KubeletRecord
    g: list[str]  # GPU UUIDs by index
    cdi_dir: Path

    def spec_exists(self, ids: list[str]) -> bool:
        return (self.cdi_dir / f"sharegpu.io-dp_{cdi_allocation_name(ids)}.json").exists()


@asynccontextmanager
async def _node(tmp_path: Path, sock_dir: Path) -> AsyncIterator[Node]:
    sim = SimBackend(parse_sim_config(SIM_YAML), seed="node-a")
    kube = FakeKube(NodeInfo("node-a", {}, {}, 32000, 256 * 1024))
    config = agent_config(tmp_path, sock_dir, allocate_wait_s=0.2)
    record = record_for(config)
    await record.start()
    try:
        yield Node(
            NodeAgent(config, sim, kube, SimMpsDaemon()), kube, record, [d.uuid for d in sim.devices()], config.cdi_dir
        )
    finally:
        await record.stop()


def _run(tmp_path: Path, sock_dir: Path, body: Callable[[Node], Awaitable[None]]) -> None:
    async def main() -> None:
        async with _node(tmp_path, sock_dir) as n:
            await body(n)

    asyncio.run(main())


def _ts(gpu: int, uuid: str) -> GpuShare:
    return share(gpu, uuid, Mechanism.TIME_SLICING, 100)


def test_two_pods_created_in_one_order_and_started_in_the_other_get_their_own_shares(
    tmp_path: Path, sock_dir: Path
) -> None:
    """The bug the redesign fixes: the oldest pending pod was taken for the container's, so a burst that reached the
    kubelet out of creation order swapped the pods' shares."""

    async def body(n: Node) -> None:
        old = n.kube.add(pod("old", assignment("old", share(0, n.g[0], Mechanism.MPS, 300, 1024)), created="1"))
        young = n.kube.add(pod("young", assignment("young", share(1, n.g[1], Mechanism.EXCLUSIVE, 1000)), created="2"))
        # The kubelet admits both (each holds its device IDs), then starts the younger pod's container first.
        n.record.hold(old, "c0", ["t-old"])
        n.record.hold(young, "c0", ["t-young"])
        y = await start_container(n.agent, n.record, young, "c0", ["t-young"])
        o = await start_container(n.agent, n.record, old, "c0", ["t-old"])
        assert (y.pod, y.pod_uid, y.units) == ("default/young", young.uid, (n.g[1],))
        assert (o.pod, o.pod_uid, o.units) == ("default/old", old.uid, (n.g[0],))
        assert cdi_spec(n.cdi_dir, ["t-young"])["env"] == {
            "NVIDIA_VISIBLE_DEVICES": n.g[1],
            "SHAREGPU_MECHANISM": "exclusive",
        }
        assert cdi_spec(n.cdi_dir, ["t-old"])["env"]["NVIDIA_VISIBLE_DEVICES"] == n.g[0]
        assert cdi_spec(n.cdi_dir, ["t-old"])["env"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=1024M"
        assert n.agent.state.device_share == {young.uid: {"t-young": 0}, old.uid: {"t-old": 0}}

    _run(tmp_path, sock_dir, body)


def test_ids_held_by_two_pods_are_refused(tmp_path: Path, sock_dir: Path) -> None:
    async def body(n: Node) -> None:
        a = n.kube.add(pod("a", assignment("a", _ts(0, n.g[0]))))
        b = n.kube.add(pod("b", assignment("b", _ts(1, n.g[1]))))
        n.record.hold(a, "c0", ["t0"])
        n.record.hold(b, "c0", ["t0", "t1"])
        with pytest.raises(AllocationError, match="held by several pods") as e:
            await n.agent.allocator.prestart(["t0"])
        assert "default-a" in str(e.value).replace("/", "-") and "default-b" in str(e.value).replace("/", "-")
        assert not n.spec_exists(["t0"]) and n.agent.state.device_share == {} and n.agent.state.allocations == {}

    _run(tmp_path, sock_dir, body)


def test_a_pod_replaced_under_the_same_name_is_not_taken_for_the_one_the_kubelet_recorded(
    tmp_path: Path, sock_dir: Path
) -> None:
    async def body(n: Node) -> None:
        a = assignment("a", _ts(0, n.g[0]))
        gone = pod("a", a, uid="uid-old")
        n.record.hold(gone, "c0", ["t0"])  # the kubelet's record: the old pod's UID
        n.kube.add(pod("a", a, uid="uid-new"))  # the API: a new pod under the same name
        with pytest.raises(AllocationError, match=r"default/a .*with UID uid-old .*refusing to guess"):
            await n.agent.allocator.prestart(["t0"])
        assert not n.spec_exists(["t0"]) and n.agent.state.device_share == {}

    _run(tmp_path, sock_dir, body)


def test_an_init_containers_ids_handed_on_to_an_app_container_keep_their_share(tmp_path: Path, sock_dir: Path) -> None:
    """The kubelet hands an init container's device IDs on to the next container that asks: a pod with a 1-GPU init
    container and two 1-GPU app containers holds 2 IDs (2 shares, not 3), and the app container that takes over the
    init container's ID takes over its share."""

    async def body(n: Node) -> None:
        a = assignment("p", _ts(0, n.g[0]), _ts(1, n.g[1]))
        p = n.kube.add(pod("p", a, gpus=(1, 1), init=(ContainerInfo("init", 1),)))
        assert p.gpu_demand == 2
        # At admission the kubelet allocates every container: init gets t5, c0 reuses t5, c1 gets t2.
        n.record.hold(p, "init", ["t5"])
        n.record.hold(p, "c0", ["t5"])
        n.record.hold(p, "c1", ["t2"])
        init = await n.agent.allocator.prestart(["t5"])
        c1 = await start_container(n.agent, n.record, p, "c1", ["t2"])
        c0 = await start_container(n.agent, n.record, p, "c0", ["t5"])
        assert init.units == c0.units == (n.g[0],) and c1.units == (n.g[1],)
        assert set(init.container.split("|")) == {"init", "c0"}  # both hold exactly these IDs
        assert n.agent.state.device_shares(p.uid) == {"t5": 0, "t2": 1}

    _run(tmp_path, sock_dir, body)


def test_an_init_container_is_found_through_the_checkpoint_alone(tmp_path: Path, sock_dir: Path) -> None:
    """The pod-resources API does not list ordinary init containers; an init container whose IDs no app container
    takes over is known only to the checkpoint (by pod UID)."""

    async def body(n: Node) -> None:
        a = assignment("p", _ts(2, n.g[2]))
        p = n.kube.add(pod("p", a, gpus=(0,), init=(ContainerInfo("prepare", 1),)))
        grant = await start_container(n.agent, n.record, p, "prepare", ["t9"])
        assert (grant.pod_uid, grant.container, grant.units) == (p.uid, "prepare", (n.g[2],))
        assert n.record.lists >= 1  # the API was asked, and did not list it
        # The checkpoint gone too: nothing names the pod.
        n.record.checkpoint.unlink()
        with pytest.raises(AllocationError, match="no pod on this node holds device IDs t9"):
            await n.agent.allocator.prestart(["t9"])

    _run(tmp_path, sock_dir, body)


def test_a_native_sidecar_and_an_app_container_running_together_get_different_shares(
    tmp_path: Path, sock_dir: Path
) -> None:
    async def body(n: Node) -> None:
        a = assignment("p", share(0, n.g[0], Mechanism.MPS, 200, 1024), share(1, n.g[1], Mechanism.MPS, 500, 2048))
        p = n.kube.add(pod("p", a, gpus=(1,), init=(ContainerInfo("proxy", 1, sidecar=True),)))
        assert p.gpu_demand == 2  # the sidecar runs beside the app container
        side = await start_container(n.agent, n.record, p, "proxy", ["s0"])
        app = await start_container(n.agent, n.record, p, "c0", ["a0"])
        assert (side.container, app.container) == ("proxy", "c0")  # the API lists sidecars: found by name
        assert side.units == (n.g[0],) and app.units == (n.g[1],)
        assert cdi_spec(n.cdi_dir, ["s0"])["env"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=1024M"
        assert cdi_spec(n.cdi_dir, ["a0"])["env"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2048M"

    _run(tmp_path, sock_dir, body)


def test_a_pod_whose_gpu_containers_declare_different_users_is_refused_with_the_reason(
    tmp_path: Path, sock_dir: Path
) -> None:
    """Clients of two UIDs would wait on each other on one MPS server: such a pod is refused before any daemon starts,
    with what to change; a container without a GPU (a sidecar that runs no client) decides nothing."""

    async def body(n: Node) -> None:
        a = assignment("p", share(0, n.g[0], Mechanism.MPS, 200, 1024), share(1, n.g[1], Mechanism.MPS, 200, 1024))
        p = n.kube.add(
            replace(
                pod("p", a, gpus=(1, 1)),
                containers=(ContainerInfo("web", 1, user=1000), ContainerInfo("worker", 1, user=0)),
            )
        )
        with pytest.raises(AllocationError, match=r"web: 1000, worker: 0.*runAsUser"):
            await start_container(n.agent, n.record, p, "web", ["t0"])
        assert n.agent.mps.running() == frozenset() and not n.spec_exists(["t0"])
        # The same pod with a GPU-less log shipper of another user is one tenant: uid 1000 in its namespace.
        ok = n.kube.add(
            replace(
                pod("q", assignment("q", share(0, n.g[0], Mechanism.MPS, 200, 1024)), gpus=(1,)),
                containers=(ContainerInfo("web", 1, user=1000), ContainerInfo("logs", 0, user=0)),
            )
        )
        grant = await start_container(n.agent, n.record, ok, "web", ["t1"])
        assert grant.mounts[0].host_path == str(n.agent.mps.spec(n.g[0], "default/uid-1000").pipe_dir)

    _run(tmp_path, sock_dir, body)


def test_a_restarted_container_gets_the_same_share(tmp_path: Path, sock_dir: Path) -> None:
    async def body(n: Node) -> None:
        a = assignment("p", _ts(0, n.g[0]), _ts(1, n.g[1]), _ts(2, n.g[2]))
        p = n.kube.add(pod("p", a, gpus=(1, 2)))
        n.record.hold(p, "c0", ["x"])
        first = await start_container(n.agent, n.record, p, "c1", ["y", "z"])
        spec = cdi_spec(n.cdi_dir, ["y", "z"])
        # c1 crashes and the kubelet starts it again (PreStartContainer with the same IDs), before and after c0 starts.
        assert (await n.agent.allocator.prestart(["z", "y"])).units == first.units
        c0 = await n.agent.allocator.prestart(["x"])
        again = await n.agent.allocator.prestart(["y", "z"])
        assert again.units == first.units == (n.g[0], n.g[1]) and c0.units == (n.g[2],)
        assert cdi_spec(n.cdi_dir, ["y", "z"]) == spec
        assert n.agent.state.device_shares(p.uid) == {"y": 0, "z": 1, "x": 2}

    _run(tmp_path, sock_dir, body)


def test_more_ids_than_shares_are_refused(tmp_path: Path, sock_dir: Path) -> None:
    async def body(n: Node) -> None:
        a = assignment("p", _ts(0, n.g[0]))
        p = n.kube.add(pod("p", a, gpus=(1,)))
        await start_container(n.agent, n.record, p, "c0", ["t0"])
        # A record that gives the pod a second ID (the kubelet never should): no share is left for it.
        with pytest.raises(AllocationError, match=r"more sharegpu.io/gpu device IDs \(2\) than its assignment"):
            await start_container(n.agent, n.record, p, "c0", ["t1"])
        assert n.agent.state.device_shares(p.uid) == {"t0": 0}

    _run(tmp_path, sock_dir, body)


def test_either_record_is_enough_and_neither_is_refused(tmp_path: Path, sock_dir: Path) -> None:
    async def body(n: Node) -> None:
        a = n.kube.add(pod("a", assignment("a", _ts(0, n.g[0]))))
        b = n.kube.add(pod("b", assignment("b", _ts(1, n.g[1]))))
        c = n.kube.add(pod("c", assignment("c", _ts(2, n.g[2]))))
        # The pod-resources API down: the checkpoint names the pod by UID.
        n.record.list_error = grpc.StatusCode.UNAVAILABLE
        assert (await start_container(n.agent, n.record, a, "c0", ["ta"])).pod == "default/a"
        # No checkpoint file (an older or a different kubelet): the pod-resources API names it by name.
        n.record.list_error = None
        n.record.checkpoint.unlink()
        n.record.write_checkpoint = False
        assert (await start_container(n.agent, n.record, b, "c0", ["tb"])).pod == "default/b"
        # Neither: refused, with both reasons.
        n.record.list_error = grpc.StatusCode.UNAVAILABLE
        n.record.hold(c, "c0", ["tc"])
        with pytest.raises(AllocationError) as e:
            await n.agent.allocator.prestart(["tc"])
        assert "UNAVAILABLE" in str(e.value) and "checkpoint" in str(e.value) and "refusing to guess" in str(e.value)
        # An unreadable checkpoint is an error, not an empty record.
        n.record.checkpoint.write_text("{half a file")
        with pytest.raises(AllocationError, match="cannot be read"):
            await n.agent.allocator.prestart(["tc"])

    _run(tmp_path, sock_dir, body)


def test_a_refused_container_is_served_once_its_pod_is_fixed(tmp_path: Path, sock_dir: Path) -> None:
    """A PreStartContainer error makes the kubelet retry the container; nothing of the refusal is held against it."""

    async def body(n: Node) -> None:
        good = assignment("a", _ts(0, n.g[0]))
        p = n.kube.add(pod("a", assignment("a", share(0, "GPU-not-here", Mechanism.TIME_SLICING, 100))))
        with pytest.raises(AllocationError, match=r"default/a: its assignment names GPU 0 \(GPU-not-here\)"):
            await start_container(n.agent, n.record, p, "c0", ["t0"])
        n.kube.add(replace(p, annotations={"sharegpu.io/assignment": good.to_json()}))
        assert (await n.agent.allocator.prestart(["t0"])).units == (n.g[0],)

    _run(tmp_path, sock_dir, body)


def test_status_reason_is_read_from_the_api() -> None:
    p = pod_info(Pod.model_validate({"metadata": {"name": "x"}, "status": {"phase": "Pending", "reason": "OutOfcpu"}}))
    assert p.reason == "OutOfcpu"
    assert pod_info(Pod.model_validate({"metadata": {"name": "x"}, "status": {"phase": "Pending"}})).reason == ""
