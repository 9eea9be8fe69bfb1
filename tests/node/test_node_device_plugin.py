"""The device plugin over real gRPC on unix sockets, against a test peer that plays the kubelet."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import grpc.aio
import pytest
from node_fakes import SIM_YAML, FakeKube, FakeKubelet, assignment, pod, share

from sharegpu.model.assignment import Mechanism, MigSlot
from sharegpu.node.allocation import MPS_PIPE_IN_CONTAINER, Allocator
from sharegpu.node.backends.sim import SimBackend
from sharegpu.node.backends.sim_config import parse_sim_config
from sharegpu.node.device_plugin import DevicePluginError, DevicePluginServer, device_tokens
from sharegpu.node.mig import MigManager
from sharegpu.node.mps import MpsManager, SimMpsDaemon
from sharegpu.node.proto import deviceplugin_pb2 as pb
from sharegpu.node.state import AgentState


async def until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async def wait() -> None:
        while not cond():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(wait(), timeout_s)


@dataclass
class Rig:
    sim: SimBackend
    kube: FakeKube
    kubelet: FakeKubelet
    plugin: DevicePluginServer
    mps_daemon: SimMpsDaemon
    mps_root: Path
    state: AgentState

    def uuid(self, i: int) -> str:
        return self.sim.devices()[i].uuid

    async def allocate(self, n: int = 1) -> pb.ContainerAllocateResponse:
        stub = self.kubelet.plugin()
        req = pb.AllocateRequest(
            container_requests=[pb.ContainerAllocateRequest(devices_ids=[f"t{i}" for i in range(n)])]
        )
        resp = await stub.Allocate(req, timeout=10)
        assert len(resp.container_responses) == 1
        return resp.container_responses[0]


def run(sock_dir: Path, body: Callable[[Rig], Awaitable[None]], *, honour_field_selector: bool = True) -> None:
    async def main() -> None:
        sim = SimBackend(parse_sim_config(SIM_YAML), seed="node-a")
        kube = FakeKube(honour_field_selector=honour_field_selector)
        state = AgentState()
        daemon = SimMpsDaemon()
        mps_root = sock_dir / "mps"
        allocator = Allocator(
            "node-a", sim, kube, MigManager(sim, state), MpsManager(mps_root, daemon), state, wait_s=0.3, poll_s=0.05
        )
        plugin = DevicePluginServer(sock_dir, allocator, poll_s=0.05)
        await plugin.set_devices(device_tokens(sim.devices(), per_gpu=2))
        kubelet = FakeKubelet(sock_dir)
        await kubelet.start()
        stop = asyncio.Event()
        task = asyncio.create_task(plugin.run(stop))
        try:
            await asyncio.wait_for(kubelet.registered.wait(), 5)
            await body(Rig(sim, kube, kubelet, plugin, daemon, mps_root, state))
        finally:
            stop.set()
            await task
            await kubelet.stop()

    asyncio.run(main())


def test_registers_with_the_exact_protocol_values(sock_dir: Path) -> None:
    async def body(rig: Rig) -> None:
        (req,) = rig.kubelet.requests
        assert (req.version, req.endpoint, req.resource_name) == ("v1beta1", "sharegpu.sock", "sharegpu.io/gpu")
        opts = await rig.kubelet.plugin().GetDevicePluginOptions(pb.Empty(), timeout=5)
        assert not opts.pre_start_required and not opts.get_preferred_allocation_available
        # Field numbers on the wire are upstream's: ContainerAllocateResponse.envs is field 1, mounts 2.
        wire = pb.ContainerAllocateResponse(envs={"a": "b"}, mounts=[pb.Mount(host_path="/h")]).SerializeToString()
        assert wire[0] == (1 << 3) | 2 and wire.index(bytes([(2 << 3) | 2])) > 0
        assert pb.RegisterRequest(resource_name="x").SerializeToString()[0] == (3 << 3) | 2

    run(sock_dir, body)


def test_list_and_watch_sends_devices_and_health_changes(sock_dir: Path) -> None:
    async def body(rig: Rig) -> None:
        stream = rig.kubelet.plugin().ListAndWatch(pb.Empty())
        first = await stream.read()
        assert len(first.devices) == 6 and {d.health for d in first.devices} == {"Healthy"}
        assert f"{rig.uuid(0)}::0" == first.devices[0].ID and all(len(d.ID) <= 63 for d in first.devices)
        rig.sim.set_health(2, False)
        await rig.plugin.set_devices(device_tokens(rig.sim.devices(), per_gpu=2))
        second = await asyncio.wait_for(stream.read(), 5)
        assert [d.health for d in second.devices if d.ID.startswith(rig.uuid(2))] == ["Unhealthy"] * 2
        assert [d.health for d in second.devices if d.ID.startswith(rig.uuid(0))] == ["Healthy"] * 2
        stream.cancel()

    run(sock_dir, body)


def test_allocate_mps_share_returns_daemon_pipe_and_limits(sock_dir: Path) -> None:
    async def body(rig: Rig) -> None:
        a = assignment("infer", share(0, rig.uuid(0), Mechanism.MPS, compute_milli=300, memory_mib=10240))
        rig.kube.add(pod("infer", a))
        resp = await rig.allocate()
        assert dict(resp.envs) == {
            "NVIDIA_VISIBLE_DEVICES": rig.uuid(0),
            "CUDA_MPS_PIPE_DIRECTORY": MPS_PIPE_IN_CONTAINER,
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=10240M",
        }
        (mount,) = resp.mounts
        assert mount.container_path == MPS_PIPE_IN_CONTAINER
        assert Path(mount.host_path) == rig.mps_root / rig.uuid(0) / "pipe"
        assert rig.mps_daemon.starts == 1 and (Path(mount.host_path) / SimMpsDaemon.MARKER).exists()

    run(sock_dir, body)


def test_allocate_time_slicing_and_exclusive_give_the_uuid_only(sock_dir: Path) -> None:
    async def body(rig: Rig) -> None:
        rig.kube.add(pod("ts", assignment("ts", share(1, rig.uuid(1), Mechanism.TIME_SLICING, 500)), created="1"))
        rig.kube.add(
            pod("whole", assignment("whole", share(2, rig.uuid(2), Mechanism.EXCLUSIVE, 1000, 24 * 1024)), created="2")
        )
        for gpu in (1, 2):
            resp = await rig.allocate()
            assert dict(resp.envs) == {"NVIDIA_VISIBLE_DEVICES": rig.uuid(gpu)}
            assert len(resp.mounts) == 0
        assert rig.mps_daemon.starts == 0

    run(sock_dir, body)


def test_allocate_creates_the_mig_instance_before_handing_it_out(sock_dir: Path) -> None:
    async def body(rig: Rig) -> None:
        a = assignment(
            "train",
            share(1, rig.uuid(1), Mechanism.MIG, 1000, 40 * 1024, MigSlot("3g.40gb", 4), Mechanism.EXCLUSIVE),
            share(2, rig.uuid(2), Mechanism.MIG, 500, 6 * 1024, MigSlot("1g.6gb", 3), Mechanism.TIME_SLICING),
        )
        rig.kube.add(pod("train", a, gpus=(2,)))
        resp = await rig.allocate(2)
        (inst1,) = rig.sim.mig_instances(1)
        (inst2,) = rig.sim.mig_instances(2)
        assert (inst1.profile, inst1.start, inst2.profile, inst2.start) == ("3g.40gb", 4, "1g.6gb", 3)
        assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == f"{inst1.uuid},{inst2.uuid}"

    run(sock_dir, body)


def test_mps_inside_a_mig_instance_gets_its_own_daemon(sock_dir: Path) -> None:
    async def body(rig: Rig) -> None:
        s = share(0, rig.uuid(0), Mechanism.MIG, 250, 5 * 1024, MigSlot("2g.20gb", 2), Mechanism.MPS)
        rig.kube.add(pod("m", assignment("m", s)))
        resp = await rig.allocate()
        (inst,) = rig.sim.mig_instances(0)
        assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == inst.uuid
        assert resp.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
        assert resp.mounts[0].host_path == str(rig.mps_root / inst.uuid / "pipe")

    run(sock_dir, body)


def test_containers_of_one_pod_take_consecutive_shares_in_order(sock_dir: Path) -> None:
    async def body(rig: Rig) -> None:
        a = assignment(
            "two",
            share(0, rig.uuid(0), Mechanism.TIME_SLICING, 100),
            share(1, rig.uuid(1), Mechanism.TIME_SLICING, 100),
            share(2, rig.uuid(2), Mechanism.TIME_SLICING, 100),
        )
        rig.kube.add(pod("two", a, gpus=(1, 2)))
        assert (await rig.allocate(1)).envs["NVIDIA_VISIBLE_DEVICES"] == rig.uuid(0)
        second = await rig.allocate(2)
        assert second.envs["NVIDIA_VISIBLE_DEVICES"] == f"{rig.uuid(1)},{rig.uuid(2)}"
        assert rig.state.allocated_containers("uid-default-two") == {"c0", "c1"}

    run(sock_dir, body)


async def _refused(rig: Rig, n: int = 1) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await rig.allocate(n)
    assert e.value.code() in (grpc.StatusCode.FAILED_PRECONDITION,)
    return e.value.details() or ""


def test_bad_assignments_fail_allocate_clearly_and_the_plugin_keeps_serving(sock_dir: Path) -> None:
    async def body(rig: Rig) -> None:
        good = assignment("good", share(0, rig.uuid(0), Mechanism.TIME_SLICING, 100))
        cases = [
            ("{not json", "is invalid"),
            ('{"version": 1, "pod": "default/x"}', "is invalid"),
            (assignment("bad", share(0, rig.uuid(0), Mechanism.TIME_SLICING, 100), node="node-b"), "not this node"),
            (assignment("someone-else", share(0, rig.uuid(0), Mechanism.TIME_SLICING, 100)), "foreign"),
            (assignment("bad", share(5, "GPU-nope", Mechanism.TIME_SLICING, 100)), "does not have"),
            (assignment("bad", share(0, "GPU-nope", Mechanism.TIME_SLICING, 100)), "does not have"),
            (
                assignment("bad", share(0, rig.uuid(0), Mechanism.MIG, 100, 0, MigSlot("3g.40gb", 2), Mechanism.MPS)),
                "cannot start at slot 2",
            ),
            (None, "no sharegpu.io/assignment"),
        ]
        for i, (annotation, message) in enumerate(cases):
            # A new pod each time (own UID): a refused pod is never picked again.
            p = rig.kube.add(replace(pod("bad", annotation), uid=f"uid-bad-{i}"))
            assert message in await _refused(rig)
            del rig.kube.pods[p.uid]
        rig.kube.add(pod("good", good))
        assert (await rig.allocate()).envs["NVIDIA_VISIBLE_DEVICES"] == rig.uuid(0)

    run(sock_dir, body)


def test_count_mismatch_and_no_pod_are_refused(sock_dir: Path) -> None:
    async def body(rig: Rig) -> None:
        assert "no pending pod bound to node node-a" in await _refused(rig)
        two = assignment(
            "two",
            share(0, rig.uuid(0), Mechanism.TIME_SLICING, 100),
            share(1, rig.uuid(1), Mechanism.TIME_SLICING, 100),
        )
        rig.kube.add(pod("two", two, gpus=(1,)))
        assert "ask for 1 sharegpu.io/gpu in all, but its assignment holds 2" in await _refused(rig)
        mps_two = assignment(
            "m2", share(0, rig.uuid(0), Mechanism.MPS, 100, 100), share(1, rig.uuid(1), Mechanism.MPS, 100, 100)
        )
        rig.kube.pods.clear()
        rig.kube.add(pod("m2", mps_two, gpus=(2,)))
        assert "one MPS daemon" in await _refused(rig, 2)

    run(sock_dir, body)


def test_pods_of_other_nodes_are_never_used(sock_dir: Path) -> None:
    async def body(rig: Rig) -> None:
        # The API (wrongly) returns another node's pod, with an assignment that even names this node.
        other = assignment("other", share(0, rig.uuid(0), Mechanism.TIME_SLICING, 100))
        rig.kube.add(pod("other", other, node="node-b"))
        assert "no pending pod bound to node node-a" in await _refused(rig)
        assert rig.state.allocations == {}

    run(sock_dir, body, honour_field_selector=False)


def test_allocate_waits_for_a_pod_that_the_api_shows_late(sock_dir: Path) -> None:
    async def body(rig: Rig) -> None:
        rig.kube.fail_lists = 2  # the API server hiccups first
        late = assignment("late", share(0, rig.uuid(0), Mechanism.TIME_SLICING, 100))
        asyncio.get_running_loop().call_later(0.1, rig.kube.add, pod("late", late))
        assert (await rig.allocate()).envs["NVIDIA_VISIBLE_DEVICES"] == rig.uuid(0)

    run(sock_dir, body)


def test_registers_again_after_the_kubelet_restarts(sock_dir: Path) -> None:
    async def body(rig: Rig) -> None:
        await rig.kubelet.stop(remove_plugin_sockets=True)
        assert not (sock_dir / "sharegpu.sock").exists()
        await rig.kubelet.start()
        await asyncio.wait_for(rig.kubelet.registered.wait(), 5)
        await until(lambda: rig.plugin.registrations == 2)
        assert len(rig.kubelet.requests) == 2
        first = await rig.kubelet.plugin().ListAndWatch(pb.Empty()).read()
        assert len(first.devices) == 6

    run(sock_dir, body)


def test_socket_path_too_long_is_a_clear_error(tmp_path: Path) -> None:
    long_dir = tmp_path / ("d" * 120)

    class NoAllocator:
        async def allocate(self, device_count: int) -> object:
            raise AssertionError

    with pytest.raises(DevicePluginError, match="shorter --device-plugin-dir"):
        DevicePluginServer(long_dir, NoAllocator())  # type: ignore[arg-type]
