"""The device plugin over real gRPC on unix sockets, against a test peer that plays the kubelet: Allocate names a CDI
device and hides every GPU; PreStartContainer finds the pod in the kubelet's records (its pod-resources API, also over
gRPC, and its checkpoint) and writes the CDI spec, which is read back here as the runtime would."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from node_fakes import SIM_YAML, FakeKube, FakeKubelet, KubeletRecord, assignment, cdi_spec, pod, share

from sharegpu.model.assignment import Mechanism, MigSlot
from sharegpu.model.contract import cdi_allocation_name
from sharegpu.model.tenant import tenant_dir
from sharegpu.node.allocation import MPS_PIPE_IN_CONTAINER, Allocator
from sharegpu.node.backends.sim import SimBackend
from sharegpu.node.backends.sim_config import parse_sim_config
from sharegpu.node.cdi import CdiWriter
from sharegpu.node.device_plugin import DevicePluginError, DevicePluginServer, device_tokens
from sharegpu.node.kube import PodInfo
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
    record: KubeletRecord
    plugin: DevicePluginServer
    mps_daemon: SimMpsDaemon
    mps_root: Path
    state: AgentState
    cdi_dir: Path

    def uuid(self, i: int) -> str:
        return self.sim.devices()[i].uuid

    async def start(self, p: PodInfo, ids: Sequence[str] = ("t0",), container: str = "c0") -> dict[str, Any]:
        """Start ``container`` of ``p`` with ``ids`` as the kubelet does; returns the CDI spec PreStartContainer
        wrote for it (and checks what Allocate answered)."""
        answer = await self.kubelet.run_container(self.record, p, container, ids)
        assert list(answer.cdi_devices) == [pb.CDIDevice(name=f"sharegpu.io/gpu={cdi_allocation_name(ids)}")]
        assert dict(answer.envs) == {"NVIDIA_VISIBLE_DEVICES": "void"} and len(answer.mounts) == 0
        return cdi_spec(self.cdi_dir, ids)

    async def refused(self, p: PodInfo | None, ids: Sequence[str] = ("t0",), container: str = "c0") -> str:
        """Start it; PreStartContainer must refuse it with FAILED_PRECONDITION and write no spec: the message."""
        with pytest.raises(grpc.aio.AioRpcError) as e:
            if p is None:  # the kubelet records no pod for these IDs
                await self.kubelet.plugin().PreStartContainer(pb.PreStartContainerRequest(devices_ids=ids), timeout=10)
            else:
                await self.kubelet.run_container(self.record, p, container, ids)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value
        assert not (self.cdi_dir / f"sharegpu.io-dp_{cdi_allocation_name(ids)}.json").exists()
        return e.value.details() or ""


def run(sock_dir: Path, body: Callable[[Rig], Awaitable[None]], *, honour_field_selector: bool = True) -> None:
    async def main() -> None:
        sim = SimBackend(parse_sim_config(SIM_YAML), seed="node-a")
        kube = FakeKube(honour_field_selector=honour_field_selector)
        state = AgentState()
        daemon = SimMpsDaemon()
        mps_root = sock_dir / "mps"
        cdi_dir = sock_dir / "cdi"
        record = KubeletRecord(sock_dir / "pr" / "kubelet.sock", sock_dir)
        await record.start()
        allocator = Allocator(
            "node-a",
            sim,
            kube,
            MigManager(sim, state),
            MpsManager(mps_root, daemon),
            state,
            record.attributor(),
            CdiWriter(cdi_dir),
            wait_s=0.3,
            poll_s=0.05,
        )
        plugin = DevicePluginServer(sock_dir, allocator, poll_s=0.05)
        await plugin.set_devices(device_tokens(sim.devices(), per_gpu=2))
        kubelet = FakeKubelet(sock_dir)
        await kubelet.start()
        stop = asyncio.Event()
        task = asyncio.create_task(plugin.run(stop))
        try:
            await asyncio.wait_for(kubelet.registered.wait(), 5)
            await body(Rig(sim, kube, kubelet, record, plugin, daemon, mps_root, state, cdi_dir))
        finally:
            stop.set()
            await task
            await kubelet.stop()
            await record.stop()

    asyncio.run(main())


def test_registers_with_the_exact_protocol_values(sock_dir: Path) -> None:
    async def body(rig: Rig) -> None:
        (req,) = rig.kubelet.requests
        assert (req.version, req.endpoint, req.resource_name) == ("v1beta1", "sharegpu.sock", "sharegpu.io/gpu")
        # PreStartContainer is asked for at registration and in the options: without it no container gets its share.
        assert req.options.pre_start_required and not req.options.get_preferred_allocation_available
        opts = await rig.kubelet.plugin().GetDevicePluginOptions(pb.Empty(), timeout=5)
        assert opts.pre_start_required and not opts.get_preferred_allocation_available
        # Field numbers on the wire are upstream's: ContainerAllocateResponse.envs is field 1, mounts 2, cdi_devices 5;
        # DevicePluginOptions.pre_start_required 1; RegisterRequest.options 4.
        wire = pb.ContainerAllocateResponse(envs={"a": "b"}, mounts=[pb.Mount(host_path="/h")]).SerializeToString()
        assert wire[0] == (1 << 3) | 2 and wire.index(bytes([(2 << 3) | 2])) > 0
        assert pb.ContainerAllocateResponse(cdi_devices=[pb.CDIDevice(name="x")]).SerializeToString()[0] == (5 << 3) | 2
        assert pb.DevicePluginOptions(pre_start_required=True).SerializeToString() == bytes([1 << 3, 1])
        assert pb.RegisterRequest(resource_name="x").SerializeToString()[0] == (3 << 3) | 2
        assert pb.RegisterRequest(options=pb.DevicePluginOptions()).SerializeToString()[0] == (4 << 3) | 2

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


def test_allocate_only_names_the_cdi_device_and_hides_every_gpu(sock_dir: Path) -> None:
    async def body(rig: Rig) -> None:
        rig.kube.add(pod("infer", assignment("infer", share(0, rig.uuid(0), Mechanism.MPS, 300, 1024))))
        stub = rig.kubelet.plugin()
        ids = ["t1", "t0"]
        resp = await stub.Allocate(
            pb.AllocateRequest(
                container_requests=[
                    pb.ContainerAllocateRequest(devices_ids=ids),
                    pb.ContainerAllocateRequest(devices_ids=["t0", "t1"]),
                    pb.ContainerAllocateRequest(devices_ids=["t2"]),
                ]
            ),
            timeout=5,
        )
        names = [[d.name for d in r.cdi_devices] for r in resp.container_responses]
        assert names[0] == [f"sharegpu.io/gpu={cdi_allocation_name(ids)}"] and names[0][0].startswith(
            "sharegpu.io/gpu=dp-"
        )
        assert names[1] == names[0] != names[2]  # named after the IDs, whatever their order
        assert all(dict(r.envs) == {"NVIDIA_VISIBLE_DEVICES": "void"} for r in resp.container_responses)
        assert all(len(r.mounts) == 0 and len(r.devices) == 0 for r in resp.container_responses)
        # Nothing is made ready and nothing is written before PreStartContainer: the pod is not known yet.
        assert rig.mps_daemon.starts == 0 and not rig.cdi_dir.exists() and rig.state.allocations == {}
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Allocate(pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest()]), timeout=5)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "at least 1" in (e.value.details() or "")

    run(sock_dir, body)


def test_prestart_for_ids_no_pod_holds_is_refused(sock_dir: Path) -> None:
    async def body(rig: Rig) -> None:
        rig.kube.add(pod("a", assignment("a", share(0, rig.uuid(0), Mechanism.TIME_SLICING, 100))))
        message = await rig.refused(None, ["t7"])
        assert "no pod on this node holds device IDs t7" in message and "refusing to guess" in message
        assert rig.record.lists == 1  # the kubelet's pod-resources API was asked
        assert rig.state.allocations == {} and rig.state.device_share == {}
        # The kubelet's records unreadable altogether: refused, saying what failed.
        await rig.record.stop()
        rig.record.checkpoint.unlink(missing_ok=True)
        message = await rig.refused(None, ["t7"])
        assert "pod-resources API" in message and "checkpoint" in message and "does not exist" in message

    run(sock_dir, body)


def test_mps_share_gets_the_daemon_pipe_and_limits_in_its_cdi_spec(sock_dir: Path) -> None:
    async def body(rig: Rig) -> None:
        a = assignment("infer", share(0, rig.uuid(0), Mechanism.MPS, compute_milli=300, memory_mib=10240))
        spec = await rig.start(rig.kube.add(pod("infer", a)))
        assert spec["env"] == {
            "NVIDIA_VISIBLE_DEVICES": rig.uuid(0),
            "SHAREGPU_MECHANISM": "mps",
            "CUDA_MPS_PIPE_DIRECTORY": MPS_PIPE_IN_CONTAINER,
            # The only share of its tenant on the GPU: its daemon's turn is all its own (daemons take turns).
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=10240M",
        }
        (mount,) = spec["mounts"]
        assert mount["containerPath"] == MPS_PIPE_IN_CONTAINER and "rw" in mount["options"]
        # Its tenant's daemon: the pod declares no user, so it is a tenant of its own.
        assert Path(mount["hostPath"]) == rig.mps_root / rig.uuid(0) / tenant_dir("pod/uid-default-infer") / "pipe"
        assert rig.mps_daemon.starts == 1 and (Path(mount["hostPath"]) / SimMpsDaemon.MARKER).exists()
        assert spec["deviceNodes"] == []  # the simulated backend has no device nodes (a runtime stats each one)
        assert rig.state.allocations == {"uid-default-infer": {"c0": (rig.uuid(0),)}}
        assert rig.state.cdi_specs == {"uid-default-infer": {cdi_allocation_name(["t0"])}}

    run(sock_dir, body)


def test_time_slicing_and_exclusive_give_the_uuid_only(sock_dir: Path) -> None:
    async def body(rig: Rig) -> None:
        ts = rig.kube.add(pod("ts", assignment("ts", share(1, rig.uuid(1), Mechanism.TIME_SLICING, 500))))
        whole = rig.kube.add(
            pod("whole", assignment("whole", share(2, rig.uuid(2), Mechanism.EXCLUSIVE, 1000, 24 * 1024)))
        )
        for p, ids, gpu, mechanism in ((ts, ["t0"], 1, "time-slicing"), (whole, ["t1"], 2, "exclusive")):
            spec = await rig.start(p, ids)
            assert spec["env"] == {"NVIDIA_VISIBLE_DEVICES": rig.uuid(gpu), "SHAREGPU_MECHANISM": mechanism}
            assert spec["mounts"] == []
        assert rig.mps_daemon.starts == 0

    run(sock_dir, body)


def test_prestart_creates_the_mig_instances_before_handing_them_out(sock_dir: Path) -> None:
    async def body(rig: Rig) -> None:
        a = assignment(
            "train",
            share(1, rig.uuid(1), Mechanism.MIG, 1000, 40 * 1024, MigSlot("3g.40gb", 4), Mechanism.EXCLUSIVE),
            share(2, rig.uuid(2), Mechanism.MIG, 500, 6 * 1024, MigSlot("1g.6gb", 3), Mechanism.TIME_SLICING),
        )
        p = rig.kube.add(pod("train", a, gpus=(2,)))
        stub = rig.kubelet.plugin()
        await stub.Allocate(
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["t0", "t1"])]), timeout=5
        )
        assert rig.sim.mig_instances(1) == () and rig.sim.mig_instances(2) == ()  # Allocate makes nothing
        spec = await rig.start(p, ["t0", "t1"])
        (inst1,) = rig.sim.mig_instances(1)
        (inst2,) = rig.sim.mig_instances(2)
        assert (inst1.profile, inst1.start, inst2.profile, inst2.start) == ("3g.40gb", 4, "1g.6gb", 3)
        assert spec["env"]["NVIDIA_VISIBLE_DEVICES"] == f"{inst1.uuid},{inst2.uuid}"
        assert spec["env"]["SHAREGPU_MECHANISM"] == "exclusive,time-slicing"  # how each unit is shared

    run(sock_dir, body)


def test_mps_inside_a_mig_instance_gets_its_own_daemon(sock_dir: Path) -> None:
    async def body(rig: Rig) -> None:
        s = share(0, rig.uuid(0), Mechanism.MIG, 250, 5 * 1024, MigSlot("2g.20gb", 2), Mechanism.MPS)
        spec = await rig.start(rig.kube.add(pod("m", assignment("m", s))))
        (inst,) = rig.sim.mig_instances(0)
        assert spec["env"]["NVIDIA_VISIBLE_DEVICES"] == inst.uuid
        assert spec["env"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "100"  # alone in its daemon
        assert spec["env"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=5120M"
        assert spec["mounts"][0]["hostPath"] == str(rig.mps_root / inst.uuid / tenant_dir("pod/uid-default-m") / "pipe")

    run(sock_dir, body)


def test_containers_of_one_pod_get_distinct_shares_in_the_order_they_start(sock_dir: Path) -> None:
    async def body(rig: Rig) -> None:
        a = assignment(
            "two",
            share(0, rig.uuid(0), Mechanism.TIME_SLICING, 100),
            share(1, rig.uuid(1), Mechanism.TIME_SLICING, 100),
            share(2, rig.uuid(2), Mechanism.TIME_SLICING, 100),
        )
        p = rig.kube.add(pod("two", a, gpus=(1, 2)))
        # c1 starts first: it takes the first two shares; c0 the one left.
        second = await rig.start(p, ["t1", "t2"], "c1")
        assert second["env"]["NVIDIA_VISIBLE_DEVICES"] == f"{rig.uuid(0)},{rig.uuid(1)}"
        first = await rig.start(p, ["t0"], "c0")
        assert first["env"]["NVIDIA_VISIBLE_DEVICES"] == rig.uuid(2)
        assert rig.state.allocated_containers("uid-default-two") == {"c0", "c1"}
        assert rig.state.device_shares("uid-default-two") == {"t1": 0, "t2": 1, "t0": 2}

    run(sock_dir, body)


def test_bad_assignments_fail_prestart_clearly_and_the_plugin_keeps_serving(sock_dir: Path) -> None:
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
            p = rig.kube.add(pod("bad", annotation, uid=f"uid-bad-{i}"))
            details = await rig.refused(p, [f"bad{i}"])
            assert message in details and "default/bad" in details, details
            del rig.kube.pods[p.uid]
            rig.record.release(p.uid)
        # A pod whose container is refused may be retried (the kubelet does): once its assignment is fixed, it starts.
        p = rig.kube.add(pod("good", "{not json"))
        assert "is invalid" in await rig.refused(p, ["g0"])
        rig.kube.add(replace(p, annotations={"sharegpu.io/assignment": good.to_json()}))
        assert (await rig.start(p, ["g0"]))["env"]["NVIDIA_VISIBLE_DEVICES"] == rig.uuid(0)

    run(sock_dir, body)


def test_count_mismatch_and_mps_across_gpus_are_refused(sock_dir: Path) -> None:
    async def body(rig: Rig) -> None:
        two = assignment(
            "two",
            share(0, rig.uuid(0), Mechanism.TIME_SLICING, 100),
            share(1, rig.uuid(1), Mechanism.TIME_SLICING, 100),
        )
        p = rig.kube.add(pod("two", two, gpus=(1,)))
        assert "hold 1 sharegpu.io/gpu at their peak, but its assignment holds 2" in await rig.refused(p)
        rig.record.release(p.uid)
        mps_two = assignment(
            "m2", share(0, rig.uuid(0), Mechanism.MPS, 100, 100), share(1, rig.uuid(1), Mechanism.MPS, 100, 100)
        )
        rig.kube.pods.clear()
        p = rig.kube.add(pod("m2", mps_two, gpus=(2,)))
        assert "one MPS daemon" in await rig.refused(p, ["t0", "t1"])

    run(sock_dir, body)


def test_pods_of_other_nodes_are_never_used(sock_dir: Path) -> None:
    async def body(rig: Rig) -> None:
        # The API (wrongly) returns another node's pod, with an assignment that even names this node.
        other = assignment("other", share(0, rig.uuid(0), Mechanism.TIME_SLICING, 100))
        p = rig.kube.add(pod("other", other, node="node-b"))
        assert "is bound to node node-a in the API" in await rig.refused(p)
        assert rig.state.allocations == {} and rig.state.device_share == {}

    run(sock_dir, body, honour_field_selector=False)


def test_prestart_waits_for_a_pod_that_the_api_shows_late(sock_dir: Path) -> None:
    async def body(rig: Rig) -> None:
        rig.kube.fail_lists = 2  # the API server hiccups first
        late = pod("late", assignment("late", share(0, rig.uuid(0), Mechanism.TIME_SLICING, 100)))
        asyncio.get_running_loop().call_later(0.1, rig.kube.add, late)
        assert (await rig.start(late))["env"]["NVIDIA_VISIBLE_DEVICES"] == rig.uuid(0)

    run(sock_dir, body)


def test_an_unexpected_failure_fails_one_container_and_the_plugin_keeps_serving(sock_dir: Path) -> None:
    async def body(rig: Rig) -> None:
        p = rig.kube.add(pod("a", assignment("a", share(0, rig.uuid(0), Mechanism.TIME_SLICING, 100))))
        real = rig.kube.pods_on_node

        async def broken(node: str) -> list[PodInfo]:
            raise RuntimeError("a bug")

        rig.kube.pods_on_node = broken  # type: ignore[method-assign]
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await rig.kubelet.run_container(rig.record, p, "c0", ["t0"])
        assert e.value.code() == grpc.StatusCode.INTERNAL
        assert e.value.details() == "sharegpu node agent failed: RuntimeError: a bug"
        rig.kube.pods_on_node = real  # type: ignore[method-assign]
        assert (await rig.start(p))["env"]["NVIDIA_VISIBLE_DEVICES"] == rig.uuid(0)

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


class NoAllocator:
    def allocate(self, device_ids: Sequence[str]) -> object:
        raise AssertionError

    async def prestart(self, device_ids: Sequence[str]) -> object:
        raise AssertionError


def test_a_kubelet_sock_nobody_listens_on_fails_at_once_and_the_new_kubelet_gets_the_next_try(sock_dir: Path) -> None:
    """A stopping kubelet leaves a ``kubelet.sock`` that refuses connections; a registration held on it until its
    timeout once let a restarted kubelet admit (and reject) a whole burst before the plugin registered again."""
    import socket as sk

    async def main() -> None:
        kubelet = FakeKubelet(sock_dir)
        dead = sk.socket(sk.AF_UNIX, sk.SOCK_STREAM)
        dead.bind(str(kubelet.socket))  # a socket file with no listener: connect() is refused
        dead.close()
        plugin = DevicePluginServer(sock_dir, NoAllocator(), poll_s=0.05, register_timeout_s=60)  # type: ignore[arg-type]
        try:
            await asyncio.wait_for(plugin.tick(), 10)  # wait_for_ready would hold this call for the whole 60 s
            assert plugin.registrations == 0
            kubelet.socket.unlink()
            await kubelet.start()
            await asyncio.wait_for(plugin.tick(), 10)
            assert plugin.registrations == 1 and kubelet.requests[-1].resource_name == "sharegpu.io/gpu"
        finally:
            await plugin.close()
            await kubelet.stop()

    asyncio.run(main())


def test_socket_path_too_long_is_a_clear_error(tmp_path: Path) -> None:
    long_dir = tmp_path / ("d" * 120)
    with pytest.raises(DevicePluginError, match="shorter --device-plugin-dir"):
        DevicePluginServer(long_dir, NoAllocator())  # type: ignore[arg-type]
