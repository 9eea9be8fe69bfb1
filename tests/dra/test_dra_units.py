"""The DRA driver's parts without an API server: slices, configs, claim planning, CDI, checkpoint, gRPC, CLI."""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import grpc.aio
import pytest
from typer.testing import CliRunner

from sharegpu.cli import app
from sharegpu.kube.schema import Pod, ResourceClaim
from sharegpu.model.assignment import Mechanism
from sharegpu.model.catalog import DEFAULT_CATALOG
from sharegpu.model.request import Isolation
from sharegpu.node.backends.base import DeviceInfo
from sharegpu.node.backends.sim import SimBackend
from sharegpu.node.backends.sim_config import SimConfig, SimGpuGroup
from sharegpu.node.cdi import CdiWriter
from sharegpu.node.dra.checkpoint import Checkpoint, CheckpointError
from sharegpu.node.dra.claims import ClaimError, plan_claim
from sharegpu.node.dra.config import ConfigError, Sharing, configs_for_request, parse_config
from sharegpu.node.dra.driver import ClaimRef, DraDriver, SimTimeSlicer
from sharegpu.node.dra.plugin import DraPluginServer, SocketPaths
from sharegpu.node.dra.slices import build_slices, node_devices
from sharegpu.node.mig import MigManager
from sharegpu.node.mps import DaemonKey, MpsLimits, MpsManager, SimMpsDaemon
from sharegpu.node.proto import dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from sharegpu.node.proto.generate import PROTOS, generate
from sharegpu.node.state import AgentState

A100 = DeviceInfo(0, "GPU-a100", "NVIDIA A100-SXM4-80GB", "A100-80GB", 81920, 108, False)
T4 = DeviceInfo(1, "GPU-t4", "Tesla T4", "T4", 16384, 40, False)
P100 = DeviceInfo(2, "GPU-p100", "Tesla P100", "P100", 16384, 56, False)


def test_generated_dra_modules_match_their_protos(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (a dev dependency) regenerates the stubs")
    generate(tmp_path)
    for proto in PROTOS:
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            name = proto.stem + suffix
            fresh = (tmp_path / "sharegpu" / "node" / "proto" / name).read_text()
            assert fresh == (proto.parent / name).read_text(), f"{name} is stale: regenerate"


def test_proto_field_numbers_are_the_kubelets() -> None:
    from sharegpu.node.proto import dra_v1_pb2, pluginregistration_pb2

    def numbers(msg: Any) -> dict[str, int]:
        return {f.name: f.number for f in msg.DESCRIPTOR.fields}

    assert numbers(dra_v1_pb2.Device) == {
        "request_names": 1,
        "pool_name": 2,
        "device_name": 3,
        "cdi_device_ids": 4,
        "share_id": 5,
    }
    assert numbers(dra_v1_pb2.Claim) == {"namespace": 1, "uid": 2, "name": 3}
    assert numbers(dra_v1_pb2.NodePrepareResourceResponse) == {"devices": 1, "error": 2}
    assert dra_v1_pb2.DESCRIPTOR.services_by_name["DRAPlugin"].full_name == "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"
    assert numbers(pluginregistration_pb2.PluginInfo) == {
        "type": 1,
        "name": 2,
        "endpoint": 3,
        "supported_versions": 4,
    }
    assert pluginregistration_pb2.DESCRIPTOR.services_by_name["Registration"].full_name == (
        "pluginregistration.Registration"
    )


# ----- slices --------------------------------------------------------------------------------------------------
def test_mig_devices_consume_exactly_their_slots_and_no_overlap_can_fit() -> None:
    slices = build_slices("n1", (A100, T4))
    counters = [s for s in slices if "sharedCounters" in s.spec]
    assert [s.spec["sharedCounters"][0]["name"] for s in counters] == ["gpu-0-counters"]  # the T4 has no MIG
    devices = {d["name"]: d for s in slices for d in s.spec.get("devices", [])}
    assert devices["gpu-0"]["allowMultipleAllocations"] is True
    assert devices["gpu-0"]["capacity"]["compute"]["requestPolicy"]["default"] == "100"
    slots = devices["gpu-0-mig-3g40gb-4"]["consumesCounters"][0]["counters"]
    assert slots == {f"memory-slice-{n}": {"value": "1"} for n in range(4, 8)} | {"compute-slices": {"value": "3"}}
    # Any two MIG devices whose memory slots overlap can never both be allocated: each slot counter is 1.
    mig = [d for n, d in devices.items() if n.startswith("gpu-0-mig")]
    for x, y in itertools.combinations(mig, 2):
        sx = {k for k in x["consumesCounters"][0]["counters"] if k.startswith("memory")}
        sy = {k for k in y["consumesCounters"][0]["counters"] if k.startswith("memory")}
        ax, ay = x["attributes"], y["attributes"]
        span = lambda a: set(range(a["placementStart"]["int"], a["placementStart"]["int"] + a["placementSize"]["int"]))  # noqa: E731
        assert bool(sx & sy) == bool(span(ax) & span(ay))
    assert len(mig) == sum(len(p.starts) for p in DEFAULT_CATALOG.get("A100-80GB").mig_profiles)
    # The whole GPU consumes every counter, so no partition can be allocated beside a share.
    assert set(devices["gpu-0"]["consumesCounters"][0]["counters"]) == set(
        counters[0].spec["sharedCounters"][0]["counters"]
    )
    assert devices["gpu-1"]["attributes"]["cudaComputeCapability"] == {"version": "7.5.0"}


def test_unhealthy_gpus_are_withdrawn() -> None:
    sick = DeviceInfo(0, "GPU-a100", "x", "A100-80GB", 81920, 108, False, healthy=False)
    assert build_slices("n1", (sick, T4))[0].name == "n1-gpu.sharegpu.io-gpu-1-devices"
    assert set(node_devices((sick, T4))) == {"gpu-1"}


# ----- config --------------------------------------------------------------------------------------------------
def cfg(source: str, requests: list[str] | None = None, **params: Any) -> dict[str, Any]:
    return {
        "source": source,
        "requests": requests or [],
        "opaque": {
            "driver": "gpu.sharegpu.io",
            "parameters": {"apiVersion": "gpu.sharegpu.io/v1alpha1", "kind": "GpuConfig", **params},
        },
    }


def test_claim_config_wins_over_its_class_field_by_field() -> None:
    merged = configs_for_request(
        [cfg("FromClaim", sharing="TimeSlicing"), cfg("FromClass", sharing="MPS", isolation="none")], "gpu", "ns/c"
    )
    assert merged.sharing is Sharing.TIME_SLICING and merged.isolation is Isolation.NONE
    other = configs_for_request([cfg("FromClaim", ["other"], sharing="TimeSlicing")], "gpu", "ns/c")
    assert other.sharing is None  # a config for another request does not apply: no mechanism asked


def test_invalid_config_says_what_to_change() -> None:
    with pytest.raises(ConfigError, match=r"sharing: 'Turbo' is not accepted; use MPS or TimeSlicing"):
        parse_config({"apiVersion": "gpu.sharegpu.io/v1alpha1", "kind": "GpuConfig", "sharing": "Turbo"}, "c")
    with pytest.raises(ConfigError, match="unknown field"):
        parse_config({"apiVersion": "gpu.sharegpu.io/v1alpha1", "kind": "GpuConfig", "replicas": 4}, "c")
    with pytest.raises(ConfigError, match="apiVersion"):
        parse_config({"apiVersion": "v1", "kind": "GpuConfig"}, "c")


# ----- claim planning ------------------------------------------------------------------------------------------
def claim(
    device: str = "gpu-0",
    consumed: Mapping[str, str] | None = None,
    config: list[dict[str, Any]] | None = None,
    pool: str = "n1",
    uid: str = "u1",
) -> dict[str, Any]:
    result: dict[str, Any] = {"request": "gpu", "driver": "gpu.sharegpu.io", "pool": pool, "device": device}
    if consumed is not None:
        result |= {"consumedCapacity": dict(consumed), "shareID": "s-1"}
    return {
        "metadata": {"namespace": "ns", "name": "c", "uid": uid},
        "status": {"allocation": {"devices": {"results": [result], "config": config or []}}},
    }


def test_plans_follow_the_allocation_and_the_config() -> None:
    mps = plan_claim(
        ResourceClaim.model_validate(claim(consumed={"memory": "10Gi", "compute": "30"})), "u1", "n1", (A100,)
    ).devices[0]
    assert (mps.mechanism, mps.compute_percent, mps.memory_mib, mps.share_id) == (Mechanism.MPS, 30, 10240, "s-1")
    whole = plan_claim(
        ResourceClaim.model_validate(claim(consumed={"memory": "80Gi", "compute": "100"})), "u1", "n1", (A100,)
    ).devices[0]
    assert whole.mechanism is Mechanism.EXCLUSIVE
    ts = plan_claim(
        ResourceClaim.model_validate(
            claim(consumed={"memory": "8Gi", "compute": "50"}, config=[cfg("FromClaim", sharing="TimeSlicing")])
        ),
        "u1",
        "n1",
        (A100,),
    ).devices[0]
    assert ts.mechanism is Mechanism.TIME_SLICING
    mig = plan_claim(ResourceClaim.model_validate(claim("gpu-0-mig-2g20gb-4")), "u1", "n1", (A100,)).devices[0]
    assert (mig.mechanism, mig.mig_profile, mig.mig_start) == (Mechanism.MIG, "2g.20gb", 4)


@pytest.mark.parametrize(
    ("c", "uid", "gpus", "message"),
    [
        (claim(), "other", (A100,), "re-created"),
        ({"metadata": {"namespace": "ns", "name": "c", "uid": "u1"}}, "u1", (A100,), "not allocated"),
        (claim(pool="n2"), "u1", (A100,), "not from this node"),
        (claim("gpu-7"), "u1", (A100,), "not a healthy device"),
        (
            claim(consumed={"memory": "1Gi", "compute": "5"}, config=[cfg("FromClaim", isolation="hardware")]),
            "u1",
            (A100,),
            "MIG partition",
        ),
        (
            claim(
                consumed={"memory": "1Gi", "compute": "5"},
                config=[cfg("FromClaim", sharing="TimeSlicing", isolation="memory")],
            ),
            "u1",
            (A100,),
            "use sharing: MPS",
        ),
        (claim("gpu-2", consumed={"memory": "1Gi", "compute": "5"}), "u1", (P100,), "no MPS"),
        (claim(consumed={"memory": "lots", "compute": "5"}), "u1", (A100,), "malformed"),
    ],
)
def test_claims_that_cannot_be_prepared(
    c: dict[str, Any], uid: str, gpus: tuple[DeviceInfo, ...], message: str
) -> None:
    with pytest.raises(ClaimError, match=message):
        plan_claim(ResourceClaim.model_validate(c), uid, "n1", gpus)


def test_fault_isolation_is_time_slicing_and_never_mps() -> None:
    fault = [cfg("FromClaim", isolation="fault")]
    plan = plan_claim(
        ResourceClaim.model_validate(claim(consumed={"memory": "8Gi", "compute": "50"}, config=fault)),
        "u1",
        "n1",
        (A100,),
    ).devices[0]
    assert plan.mechanism is Mechanism.TIME_SLICING
    with pytest.raises(ClaimError, match="isolation: fault cannot be met by MPS"):
        both = [cfg("FromClaim", isolation="fault", sharing="MPS")]
        plan_claim(
            ResourceClaim.model_validate(claim(consumed={"memory": "8Gi", "compute": "50"}, config=both)),
            "u1",
            "n1",
            (A100,),
        )


def test_a_foreign_claim_has_no_device_of_ours() -> None:
    c = claim()
    c["status"]["allocation"]["devices"]["results"][0]["driver"] = "gpu.nvidia.com"
    with pytest.raises(ClaimError, match="not this driver's"):
        plan_claim(ResourceClaim.model_validate(c), "u1", "n1", (A100,))


# ----- the driver on a simulated node, without an API server ---------------------------------------------------
class Claims:
    def __init__(self, claims: dict[str, dict[str, Any]], pods: dict[str, dict[str, Any]] | None = None) -> None:
        self.claims = claims
        self.pods = pods or {}

    async def get_claim(self, namespace: str, name: str) -> ResourceClaim:
        return ResourceClaim.model_validate(self.claims[name])

    async def get_pod(self, namespace: str, name: str) -> Pod:
        return Pod.model_validate(self.pods[name])


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="dra", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def make_driver(
    root: Path, claims: dict[str, dict[str, Any]], backend: SimBackend, pods: dict[str, dict[str, Any]] | None = None
) -> DraDriver:
    return DraDriver(
        "n1",
        backend,
        Claims(claims, pods),
        MigManager(backend, AgentState(root / "mig.json")),
        MpsManager(root / "mps", SimMpsDaemon()),
        Checkpoint(root / "checkpoint.json"),
        CdiWriter(root / "cdi"),
        SimTimeSlicer(),
    )


def test_prepare_is_idempotent_restart_safe_and_fails_claims_one_by_one(short_tmp: Path) -> None:
    backend = SimBackend(SimConfig((SimGpuGroup("A100-80GB", 1),)), seed="n1")
    uuid = backend.devices()[0].uuid
    shared = claim(consumed={"memory": "10Gi", "compute": "30"}, uid="u1")
    shared["metadata"]["name"] = "shared"
    mig = claim("gpu-0-mig-3g40gb-4", uid="u2")
    mig["metadata"]["name"] = "mig"
    claims = {"shared": shared, "mig": mig}

    async def main() -> None:
        driver = make_driver(short_tmp, claims, backend)
        first = await driver.prepare([ClaimRef("ns", "u1", "shared"), ClaimRef("ns", "u2", "mig")])
        # Shared and MIG on one GPU is what the scheduler never allocates; the driver refuses the second one
        # without touching the first.
        assert first["u1"].error == ""
        assert "MIG" in first["u2"].error
        assert backend.mig_instances(0) == ()
        env = json.loads((short_tmp / "cdi" / "sharegpu.io-gpu_u1.json").read_text())["devices"][0]["containerEdits"]
        assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M" in env["env"]
        restarted = make_driver(short_tmp, claims, backend)
        await restarted.recover()
        assert (await restarted.prepare([ClaimRef("ns", "u1", "shared")]))["u1"] == first["u1"]
        # The checkpoint's claim keeps its tenant (a pod-less claim: its own) and the daemon's exact limits are set
        # again after the restart: 10 GiB pinned, and all threads (its daemon's only client: daemons take turns).
        tenant = restarted.checkpoint.claims["u1"].tenant
        assert tenant == "pod/u1"
        assert restarted._mps.limits(DaemonKey(uuid, tenant)) == MpsLimits(100, 10240)
        assert await restarted.unprepare([ClaimRef("ns", "u1", "shared")]) == {"u1": ""}
        assert await restarted.unprepare([ClaimRef("ns", "u1", "shared")]) == {"u1": ""}
        assert not (short_tmp / "mps" / uuid).exists()  # the daemon is stopped once no claim uses it
        second = await restarted.prepare([ClaimRef("ns", "u2", "mig")])
        assert second["u2"].error == ""
        assert [(i.profile, i.start) for i in backend.mig_instances(0)] == [("3g.40gb", 4)]
        await restarted.unprepare([ClaimRef("ns", "u2", "mig")])
        assert backend.mig_instances(0) == ()

    asyncio.run(main())


def test_a_corrupt_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "c.json").write_text("{")
    with pytest.raises(CheckpointError, match="move the file away"):
        Checkpoint(tmp_path / "c.json")


def test_v1beta1_service_answers_too(short_tmp: Path) -> None:
    backend = SimBackend(SimConfig((SimGpuGroup("A100-80GB", 1),)), seed="n1")
    claims = {"c": claim(consumed={"memory": "10Gi", "compute": "30"}, uid="u1")}

    async def main() -> None:
        server = DraPluginServer(make_driver(short_tmp, claims, backend), SocketPaths.under(short_tmp / "kubelet"))
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"unix://{server.paths.service}") as ch:
                stub = dra_v1beta1_pb2_grpc.DRAPluginStub(ch)
                req = dra_v1beta1_pb2.NodePrepareResourcesRequest(
                    claims=[dra_v1beta1_pb2.Claim(namespace="ns", name="c", uid="u1")]
                )
                resp = await stub.NodePrepareResources(req)
                assert resp.claims["u1"].devices[0].cdi_device_ids[0] == "sharegpu.io/gpu=u1-gpu-gpu-0"
        finally:
            await server.stop()

    asyncio.run(main())


def test_cli_refuses_bad_input_with_exit_code_2(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(
        app, ["dra-driver", "--node-name", "n1", "--backend", "sim", "--kubelet-dir", "/" + "x" * 120]
    )
    assert result.exit_code == 2
    assert "shorter" in result.output
    result = runner.invoke(app, ["dra-driver", "--node-name", "n1", "--backend", "sim", "--kubelet-dir", str(tmp_path)])
    assert result.exit_code == 2 and "--sim-config" in result.output
