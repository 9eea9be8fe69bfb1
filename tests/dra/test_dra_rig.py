"""The DRA driver against a real control plane (../shared/k8s-rig: kube-apiserver and kube-scheduler v1.36 with
DRA, consumable capacity and partitionable devices on). Set SHAREGPU_TEST_KUBECONFIG to its kubeconfig.

The driver runs in-process on a simulated A100-80GB node; the test plays the kubelet through gRPC clients generated
from the kubelet's protos: it registers the plugin over the unix socket and prepares the claims that the real
kube-scheduler allocated on the published ResourceSlices.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from sharegpu.model.contract import DEVICE_PATH_LABEL, MIG_CLASS, SHARED_CLASS
from sharegpu.model.tenant import user_tenant
from sharegpu.node.backends.sim import SimBackend
from sharegpu.node.cli import BackendKind, build_dra_service
from sharegpu.node.dra.classes import device_classes
from sharegpu.node.dra.config import TimeSlice
from sharegpu.node.dra.driver import SimTimeSlicer
from sharegpu.node.dra.kube import LightkubeDraApi
from sharegpu.node.dra.service import DraDriverService
from sharegpu.node.mps import DaemonKey, MpsLimits, SimMpsDaemon
from sharegpu.node.proto import dra_v1_pb2, dra_v1_pb2_grpc, pluginregistration_pb2, pluginregistration_pb2_grpc

KUBECONFIG = os.environ.get("SHAREGPU_TEST_KUBECONFIG")
pytestmark = pytest.mark.skipif(
    not KUBECONFIG, reason="no API server: set SHAREGPU_TEST_KUBECONFIG to a k8s-rig kubeconfig (DRA features on)"
)


async def until(cond: Callable[[], Awaitable[bool]], what: str, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.3)


class Rig:
    """A thin lightkube client for the test's own objects (what kubectl would do)."""

    def __init__(self, client: Any, ns: str, node: str) -> None:
        self.c = client
        self.ns = ns
        self.node = node

    async def create(self, obj: dict[str, Any]) -> Any:
        from lightkube import codecs

        return await self.c.create(codecs.from_dict(obj))

    async def claim(self, name: str) -> dict[str, Any]:
        from lightkube.resources.resource_v1 import ResourceClaim

        out: dict[str, Any] = (await self.c.get(ResourceClaim, name, namespace=self.ns)).to_dict()
        return out

    async def make_claim_and_pod(
        self, name: str, request: dict[str, Any], config: dict[str, Any] | None = None
    ) -> None:
        spec: dict[str, Any] = {"devices": {"requests": [{"name": "gpu", "exactly": request}]}}
        if config is not None:
            spec["devices"]["config"] = [
                {"requests": ["gpu"], "opaque": {"driver": "gpu.sharegpu.io", "parameters": config}}
            ]
        await self.create(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": name, "namespace": self.ns},
                "spec": spec,
            }
        )
        await self.create(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "namespace": self.ns},
                "spec": {
                    "nodeSelector": {"kubernetes.io/hostname": self.node},
                    # One user: the pods of one namespace and one declared UID are one MPS tenant, whose claims on a
                    # GPU share one daemon (a pod that declares none would be a tenant, and a daemon, of its own).
                    "securityContext": {"runAsUser": 0},
                    "containers": [{"name": "main", "image": "cuda", "resources": {"claims": [{"name": "gpu"}]}}],
                    "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
                },
            }
        )

    async def unschedulable(self, name: str, why: str = "cannot allocate all claims") -> str:
        """Wait until the kube-scheduler has tried pod ``name`` and found no device for its claim (its PodScheduled
        condition: False, Unschedulable, with ``why`` in the message, as the DRA plugin says it); the message."""
        from lightkube.resources.core_v1 import Pod

        found: list[str] = []

        async def judged() -> bool:
            pod = (await self.c.get(Pod, name, namespace=self.ns)).to_dict()
            for cond in pod.get("status", {}).get("conditions") or []:
                if cond.get("type") == "PodScheduled" and cond.get("reason") == "Unschedulable":
                    found[:] = [str(cond.get("message", ""))]
                    return why in found[0]
            return False

        await until(judged, f"the kube-scheduler to find no room for {name}'s claim ({why})")
        return found[0]

    async def allocated(self, name: str) -> bool:
        return bool((await self.claim(name)).get("status", {}).get("allocation"))

    async def remove(self, name: str) -> None:
        from lightkube.resources.core_v1 import Pod
        from lightkube.resources.resource_v1 import ResourceClaim

        await self.c.delete(Pod, name, namespace=self.ns, grace_period=0)
        await self.c.delete(ResourceClaim, name, namespace=self.ns)

        async def gone() -> bool:
            from lightkube.core.exceptions import ApiError

            try:
                await self.c.get(ResourceClaim, name, namespace=self.ns)
            except ApiError as e:
                return e.status.code == 404
            return False

        await until(gone, f"claim {name} deleted")


def claim_msg(c: dict[str, Any], uid: str | None = None) -> dra_v1_pb2.Claim:
    meta = c["metadata"]
    return dra_v1_pb2.Claim(namespace=meta["namespace"], name=meta["name"], uid=uid or meta["uid"])


@pytest.fixture
def short_tmp() -> Any:
    # Unix socket paths must stay under 108 bytes: pytest's tmp_path can be longer.
    d = Path(tempfile.mkdtemp(prefix="dra", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


async def _setup(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[Rig, DraDriverService]]:
    from lightkube import AsyncClient, KubeConfig
    from lightkube.resources.core_v1 import Namespace, Node, NodeStatus
    from lightkube.resources.resource_v1 import DeviceClass, ResourceSlice
    from lightkube.types import PatchType

    assert KUBECONFIG is not None
    client = AsyncClient(config=KubeConfig.from_file(KUBECONFIG), field_manager="sharegpu-test")
    suffix = uuid.uuid4().hex[:6]
    node, ns = f"dra-{suffix}", f"dra-test-{suffix}"
    rig = Rig(client, ns, node)
    await rig.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    await rig.create(
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node, "labels": {"kubernetes.io/hostname": node}}}
    )
    alloc = {"cpu": "16", "memory": "64Gi", "pods": "110"}
    await client.patch(
        NodeStatus,
        node,
        {
            "status": {
                "capacity": alloc,
                "allocatable": alloc,
                "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "fake"}],
            }
        },
        patch_type=PatchType.MERGE,
    )
    # The API server taints a new Node not-ready; a kubelet would lift it, the test does.
    await client.patch(Node, node, {"spec": {"taints": None}}, patch_type=PatchType.MERGE)
    for cls in device_classes():
        await client.apply(DeviceClass.from_dict(cls), force=True)  # type: ignore[arg-type]

    sim_config = short_tmp / "sim.yaml"
    # The MIG layout persists in stateFile, as on hardware, so that a restarted driver finds the same GPU.
    sim_config.write_text(f"gpus:\n  - {{model: A100-80GB, count: 1}}\nstateFile: {short_tmp / 'sim-state.json'}\n")
    monkeypatch.setenv("SHAREGPU_STATE_DIR", str(short_tmp / "state"))
    service = build_dra_service(
        node,
        Path(KUBECONFIG),
        BackendKind.SIM,
        sim_config,
        short_tmp / "kubelet",
        None,
        None,
        short_tmp / "cdi",
    )
    await service.kube.label_node(node, {DEVICE_PATH_LABEL: "dra"})
    await service.driver.recover()
    await service.server.start()
    try:
        yield rig, service
    finally:
        await service.server.stop()
        await close(service)
        await client.delete(Namespace, ns)
        lister = LightkubeDraApi(Path(KUBECONFIG))
        for s in await lister.list_slices(node):
            await client.delete(ResourceSlice, s.metadata.name)
        await lister.close()
        await client.delete(Node, node)
        await client.close()


async def close(service: DraDriverService) -> None:
    """Its API clients: the driver's and the audit's (Events)."""
    await service.kube.close()
    if service.watch is not None and service.watch.notifier is not None:
        await service.watch.notifier.close()


def test_dra_driver_on_the_real_control_plane(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        gen = _setup(short_tmp, monkeypatch)
        rig, service = await gen.__anext__()
        try:
            await scenario(rig, service, short_tmp)
        finally:
            await gen.aclose()

    asyncio.run(main())


async def scenario(rig: Rig, service: DraDriverService, tmp: Path) -> None:
    from lightkube.resources.core_v1 import Node, Pod

    backend = service.driver.backend
    assert isinstance(backend, SimBackend)
    gpu = backend.devices()[0]

    # 1. The slices are accepted by the API server: a counter slice and a device slice, one generation.
    assert await service.publisher.publish(backend.devices())
    slices = await service.kube.list_slices(rig.node)
    assert len(slices) == 2
    assert {s.spec.pool.generation for s in slices} == {service.publisher.generation}
    devices = [d for s in slices for d in s.spec.devices]
    assert len(devices) == 1 + 7 + 4 + 3 + 2 + 1 + 1  # the GPU and every valid MIG placement of an A100-80GB
    assert all(s.metadata.owner_references[0].kind == "Node" for s in slices)
    assert not await service.publisher.publish(backend.devices())  # nothing changed: nothing written
    node = (await rig.c.get(Node, rig.node)).to_dict()
    assert node["metadata"]["labels"][DEVICE_PATH_LABEL] == "dra"

    # 2. The docs' shared-GPU example: two MPS claims share the GPU, allocated by the real kube-scheduler. One at a
    # time: created together, the third was once left unallocated for over 30 s in a full-suite run (the stock
    # scheduler had set its pod aside as unschedulable while the others' allocations were in flight).
    await rig.make_claim_and_pod(
        "infer-a", {"deviceClassName": SHARED_CLASS, "capacity": {"requests": {"memory": "10Gi", "compute": "30"}}}
    )
    await until(lambda: rig.allocated("infer-a"), "infer-a allocated")
    await rig.make_claim_and_pod(
        "infer-b", {"deviceClassName": SHARED_CLASS, "capacity": {"requests": {"memory": "20Gi", "compute": "50"}}}
    )
    await until(lambda: rig.allocated("infer-b"), "infer-b allocated")
    # A claim whose config is wrong is allocated all the same (the API server does not read opaque configs).
    await rig.make_claim_and_pod(
        "bad-config",
        {"deviceClassName": SHARED_CLASS, "capacity": {"requests": {"memory": "1Gi", "compute": "5"}}},
        {"apiVersion": "gpu.sharegpu.io/v1alpha1", "kind": "GpuConfig", "sharing": "Turbo"},
    )
    await until(lambda: rig.allocated("bad-config"), "bad-config allocated")
    a, b, bad = [await rig.claim(n) for n in ("infer-a", "infer-b", "bad-config")]
    ra, rb = a["status"]["allocation"]["devices"]["results"][0], b["status"]["allocation"]["devices"]["results"][0]
    assert ra["device"] == rb["device"] == "gpu-0"
    assert ra["shareID"] and rb["shareID"] and ra["shareID"] != rb["shareID"]
    assert (await rig.c.get(Pod, "infer-a", namespace=rig.ns)).spec.nodeName == rig.node

    # `sharegpu status` shows the DRA node from its slices and claims, listed by its cluster view (the extender's
    # device-plugin ledger leaves the node out).
    from sharegpu.k8s.cache.view import ClusterView
    from sharegpu.k8s.status.report import status_report
    from sharegpu.kube.api import LightkubeClusterApi

    view = ClusterView(follow_dra=True)
    api = LightkubeClusterApi(Path(str(KUBECONFIG)))
    try:
        await view.load(api)
    finally:
        await api.close()
    assert rig.node not in view.ledger.index and not view.dra_unavailable
    shown = [n for n in status_report(view)["dra_nodes"] if n["name"] == rig.node]
    assert len(shown) == 1 and len(shown[0]["gpus"]) == 1
    row = shown[0]["gpus"][0]
    assert (row["uuid"], row["mechanism"], row["memory_mib_used"], row["compute_pct_used"]) == (
        gpu.uuid,
        "shared",
        31744,
        85,
    )
    assert sorted(row["claims"]) == sorted(f"{rig.ns}/{n}" for n in ("infer-a", "infer-b", "bad-config"))

    # 3. The kubelet's side: register over the registration socket, then prepare through the endpoint it names.
    async with grpc.aio.insecure_channel(f"unix://{service.server.paths.registration}") as ch:
        reg = pluginregistration_pb2_grpc.RegistrationStub(ch)
        info = await reg.GetInfo(pluginregistration_pb2.InfoRequest())
        assert (info.type, info.name) == ("DRAPlugin", "gpu.sharegpu.io")
        assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
        await reg.NotifyRegistrationStatus(pluginregistration_pb2.RegistrationStatus(plugin_registered=True))
    assert service.server.registered is True

    async with grpc.aio.insecure_channel(f"unix://{info.endpoint}") as ch:
        dra = dra_v1_pb2_grpc.DRAPluginStub(ch)
        ghost = dra_v1_pb2.Claim(namespace=rig.ns, name="no-such-claim", uid=str(uuid.uuid4()))
        resp = await dra.NodePrepareResources(
            dra_v1_pb2.NodePrepareResourcesRequest(
                claims=[claim_msg(a), claim_msg(b), claim_msg(bad), claim_msg(a, uid="not-the-uid"), ghost]
            )
        )
        pa, pb = resp.claims[a["metadata"]["uid"]], resp.claims[b["metadata"]["uid"]]
        assert pa.error == "" and pb.error == ""
        assert pa.devices[0].share_id == ra["shareID"] and pb.devices[0].share_id == rb["shareID"]
        assert pa.devices[0].pool_name == rig.node and list(pa.devices[0].request_names) == ["gpu"]
        assert (
            "sharing" in resp.claims[bad["metadata"]["uid"]].error
            and "Turbo" in resp.claims[bad["metadata"]["uid"]].error
        )
        assert "re-created" in resp.claims["not-the-uid"].error
        assert "no-such-claim" in resp.claims[ghost.uid].error

        # The CDI specs carry each claim's own limits: its memory, and its compute against the other clients its
        # tenant's daemon had at its Prepare (infer-a came first: alone, all threads; infer-b: 50 of 30 + 50). The
        # daemon holds every client to the largest; the claims that failed in the same call released what no
        # prepared claim needs, which sets each daemon's limits exactly (Prepare alone only widens them).
        caps = {}
        for c, mem in ((a, "0=10240M"), (b, "0=20480M")):
            spec = json.loads((tmp / "cdi" / f"sharegpu.io-gpu_{c['metadata']['uid']}.json").read_text())
            dev = spec["devices"][0]
            env = dict(e.split("=", 1) for e in dev["containerEdits"]["env"])
            assert env["NVIDIA_VISIBLE_DEVICES"] == gpu.uuid and env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == mem
            assert dev["containerEdits"]["mounts"][0]["containerPath"] == "/run/sharegpu/mps"
            caps[c["metadata"]["name"]] = env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]
        assert caps == {"infer-a": "100", "infer-b": "62"}
        spec_a = json.loads((tmp / "cdi" / f"sharegpu.io-gpu_{a['metadata']['uid']}.json").read_text())
        assert f"sharegpu.io/gpu={spec_a['devices'][0]['name']}" == pa.devices[0].cdi_device_ids[0]
        mps = service.driver.mps
        daemon = DaemonKey(gpu.uuid, user_tenant(rig.ns, 0))  # both pods run as uid 0: one tenant, one daemon
        assert mps.running() == {daemon}
        assert mps.limits(daemon) == MpsLimits(62, 20480)

        # Idempotent, and the same answer from a restarted driver (its checkpoint).
        again = await dra.NodePrepareResources(dra_v1_pb2.NodePrepareResourcesRequest(claims=[claim_msg(a)]))
        assert again.claims[a["metadata"]["uid"]] == pa

    # 4. A MIG claim waits while the GPU is shared.
    profile = '"3g.40gb"'
    mig_request = {
        "deviceClassName": MIG_CLASS,
        "selectors": [{"cel": {"expression": f'device.attributes["gpu.sharegpu.io"].profile == {profile}'}}],
    }
    await rig.make_claim_and_pod("mig-a", mig_request)
    await rig.unschedulable("mig-a")
    assert not await rig.allocated("mig-a")

    # A restarted driver (a new process on the same state) answers from its checkpoint and then unprepares.
    await service.server.stop()
    restarted = build_dra_service(
        rig.node, Path(str(KUBECONFIG)), BackendKind.SIM, tmp / "sim.yaml", tmp / "kubelet", None, None, tmp / "cdi"
    )
    backend = restarted.driver.backend
    assert isinstance(backend, SimBackend) and backend.devices()[0].uuid == gpu.uuid
    await restarted.driver.recover()
    await restarted.server.start()
    service.server = restarted.server
    async with grpc.aio.insecure_channel(f"unix://{restarted.server.paths.service}") as ch:
        dra = dra_v1_pb2_grpc.DRAPluginStub(ch)
        again = await dra.NodePrepareResources(dra_v1_pb2.NodePrepareResourcesRequest(claims=[claim_msg(b)]))
        assert again.claims[b["metadata"]["uid"]] == pb
        un = await dra.NodeUnprepareResources(
            dra_v1_pb2.NodeUnprepareResourcesRequest(claims=[claim_msg(a), claim_msg(b), claim_msg(bad)])
        )
        assert all(r.error == "" for r in un.claims.values()) and len(un.claims) == 3
        assert not (tmp / "cdi" / f"sharegpu.io-gpu_{a['metadata']['uid']}.json").exists()
        un = await dra.NodeUnprepareResources(dra_v1_pb2.NodeUnprepareResourcesRequest(claims=[claim_msg(a)]))
        assert un.claims[a["metadata"]["uid"]].error == ""  # twice is fine
        assert not SimMpsDaemon().limits(restarted.driver.mps.spec(gpu.uuid, daemon.tenant))  # the daemon is gone
        assert restarted.driver.mps.running() == frozenset()

    # 5. Once the shares are gone the MIG claim is allocated; a second 3g lands on the other half; then the GPU's
    # slots are used up and neither a third partition nor a share is allocated.
    for name in ("infer-a", "infer-b", "bad-config"):
        await rig.remove(name)
    await until(lambda: rig.allocated("mig-a"), "mig-a allocated once the shares are gone")
    await rig.make_claim_and_pod("mig-b", mig_request)
    await until(lambda: rig.allocated("mig-b"), "mig-b allocated")
    ma, mb = await rig.claim("mig-a"), await rig.claim("mig-b")
    names = {c["status"]["allocation"]["devices"]["results"][0]["device"] for c in (ma, mb)}
    assert names == {"gpu-0-mig-3g40gb-0", "gpu-0-mig-3g40gb-4"}
    await rig.make_claim_and_pod(
        "mig-c",
        {
            "deviceClassName": MIG_CLASS,
            "selectors": [{"cel": {"expression": 'device.attributes["gpu.sharegpu.io"].profile == "1g.10gb"'}}],
        },
    )
    await rig.make_claim_and_pod(
        "late-share", {"deviceClassName": SHARED_CLASS, "capacity": {"requests": {"memory": "1Gi", "compute": "1"}}}
    )
    await rig.unschedulable("mig-c")
    await rig.unschedulable("late-share")
    assert not await rig.allocated("mig-c") and not await rig.allocated("late-share")

    async with grpc.aio.insecure_channel(f"unix://{restarted.server.paths.service}") as ch:
        dra = dra_v1_pb2_grpc.DRAPluginStub(ch)
        resp = await dra.NodePrepareResources(
            dra_v1_pb2.NodePrepareResourcesRequest(claims=[claim_msg(ma), claim_msg(mb)])
        )
        assert all(r.error == "" for r in resp.claims.values()), resp
        made = {(i.profile, i.start) for i in backend.mig_instances(0)}
        assert made == {("3g.40gb", 0), ("3g.40gb", 4)}  # at exactly the allocated placements
        spec = json.loads((tmp / "cdi" / f"sharegpu.io-gpu_{ma['metadata']['uid']}.json").read_text())
        env = dict(e.split("=", 1) for e in spec["devices"][0]["containerEdits"]["env"])
        assert env["NVIDIA_VISIBLE_DEVICES"].startswith("MIG-")
        await dra.NodeUnprepareResources(
            dra_v1_pb2.NodeUnprepareResourcesRequest(claims=[claim_msg(ma), claim_msg(mb)])
        )
        assert backend.mig_instances(0) == ()  # released: sharegpu made them and no claim needs them

    # 6. The docs' other examples: the 80/20 MPS split, a dedicated GPU, a time-sliced notebook.
    for name in ("mig-a", "mig-b", "mig-c", "late-share"):
        await rig.remove(name)
    shared = {"deviceClassName": SHARED_CLASS}
    await rig.make_claim_and_pod("heavy", shared | {"capacity": {"requests": {"memory": "64Gi", "compute": "80"}}})
    await rig.make_claim_and_pod("light", shared | {"capacity": {"requests": {"memory": "16Gi", "compute": "20"}}})
    for name in ("heavy", "light"):
        await until(lambda n=name: rig.allocated(n), f"{name} allocated")  # type: ignore[misc]
    heavy, light = await rig.claim("heavy"), await rig.claim("light")
    async with grpc.aio.insecure_channel(f"unix://{restarted.server.paths.service}") as ch:
        dra = dra_v1_pb2_grpc.DRAPluginStub(ch)
        resp = await dra.NodePrepareResources(
            dra_v1_pb2.NodePrepareResourcesRequest(claims=[claim_msg(heavy), claim_msg(light)])
        )
        assert all(r.error == "" for r in resp.claims.values()), resp
        # One tenant: heavy, prepared first, was its daemon's only client (all threads); light got 20 of 80 + 20.
        for c, pct, mib in ((heavy, "100", "65536"), (light, "20", "16384")):
            spec = json.loads((tmp / "cdi" / f"sharegpu.io-gpu_{c['metadata']['uid']}.json").read_text())
            env = dict(e.split("=", 1) for e in spec["devices"][0]["containerEdits"]["env"])
            assert (env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]) == (
                pct,
                f"0={mib}M",
            )
        await dra.NodeUnprepareResources(
            dra_v1_pb2.NodeUnprepareResourcesRequest(claims=[claim_msg(heavy), claim_msg(light)])
        )
    for name in ("heavy", "light"):
        await rig.remove(name)
    await rig.make_claim_and_pod("dedicated", {"deviceClassName": "whole-gpu.sharegpu.io"})
    await until(lambda: rig.allocated("dedicated"), "dedicated allocated")
    await rig.make_claim_and_pod(
        "notebook",
        shared | {"capacity": {"requests": {"memory": "8Gi", "compute": "25"}}},
        {
            "apiVersion": "gpu.sharegpu.io/v1alpha1",
            "kind": "GpuConfig",
            "sharing": "TimeSlicing",
            "timeSliceInterval": "Short",
        },
    )
    await rig.unschedulable("notebook")
    assert not await rig.allocated("notebook")  # the dedicated claim holds the whole GPU
    dedicated = await rig.claim("dedicated")
    async with grpc.aio.insecure_channel(f"unix://{restarted.server.paths.service}") as ch:
        dra = dra_v1_pb2_grpc.DRAPluginStub(ch)
        resp = await dra.NodePrepareResources(dra_v1_pb2.NodePrepareResourcesRequest(claims=[claim_msg(dedicated)]))
        assert resp.claims[dedicated["metadata"]["uid"]].error == ""
        spec = json.loads((tmp / "cdi" / f"sharegpu.io-gpu_{dedicated['metadata']['uid']}.json").read_text())
        env = dict(e.split("=", 1) for e in spec["devices"][0]["containerEdits"]["env"])
        assert env["SHAREGPU_MECHANISM"] == "exclusive" and "CUDA_MPS_PIPE_DIRECTORY" not in env
        await dra.NodeUnprepareResources(dra_v1_pb2.NodeUnprepareResourcesRequest(claims=[claim_msg(dedicated)]))
        await rig.remove("dedicated")
        await until(lambda: rig.allocated("notebook"), "notebook allocated once the GPU is free")
        notebook = await rig.claim("notebook")
        resp = await dra.NodePrepareResources(dra_v1_pb2.NodePrepareResourcesRequest(claims=[claim_msg(notebook)]))
        assert resp.claims[notebook["metadata"]["uid"]].error == ""
        slicer = restarted.driver._time_slicer
        assert isinstance(slicer, SimTimeSlicer) and slicer.intervals[gpu.uuid] is TimeSlice.SHORT
    await close(restarted)
