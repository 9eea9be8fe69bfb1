"""The DRA driver against bad input (flags, configs, claim references, log lines), its health stream over real gRPC,
MPS inside a MIG instance, and the plugin's registration waking the republish. No API server needed."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import grpc.aio
import pytest
from typer.testing import CliRunner

from sharegpu.cli import app
from sharegpu.kube.schema import Node, ResourceClaim, ResourceSlice
from sharegpu.model.assignment import Mechanism
from sharegpu.model.catalog import DEFAULT_CATALOG
from sharegpu.model.tenant import own_tenant
from sharegpu.node.backends.sim import SimBackend
from sharegpu.node.backends.sim_config import SimConfig, SimGpuGroup, parse_sim_config
from sharegpu.node.cdi import CdiWriter
from sharegpu.node.dra.checkpoint import Checkpoint
from sharegpu.node.dra.claims import ClaimError, plan_claim
from sharegpu.node.dra.config import ConfigError, parse_config
from sharegpu.node.dra.driver import ClaimRef, DraDriver, SimTimeSlicer, printable
from sharegpu.node.dra.health import HealthService
from sharegpu.node.dra.plugin import DraPluginServer, SocketPaths
from sharegpu.node.dra.service import DraDriverService, ServiceConfig
from sharegpu.node.mig import MigManager
from sharegpu.node.mps import DaemonKey, MpsLimits, MpsManager, SimMpsDaemon
from sharegpu.node.proto import (
    dra_health_v1alpha1_pb2,
    dra_health_v1alpha1_pb2_grpc,
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    pluginregistration_pb2,
    pluginregistration_pb2_grpc,
)
from sharegpu.node.state import AgentState

GPU_CONFIG = {"apiVersion": "gpu.sharegpu.io/v1alpha1", "kind": "GpuConfig"}


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="dra", dir="/tmp"))  # unix socket paths must stay under 108 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


def sim(*groups: SimGpuGroup, health_file: Path | None = None) -> SimBackend:
    return SimBackend(SimConfig(groups, health_file=health_file), seed="n1")


def claim(
    device: str, uid: str, name: str = "c", config: dict[str, Any] | None = None, **consumed: str
) -> dict[str, Any]:
    result: dict[str, Any] = {"request": "gpu", "driver": "gpu.sharegpu.io", "pool": "n1", "device": device}
    if consumed:
        result |= {"consumedCapacity": consumed, "shareID": f"s-{uid}"}
    cfgs = []
    if config is not None:
        cfgs = [
            {
                "source": "FromClaim",
                "requests": ["gpu"],
                "opaque": {"driver": "gpu.sharegpu.io", "parameters": GPU_CONFIG | config},
            }
        ]
    return {
        "metadata": {"namespace": "ns", "name": name, "uid": uid},
        "status": {"allocation": {"devices": {"results": [result], "config": cfgs}}},
    }


class Claims:
    def __init__(self, claims: dict[str, dict[str, Any]]) -> None:
        self.claims = claims
        self.asked: list[tuple[str, str]] = []

    async def get_claim(self, namespace: str, name: str) -> ResourceClaim:
        self.asked.append((namespace, name))
        return ResourceClaim.model_validate(self.claims[name])


def make_driver(root: Path, claims: Claims, backend: SimBackend) -> DraDriver:
    return DraDriver(
        "n1",
        backend,
        claims,
        MigManager(backend, AgentState(root / "mig.json")),
        MpsManager(root / "mps", SimMpsDaemon()),
        Checkpoint(root / "checkpoint.json"),
        CdiWriter(root / "cdi"),
        SimTimeSlicer(),
    )


# ----- flags ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--cdi-dir", "/proc/cdi"], "--cdi-dir /proc/cdi"),
        (["--interval", "nan"], "--interval nan must be a finite number"),
        (["--interval", "inf"], "--interval inf must be a finite number"),
        (["--interval", "-1"], "--interval -1.0 must be a finite number"),
    ],
)
def test_bad_flags_stop_the_driver_with_exit_2_and_a_message(
    flags: list[str], message: str, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (short_tmp / "sim.yaml").write_text("gpus: [{model: H100-80GB, count: 2}]\n")
    monkeypatch.setenv("SHAREGPU_STATE_DIR", str(short_tmp / "state"))
    args = ["dra-driver", "--node-name", "n1", "--backend", "sim", "--sim-config", str(short_tmp / "sim.yaml")]
    args += ["--kubelet-dir", str(short_tmp / "kubelet"), "--kubeconfig", str(short_tmp / "missing")]
    if "--cdi-dir" not in flags:
        args += ["--cdi-dir", str(short_tmp / "cdi")]
    result = CliRunner().invoke(app, [*args, *flags])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output


def test_a_relative_kubelet_dir_is_taken_from_the_working_directory(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Resolved, not refused: the kubelet dials the endpoint GetInfo names, which must be absolute."""
    from sharegpu.node.cli import BackendKind, build_dra_service

    (short_tmp / "sim.yaml").write_text("gpus: [{model: H100-80GB, count: 1}]\n")
    monkeypatch.setenv("SHAREGPU_STATE_DIR", str(short_tmp / "state"))
    monkeypatch.chdir(short_tmp)

    class NoKube:
        async def close(self) -> None:
            pass

    service = build_dra_service(
        "n1",
        None,
        BackendKind.SIM,
        Path("sim.yaml"),
        Path("kl"),
        None,
        None,
        Path("cdi"),
        kube=NoKube(),  # type: ignore[arg-type]
    )
    assert service.server.paths.service == short_tmp / "kl" / "plugins" / "gpu.sharegpu.io" / "dra.sock"
    assert service.server.paths.registration.is_absolute()

    async def main() -> None:
        await service.server.start()
        try:
            async with grpc.aio.insecure_channel(f"unix://{service.server.paths.registration}") as ch:
                info = await pluginregistration_pb2_grpc.RegistrationStub(ch).GetInfo(
                    pluginregistration_pb2.InfoRequest()
                )
            assert info.endpoint == str(short_tmp / "kl" / "plugins" / "gpu.sharegpu.io" / "dra.sock")
        finally:
            await service.server.stop()

    asyncio.run(main())


# ----- configs -------------------------------------------------------------------------------------------------
def test_an_explicit_null_is_refused_with_what_to_write_instead() -> None:
    with pytest.raises(ConfigError, match=r"sharing: null is not a value; leave the field out .* MPS or TimeSlicing"):
        parse_config(GPU_CONFIG | {"sharing": None}, "claim ns/c")
    with pytest.raises(ConfigError, match=r"isolation: null"):
        parse_config(GPU_CONFIG | {"isolation": None}, "claim ns/c")
    with pytest.raises(ConfigError, match="must be an object"):
        parse_config(["MPS"], "claim ns/c")  # type: ignore[arg-type]
    # Through planning: the claim fails at Prepare, it is not prepared as MPS.
    with pytest.raises(ClaimError, match="sharing: null"):
        plan_claim(
            ResourceClaim.model_validate(claim("gpu-0", "u1", config={"sharing": None}, memory="10Gi", compute="30")),
            "u1",
            "n1",
            sim(SimGpuGroup("H100-80GB")).devices(),
        )


def test_mig_devices_take_mps_or_nothing_never_time_slicing() -> None:
    gpus = sim(SimGpuGroup("H100-80GB")).devices()
    with pytest.raises(ClaimError, match="TimeSlicing does not apply to a MIG instance"):
        plan_claim(
            ResourceClaim.model_validate(claim("gpu-0-mig-3g40gb-4", "u1", config={"sharing": "TimeSlicing"})),
            "u1",
            "n1",
            gpus,
        )
    alone = plan_claim(ResourceClaim.model_validate(claim("gpu-0-mig-3g40gb-4", "u1")), "u1", "n1", gpus).devices[0]
    assert alone.mechanism is Mechanism.MIG
    shared = plan_claim(
        ResourceClaim.model_validate(claim("gpu-0-mig-1g10gb-6", "u1", config={"sharing": "MPS"})), "u1", "n1", gpus
    ).devices[0]
    assert (shared.mechanism, shared.mig_profile, shared.mig_start) == (Mechanism.MPS, "1g.10gb", 6)
    whole_instance = DEFAULT_CATALOG.get("H100-80GB").profile("1g.10gb").memory_mib
    assert (shared.compute_percent, shared.memory_mib) == (100, whole_instance)


def test_mps_inside_a_mig_instance_is_prepared_and_released(short_tmp: Path) -> None:
    backend = sim(SimGpuGroup("H100-80GB"))
    claims = Claims({"c": claim("gpu-0-mig-3g40gb-4", "u1", config={"sharing": "MPS"})})

    async def main() -> None:
        driver = make_driver(short_tmp, claims, backend)
        out = await driver.prepare([ClaimRef("ns", "u1", "c")])
        assert out["u1"].error == ""
        [inst] = backend.mig_instances(0)
        assert (inst.profile, inst.start) == ("3g.40gb", 4)
        spec = json.loads((short_tmp / "cdi" / "sharegpu.io-gpu_u1.json").read_text())
        env = dict(e.split("=", 1) for e in spec["devices"][0]["containerEdits"]["env"])
        assert env["NVIDIA_VISIBLE_DEVICES"] == inst.uuid and env["SHAREGPU_MECHANISM"] == "mps"
        mib = DEFAULT_CATALOG.get("H100-80GB").profile("3g.40gb").memory_mib
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={mib}M"  # the instance's whole memory
        # The instance's daemon of the claim's tenant (a claim reserved for no pod: its own).
        daemon = DaemonKey(inst.uuid, own_tenant("u1"))
        assert driver.checkpoint.claims["u1"].tenant == daemon.tenant
        assert spec["devices"][0]["containerEdits"]["mounts"][0]["hostPath"] == str(
            short_tmp / "mps" / inst.uuid / "pod_u1" / "pipe"
        )
        assert driver._mps.limits(daemon) == MpsLimits(100, mib)
        await driver.reconcile()  # the instance stays while its MPS claim is prepared
        assert len(backend.mig_instances(0)) == 1
        await driver.unprepare([ClaimRef("ns", "u1", "c")])
        assert backend.mig_instances(0) == () and driver._mps.limits(daemon) is None
        assert driver._mps.running() == frozenset()

    asyncio.run(main())


# ----- claim references from the kubelet -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("ref", "message"),
    [
        (ClaimRef("", "", ""), "namespace '' is not a namespace name"),
        (ClaimRef("ns", "u9", "../../etc/passwd"), "name '../../etc/passwd' is not a ResourceClaim name"),
        (ClaimRef("ns/../kube-system", "u9", "c"), "is not a namespace name"),
        (ClaimRef("ns", "../u9", "c"), "UID '../u9' is not a UID"),
        (ClaimRef("ns", "u9", "a\x00b\u202ec"), r"name 'a\x00b\u202ec'"),
    ],
)
def test_a_bad_claim_reference_fails_alone_and_never_reaches_the_api(
    ref: ClaimRef, message: str, short_tmp: Path
) -> None:
    backend = sim(SimGpuGroup("H100-80GB"))
    claims = Claims({"c": claim("gpu-0", "u1", memory="10Gi", compute="30")})

    async def main() -> None:
        driver = make_driver(short_tmp, claims, backend)
        out = await driver.prepare([ref, ClaimRef("ns", "u1", "c")])
        assert message in out[ref.uid].error and "invalid" in out[ref.uid].error
        assert out["u1"].error == ""  # the good claim in the same call is prepared
        assert claims.asked == [("ns", "c")]  # the bad reference never became an API path

    asyncio.run(main())


def test_log_lines_escape_control_and_bidirectional_characters(
    short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    backend = sim(SimGpuGroup("H100-80GB"))
    driver = make_driver(short_tmp, Claims({}), backend)
    with caplog.at_level(logging.INFO, logger="sharegpu.node.dra.driver"):
        asyncio.run(driver.prepare([ClaimRef("n\x1b[2Js", "u\u202e1", "evil\x00\u202eexe.txt\nforged line")]))
        asyncio.run(driver.unprepare([ClaimRef("ns", "u\x00", "c\u2066")]))
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert text, "the refusal is logged"
    for bad in ("\x00", "\x1b", "\u202e", "\u2066", "forged line\n", "\nforged"):
        assert bad not in text
    assert r"evil\x00\u202eexe.txt\nforged line" in text
    assert printable("ok é ü") == "ok é ü" and printable("a\\x00") == r"a\\x00"  # an escape cannot be faked


# ----- the health stream ---------------------------------------------------------------------------------------
def test_health_stream_over_grpc_reports_every_device_and_each_change(short_tmp: Path) -> None:
    health_file = short_tmp / "health.yaml"
    backend = sim(SimGpuGroup("H100-80GB", 2), health_file=health_file)
    gpu1 = backend.devices()[1]
    driver = make_driver(short_tmp, Claims({}), backend)

    async def main() -> None:
        health = HealthService("n1", backend.devices, poll_s=0.05, resend_s=0.5, timeout_s=30)
        server = DraPluginServer(driver, SocketPaths.under(short_tmp / "kubelet"), health)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"unix://{server.paths.service}") as ch:
                stub = dra_health_v1alpha1_pb2_grpc.DRAResourceHealthStub(ch)
                stream = stub.NodeWatchResources(dra_health_v1alpha1_pb2.NodeWatchResourcesRequest())
                first = await asyncio.wait_for(stream.read(), 5)
                by_name = {d.device.device_name: d for d in first.devices}
                published = {d["name"] for s in _slices(backend) for d in s.spec.get("devices", [])}
                assert set(by_name) == published  # the published device names, MIG placements included
                assert {d.device.pool_name for d in first.devices} == {"n1"}
                assert {d.health for d in first.devices} == {dra_health_v1alpha1_pb2.HEALTHY}
                assert all(abs(d.last_updated_time - time.time()) < 5 for d in first.devices)
                assert {d.health_check_timeout_seconds for d in first.devices} == {30}

                health_file.write_text(f"unhealthy: [{gpu1.uuid}]\n")  # by UUID; an index works as well
                t0 = time.monotonic()
                changed = await asyncio.wait_for(stream.read(), 5)
                assert time.monotonic() - t0 < 2
                sick = {d.device.device_name for d in changed.devices if d.health == dra_health_v1alpha1_pb2.UNHEALTHY}
                assert sick == {n for n in published if n == "gpu-1" or n.startswith("gpu-1-mig-")}
                assert "GPU 1" in {d.device.device_name: d for d in changed.devices}["gpu-1"].message
                # Nothing changes: the whole list comes again before the kubelet's timeout (here 0.5 s).
                again = await asyncio.wait_for(stream.read(), 5)
                assert len(again.devices) == len(changed.devices)

                health_file.unlink()  # back to the config's health
                healed = await asyncio.wait_for(stream.read(), 5)
                assert {d.health for d in healed.devices} == {dra_health_v1alpha1_pb2.HEALTHY}
                assert health.streams == 1
                stream.cancel()
        finally:
            await server.stop()

    asyncio.run(main())


def _slices(backend: SimBackend) -> Any:
    from sharegpu.node.dra.slices import build_slices

    return build_slices("n1", backend.devices())


def test_sim_health_file_is_read_when_it_changes_and_a_bad_edit_is_ignored(short_tmp: Path) -> None:
    health_file = short_tmp / "h.yaml"
    config = parse_sim_config(f"gpus: [{{model: H100-80GB, count: 2}}]\nhealthFile: {health_file}\n")
    assert config.health_file == health_file
    backend = SimBackend(config, seed="n1")
    assert [d.healthy for d in backend.devices()] == [True, True]
    health_file.write_text("unhealthy: [0]\n")
    assert [d.healthy for d in backend.devices()] == [False, True]
    health_file.write_text("unhealthy: oops, not a list\n")
    assert [d.healthy for d in backend.devices()] == [False, True]  # kept
    health_file.write_text("unhealthy: []\n")
    assert [d.healthy for d in backend.devices()] == [True, True]


# ----- registration wakes the republish ------------------------------------------------------------------------
class FakeKube:
    """Stands in for the API server: slices in a dict, so the test can delete them as a restarted kubelet does."""

    def __init__(self) -> None:
        self.slices: dict[str, Mapping[str, Any]] = {}
        self.writes = 0

    async def get_claim(self, namespace: str, name: str) -> ResourceClaim:
        raise KeyError(name)

    async def get_node(self, name: str) -> Node:
        return Node.model_validate({"metadata": {"name": name, "uid": "node-uid"}})

    async def label_node(self, name: str, labels: Mapping[str, str | None]) -> None:
        pass

    async def list_slices(self, node: str) -> list[ResourceSlice]:
        return [ResourceSlice.model_validate(s) for s in self.slices.values()]

    async def apply_slice(self, obj: Mapping[str, Any]) -> None:
        self.writes += 1
        self.slices[obj["metadata"]["name"]] = obj

    async def delete_slice(self, name: str) -> None:
        self.slices.pop(name, None)

    async def close(self) -> None:
        pass


def test_a_kubelet_registration_republishes_the_slices_at_once(short_tmp: Path) -> None:
    from sharegpu.node.dra.publisher import SlicePublisher

    backend = sim(SimGpuGroup("H100-80GB", 2))
    kube = FakeKube()
    driver = make_driver(short_tmp, Claims({}), backend)
    server = DraPluginServer(driver, SocketPaths.under(short_tmp / "kubelet"))
    service = DraDriverService(ServiceConfig("n1", interval_s=60), driver, server, kube, SlicePublisher("n1", kube))  # type: ignore[arg-type]

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(service.run(stop))
        try:
            for _ in range(100):
                if len(kube.slices) == 4 and server.paths.registration.exists():
                    break
                await asyncio.sleep(0.05)
            assert len(kube.slices) == 4
            kube.slices.clear()  # the restarted kubelet deleted the node's slices
            async with grpc.aio.insecure_channel(f"unix://{server.paths.registration}") as ch:
                stub = pluginregistration_pb2_grpc.RegistrationStub(ch)
                await stub.GetInfo(pluginregistration_pb2.InfoRequest())
                t0 = time.monotonic()
                await stub.NotifyRegistrationStatus(pluginregistration_pb2.RegistrationStatus(plugin_registered=True))
            while len(kube.slices) < 4 and time.monotonic() - t0 < 5:
                await asyncio.sleep(0.02)
            assert len(kube.slices) == 4 and time.monotonic() - t0 < 1.0  # not the 60 s timer
            assert server.registrations == 1
            kube.slices.clear()  # deleted again just after (the kubelet's wipe raced our republish)
            await asyncio.sleep(1.5)
            assert len(kube.slices) == 4  # a follow-up check within the next seconds put them back
        finally:
            stop.set()
            await asyncio.wait_for(task, 5)

    asyncio.run(main())


def test_prepare_over_grpc_answers_a_bad_reference_in_its_own_entry(short_tmp: Path) -> None:
    backend = sim(SimGpuGroup("H100-80GB"))
    driver = make_driver(short_tmp, Claims({"c": claim("gpu-0", "u1", memory="1Gi", compute="5")}), backend)

    async def main() -> None:
        server = DraPluginServer(driver, SocketPaths.under(short_tmp / "kubelet"))
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"unix://{server.paths.service}") as ch:
                stub = dra_v1_pb2_grpc.DRAPluginStub(ch)
                resp = await stub.NodePrepareResources(
                    dra_v1_pb2.NodePrepareResourcesRequest(
                        claims=[
                            dra_v1_pb2.Claim(namespace="", name="", uid=""),
                            dra_v1_pb2.Claim(namespace="ns", name="c", uid="u1"),
                        ]
                    )
                )
            assert "invalid" in resp.claims[""].error and resp.claims["u1"].error == ""
        finally:
            await server.stop()

    asyncio.run(main())
